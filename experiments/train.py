"""The host side of a run: data, program, loop, files, resume.

`run(config)` takes a plain dict with one key per setting
(experiments/config.py; main.py builds it from flags, tests build it
directly). Everything numeric happens in one compiled round program; this
module moves data to the device once, calls the program, logs, evaluates
and checkpoints. It knows no method by name: a method's settings, server
data and default aggregator come from its registry entry.

Every check (flags, data, method, threat model) runs before anything is
written to the workdir.

Files in the workdir:
  config.json            the run's config (resume refuses a changed one)
  client_histograms.json per-client class histograms, cohort and spec
  metrics.jsonl          one JSON object per evaluated round
  rounds.jsonl           every round's metrics and per-client values
                         (--log_clients; e.g. per-round detection)
  summary.json           final metrics, config, versions, device, hash
  curves.png             accuracy against round
  checkpoints/           orbax steps (atomic, verified on start)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from experiments import backbone
from experiments import preemption as preemption_lib
from experiments import tracking
from experiments import config as config_lib
from experiments import workdir as workdir_lib
from experiments.devices import configure_cpu_devices
from experiments.workdir import ConfigMismatchError, WorkdirError
from experiments.threat import build_threat, typical_client_steps
from fedrobust import adapt, aggregators
from fedrobust.aggregators import fedhan as fedhan_lib
from fedrobust.checkpoint import (CheckpointError, CheckpointSpaceError,
                                  Checkpointer, barrier, is_primary)
from fedrobust.cohort import Cohort, split_roles
from fedrobust.data import (DEFAULT_FASHION_MNIST_DIR, DataNotFoundError,
                            RowTable, build_federated_setup, hold_out,
                            load_dataset, subsample, subsample_test,
                            unused_rows)
from fedrobust.engine import (CohortSlots, LocalConfig, RoundConfig,
                              client_mesh, default_strategy, evaluate,
                              init_server_state,
                              make_round_step, make_setup_step, parse_delay,
                              place_clients, sgd)
from fedrobust.engine.evaluate import (backdoor_rates, evaluations,
                                       pad_leading, pad_to_batches, rebatch)
from fedrobust.local import adamw
from fedrobust.engine.round import all_finite
from fedrobust.errors import SettingError
from fedrobust.methods import METHODS, fedlora
from fedrobust.methods.hilora_subspace import adjusted_rand_index
from fedrobust.methods.fedavg import parse_share
from fedrobust.models import (default_compute_dtype, default_conv_impl,
                              get_model)
from fedrobust.pretrain import pretrain
from fedrobust.transforms import get_transform
from fedrobust.types import ServerState, legacy_server_state
from fedrobust.transforms.base import get_path

RESUMABLE_KEYS = config_lib.RESUMABLE_KEYS
EXECUTION_KEYS = config_lib.EXECUTION_KEYS

PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'chex',
            'numpy', 'tensorflow-datasets', 'absl-py')


class FlagError(ValueError):
  """A library SettingError, reported under the flag that set it."""


def default_workdir(config: dict[str, Any]) -> str:
  return os.path.join('runs', f"{config['method']}_{config['dataset']}_"
                      f"{config['model']}_s{config['seed']}")


def parse_list(text: str, kind, flag: str) -> tuple:
  try:
    values = tuple(kind(v) for v in str(text).split(',') if v.strip())
  except ValueError:
    raise ValueError(f'--{flag}={text!r}: expected comma-separated '
                     f'{kind.__name__}s') from None
  if not values:
    raise ValueError(f'--{flag} is empty')
  return values


def validate(config: dict[str, Any]) -> None:
  """Checks settings the library does not (names flags)."""
  if config['method'] not in METHODS:
    raise ValueError(f"--method={config['method']!r} is not a known method; "
                     f'expected one of {sorted(METHODS)}')
  positive = ('num_clients', 'num_rounds', 'local_epochs', 'batch_size',
              'eval_every', 'eval_batch_size', 'checkpoint_every',
              'checkpoints_keep', 'unseen_epochs')
  for key in positive:
    if config[key] < 1:
      raise ValueError(f'--{key} must be >= 1, got {config[key]}')
  for key in ('clients_per_round', 'max_train_examples', 'max_test_examples',
              'validation_size',
              'public_size', 'chunk_size', 'scan_unroll', 'num_devices',
              'cpu_devices', 'pretrain_epochs', 'global_test_per_class',
              'unseen_clients'):
    if config[key] < 0:
      raise ValueError(f'--{key} must be >= 0, got {config[key]}')
  if config['clients_per_round'] > config['num_clients']:
    raise ValueError(f"--clients_per_round={config['clients_per_round']} "
                     f"exceeds --num_clients={config['num_clients']}")
  if config['unseen_clients'] and not config['local_test_fraction'] > 0:
    raise ValueError(f"--unseen_clients={config['unseen_clients']} scores "
                     'the newcomers on their own test splits: it needs '
                     '--local_test_fraction > 0')
  finite = lambda v: isinstance(v, (int, float)) and np.isfinite(v)
  for key, value in config.items():
    if isinstance(value, float) and not np.isfinite(value):
      raise ValueError(f'--{key} must be a finite number, got {value}')
  for key in ('validation_fraction', 'local_test_fraction',
              'malicious_fraction'):
    if not 0.0 <= config[key] < 1.0:
      raise ValueError(f'--{key} must be in [0, 1), got {config[key]}')
  for key in ('dirichlet_alpha', 'quantity_alpha'):
    if not config[key] > 0:
      raise ValueError(f'--{key} must be > 0, got {config[key]}')
  if config['force_overwrite'] and not config['overwrite']:
    raise ValueError('--force_overwrite only applies with --overwrite')
  if not (finite(config['local_lr']) and config['local_lr'] > 0):
    raise ValueError(f"--local_lr must be a finite number > 0, got "
                     f"{config['local_lr']}")
  if not (finite(config['momentum']) and 0 <= config['momentum'] < 1):
    raise ValueError(f"--momentum must be in [0, 1), got {config['momentum']}")
  if not (finite(config['weight_decay']) and config['weight_decay'] >= 0):
    raise ValueError(f"--weight_decay must be a finite number >= 0, got "
                     f"{config['weight_decay']}")
  if not (finite(config['server_lr']) and config['server_lr'] > 0):
    raise ValueError(f"--server_lr must be a finite number > 0, got "
                     f"{config['server_lr']}")
  config_lib.check_foreign_settings(config)
  if config['client_execution'] != 'chunked' and config['chunk_size']:
    raise ValueError('--chunk_size needs --client_execution=chunked')
  if config['dataset'] == 'idx' and not config['data_dir']:
    raise ValueError('--dataset=idx needs --data_dir (a directory with the '
                     'four IDX files)')
  if config['transform'] != 'lora' and (
      config['lora_ranks'] != '8' or config['lora_targets'] != 'all'):
    raise ValueError('--lora_ranks/--lora_targets need --transform=lora')
  if config['transform'] != 'select' and config['select_targets'] != \
      'first,head':
    raise ValueError('--select_targets needs --transform=select')
  if config['transform'] != 'width' and (
      config['width_ratios'] != '1' or config['width_variant'] != 'heterofl'
      or config['width_redraw']):
    raise ValueError('--width_ratios/--width_variant/--width_redraw need '
                     '--transform=width')
  if config['pretrain_epochs'] and not config['public_size']:
    raise ValueError('--pretrain_epochs needs a public split: '
                     '--public_size > 0')
  spec = METHODS[config['method']]
  if not spec.cohorts and (config['cohorts'] or
                           config['transform'] != 'identity'):
    raise ValueError(f"--method={config['method']} trains one full model: "
                     'it takes no --cohorts and --transform=identity')


# ----------------------------------------------------------------------------
# Cohorts: who trains which architecture, with which transform setting.
# ----------------------------------------------------------------------------


def parse_cohorts(text: str, default_model: str
                  ) -> list[tuple[str, float]]:
  """'simple_cnn:0.5,row_lstm:0.5' -> [(model, share)]; '' -> [(model, 1)]."""
  if not text:
    return [(default_model, 1.0)]
  out = []
  for item in text.split(','):
    name, _, share = item.strip().partition(':')
    try:
      value = float(share) if share else 1.0
    except ValueError:
      raise ValueError(f'--cohorts: {item!r} is not model:share') from None
    if not value > 0:
      raise ValueError(f'--cohorts: share of {name!r} must be > 0')
    out.append((name, value))
  return out


def largest_remainder(total: int, weights: list[float], minimum: int = 1,
                      caps: list[int] | None = None) -> list[int]:
  """Integers >= minimum (<= caps) summing to total, proportional to
  weights."""
  w = np.asarray(weights, np.float64) / np.sum(weights)
  counts = np.maximum(np.floor(w * total).astype(int), minimum)
  if caps is not None:
    counts = np.minimum(counts, caps)
  while counts.sum() < total:
    room = (w * total - counts) + (0 if caps is None else
                                   -1e9 * (counts >= np.asarray(caps)))
    counts[int(np.argmax(room))] += 1
  while counts.sum() > total:
    room = (counts - w * total) - 1e9 * (counts <= minimum)
    counts[int(np.argmax(room))] -= 1
  return counts.tolist()


def assign_cohorts(config: dict[str, Any]
                   ) -> tuple[list[tuple[str, float]], list[np.ndarray],
                              list[int]]:
  """(cohort entries, member ids per cohort, clients per round per cohort).

  Members come from a seeded permutation of the K clients split by share;
  C_j is C split the same way (C_j = K_j when every client trains).
  """
  entries = parse_cohorts(config['cohorts'], config['model'])
  k, c = config['num_clients'], config['clients_per_round']
  if len(entries) > k:
    raise ValueError(f'--cohorts has {len(entries)} cohorts for '
                     f'--num_clients={k}')
  sizes = largest_remainder(k, [s for _, s in entries])
  perm = np.random.default_rng(config['seed'] + 11).permutation(k)
  members, start = [], 0
  for size in sizes:
    members.append(np.sort(perm[start:start + size]))
    start += size
  if c == k:
    per_round = list(sizes)
  else:
    if c < len(entries):
      raise ValueError(f'--clients_per_round={c} is fewer than the '
                       f'{len(entries)} cohorts')
    per_round = largest_remainder(c, sizes, caps=sizes)
  return entries, members, per_round


def assign_specs(values: tuple, num_clients: int, seed: int) -> np.ndarray:
  """float32[K]: values dealt round-robin over a seeded client order."""
  order = np.random.default_rng(seed + 13).permutation(num_clients)
  out = np.zeros(num_clients, np.float32)
  out[order] = np.resize(np.asarray(values, np.float32), num_clients)
  return out


def build_cohorts(config: dict[str, Any], *, num_classes: int,
                  input_shape: tuple[int, ...], conv_impl: str,
                  compute_dtype: str) -> tuple[tuple[Cohort, ...],
                                               np.ndarray]:
  """The run's cohorts and the per-client transform spec (float32[K])."""
  entries, members, per_round = assign_cohorts(config)
  transform = config['transform']
  specs = np.zeros(config['num_clients'], np.float32)
  kwargs: dict[str, Any] = {}
  if transform == 'lora':
    ranks = parse_list(config['lora_ranks'], int, 'lora_ranks')
    specs = assign_specs(ranks, config['num_clients'], config['seed'])
    kwargs = dict(ranks=ranks, alpha=config['lora_alpha'],
                  targets=parse_list(config['lora_targets'], str,
                                     'lora_targets'))
  elif transform == 'select':
    kwargs = dict(targets=parse_list(config['select_targets'], str,
                                     'select_targets'))
  elif transform == 'width':
    ratios = parse_list(config['width_ratios'], float, 'width_ratios')
    specs = assign_specs(ratios, config['num_clients'], config['seed'])
    kwargs = dict(ratios=ratios,
                  rolling=config['width_variant'] == 'fedrolex',
                  ordered_dropout=config['width_variant'] == 'fjord')
  cohorts, seen = [], {}
  for (name, _), ids, c_j in zip(entries, members, per_round):
    model = get_model(name, num_classes=num_classes, input_shape=input_shape,
                      conv_impl=conv_impl, pipeline=config['input_pipeline'],
                      dtype=None if compute_dtype == 'float32' else
                      jnp.dtype(compute_dtype))
    label = name if name not in seen else f'{name}_{seen[name]}'
    seen[name] = seen.get(name, 0) + 1
    cohorts.append(Cohort(label, model, get_transform(transform, model,
                                                      **kwargs),
                          tuple(int(i) for i in ids), int(c_j),
                          tuple(float(v) for v in specs),
                          tuple(float(v) for v in ratios)
                          if config['width_redraw'] else ()))
  return tuple(cohorts), specs


def aggregation_groups(cohorts: tuple[Cohort, ...],
                       config: dict[str, Any]) -> tuple[int, ...]:
  """Clients per round of each group a rule aggregates (methods/base.py
  cohort_aggregation): one cohort is one group; several cohorts give the
  shared layers (all clients) plus each cohort whose trainable tree has
  layers of its own."""
  if len(cohorts) == 1:
    return (cohorts[0].clients_per_round,)
  share = parse_share(config.get('cohort_share', 'none'))
  sizes = [sum(c.clients_per_round for c in cohorts)] if share else []
  for c in cohorts:
    template = jax.eval_shape(
        lambda c=c: c.transform.init(c.model.init(jax.random.key(0)),
                                     jax.random.key(0))[1])
    private = split_roles(template, c.model, share)[1] if share else template
    if jax.tree.leaves(private):
      sizes.append(c.clients_per_round)
  return tuple(sizes)


def upload_bytes(cohort: Cohort, template: Any) -> dict[str, int]:
  """Bytes a client of each spec uploads per round (float32 coordinates it
  owns), keyed by spec ('' without specs)."""
  t = cohort.transform
  values = t.spec_values or (None,)
  out = {}
  for v in values:
    cov = t.coverage(template, None if v is None else jnp.float32(v),
                     jnp.int32(0))
    if cov is None:
      count = sum(int(np.prod(leaf.shape)) for leaf in
                  jax.tree.leaves(template))
    else:
      count = int(sum(float(jnp.sum(c)) for c in jax.tree.leaves(cov)))
    out['' if v is None else f'{t.spec_name}={v:g}'] = 4 * count
  return out


def lora_communication(method: str, cohort: Cohort, template: Any, *,
                       anchors: int, classes: int) -> dict[str, Any] | None:
  """Per-round (upload, download) bytes of one client, by rank, for the
  federated-LoRA methods (fedlora.communication_bytes; RFD-LoRA Table 2);
  None for other methods or transforms."""
  if cohort.transform.name != 'lora' or method not in LORA_COMM_METHODS:
    return None
  modules = {p: (int(get_path(template, p)['a'].shape[0]),
                 int(get_path(template, p)['b'].shape[1]))
             for p in fedlora.lora_modules(template)}
  r_max = int(get_path(template, next(iter(modules)))['a'].shape[1])
  ranks = [int(v) for v in cohort.specs] if cohort.transform.spec_values \
      else [r_max] * len(cohort.members)
  # FLoRA's download is the stack of the round's adapters: the mean
  # client's rank times the clients a round.
  per_round = (tuple(ranks) if cohort.clients_per_round == len(ranks) else
               (float(np.mean(ranks)),) * cohort.clients_per_round)
  out, up, down = {}, [], []
  for r in sorted(set(ranks)):
    u, d = fedlora.communication_bytes(
        method, modules, rank=r, round_ranks=per_round,
        head=(cohort.model.roles or {}).get('head'), anchors=anchors,
        classes=classes)
    out[f'rank={r}'] = {'upload': int(u), 'download': int(d)}
  for r in ranks:
    up.append(out[f'rank={r}']['upload'])
    down.append(out[f'rank={r}']['download'])
  out['mean'] = {'upload': float(np.mean(up)), 'download': float(np.mean(down))}
  return out


LORA_COMM_METHODS = ('fedavg', 'fedit', 'ffa_lora', 'flora', 'flexlora',
                     'lora_fair', 'rfd_lora')


# ----------------------------------------------------------------------------
# Files.
# ----------------------------------------------------------------------------


DETECTION_KEYS = ('det_tp', 'det_fp', 'det_fn', 'det_tn')


def detection_rates(counts: dict[str, Any], prefix: str) -> dict[str, Any]:
  """Precision, recall, FPR, FNR and accuracy (FedHAN's DACC) of
  'excluded' vs 'malicious' (NaN if 0/0)."""
  tp, fp, fn, tn = (float(counts[k]) for k in DETECTION_KEYS)
  div = lambda a, b: a / b if b else float('nan')
  return {f'{prefix}detection_precision': div(tp, tp + fp),
          f'{prefix}detection_recall': div(tp, tp + fn),
          f'{prefix}detection_fpr': div(fp, fp + tn),
          f'{prefix}detection_fnr': div(fn, fn + tp),
          f'{prefix}detection_accuracy': div(tp + tn, tp + fp + fn + tn)}


def params_sha256(params: Any) -> str:
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
  return digest.hexdigest()


def package_versions() -> dict[str, str]:
  out = {}
  for name in PACKAGES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = 'not installed'
  return out


def device_info() -> dict[str, Any]:
  devices = jax.devices()
  return {'backend': jax.default_backend(), 'device_kind':
          devices[0].device_kind, 'device_count': len(devices),
          'process_count': jax.process_count()}


def plot_clients(path: str, rows: list[dict[str, Any]], title: str) -> None:
  """Per-client values by round (red: attacking): the aggregation weight
  share and, where the method has one, its score (SDFC's T_k)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows = [r for r in rows if 'clients' in r]
  panels = [k for k in ('weight', 'fisher_discrepancy',
                        'fisher_discrepancy_incoming')
            if k in rows[0]['clients']]
  if not panels:
    return
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6),
                           squeeze=False)
  for ax, key in zip(axes[0], panels):
    for r in rows:
      c = r['clients']
      values = np.asarray(c[key], np.float64)
      if key == 'weight' and values.sum() > 0:
        values = values / values.sum()
      colors = ['tab:red' if m else 'tab:blue' for m in c['malicious']]
      ax.scatter([r['round']] * len(values), values, c=colors, s=12)
    ax.set_xlabel('round')
    ax.set_ylabel('weight share' if key == 'weight' else key)
    ax.grid(alpha=0.3)
  axes[0][0].set_title(f'{title}: red = attacking', fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_curves(path: str, rows: list[dict[str, Any]], title: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  rounds = [r['round'] for r in rows]
  keys = [('test_accuracy', 'global test'),
          ('local_accuracy', 'local test (mean over clients)'),
          ('attack_success_rate', 'attack success')]
  variants = sorted({k.split('/', 1)[1] for r in rows for k in r
                     if k.startswith('test_accuracy/')})
  keys += [(f'test_accuracy/{v}', f'global test: {v}') for v in variants]
  for key, label in keys:
    values = [r.get(key) for r in rows]
    if any(v is not None for v in values):
      ax.plot(rounds, values, marker='.', label=label)
  ax.set_xlabel('round')
  ax.set_ylabel('accuracy')
  ax.set_ylim(0, 1)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# ----------------------------------------------------------------------------
# Building the run (no file is touched).
# ----------------------------------------------------------------------------


def resolve(config: dict[str, Any]) -> dict[str, Any]:
  """Fills defaults that depend on other settings ('auto', 0, unset)."""
  config = {**config_lib.defaults(), **config}
  if not config.get('workdir'):
    config['workdir'] = default_workdir(config)
  if not config['clients_per_round']:
    config['clients_per_round'] = config['num_clients']
  if config['aggregator'] == 'auto':
    spec = METHODS.get(config["method"])
    if spec is not None:
      config['aggregator'] = spec.default_aggregator(
          config_lib.settings_of(config['method'], config))
  return config


class Program(NamedTuple):
  """Everything a run needs, built and checked before the workdir."""
  setup: Any
  cohorts: tuple[Cohort, ...]
  specs: np.ndarray
  method: Any
  threat: Any
  round_config: RoundConfig
  mesh: Any
  local: LocalConfig
  optimizer: Any
  server_data: dict[str, Any]
  resolved: dict[str, Any]
  unseen: Any = None      # the newcomers' FederatedSetup (--unseen_clients)


def build(config: dict[str, Any]) -> Program:
  """Data, cohorts, method, threat and round program, fully checked."""
  backend = jax.default_backend()
  strategy = (default_strategy(backend) if config['client_execution'] ==
              'auto' else config['client_execution'])
  chunk_size = config['chunk_size'] or (
      min(config['clients_per_round'], 16) if strategy == 'chunked' else 0)
  conv_impl = (default_conv_impl(backend) if config['conv_impl'] == 'auto'
               else config['conv_impl'])
  compute_dtype = config['compute_dtype']
  if compute_dtype == 'auto':
    compute_dtype = default_compute_dtype(backend)
  # All devices of all processes (under --distributed, a mesh of one
  # process's devices would leave the others with nothing to run).
  num_devices = config['num_devices'] or jax.device_count()
  mesh = client_mesh(num_devices) if num_devices > 1 else None

  dataset = load_dataset(config['dataset'], config['data_dir'])
  dataset = subsample(dataset, config['max_train_examples'], config['seed'])
  dataset = subsample_test(dataset, config['max_test_examples'],
                           config['seed'])
  setup = build_federated_setup(
      dataset, num_clients=config['num_clients'] + config['unseen_clients'],
      partition_name=config['partition'], seed=config['seed'],
      dirichlet_alpha=config['dirichlet_alpha'],
      classes_per_client=config['classes_per_client'],
      quantity_alpha=config['quantity_alpha'],
      validation_fraction=config['validation_fraction'],
      validation_size=config['validation_size'],
      public_size=config['public_size'],
      local_test_fraction=config['local_test_fraction'],
      eval_batch_size=config['eval_batch_size'],
      global_test_per_class=config['global_test_per_class'])
  setup, unseen = hold_out(setup, config['unseen_clients'], config['seed'])
  cohorts, specs = build_cohorts(
      config, num_classes=setup.num_classes, input_shape=setup.input_shape,
      conv_impl=conv_impl, compute_dtype=compute_dtype)
  delay = parse_delay(config['client_delay'])

  n_max = setup.train.x.shape[1]
  steps_per_epoch = -(-n_max // config['batch_size'])
  local = LocalConfig(
      batch_size=config['batch_size'], num_epochs=config['local_epochs'],
      steps_per_epoch=steps_per_epoch,
      unroll=config['scan_unroll'] or steps_per_epoch *
      config['local_epochs'])
  optimizer = make_optimizer(config, config['local_lr'], local.num_steps)
  threat = build_threat(
      config, num_classes=setup.num_classes, input_shape=setup.input_shape,
      # Lazy: a triggered test set is built by the block a process places.
      test_x=RowTable(dataset.test_x, np.arange(len(dataset.test_y))),
      test_y=dataset.test_y,
      validation=(setup.validation_x, setup.validation_y),
      cohorts=cohorts, delayed=delay is not None,
      group_sizes=aggregation_groups(cohorts, config),
      client_steps=typical_client_steps(setup.train.count,
                                        config['batch_size'],
                                        config['local_epochs']))

  spec = METHODS[config['method']]
  settings = config_lib.settings_of(config['method'], config)
  spec.validate(settings, config['aggregator'])
  server_data = {}
  for name in spec.server_data:
    if name == 'validation':
      if not config['validation_size']:
        raise ValueError(f"--method={config['method']} needs a clean "
                         'validation sample: --validation_fraction > 0 and '
                         '--validation_size > 0')
      server_data[name] = tuple(map(jnp.asarray, pad_to_batches(
          setup.validation_x, setup.validation_y, config['batch_size'])))
    if name == 'anchors':
      server_data[name] = jnp.asarray(anchor_inputs(
          settings['anchor_dataset'], settings['anchor_fraction'],
          len(dataset.train_y), setup.input_shape, config))
  method = spec.build(cohorts=cohorts, local=local, optimizer=optimizer,
                      aggregator=threat.aggregator,
                      server_lr=config['server_lr'], poison=threat.poison,
                      num_clients=config['num_clients'], **settings)
  if spec.uses_aggregator:
    aggregators.check_provided(config['aggregator'], threat.aggregator,
                               method.provides)
  round_config = RoundConfig(
      num_clients=config['num_clients'],
      clients_per_round=config['clients_per_round'], strategy=strategy,
      chunk_size=chunk_size, num_devices=num_devices if mesh else 1,
      cohorts=tuple(CohortSlots(c.members, c.clients_per_round)
                    for c in cohorts) if len(cohorts) > 1 else (),
      delay=delay, max_arrivals=config['max_arrivals'],
      train_on_arrival=config['train_on_arrival'],
      max_staleness=config['max_staleness'],
      sample_strata=config['sample_strata'],
      client_data=config['client_data'])
  resolved = {'client_execution': strategy, 'chunk_size': chunk_size,
              'conv_impl': conv_impl, 'compute_dtype': compute_dtype,
              'num_devices': num_devices, 'backend': backend,
              'steps_per_round': local.num_steps, 'padded_client_size': n_max,
              'aggregator': config['aggregator']}
  return Program(setup, cohorts, specs, method, threat, round_config, mesh,
                 local, optimizer, server_data, resolved, unseen)


# ----------------------------------------------------------------------------
# Evaluation.
# ----------------------------------------------------------------------------


def no_local(n: int) -> dict[str, np.ndarray]:
  """The per-client local metrics of clients without a local test split."""
  return {'count': np.zeros(n), 'accuracy': np.zeros(n)}


class Evaluator:
  """Global, local and backdoor accuracy of every model a method reports.

  For one cohort the headline model's metrics are `test_accuracy`,
  `local_accuracy`, ...; other models (width submodels, cohorts) add
  `<metric>/<label>`. With several cohorts the headline numbers are the
  member-weighted means over the cohorts' global models, and
  local_accuracy is the mean over all clients of their own cohort's model.
  A per-client model set (private backbones) is evaluated client by
  client, as Horus does: global accuracy is the mean over clients of their
  own model's accuracy on the global test set, local accuracy the mean of
  their own model on their own local test split.

  With a mesh of several devices the evaluations split over it
  (engine.evaluate.evaluations): the global and triggered sets' batches,
  and the clients of the local test splits, each device evaluating its
  share once instead of every device evaluating everything. The sets'
  inputs are lazy (data.RowTable) through the padding and re-cuts, so
  under several processes each process builds, and sends to its devices,
  only its own share of the global, triggered and local test sets; the
  labels and masks (small) are whole on every process.
  """

  def __init__(self, program: Program, put, eval_batch_size: int,
               mesh=None):
    self.cohorts = program.cohorts
    self.num_clients = program.setup.train.count.shape[0]
    self.mesh = mesh if mesh is not None and mesh.size > 1 else None
    self.test = self.place_set(program.setup.test, put)
    lt = program.setup.local_test
    self.local_tests = [self.place_local(tuple(a[np.asarray(c.members)]
                                                 for a in lt), put)
                        for c in self.cohorts]
    # Without local test splits (--local_test_fraction=0) the per-client
    # local evaluation would run every client over padding: skip it.
    self.has_local = [bool(np.any(np.asarray(lt[2])[np.asarray(c.members)]))
                      for c in self.cohorts]
    self._fns = [self._compile(c.model.apply) for c in self.cohorts]
    self._own_apply: dict[Any, dict[str, Any]] = {}
    # The triggered inputs, scored against their true labels: one pass
    # gives ASR and RA (engine.evaluate's confusion); the clean target rate
    # comes from the clean test pass.
    self.triggered = None
    if program.threat.triggered_test is not None:
      x, target, true = program.threat.triggered_test
      self.target = int(target[0]) if len(target) else 0
      # Edge-case inputs have no true class (their "true" label is the
      # target): no RA, and the clean floor over non-target inputs.
      self.no_true_class = bool(len(true)) and bool(np.all(true ==
                                                           self.target))
      self.exclude_target = (self.no_true_class or
                             not np.any(true == self.target))
      self.triggered = self.place_set(pad_to_batches(
          x, true, eval_batch_size), put)

  def place_set(self, batches, put):
    """One evaluation set [T, B, ...] on the devices: whole (`put`), or
    with its batches split over the mesh."""
    if self.mesh is None:
      return put(tuple(map(jnp.asarray, batches)))
    return place_clients(rebatch(*batches, self.mesh.size), self.mesh,
                         'sharded')

  def place_local(self, tree, put):
    """Per-client sets [K, ...] on the devices: whole (`put`), or split
    over the mesh by client, padded with empty clients to a multiple of
    its size (`clients` and `own` cut outputs back to K)."""
    if self.mesh is None:
      return put(jax.tree.map(jnp.asarray, tree))
    return place_clients(pad_leading(tree, self.mesh.size), self.mesh,
                         'sharded')

  @staticmethod
  def _fetch(tree, k: int) -> dict[str, np.ndarray]:
    """Per-client outputs [K', ...] to the host, cut to the first k; a
    split output is gathered from every process."""
    if jax.process_count() > 1:
      tree = multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree.map(lambda a: np.asarray(a)[:k], jax.device_get(tree))

  def clients(self, fns, params, local, k: int) -> dict[str, np.ndarray]:
    """One model on k clients' placed local sets (`place_local`)."""
    return self._fetch(fns['clients'](params, *local), k)

  def own(self, fns, params, index, local, k: int) -> dict[str, np.ndarray]:
    """Row index[i] of a stacked model set on client i's placed local set,
    for k clients."""
    index = self.place_local(np.asarray(index, np.int32), jnp.asarray)
    return self._fetch(fns['own'](params, index, local), k)

  def _compile(self, apply) -> dict[str, Any]:
    """The jitted evaluations of one forward `apply`: 'test' (a model on
    one set), 'clients' (a model on every client's local test), 'rows'
    (each row of a stacked model set on one set) and 'own' (client k's row
    on its own local test); engine.evaluate.evaluations."""
    return evaluations(apply, self.mesh)

  def for_cohort(self, j: int) -> dict[str, Any]:
    """The evaluations of cohort j's Model."""
    return self._fns[j]

  def fns(self, m) -> dict[str, Any]:
    """The evaluations for EvalModel m: its cohort Model's, or those of
    the method's own forward (m.apply), compiled once."""
    if m.apply is None:
      return self.for_cohort(m.cohort)
    if m.apply not in self._own_apply:
      self._own_apply[m.apply] = self._compile(m.apply)
    return self._own_apply[m.apply]

  def __call__(self, models) -> dict[str, Any]:
    row: dict[str, Any] = {}
    own_local: dict[int, float] = {}
    per_cohort: dict[int, dict[str, float]] = {}
    for m in models:
      c = self.cohorts[m.cohort]
      members = list(c.members)
      if m.per_client:
        values = self._per_client(m)
        suffix = f'/{m.label}' if m.label else ''
        row.update({k + suffix: v for k, v in values.items()
                    if k != '_own'})
        per_cohort[m.cohort] = values
        own_local.update(values['_own'])
        continue
      test = jax.device_get(self.fns(m)['test'](m.params, *self.test))
      local = (self.clients(self.fns(m), m.params,
                            self.local_tests[m.cohort], len(members))
               if self.has_local[m.cohort] else no_local(len(members)))
      wanted = set(m.clients) if m.clients is not None else set(members)
      pick = np.array([i in wanted for i in members])
      has = (np.asarray(local['count']) > 0) & pick
      values = {'test_accuracy': float(test['accuracy']),
                'test_loss': float(test['loss']),
                'local_accuracy': (float(np.mean(local['accuracy'][has]))
                                   if has.any() else None)}
      if self.triggered is not None:
        trig = jax.device_get(self.fns(m)['test'](m.params,
                                                      *self.triggered))
        values.update(self._backdoor(values['test_accuracy'],
                                     test['confusion'], trig['confusion']))
      suffix = f'/{m.label}' if m.label else ''
      row.update({k + suffix: v for k, v in values.items()})
      if m.clients is None:
        per_cohort[m.cohort] = values
        for i, ok, acc in zip(members, np.asarray(local['count']) > 0,
                              np.asarray(local['accuracy'])):
          if ok:
            own_local[i] = float(acc)
    # Personalisation (the personalised-FL papers' "mean" and "worst
    # 10%"), comparable across methods: every client's accuracy on its own
    # test split with its own model (the last per-client model a method
    # reports), else with its cohort's global model.
    mine = np.array(list(own_local.values()), np.float64)
    if mine.size:
      row['personal_accuracy'] = float(np.mean(mine))
      row['personal_accuracy_p10'] = float(np.percentile(mine, 10))
    if len(self.cohorts) > 1:
      share = np.array([len(c.members) for c in self.cohorts], np.float64)
      share /= share.sum()
      for key in ('test_accuracy', 'test_loss', 'attack_success_rate',
                  'backdoor_failure_rate', 'tradeoff_v', 'robust_accuracy',
                  'clean_target_rate'):
        if key in per_cohort[0]:
          row[key] = float(sum(s * per_cohort[j][key]
                               for j, s in enumerate(share)))
      row['local_accuracy'] = (float(np.mean(list(own_local.values())))
                               if own_local else None)
    return row


  def _per_client(self, m) -> dict[str, Any]:
    """A model per client: mean over clients of their own model's global
    accuracy (and ASR), and of its accuracy on their own local test. With
    `m.index` clients share rows (one submodel per width), so each
    distinct model is evaluated on the global sets once."""
    members = list(self.cohorts[m.cohort].members)
    index = (np.arange(len(members), dtype=np.int32) if m.index is None
             else np.asarray(m.index, np.int32))
    rows_fn = self.fns(m)['rows']
    global_m = jax.device_get(rows_fn(m.params, *self.test))
    local_m = (self.own(self.fns(m), m.params, index,
                        self.local_tests[m.cohort], len(members))
               if self.has_local[m.cohort] else no_local(len(members)))
    has = np.asarray(local_m['count']) > 0
    values = {'test_accuracy': float(np.mean(global_m['accuracy'][index])),
              'test_loss': float(np.mean(global_m['loss'][index])),
              'local_accuracy': (float(np.mean(local_m['accuracy'][has]))
                                 if has.any() else None),
              # The personalisation papers' tail: the 10th percentile of
              # the clients' own accuracies (HiLoRA's "worst 10%").
              'local_accuracy_p10': (float(np.percentile(
                  local_m['accuracy'][has], 10)) if has.any() else None),
              '_own': {i: float(a) for i, a, ok in zip(
                  members, np.asarray(local_m['accuracy']), has) if ok}}
    if self.triggered is not None:
      trig = jax.device_get(rows_fn(m.params, *self.triggered))
      values.update(self._backdoor(
          values['test_accuracy'],
          np.asarray(global_m['confusion'])[index],
          np.asarray(trig['confusion'])[index]))
    return values

  def _backdoor(self, test_accuracy: float, clean, triggered
                ) -> dict[str, float]:
    """ASR, RA and the clean target rate (means over leading rows)."""
    rates = {k: float(np.mean(v)) for k, v in backdoor_rates(
        clean, triggered, self.target,
        exclude_target=self.exclude_target).items()}
    asr = rates['attack_success_rate']
    if self.no_true_class:
      rates.pop('robust_accuracy')
    return dict(rates, backdoor_failure_rate=1 - asr,
                tradeoff_v=(test_accuracy + 1 - asr) / 2)


HEADLINE = ('test_accuracy', 'local_accuracy', 'local_accuracy_p10',
            'personal_accuracy', 'personal_accuracy_p10',
            'attack_success_rate',
            'backdoor_failure_rate', 'tradeoff_v', 'robust_accuracy',
            'clean_target_rate')


# ----------------------------------------------------------------------------
# The run.
# ----------------------------------------------------------------------------


def clustering_summary(method_state, client_groups) -> dict[str, Any]:
  """A clustering method's (HiLoRA's) clusters: `num_clusters` (0 before
  it clustered), `cluster_assignment` per client (-1: none) and, when the
  partition knows the true groups, `true_clusters` and `cluster_ari`
  (adjusted Rand index of the assignment against them)."""
  if not all(hasattr(method_state, f) for f in ('assign', 'num_clusters')):
    return {}
  assign = np.asarray(jax.device_get(method_state.assign))
  out = {'num_clusters': int(jax.device_get(method_state.num_clusters)),
         'cluster_assignment': assign.tolist()}
  if client_groups is not None and out['num_clusters'] > 0:
    truth = np.asarray(client_groups)[:len(assign)]
    out['true_clusters'] = int(len(set(truth[truth >= 0].tolist())))
    out['cluster_ari'] = adjusted_rand_index(truth, assign)
  return out


def adapt_unseen(program: Program, state, evaluator: 'Evaluator', put,
                 config: dict[str, Any]) -> dict[str, Any]:
  """The newcomers (--unseen_clients): each adapts the model the method
  gives a new client for --unseen_epochs on its own data
  (fedrobust.adapt) and is scored on its own test split. Returns
  summary entries: unseen_accuracy (mean over newcomers), its 10th
  percentile, the per-newcomer accuracies and, for a clustering method,
  the cluster each was routed to and unseen_route_accuracy (the share
  routed to a cluster whose members' majority domain is theirs)."""
  unseen = program.unseen
  t0 = time.perf_counter()
  local = program.local._replace(num_epochs=config['unseen_epochs'],
                                 unroll=1)
  fn = jax.jit(functools.partial(
      adapt.adapt_newcomers, program.method, program.cohorts,
      local=local, optimizer=program.optimizer))
  params, info = fn(state, put(jax.tree.map(jnp.asarray, unseen.train)),
                    jax.random.key(config['seed'] + 7))
  k = unseen.train.count.shape[0]
  scores = evaluator.own(evaluator.for_cohort(0), params, np.arange(k),
                         evaluator.place_local(tuple(unseen.local_test),
                                                 put), k)
  has = np.asarray(scores['count']) > 0
  acc = np.asarray(scores['accuracy'])
  out = {'unseen_accuracy': float(np.mean(acc[has])) if has.any() else None,
         'unseen_accuracy_p10': (float(np.percentile(acc[has], 10))
                                 if has.any() else None),
         'unseen_client_accuracy': [float(a) for a in acc],
         'unseen_seconds': time.perf_counter() - t0}
  info = jax.device_get(info)
  if 'cluster' in info:
    routes = np.asarray(info['cluster']).astype(int)
    out['unseen_cluster'] = routes.tolist()
    assign = np.asarray(jax.device_get(state.method_state.assign))
    truth = program.setup.client_groups
    if unseen.client_groups is not None and truth is not None:
      majority = {j: np.bincount(truth[assign == j]).argmax()
                  for j in set(assign.tolist()) if j >= 0}
      out['unseen_groups'] = unseen.client_groups.tolist()
      out['unseen_route_accuracy'] = float(np.mean(
          [majority.get(r, -1) == g
           for r, g in zip(routes, unseen.client_groups)]))
  logging.info('newcomers: %d adapted for %d epochs, accuracy %s (%.1fs)',
               k, config['unseen_epochs'], _fmt(out['unseen_accuracy']),
               out['unseen_seconds'])
  return out


class DivergenceError(RuntimeError):
  """The global model became non-finite and --on_divergence=stop (or the
  run ended on a non-finite model)."""

  def __init__(self, message: str, summary: dict[str, Any]):
    super().__init__(message)
    self.summary = summary


def anchor_inputs(name: str, fraction: float, train_size: int,
                  input_shape: tuple[int, ...], config) -> np.ndarray:
  """A public anchor set: round(fraction * train_size) training inputs of
  dataset `name` (labels dropped), drawn with the run's seed.

  When `name` is the clients' own dataset, the anchors are in-domain
  public data: they are drawn only from the training rows that
  --max_train_examples leaves out, so no client, newcomer or server split
  holds them.
  """
  flag = f"--{config['method']}_anchor_dataset"
  in_domain = name == config['dataset']
  anchors = load_dataset(name, config['data_dir'] if in_domain
                         else None).train_x
  if tuple(anchors.shape[1:]) != tuple(input_shape):
    raise ValueError(f'{flag}={name} stores examples of shape '
                     f'{anchors.shape[1:]}, the clients {input_shape}')
  pool = np.arange(len(anchors))
  if in_domain:
    pool = unused_rows(len(anchors), config['max_train_examples'],
                       config['seed'])
    if not len(pool):
      raise ValueError(
          f"{flag}={name} is the clients' own dataset, and the clients "
          f'hold all {len(anchors)} of its training examples: set '
          f'--max_train_examples below {len(anchors)} so that in-domain '
          'anchors can be drawn from the rest, or name a disjoint public '
          'dataset')
  n = max(1, int(round(fraction * train_size)))
  if n > len(pool):
    where = ('training examples the clients do not hold' if in_domain
             else 'examples')
    raise ValueError(f'{flag}={name} has {len(pool)} {where}, fewer '
                     f'than the {n} anchors asked for')
  rows = np.random.default_rng(config['seed'] + 11).choice(
      len(pool), n, replace=False)
  return anchors[pool[np.sort(rows)]]


def run(config: dict[str, Any]) -> dict[str, Any]:
  """Runs (or resumes) one experiment; returns the summary dict.

  Raises:
    FlagError, ValueError, ConfigMismatchError, WorkdirError,
      DataNotFoundError: bad settings, data or workdir, each naming the
      flag or path; nothing is written to the workdir before every check
      on settings and data has passed.
    DivergenceError: the model diverged (see --on_divergence); the
      summary is written first, with status 'diverged'.
  """
  try:
    return _run(config)
  except SettingError as err:
    method = config.get('method', 'fedavg')
    raise FlagError(config_lib.describe_error(
        err, method if method in METHODS else 'fedavg')) from err


def _run(config: dict[str, Any]) -> dict[str, Any]:
  started = time.perf_counter()
  config = resolve(config)
  validate(config)
  # Before anything starts JAX's CPU backend (a no-op once it has).
  configure_cpu_devices(
      config['cpu_devices'], config['clients_per_round'],
      strata=(config['sample_strata'] if config['client_data'] == 'sharded'
              else 1))
  program = build(config)
  workdir = config['workdir']
  if os.path.lexists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f'--workdir={workdir} exists and is not a directory')
  os.makedirs(workdir, exist_ok=True)
  # Under jax.distributed every process runs this loop on one shared
  # workdir: process 0 holds the lock and writes the run's files; every
  # process computes the same replicated rounds and joins each checkpoint.
  # A SIGTERM or SIGINT from here on ends the run after the round in
  # flight, checkpointed (experiments/preemption.py).
  with (workdir_lib.Lock(workdir) if is_primary()
        else contextlib.nullcontext()), \
      preemption_lib.Preemption() as preemption:
    return _run_locked(config, program, started, preemption)


def make_optimizer(config: dict[str, Any], lr: float, num_steps: int):
  """--local_optimizer at learning rate `lr` (AdamW warms up over
  --warmup_fraction of `num_steps`)."""
  if config['local_optimizer'] == 'adamw':
    return adamw(learning_rate=lr, weight_decay=config['weight_decay'],
                 warmup_steps=int(round(config['warmup_fraction'] *
                                        num_steps)))
  return sgd(learning_rate=lr, momentum=config['momentum'],
             weight_decay=config['weight_decay'])


def _pretrain_cohort(config: dict[str, Any], program: Program,
                     cohort: Cohort, params: Any, index: int
                     ) -> tuple[Any, dict[str, Any]]:
  """Central pretraining of one cohort's model on the public split."""
  setup = program.setup
  t0 = time.perf_counter()
  params, stats = pretrain(
      cohort.model.apply, params, setup.public_x, setup.public_y,
      epochs=config['pretrain_epochs'], batch_size=config['batch_size'],
      optimizer=make_optimizer(
          config, config['pretrain_lr'] or config['local_lr'],
          config['pretrain_epochs'] * -(-len(setup.public_y) //
                                        config['batch_size'])),
      key=jax.random.fold_in(jax.random.key(config['seed'] + 5), index))
  acc = float(jax.jit(functools.partial(evaluate, cohort.model.apply))(
      params, *map(jnp.asarray, setup.test))['accuracy'])
  return params, {'test_accuracy': acc,
                  'train_loss': float(stats['train_loss']),
                  'seconds': time.perf_counter() - t0,
                  'epochs': config['pretrain_epochs'],
                  'public_examples': int(len(setup.public_y))}


def initial_server_state(program: Program, config: dict[str, Any], params,
                         *, data, server_data) -> ServerState:
  """The run's round-0 ServerState from each cohort's `params` (also the
  checkpoint template, under jax.eval_shape)."""
  state = init_server_state(program.method, params, config['num_clients'],
                            config['seed'] + 1, config=program.round_config,
                            data=data, server_data=server_data)
  threat = program.threat.threat
  if threat is not None and threat.stateful_attack is not None:
    # 3DFed's feedback state, checkpointed too.
    state = state._replace(attack=threat.stateful_attack.init(
        state.params[0]))
  return state


class SavedRun(NamedTuple):
  """A run in a workdir, rebuilt for reading its checkpoints."""
  config: dict[str, Any]
  program: Program
  fresh: tuple               # initial_params: each cohort's round-0 params
  template: Any              # the ServerState's shapes (jax.eval_shape)


def open_run(workdir: str, method: str) -> SavedRun:
  """The `method` run in `workdir` for an analysis tool: its config, the
  program built from it, and the checkpoint template.

  Raises:
    ValueError: no run in `workdir`, or a run of another method.
  """
  path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(path):
    raise ValueError(f'--workdir={workdir} holds no run (no config.json)')
  config = resolve(workdir_lib.read_json_object(path))
  if config['method'] != method:
    raise ValueError(f"--workdir={workdir} ran --method={config['method']}; "
                     f'expected {method}')
  program = build(config)
  fresh = initial_params(program.cohorts, config['seed'])
  template = jax.eval_shape(
      lambda p: initial_server_state(
          program, config, p, data=program.setup.train,
          server_data=program.server_data), fresh)
  return SavedRun(config, program, fresh, template)


def initial_params(cohorts: tuple[Cohort, ...], seed: int) -> tuple:
  """Each cohort's freshly initialised full params (cohort j folds in j)."""
  key = jax.random.key(seed)
  return tuple(c.model.init(key if j == 0 else jax.random.fold_in(key, j))
               for j, c in enumerate(cohorts))


def _run_locked(config: dict[str, Any], program: Program,
                started: float, preemption: preemption_lib.Preemption
                ) -> dict[str, Any]:
  setup, cohorts, method = program.setup, program.cohorts, program.method
  workdir = config['workdir']
  primary = is_primary()
  if primary:
    workdir_lib.prepare(config, defaults=config_lib.defaults(),
                        resumable=RESUMABLE_KEYS, execution=EXECUTION_KEYS,
                        normalize=normalize)
  barrier(f'workdir-prepared {workdir}')   # --overwrite may remove files
  cohort_of = np.zeros(config['num_clients'], int)
  for j, c in enumerate(cohorts):
    cohort_of[list(c.members)] = j
  write_json = workdir_lib.write_json if primary else lambda *_: None
  append_row = workdir_lib.append_row if primary else lambda *_: None
  write_json(os.path.join(workdir, 'client_histograms.json'), {
      'num_classes': setup.num_classes,
      'train_counts': setup.train.count.tolist(),
      'histograms': setup.histograms.tolist(),
      'cohort': [cohorts[j].name for j in cohort_of],
      'spec': ({cohorts[0].transform.spec_name: program.specs.tolist()}
               if cohorts[0].transform.spec_name else {})})

  mesh = program.mesh
  replicated = NamedSharding(mesh, P()) if mesh else None
  put = functools.partial(jax.device_put, device=replicated)
  data = place_clients(setup.train, mesh, config['client_data'])
  server_data = put(program.server_data)
  on_divergence = config['on_divergence']
  round_step = make_round_step(method, program.round_config, mesh=mesh,
                               threat=program.threat.threat,
                               skip_nonfinite=on_divergence == 'skip_round',
                               log_clients=config['log_clients'])

  fresh = initial_params(cohorts, config['seed'])

  initial_state = functools.partial(initial_server_state, program, config,
                                    data=data, server_data=server_data)

  template = jax.eval_shape(initial_state, fresh)
  if replicated is not None:      # restored straight into place, no copy
    template = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
        template)
  checkpointer = Checkpointer(os.path.join(workdir, 'checkpoints'),
                              keep=config['checkpoints_keep'],
                              compress=config['checkpoint_compress'])
  try:
    restored = checkpointer.restore_latest(
        template, legacy=legacy_server_state(template) +
        fedhan_lib.legacy_states(template))
  except CheckpointError as err:
    if not config['overwrite']:
      raise
    logging.warning('%s; --overwrite: starting over from round 0', err)
    restored = None
  pretrain_info = {}
  if restored is not None:
    state = put(restored[1])
    logging.info('resumed from round %d in %s', restored[0], workdir)
    if restored[0] > config['num_rounds']:
      raise WorkdirError(
          f"--num_rounds={config['num_rounds']} is below round "
          f'{restored[0]}, where the run in {workdir} already is; pass '
          f'--num_rounds >= {restored[0]} (a run is never cut back)')
  else:
    if config['pretrain_epochs']:
      pretrained = []
      for j, (c, p) in enumerate(zip(cohorts, fresh)):
        train = functools.partial(_pretrain_cohort, config, program, c, p, j)
        if config['pretrained_dir']:
          p, info = backbone.load_or_pretrain(
              config['pretrained_dir'],
              backbone.entry_name(c.name, p, setup.public_x, setup.public_y,
                                  config, j), p, train)
        else:
          p, info = train()
        pretrain_info[c.name] = info
        logging.info('pretrained %s centrally: %d epochs on %d public '
                     'examples, test accuracy %.4f%s', c.name,
                     config['pretrain_epochs'], len(setup.public_y),
                     info['test_accuracy'],
                     ' (stored, read back)' if info.get('reused') else '')
        pretrained.append(p)
      fresh = tuple(pretrained)
    state = put(initial_state(fresh))
    if method.client_setup is not None:
      t0 = time.perf_counter()
      setup_step = jax.jit(make_setup_step(method, program.round_config,
                                           mesh=mesh))
      state = setup_step(state, data, server_data)
      jax.block_until_ready(state)
      logging.info('setup step (e.g. local warm-up of every client) took '
                   '%.1fs', time.perf_counter() - t0)
  start_round = int(state.round)
  metrics_path = os.path.join(workdir, 'metrics.jsonl')
  missing_metrics = start_round > 0 and not os.path.lexists(metrics_path)
  if missing_metrics:
    logging.warning('%s is missing although the run is at round %d: rounds '
                    '1..%d have no metrics rows (summary.json records '
                    'this)', metrics_path, start_round, start_round)
  rows = workdir_lib.read_metrics(metrics_path, start_round,
                                  rewrite=primary)
  rounds_path = os.path.join(workdir, 'rounds.jsonl')
  logged_rounds = {}
  if config['log_clients'] or os.path.lexists(rounds_path):
    logged_rounds = {r['round']: r for r in workdir_lib.read_metrics(
        rounds_path, start_round, rewrite=primary)}

  # The state goes in replicated; XLA may otherwise choose to leave a
  # [clients, ...] leaf of the output sharded over the client axis (a
  # rule's per-slot history), and the next call would not match the
  # compiled program.
  step_fn = jax.jit(round_step, donate_argnums=0,
                    **({'out_shardings': replicated} if mesh else {}))
  t0 = time.perf_counter()
  compiled = step_fn.lower(state, data, server_data).compile()
  compile_seconds = time.perf_counter() - t0
  evaluator = Evaluator(program, put, config['eval_batch_size'], mesh)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  flops_per_round = float((cost or {}).get('flops', float('nan')))
  resolved = program.resolved
  logging.info('round program compiled in %.1fs (%s, %s, conv=%s, %d '
               'device(s))', compile_seconds, resolved['backend'],
               resolved['client_execution'], resolved['conv_impl'],
               resolved['num_devices'])

  num_rounds = config['num_rounds']
  round_times = []
  # Host-side totals (cumulative detection counts, skipped rounds) resume
  # from the restored step's ledger, so they are exact whatever
  # --checkpoint_every and --eval_every are; a step saved by an older
  # version has none, and they continue from the last logged row.
  ledger = checkpointer.ledger(restored[0]) if restored is not None else None
  if ledger is None:
    ledger = {
        'detection_totals': {k: (rows[-1].get('cumulative_' + k, 0.0)
                                 if rows else 0.0) for k in DETECTION_KEYS},
        'skipped_rounds': list(rows[-1].get('skipped_rounds', []))
                          if rows else []}
  detection_totals = dict(ledger['detection_totals'])
  skipped = list(ledger['skipped_rounds'])
  lost = [] if restored is None else missing_rounds(
      rows, start_round, config['eval_every'],
      bool(ledger.get('metrics_row')))
  # TensorBoard drops the earlier events from the first round logged anew
  # on: restored rows too, so none shows twice.
  tracker = (tracking.TensorBoard(
      workdir, None if restored is None
      else min(lost, default=start_round + 1) - 1)
             if primary and config['tensorboard'] else tracking.NoTracking())
  if lost:
    for row in restore_rows(
        lost, start_round,
        lambda: evaluator(method.eval_models(state)), logged_rounds,
        config['local_epochs'], skipped):
      rows.append(row)
      append_row(metrics_path, row)
      tracker.log(row)
  del logged_rounds
  diverged_at = None
  preempted_at = None
  threat = program.threat
  for rnd in range(start_round + 1, num_rounds + 1):
    t0 = time.perf_counter()
    state, metrics = compiled(state, data, server_data)
    metrics = jax.device_get(metrics)
    seconds = time.perf_counter() - t0
    clients = client_rows(metrics.pop('clients', None))
    nonfinite = bool(metrics['nonfinite_model'])
    if nonfinite and on_divergence == 'skip_round':
      skipped.append(rnd)
      logging.warning('round %d: the aggregated model is not finite; the '
                      "round's update is dropped (--on_divergence="
                      'skip_round, %d skipped so far)', rnd, len(skipped))
    elif nonfinite and diverged_at is None:
      diverged_at = rnd
    if 'det_tp' in metrics and threat.threat is not None:
      for key in detection_totals:
        detection_totals[key] += float(metrics[key])
      metrics.update(detection_rates(metrics, ''))
      metrics.update(detection_rates(detection_totals, 'cumulative_'))
      metrics.update({'cumulative_' + k: v
                      for k, v in detection_totals.items()})
    round_times.append(seconds)
    samples = float(metrics['examples']) * config['local_epochs']
    line = (f"round {rnd}/{num_rounds} train_loss "
            f"{float(metrics['train_loss']):.4f} {seconds:.2f}s "
            f"{samples / seconds:,.0f} samples/s")
    if 'staleness_mean' in metrics:
      line += (f" arrivals {int(metrics['arrivals'])} staleness "
               f"{float(metrics['staleness_mean']):.2f}")
    stop = nonfinite and on_divergence == 'stop'
    # Asked at every round boundary: under jax.distributed a collective
    # that every process joins, so all stop after the same round.
    if not stop and rnd < num_rounds and preemption.requested():
      preempted_at = rnd
    if config['log_clients']:
      append_row(rounds_path, dict(
          {'round': rnd}, **{k: float(v) for k, v in metrics.items()},
          round_seconds=seconds, **({'clients': clients} if clients else {})))
    evaluated = rnd % config['eval_every'] == 0 or rnd == num_rounds or stop
    if evaluated:
      t_eval = time.perf_counter()
      evaluation = evaluator(method.eval_models(state))
      row = metrics_row(rnd, evaluation, metrics, seconds=seconds,
                        samples=samples,
                        eval_seconds=time.perf_counter() - t_eval,
                        clients=clients, skipped=skipped)
      rows.append(row)
      append_row(metrics_path, row)
      tracker.log(row)
      line += f" test_acc {_fmt(row['test_accuracy'])}"
      if row.get('local_accuracy') is not None:
        line += f" local_acc {_fmt(row['local_accuracy'])}"
      if 'attack_success_rate' in row:
        line += (f" asr {_fmt(row['attack_success_rate'])}"
                 f" ra {_fmt(row.get('robust_accuracy'))}"
                 f" clean_target {_fmt(row['clean_target_rate'])}")
      for key in sorted(row):
        if key.startswith('test_accuracy/'):
          line += f" {key.split('/', 1)[1]} {_fmt(row[key])}"
    eta = np.mean(round_times[-5:]) * (num_rounds - rnd)
    logging.info('%s eta %.0fs', line, eta)
    if stop:
      break                           # the diverged state is not saved
    if (rnd % config['checkpoint_every'] == 0 or rnd == num_rounds
        or preempted_at):
      try:
        checkpointer.save(rnd, state, ledger={
            'detection_totals': detection_totals, 'skipped_rounds': skipped,
            'metrics_row': evaluated})
      except CheckpointSpaceError as err:
        raise WorkdirError(
            f'--workdir={workdir}: round {rnd} could not be checkpointed: '
            f'{err}. Free space, lower --checkpoints_keep, or pass '
            '--checkpoint_compress; rerun the same command to resume from '
            'the last step') from err
    if preempted_at:
      logging.warning('%s: stopped after round %d of %d, checkpointed',
                      preemption.received or 'a signal on another process',
                      rnd, num_rounds)
      break
  checkpointer.close()
  tracker.close()

  final_finite = bool(jax.device_get(all_finite(state.params)))
  status = 'completed' if final_finite and not (
      diverged_at and on_divergence == 'stop') else 'diverged'
  if status == 'completed' and preempted_at:
    status = 'preempted'
  newcomers = {}
  if program.unseen is not None and status == 'completed':
    newcomers = adapt_unseen(program, state, evaluator, put, config)
  final = rows[-1] if rows else {}
  last5 = {}
  keys = sorted({k for r in rows[-5:] for k in r
                 if k.split('/', 1)[0] in HEADLINE})
  for key in keys:
    values = [r[key] for r in rows[-5:] if r.get(key) is not None]
    if values:
      last5[key] = float(np.mean(values))
  template_trainables = jax.eval_shape(lambda s: s.params, state)
  summary = {
      'status': status,
      'final': final,
      # The SDFC paper reports A, R and V as means over the last 5 rounds.
      'final_mean_last5': last5,
      'rounds_completed': int(state.round),
      'skipped_rounds': skipped,
      'diverged_round': diverged_at,
      'config': {k: v for k, v in config.items()
                 if k not in ('overwrite', 'force_overwrite')},
      'resolved': {k: v for k, v in resolved.items() if k != 'backend'},
      'cohorts': {c.name: {'model': c.model.name, 'clients': len(c.members),
                           'clients_per_round': c.clients_per_round,
                           'transform': c.transform.name,
                           'upload_bytes_per_client': upload_bytes(
                               c, template_trainables[j]),
                           'full_model_bytes': 4 * sum(
                               int(np.size(l)) for l in
                               jax.tree.leaves(fresh[j]))}
                  for j, c in enumerate(cohorts)},
      'communication': {
          c.name: lora_communication(
              config['method'], c, template_trainables[j],
              anchors=int(program.server_data['anchors'].shape[0])
              if 'anchors' in program.server_data else 0,
              classes=int(setup.num_classes))
          for j, c in enumerate(cohorts)},
      **clustering_summary(state.method_state, setup.client_groups),
      **newcomers,
      'pretrain': pretrain_info,
      'compile_seconds': compile_seconds,
      'flops_per_round': flops_per_round,
      'mean_round_seconds': (float(np.mean(round_times)) if round_times
                             else None),
      'wall_seconds': time.perf_counter() - started,
      'metrics_missing_before_round': start_round + 1 if missing_metrics
                                      else None,
      'packages': package_versions(),
      'device': device_info(),
      'params_sha256': params_sha256(state.params),
      'files': {'summary': os.path.abspath(os.path.join(workdir,
                                                        'summary.json')),
                'curves': os.path.abspath(os.path.join(workdir,
                                                       'curves.png')),
                'metrics': os.path.abspath(metrics_path)},
  }
  write_json(os.path.join(workdir, 'summary.json'), summary)
  if rows and primary:
    title = (f"{config['method']} / {config['dataset']} / "
             f"{config['cohorts'] or config['model']}")
    plot_curves(os.path.join(workdir, 'curves.png'), rows, title)
    if any('clients' in r for r in rows):
      plot_clients(os.path.join(workdir, 'clients.png'), rows, title)
  if status == 'preempted':
    raise preemption_lib.Preempted(
        f'preempted ({preemption.received or "a signal on another process"})'
        f' after round {preempted_at} of {num_rounds}: round '
        f'{preempted_at} is checkpointed in {workdir}/checkpoints. Run the '
        'same command again to resume from it.', summary)
  if status == 'diverged':
    where = (f'round {diverged_at}' if diverged_at else
             f'round {int(state.round)}')
    raise DivergenceError(
        f'the global model is not finite (NaN or Inf) after {where}'
        + (': the run stopped there; its last checkpoint is intact'
           if on_divergence == 'stop' else '') +
        '. Lower the learning rates, pick a robust --aggregator, or pass '
        '--on_divergence=skip_round to drop such rounds. Summary: '
        f"{summary['files']['summary']}", summary)
  return summary


def metrics_row(rnd: int, evaluation: dict[str, Any],
                metrics: dict[str, Any], *, seconds: float, samples: float,
                eval_seconds: float, clients: dict[str, list] | None,
                skipped: list[int]) -> dict[str, Any]:
  """One metrics.jsonl row: the evaluation of round `rnd`'s model, then
  the round's own metrics (as the compiled round returned them)."""
  row = {'round': rnd}
  row.update(evaluation)
  row.update(round_seconds=seconds,
             samples_per_second=(samples / seconds if seconds else None),
             eval_seconds=eval_seconds)
  row.update({k: (None if v is None else float(v))
              for k, v in metrics.items()})
  if clients:
    row['clients'] = clients
    row['clients_auc'] = client_aucs(clients)
  if skipped:
    row['skipped_rounds'] = list(skipped)
  return row


def missing_rounds(rows: list[dict[str, Any]], start_round: int,
                   eval_every: int, last_logged: bool) -> list[int]:
  """The rounds up to the checkpointed `start_round` that should have a
  metrics row and have none (a row cut by a crash, or lost with a
  file): every --eval_every-th round after the last row, and
  `start_round` itself where its checkpoint says it was logged."""
  last = max((r['round'] for r in rows), default=0)
  want = [r for r in range(last + 1, start_round + 1) if r % eval_every == 0]
  if last_logged and start_round > last and start_round not in want:
    want.append(start_round)
  return want


def restore_rows(missing: list[int], start_round: int, evaluate_state,
                 logged: dict[int, dict[str, Any]], local_epochs: int,
                 skipped: list[int]) -> list[dict[str, Any]]:
  """Rows for the `missing` rounds: the checkpointed round re-evaluated
  from its model (`evaluate_state()`: deterministic, so the numbers are
  those the lost row had), with its round metrics from rounds.jsonl
  (`logged`, by round); an older round from rounds.jsonl alone. Each row
  says where it came from under 'restored'."""
  rows = []
  for rnd in missing:
    entry = dict(logged.get(rnd, {}))
    entry.pop('round', None)
    seconds = entry.pop('round_seconds', None)
    clients = entry.pop('clients', None)
    entry.pop('nonfinite', None)
    if rnd == start_round:
      t0 = time.perf_counter()
      evaluation = evaluate_state()
      eval_seconds = time.perf_counter() - t0
      source = 're-evaluated from the checkpoint'
    elif entry:
      evaluation, eval_seconds = {}, None
      source = 'rounds.jsonl (its model is no longer checkpointed)'
    else:
      logging.warning('round %d has no metrics row and neither its model '
                      'nor a rounds.jsonl row is left to restore it from',
                      rnd)
      continue
    examples = entry.get('examples')
    row = metrics_row(
        rnd, evaluation, entry, seconds=seconds or 0.0,
        samples=(examples or 0.0) * local_epochs, eval_seconds=eval_seconds,
        clients=clients, skipped=[r for r in skipped if r <= rnd])
    if not seconds:
      row.pop('round_seconds')
      row.pop('samples_per_second')
    row['restored'] = source
    logging.warning('metrics.jsonl had no row for round %d (cut by a '
                    'crash or lost); restored it: %s', rnd, source)
    rows.append(row)
  return rows


def client_rows(per: dict[str, np.ndarray] | None
                ) -> dict[str, list] | None:
  """The arrived slots' per-client values as lists (JSON-ready)."""
  if not per:
    return None
  keep = np.asarray(per['mask'], bool)
  out = {'id': np.asarray(per['id'])[keep].astype(int).tolist(),
         'malicious': np.asarray(per['malicious'])[keep].astype(bool)
         .tolist()}
  for name, values in per.items():
    if name not in ('id', 'mask', 'malicious'):
      out[name] = [float(v) for v in np.asarray(values)[keep]]
  return out


def client_aucs(clients: dict[str, list]) -> dict[str, float | None]:
  """For each per-client score s: P(s of a malicious client > s of a
  benign one), ties 1/2 (None without both kinds). For 'weight' it is the
  chance an attacker outweighs a benign client (low is good); for SDFC's
  T (fisher_discrepancy) high means T flags attackers."""
  mal = np.asarray(clients['malicious'], bool)
  out = {}
  for name, values in clients.items():
    if name in ('id', 'malicious'):
      continue
    v = np.asarray(values, np.float64)
    if not mal.any() or mal.all() or not np.all(np.isfinite(v)):
      out[name] = None
      continue
    diff = v[mal][:, None] - v[~mal][None, :]
    out[name] = float(np.mean((diff > 0) + 0.5 * (diff == 0)))
  return out


def _fmt(value: float | None) -> str:
  return 'nan' if value is None or not np.isfinite(value) else f'{value:.4f}'


def format_summary(summary: dict[str, Any]) -> str:
  """The few lines a run ends with: outcome, metrics, time, files."""
  final, last5 = summary['final'], summary['final_mean_last5']
  names = (('test_accuracy', 'A (global test acc)'),
           ('local_accuracy', 'local test acc'),
           ('attack_success_rate', 'ASR'),
           ('backdoor_failure_rate', 'R = 1 - ASR'),
           ('tradeoff_v', 'V = (A + R) / 2'),
           ('robust_accuracy', 'RA (triggered, true labels)'),
           ('clean_target_rate', 'clean target rate (ASR floor)'))
  lines = [f"run {summary['status']}: {summary['rounds_completed']} rounds "
           f"in {summary['wall_seconds']:.0f} s"]
  if summary['skipped_rounds']:
    lines[0] += (f" ({len(summary['skipped_rounds'])} skipped as "
                 f"non-finite: {summary['skipped_rounds']})")
  for key, label in names:
    if final.get(key) is not None or last5.get(key) is not None:
      lines.append(f'  {label:<30} final {_fmt(final.get(key))}   last-5 '
                   f'mean {_fmt(last5.get(key))}')
  files = summary['files']
  lines.append(f"  summary  {files['summary']}")
  lines.append(f"  curves   {files['curves']}")
  return '\n'.join(lines)


def normalize(config: dict[str, Any]) -> dict[str, Any]:
  """Values that mean the same compare equal (an explicit default
  --data_dir and none at all)."""
  config = dict(config)
  if config.get('dataset') == 'fashion_mnist' and not config.get(
      'data_dir'):
    config['data_dir'] = DEFAULT_FASHION_MNIST_DIR
  return config


__all__ = ['ConfigMismatchError', 'DataNotFoundError', 'DivergenceError',
           'EXECUTION_KEYS', 'FlagError', 'RESUMABLE_KEYS', 'WorkdirError',
           'format_summary', 'run']
