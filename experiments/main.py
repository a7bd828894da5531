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
from fedrobust.aggregators import AGGREGATORS
from fedrobust.attacks import ATTACKS
from fedrobust.data import DATASETS, PARTITIONERS
from fedrobust.engine.execution import STRATEGIES
from fedrobust.methods import METHOD_DEFAULTS, METHODS
from fedrobust.models import COMPUTE_DTYPES, CONV_IMPLS, MODELS

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
flags.DEFINE_float('local_test_fraction', 0.1, "Share of each client's data "
                   'kept as its local test split (Horus uses 0.2).')
flags.DEFINE_integer('max_train_examples', 0, 'Subsample the training split '
                     '(0: use all).')
flags.DEFINE_integer('num_rounds', 20, 'Communication rounds.')
flags.DEFINE_integer('local_epochs', 1, 'Local epochs per round.')
flags.DEFINE_integer('batch_size', 64, 'Local batch size.')
flags.DEFINE_float('local_lr', 0.02, 'Client SGD learning rate.')
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
flags.DEFINE_enum('compute_dtype', 'auto', ('auto',) + COMPUTE_DTYPES,
                  'Activation/matmul dtype (params and optimizer stay '
                  'float32); auto: bfloat16 on TPU, float32 elsewhere.')
flags.DEFINE_integer('num_devices', 0, 'Devices the client axis is sharded '
                     'over (0: all local devices).')
flags.DEFINE_integer('cpu_devices', 0, 'XLA devices the host CPU is split '
                     'into when running on CPU (0: auto, up to one per '
                     'available core: the fewest that give the shortest '
                     'round); clients on different devices train side by '
                     'side.')
# Threat model and robust aggregation.
flags.DEFINE_enum('aggregator', 'weighted_mean',
                  ['weighted_mean'] + sorted(AGGREGATORS),
                  'Server aggregation rule (weighted_mean: FedAvg by client '
                  'size).')
flags.DEFINE_string('aggregator_kwargs', '{}', 'JSON object of extra '
                    'aggregator settings, e.g. {"m": 5}.')
flags.DEFINE_integer('num_byzantine', -1, 'f the aggregator tolerates (-1: '
                     'the expected attackers among the sampled clients).')
flags.DEFINE_enum('attack', 'none', ['none'] + sorted(ATTACKS),
                  'Attack run by the malicious clients.')
flags.DEFINE_string('attack_kwargs', '{}', 'JSON object of extra attack '
                    'settings, e.g. {"direction": "sign"}.')
flags.DEFINE_float('malicious_fraction', 0.0, 'Share of clients that are '
                   'malicious.')
flags.DEFINE_boolean('resample_malicious', False, 'Draw the malicious set '
                     'afresh every round instead of fixing it.')
flags.DEFINE_integer('attack_start_round', 1, 'First round attackers act '
                     '(Horus: 20).')
flags.DEFINE_enum('attacker_knowledge', 'benign_stats',
                  ['benign_stats', 'own_updates_only'],
                  'What model-poisoning attackers may read.')
flags.DEFINE_integer('backdoor_target_label', 2, 'Backdoor / targeted-flip '
                     'target class.')
flags.DEFINE_enum('trigger_location', 'top_left',
                  ['top_left', 'top_right', 'bottom_left', 'bottom_right',
                   'center'], 'Where the BadNets/DBA trigger sits.')
flags.DEFINE_string('trigger_size', '2x6', 'Trigger HxW in pixels.')
flags.DEFINE_integer('trigger_value', 255, 'Trigger pixel value.')
flags.DEFINE_float('poison_fraction', 0.5, "Share of a malicious client's "
                   'data that is poisoned.')
flags.DEFINE_integer('flip_source_label', -1, 'Label flip: -1 flips every '
                     'label y -> classes-1-y; >= 0 flips this class to '
                     '--backdoor_target_label.')
flags.DEFINE_float('blend_alpha', 0.2, 'Blended-trigger opacity.')
# SDFC (--method=sdfc; a bare --method=sdfc uses the paper's setting).
flags.DEFINE_float('sdfc_lambda', 5.0, 'lambda of FDReg (Eq. 9); the '
                   'released config uses 1.')
flags.DEFINE_enum('sdfc_components', 'both', ['both', 'fdreg', 'fdagg'],
                  'Table 3 ablation.')
flags.DEFINE_enum('sdfc_importance', 'fisher', ['fisher', 'abs_grad'],
                  'Table 2 ablation: squared or absolute gradients.')
flags.DEFINE_enum('sdfc_stiffness', 'diff', ['diff', 'local', 'validation'],
                  'Table 4 ablation: H = |M(D)-M(U)|, M(D) or M(U).')
flags.DEFINE_enum('sdfc_fisher', 'per_example',
                  ['per_example', 'batch_mean_squared'],
                  'Fisher estimator; batch_mean_squared squares the batch-'
                  'mean gradient as the released code does.')
flags.DEFINE_boolean('distributed', False, 'Call jax.distributed.initialize() '
                     'first (multi-host TPU/GPU; untested here, see '
                     'BUILD_NOTES.md).')
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
  if FLAGS.distributed:
    import jax  # pylint: disable=g-import-not-at-top
    jax.distributed.initialize()
  config = {name: FLAGS[name].value for name in train.CONFIG_KEYS}
  for name, value in METHOD_DEFAULTS.get(FLAGS.method, {}).items():
    if not FLAGS[name].present:
      config[name] = value
  try:
    train.run(config)
  except (ValueError, train.ConfigMismatchError,
          train.DataNotFoundError) as err:
    print(f'error: {err}', file=sys.stderr)
    sys.exit(2)


if __name__ == '__main__':
  app.run(main)
