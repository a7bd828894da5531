"""A run's settings turned into a checked, ready-to-run `Program`.

`resolve(settings)` fills the defaults that depend on other settings,
`check_settings` checks them, and `build` loads the data, partitions it,
builds the cohorts, the method, the threat model and the round program's
configuration. Every check runs here, before anything is trained or
written. Errors are `SettingError`s naming the setting.

Nothing here names a method, rule or attack: what they need comes from
their registry entries (`MethodSpec`, `fedrobust.aggregators.needs`,
`fedrobust.attacks.needs`).
"""

from __future__ import annotations

import difflib
import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedrobust import aggregators
from fedrobust.cohort import Cohort, split_roles
from fedrobust.config import (all_settings, check_foreign_settings, defaults,
                              settings_of)
from fedrobust.data import (RowTable, build_federated_setup, hold_out,
                            load_dataset, subsample, subsample_test,
                            unused_rows)
from fedrobust.data.federated import pad_clients
from fedrobust.engine import (CohortSlots, LocalConfig, RoundConfig,
                              client_mesh, default_strategy, evaluate,
                              init_server_state, parse_delay, sgd)
from fedrobust.engine.evaluate import pad_to_batches
from fedrobust.errors import SettingError
from fedrobust.local import adamw
from fedrobust.methods import METHODS
from fedrobust.methods.fedavg import parse_share
from fedrobust.models import (default_compute_dtype, default_conv_impl,
                              get_model)
from fedrobust.pretrain import pretrain
from fedrobust.threats import build_threat, typical_client_steps
from fedrobust.transforms import get_transform
from fedrobust.types import ServerState


def parse_list(text: str, kind, flag: str) -> tuple:
  try:
    values = tuple(kind(v) for v in str(text).split(',') if v.strip())
  except ValueError:
    raise SettingError(flag, f'{flag}={text!r}: expected comma-separated '
                     f'{kind.__name__}s') from None
  if not values:
    raise SettingError(flag, 'is empty')
  return values


def check_settings(config: dict[str, Any]) -> None:
  """Checks the settings' values and combinations (components check their
  own arguments when built).

  Raises:
    SettingError: naming the setting; an unknown key is named with the
      closest known ones.
  """
  known = all_settings()
  for key in config:
    if key not in known:
      close = difflib.get_close_matches(key, known, n=3)
      raise SettingError(key, 'is not a setting' + (
          f'; did you mean {close}?' if close else
          '; fedrobust.config.defaults() lists them all'))
  if config['method'] not in METHODS:
    raise SettingError('method', f"{config['method']!r} is not a known "
                       f'method; expected one of {sorted(METHODS)}')
  positive = ('num_clients', 'num_rounds', 'local_epochs', 'batch_size',
              'num_seeds',
              'eval_every', 'eval_batch_size', 'checkpoint_every',
              'checkpoints_keep', 'unseen_epochs')
  for key in positive:
    if config[key] < 1:
      raise SettingError(key, f'must be >= 1, got {config[key]}')
  for key in ('clients_per_round', 'max_train_examples', 'max_test_examples',
              'validation_size',
              'public_size', 'chunk_size', 'scan_unroll', 'num_devices',
              'cpu_devices', 'pretrain_epochs', 'global_test_per_class',
              'replica_batch',
              'unseen_clients'):
    if config[key] < 0:
      raise SettingError(key, f'must be >= 0, got {config[key]}')
  if config['clients_per_round'] > config['num_clients']:
    raise SettingError('clients_per_round', f"clients_per_round={config['clients_per_round']} "
                     f"exceeds num_clients={config['num_clients']}")
  if config['unseen_clients'] and not config['local_test_fraction'] > 0:
    raise SettingError('unseen_clients', f"unseen_clients={config['unseen_clients']} scores "
                     'the newcomers on their own test splits: it needs '
                     'local_test_fraction > 0')
  finite = lambda v: isinstance(v, (int, float)) and np.isfinite(v)
  for key, value in config.items():
    if isinstance(value, float) and not np.isfinite(value):
      raise SettingError(key, f'must be a finite number, got {value}')
  for key in ('validation_fraction', 'local_test_fraction',
              'malicious_fraction'):
    if not 0.0 <= config[key] < 1.0:
      raise SettingError(key, f'must be in [0, 1), got {config[key]}')
  for key in ('dirichlet_alpha', 'quantity_alpha'):
    if not config[key] > 0:
      raise SettingError(key, f'must be > 0, got {config[key]}')
  if config['force_overwrite'] and not config['overwrite']:
    raise SettingError('force_overwrite', 'only applies with overwrite')
  if not (finite(config['local_lr']) and config['local_lr'] > 0):
    raise SettingError('local_lr', f"must be a finite number > 0, got "
                     f"{config['local_lr']}")
  if not (finite(config['momentum']) and 0 <= config['momentum'] < 1):
    raise SettingError('momentum', f"must be in [0, 1), got {config['momentum']}")
  if not (finite(config['weight_decay']) and config['weight_decay'] >= 0):
    raise SettingError('weight_decay', f"must be a finite number >= 0, got "
                     f"{config['weight_decay']}")
  if not (finite(config['server_lr']) and config['server_lr'] > 0):
    raise SettingError('server_lr', f"must be a finite number > 0, got "
                     f"{config['server_lr']}")
  check_foreign_settings(config)
  if config['client_execution'] != 'chunked' and config['chunk_size']:
    raise SettingError('chunk_size', 'needs client_execution=chunked')
  if config['dataset'] == 'idx' and not config['data_dir']:
    raise SettingError('dataset', 'dataset=idx needs data_dir (a directory with the '
                     'four IDX files)')
  if config['transform'] != 'lora' and (
      config['lora_ranks'] != '8' or config['lora_targets'] != 'all'):
    raise SettingError('lora_ranks', 'lora_ranks and lora_targets need '
                       'transform=lora')
  if config['transform'] != 'select' and config['select_targets'] != \
      'first,head':
    raise SettingError('select_targets', 'needs transform=select')
  if config['transform'] != 'width' and (
      config['width_ratios'] != '1' or config['width_variant'] != 'heterofl'
      or config['width_redraw']):
    raise SettingError('width_ratios', 'width_ratios, width_variant and '
                       'width_redraw need '
                     'transform=width')
  if config['pretrain_epochs'] and not config['public_size']:
    raise SettingError('pretrain_epochs', 'needs a public split: '
                     'public_size > 0')
  spec = METHODS[config['method']]
  if not spec.cohorts and (config['cohorts'] or
                           config['transform'] != 'identity'):
    raise SettingError('method', f"method={config['method']} trains one full model: "
                     'it takes no cohorts and transform=identity')


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
      raise SettingError('cohorts', f'{item!r} is not model:share') from None
    if not value > 0:
      raise SettingError('cohorts', f'share of {name!r} must be > 0')
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
    raise SettingError('cohorts', f'has {len(entries)} cohorts for '
                     f'num_clients={k}')
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
      raise SettingError('clients_per_round', f'clients_per_round={c} is fewer than the '
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


def resolve(config: dict[str, Any]) -> dict[str, Any]:
  """Fills defaults that depend on other settings ('auto', 0, unset)."""
  config = {**defaults(), **config}
  if not config['clients_per_round']:
    config['clients_per_round'] = config['num_clients']
  if config['aggregator'] == 'auto':
    spec = METHODS.get(config["method"])
    if spec is not None:
      config['aggregator'] = spec.default_aggregator(
          settings_of(config['method'], config))
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
  unseen: Any = None      # the newcomers' FederatedSetup (unseen_clients)


def build(config: dict[str, Any], data: Any = None, *,
          client_size: int | None = None) -> Program:
  """Data, cohorts, method, threat and round program, fully checked.

  Args:
    config: the resolved settings.
    data: a fedrobust.data.Dataset to use instead of loading
      config['dataset'] (e.g. from fedrobust.data.from_arrays).
    client_size: pad every client's training data to this many examples
      (at least the largest client's), as replicas of one federation do;
      the local schedule's steps per epoch follow the padded size.
  """
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
  # All devices of all processes (under distributed, a mesh of one
  # process's devices would leave the others with nothing to run).
  num_devices = config['num_devices'] or jax.device_count()
  mesh = client_mesh(num_devices) if num_devices > 1 else None

  dataset = (load_dataset(config['dataset'], config['data_dir'])
             if data is None else data)
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
  if client_size:
    setup = setup._replace(train=pad_clients(setup.train, client_size))
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
  settings = settings_of(config['method'], config)
  spec.validate(settings, config['aggregator'])
  server_data = {}
  for name in spec.server_data:
    if name == 'validation':
      if not config['validation_size']:
        raise SettingError('method', f"method={config['method']} needs a clean "
                         'validation sample: validation_fraction > 0 and '
                         'validation_size > 0')
      server_data[name] = tuple(map(jnp.asarray, pad_to_batches(
          setup.validation_x, setup.validation_y, config['batch_size'])))
    if name == 'anchors':
      server_data[name] = jnp.asarray(anchor_inputs(
          settings['anchor_dataset'], settings['anchor_fraction'],
          len(dataset.train_y), setup.input_shape, config))
  # Data poisoning is applied in one place: local training poisons the
  # malicious clients' batches with local.poison, whatever the method.
  local = local._replace(poison=threat.poison)
  method = spec.build(cohorts=cohorts, local=local, optimizer=optimizer,
                      aggregator=threat.aggregator,
                      server_lr=config['server_lr'],
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


def make_optimizer(config: dict[str, Any], lr: float, num_steps: int):
  """local_optimizer at learning rate `lr` (AdamW warms up over
  warmup_fraction of `num_steps`)."""
  if config['local_optimizer'] == 'adamw':
    return adamw(learning_rate=lr, weight_decay=config['weight_decay'],
                 warmup_steps=int(round(config['warmup_fraction'] *
                                        num_steps)))
  return sgd(learning_rate=lr, momentum=config['momentum'],
             weight_decay=config['weight_decay'])


def anchor_inputs(name: str, fraction: float, train_size: int,
                  input_shape: tuple[int, ...], config) -> np.ndarray:
  """A public anchor set: round(fraction * train_size) training inputs of
  dataset `name` (labels dropped), drawn with the run's seed.

  When `name` is the clients' own dataset, the anchors are in-domain
  public data: they are drawn only from the training rows that
  max_train_examples leaves out, so no client, newcomer or server split
  holds them.
  """
  flag = 'anchor_dataset'
  in_domain = name == config['dataset']
  anchors = load_dataset(name, config['data_dir'] if in_domain
                         else None).train_x
  if tuple(anchors.shape[1:]) != tuple(input_shape):
    raise SettingError(flag, f'{name} stores examples of shape '
                     f'{anchors.shape[1:]}, the clients {input_shape}')
  pool = np.arange(len(anchors))
  if in_domain:
    pool = unused_rows(len(anchors), config['max_train_examples'],
                       config['seed'])
    if not len(pool):
      raise SettingError(
          flag, f"{name} is the clients' own dataset, and the clients "
          f'hold all {len(anchors)} of its training examples: set '
          f'max_train_examples below {len(anchors)} so that in-domain '
          'anchors can be drawn from the rest, or name a disjoint public '
          'dataset')
  n = max(1, int(round(fraction * train_size)))
  if n > len(pool):
    where = ('training examples the clients do not hold' if in_domain
             else 'examples')
    raise SettingError(flag, f'{name} has {len(pool)} {where}, fewer '
                     f'than the {n} anchors asked for')
  rows = np.random.default_rng(config['seed'] + 11).choice(
      len(pool), n, replace=False)
  return anchors[pool[np.sort(rows)]]


def initial_params(cohorts: tuple[Cohort, ...], seed: int) -> tuple:
  """Each cohort's freshly initialised full params (cohort j folds in j)."""
  key = jax.random.key(seed)
  return tuple(c.model.init(key if j == 0 else jax.random.fold_in(key, j))
               for j, c in enumerate(cohorts))


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


def pretrain_cohort(config: dict[str, Any], program: Program,
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
