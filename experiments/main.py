r"""fedrobust experiment runner: the only module that defines flags.

  python experiments/main.py --method=fedavg --num_clients=10 \
    --partition=dirichlet --dirichlet_alpha=0.5 --num_rounds=20

Presets live in experiments/configs/*.flags (use --flagfile=...). Running
the same command on the same --workdir resumes; see experiments/train.py.
"""

from __future__ import annotations

import logging as py_logging
import os
import sys

from absl import app, flags
from absl import logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import train
from fedrobust.data import DATASETS, PARTITIONERS
from fedrobust.engine.execution import STRATEGIES
from fedrobust.methods import METHODS
from fedrobust.models import CONV_IMPLS, MODELS

flags.DEFINE_enum('method', 'fedavg', sorted(METHODS), 'Federated method.')
flags.DEFINE_enum('dataset', 'fashion_mnist', sorted(DATASETS),
                  'Dataset (fashion_mnist and idx read IDX files; the others '
                  'read prepared TFDS data from --data_dir).')
flags.DEFINE_string('data_dir', None, 'Dataset directory (default: the '
                    "dataset's standard location).")
flags.DEFINE_enum('model', 'simple_cnn', sorted(MODELS), 'Architecture.')
flags.DEFINE_integer('num_clients', 10, 'Clients in the federation (K).')
flags.DEFINE_integer('clients_per_round', 0,
                     'Clients sampled per round (C); 0 means all.')
flags.DEFINE_enum('partition', 'dirichlet', sorted(PARTITIONERS),
                  'How training data is split over clients.')
flags.DEFINE_float('dirichlet_alpha', 0.5, 'Dirichlet label-skew alpha.')
flags.DEFINE_integer('classes_per_client', 2, 'Pathological partition k.')
flags.DEFINE_float('quantity_alpha', 0.5, 'Dirichlet alpha of client sizes '
                   '(quantity_skew).')
flags.DEFINE_float('validation_fraction', 0.0, 'Share of the training split '
                   'held out as the server validation reserve (SDFC: 0.1).')
flags.DEFINE_integer('validation_size', 0, 'Clean server validation samples '
                     'drawn from the reserve (SDFC: 256).')
flags.DEFINE_integer('public_size', 0, 'Public/anchor examples carved from '
                     'the training split (distillation methods).')
flags.DEFINE_float('local_test_fraction', 0.2, "Share of each client's data "
                   'kept as its local test split (Horus: 0.2).')
flags.DEFINE_integer('max_train_examples', 0, 'Subsample the training split '
                     '(0: use all).')
flags.DEFINE_integer('num_rounds', 20, 'Communication rounds.')
flags.DEFINE_integer('local_epochs', 1, 'Local epochs per round.')
flags.DEFINE_integer('batch_size', 64, 'Local batch size.')
flags.DEFINE_float('local_lr', 0.01, 'Client SGD learning rate.')
flags.DEFINE_float('momentum', 0.9, 'Client SGD momentum.')
flags.DEFINE_float('weight_decay', 1e-5, 'Client SGD weight decay.')
flags.DEFINE_float('server_lr', 1.0, 'Server step on the aggregated delta.')
flags.DEFINE_float('fedprox_mu', 0.0, 'FedProx proximal weight (needs '
                   '--method=fedprox).')
flags.DEFINE_integer('eval_every', 1, 'Evaluate every this many rounds.')
flags.DEFINE_integer('eval_batch_size', 500, 'Evaluation batch size.')
flags.DEFINE_integer('checkpoint_every', 5, 'Checkpoint every this many '
                     'rounds (and always at the end).')
flags.DEFINE_integer('checkpoints_keep', 2, 'Checkpoints kept on disk.')
flags.DEFINE_integer('seed', 0, 'Seed of the partition, sampling and init.')
flags.DEFINE_string('workdir', None, 'Run directory (default: '
                    'runs/<method>_<dataset>_<model>_s<seed>).')
flags.DEFINE_enum('client_execution', 'auto', ('auto',) + STRATEGIES,
                  'How clients run: vmap, chunked vmap or sequential '
                  'lax.map; auto picks per backend.')
flags.DEFINE_integer('chunk_size', 0, 'Clients per chunk (chunked); 0 picks '
                     'min(C, 16).')
flags.DEFINE_integer('scan_unroll', 1, 'Unroll factor of the local-step '
                     'scan (0: fully unrolled).')
flags.DEFINE_enum('conv_impl', 'auto', ('auto',) + CONV_IMPLS,
                  'Convolution lowering; auto picks per backend.')
flags.DEFINE_integer('num_devices', 0, 'Devices the client axis is sharded '
                     'over (0: all local devices).')
flags.DEFINE_boolean('overwrite', False, 'Discard an existing run in '
                     '--workdir whose config differs.')

FLAGS = flags.FLAGS


class _QuietLibraries(py_logging.Filter):
  """Drops orbax's per-save INFO chatter; warnings still show."""

  def filter(self, record):
    return record.levelno >= py_logging.WARNING or (
        '/orbax/' not in record.pathname)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.get_absl_handler().addFilter(_QuietLibraries())
  config = {name: FLAGS[name].value for name in train.CONFIG_KEYS}
  try:
    train.run(config)
  except (ValueError, train.ConfigMismatchError,
          train.DataNotFoundError) as err:
    print(f'error: {err}', file=sys.stderr)
    sys.exit(2)


if __name__ == '__main__':
  app.run(main)
