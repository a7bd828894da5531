"""The host side of a run: data, program, loop, files, resume.

`run(config)` takes a plain dict (main.py builds it from flags; tests build
it directly). Everything numeric happens in one compiled round program;
this module only moves data to the device once, calls the program, logs,
evaluates and checkpoints.

Files in the workdir:
  config.json            the run's config (resume refuses a changed one)
  client_histograms.json per-client class histograms of the training data
  metrics.jsonl          one JSON object per evaluated round
  summary.json           final metrics, config, versions, device, hash
  curves.png             accuracy against round
  checkpoints/           orbax steps (atomic, verified on start)
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from fedrobust.checkpoint import Checkpointer
from fedrobust.data import (DataNotFoundError, build_federated_setup,
                            load_dataset, subsample)
from experiments.devices import configure_cpu_devices
from experiments.threat import build_threat
from fedrobust.engine.evaluate import pad_to_batches
from fedrobust.engine import (LocalConfig, RoundConfig, client_mesh,
                              default_strategy, evaluate, evaluate_clients,
                              init_server_state, make_round_step, sgd)
from fedrobust.methods import get_method
from fedrobust.models import (default_compute_dtype, default_conv_impl,
                              get_model)

CONFIG_KEYS = (
    'method', 'dataset', 'data_dir', 'model', 'num_clients',
    'clients_per_round', 'partition', 'dirichlet_alpha', 'classes_per_client',
    'quantity_alpha', 'validation_fraction', 'validation_size', 'public_size',
    'local_test_fraction', 'max_train_examples', 'num_rounds', 'local_epochs',
    'batch_size', 'local_lr', 'momentum', 'weight_decay', 'server_lr',
    'fedprox_mu', 'eval_every', 'eval_batch_size', 'checkpoint_every',
    'checkpoints_keep', 'seed', 'workdir', 'client_execution', 'chunk_size',
    'scan_unroll', 'conv_impl', 'num_devices', 'overwrite',
    'aggregator', 'aggregator_kwargs', 'num_byzantine', 'attack',
    'attack_kwargs', 'malicious_fraction', 'resample_malicious',
    'attack_start_round', 'attacker_knowledge', 'backdoor_target_label',
    'trigger_location', 'trigger_size', 'trigger_value', 'poison_fraction',
    'flip_source_label', 'blend_alpha', 'sdfc_lambda', 'sdfc_components',
    'sdfc_importance', 'sdfc_stiffness', 'sdfc_fisher', 'compute_dtype',
    'cpu_devices')

# Defaults of the threat-model keys, so runs saved before they existed
# resume (a missing key compares equal to its default).
THREAT_DEFAULTS = {
    'aggregator': 'weighted_mean', 'aggregator_kwargs': '{}',
    'num_byzantine': -1, 'attack': 'none', 'attack_kwargs': '{}',
    'malicious_fraction': 0.0, 'resample_malicious': False,
    'attack_start_round': 1, 'attacker_knowledge': 'benign_stats',
    'backdoor_target_label': 2, 'trigger_location': 'top_left',
    'trigger_size': '2x6', 'trigger_value': 255, 'poison_fraction': 0.5,
    'flip_source_label': -1, 'blend_alpha': 0.2, 'sdfc_lambda': 5.0,
    'sdfc_components': 'both', 'sdfc_importance': 'fisher',
    'sdfc_stiffness': 'diff', 'sdfc_fisher': 'per_example',
    'compute_dtype': 'auto', 'cpu_devices': 0}

# Changing these on resume is not a config change.
RESUMABLE_KEYS = frozenset({
    'num_rounds', 'eval_every', 'eval_batch_size', 'checkpoint_every',
    'checkpoints_keep', 'workdir', 'overwrite'})
# Changing these on resume is allowed (same math, other program), but the
# final parameters then match an uninterrupted run only within float
# tolerance, not bitwise.
EXECUTION_KEYS = frozenset({
    'client_execution', 'chunk_size', 'scan_unroll', 'conv_impl',
    'num_devices', 'cpu_devices'})

PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'chex',
            'numpy', 'tensorflow-datasets', 'absl-py')


class ConfigMismatchError(ValueError):
  """A resume whose config differs from the run in the workdir."""


def default_workdir(config: dict[str, Any]) -> str:
  return os.path.join('runs', f"{config['method']}_{config['dataset']}_"
                      f"{config['model']}_s{config['seed']}")


def validate(config: dict[str, Any]) -> None:
  """Checks settings the registries and partitioners do not; names flags."""
  positive = ('num_clients', 'num_rounds', 'local_epochs', 'batch_size',
              'eval_every', 'eval_batch_size', 'checkpoint_every',
              'checkpoints_keep')
  for key in positive:
    if config[key] < 1:
      raise ValueError(f'--{key} must be >= 1, got {config[key]}')
  for key in ('clients_per_round', 'max_train_examples', 'validation_size',
              'public_size', 'chunk_size', 'scan_unroll', 'num_devices',
              'cpu_devices'):
    if config[key] < 0:
      raise ValueError(f'--{key} must be >= 0, got {config[key]}')
  if config['clients_per_round'] > config['num_clients']:
    raise ValueError(f"--clients_per_round={config['clients_per_round']} "
                     f"exceeds --num_clients={config['num_clients']}")
  if config['local_lr'] <= 0:
    raise ValueError(f"--local_lr must be > 0, got {config['local_lr']}")
  if not 0 <= config['momentum'] < 1:
    raise ValueError(f"--momentum must be in [0, 1), got {config['momentum']}")
  if config['weight_decay'] < 0:
    raise ValueError(f"--weight_decay must be >= 0, got "
                     f"{config['weight_decay']}")
  if config['method'] == 'fedprox' and config['fedprox_mu'] <= 0:
    raise ValueError('--method=fedprox needs --fedprox_mu > 0')
  if config['method'] != 'fedprox' and config['fedprox_mu'] != 0:
    raise ValueError(f"--fedprox_mu is only used by --method=fedprox, not "
                     f"--method={config['method']}")
  if config['client_execution'] != 'chunked' and config['chunk_size']:
    raise ValueError('--chunk_size needs --client_execution=chunked')
  if config['dataset'] == 'idx' and not config['data_dir']:
    raise ValueError('--dataset=idx needs --data_dir (a directory with the '
                     'four IDX files)')


def _json_number(value: Any) -> float | None:
  value = float(value)
  return value if np.isfinite(value) else None


def detection_rates(counts: dict[str, Any], prefix: str) -> dict[str, Any]:
  """Precision, recall and FPR of 'excluded' vs 'malicious' (NaN if 0/0)."""
  tp, fp, fn, tn = (float(counts[k]) for k in ('det_tp', 'det_fp', 'det_fn',
                                               'det_tn'))
  div = lambda a, b: a / b if b else float('nan')
  return {f'{prefix}detection_precision': div(tp, tp + fp),
          f'{prefix}detection_recall': div(tp, tp + fn),
          f'{prefix}detection_fpr': div(fp, fp + tn)}


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


def _write_json(path: str, obj: Any) -> None:
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(obj, f, indent=2, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def prepare_workdir(config: dict[str, Any]) -> None:
  """Creates the workdir, or checks that a resume keeps the config."""
  workdir = config['workdir']
  path = os.path.join(workdir, 'config.json')
  if os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
    differ = sorted(k for k in set(saved) | set(config)
                    if k not in RESUMABLE_KEYS | EXECUTION_KEYS
                    and saved.get(k, THREAT_DEFAULTS.get(k)) !=
                    config.get(k, THREAT_DEFAULTS.get(k)))
    if differ and not config['overwrite']:
      details = ', '.join(f'--{k} (was {saved.get(k)!r}, now '
                          f'{config.get(k)!r})' for k in differ)
      raise ConfigMismatchError(
          f'{workdir} holds a run with a different config: {details}. '
          'Pass --overwrite to discard it, or use another --workdir.')
    if differ:
      logging.warning('--overwrite: discarding the run in %s', workdir)
      shutil.rmtree(workdir)
    else:
      changed = sorted(k for k in EXECUTION_KEYS
                       if saved.get(k) != config.get(k))
      if changed:
        logging.warning('resuming with changed execution settings %s: '
                        'results match within float tolerance, not '
                        'bitwise', changed)
  os.makedirs(workdir, exist_ok=True)
  _write_json(path, {k: v for k, v in config.items() if k != 'overwrite'})


def truncate_metrics(path: str, last_round: int) -> list[dict[str, Any]]:
  """Drops metric rows past the restored round (they will be recomputed)."""
  rows = []
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        line = line.strip()
        if not line:
          continue
        try:
          row = json.loads(line)
        except json.JSONDecodeError:   # a line cut by a kill
          continue
        if row['round'] <= last_round:
          rows.append(row)
  with open(path + '.tmp', 'w') as f:
    for row in rows:
      f.write(json.dumps(row) + '\n')
  os.replace(path + '.tmp', path)
  return rows


def plot_curves(path: str, rows: list[dict[str, Any]], title: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  rounds = [r['round'] for r in rows]
  for key, label in (('test_accuracy', 'global test'),
                     ('local_accuracy', 'local test (mean over clients)'),
                     ('attack_success_rate', 'attack success')):
    values = [r.get(key) for r in rows]
    if any(v is not None for v in values):
      ax.plot(rounds, values, marker='.', label=label)
  ax.set_xlabel('round')
  ax.set_ylabel('accuracy')
  ax.set_ylim(0, 1)
  ax.grid(alpha=0.3)
  ax.legend()
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def resolve(config: dict[str, Any]) -> dict[str, Any]:
  """Fills 'auto'/0 defaults that depend on the backend or other flags."""
  config = dict(config)
  if not config.get('workdir'):
    config['workdir'] = default_workdir(config)
  if not config['clients_per_round']:
    config['clients_per_round'] = config['num_clients']
  return config


def run(config: dict[str, Any]) -> dict[str, Any]:
  """Runs (or resumes) one experiment; returns the summary dict."""
  config = resolve(config)
  validate(config)
  # Before anything starts JAX's CPU backend (a no-op once it has).
  configure_cpu_devices(config['cpu_devices'], config['clients_per_round'])
  backend = jax.default_backend()
  strategy = (default_strategy(backend) if config['client_execution'] ==
              'auto' else config['client_execution'])
  chunk_size = config['chunk_size'] or (
      min(config['clients_per_round'], 16) if strategy == 'chunked' else 0)
  conv_impl = (default_conv_impl(backend) if config['conv_impl'] == 'auto'
               else config['conv_impl'])
  compute_dtype = config.get('compute_dtype', 'auto')
  if compute_dtype == 'auto':
    compute_dtype = default_compute_dtype(backend)
  num_devices = config['num_devices'] or jax.local_device_count()
  mesh = client_mesh(num_devices) if num_devices > 1 else None

  dataset = load_dataset(config['dataset'], config['data_dir'])
  dataset = subsample(dataset, config['max_train_examples'], config['seed'])
  setup = build_federated_setup(
      dataset, num_clients=config['num_clients'],
      partition_name=config['partition'], seed=config['seed'],
      dirichlet_alpha=config['dirichlet_alpha'],
      classes_per_client=config['classes_per_client'],
      quantity_alpha=config['quantity_alpha'],
      validation_fraction=config['validation_fraction'],
      validation_size=config['validation_size'],
      public_size=config['public_size'],
      local_test_fraction=config['local_test_fraction'],
      eval_batch_size=config['eval_batch_size'])
  prepare_workdir(config)
  workdir = config['workdir']
  _write_json(os.path.join(workdir, 'client_histograms.json'), {
      'num_classes': setup.num_classes,
      'train_counts': setup.train.count.tolist(),
      'histograms': setup.histograms.tolist()})

  model = get_model(config['model'], num_classes=setup.num_classes,
                    input_shape=setup.input_shape, conv_impl=conv_impl,
                    dtype=None if compute_dtype == 'float32' else
                    jnp.dtype(compute_dtype))
  n_max = setup.train.x.shape[1]
  steps_per_epoch = -(-n_max // config['batch_size'])
  local = LocalConfig(
      batch_size=config['batch_size'], num_epochs=config['local_epochs'],
      steps_per_epoch=steps_per_epoch,
      unroll=config['scan_unroll'] or steps_per_epoch *
      config['local_epochs'])
  optimizer = sgd(learning_rate=config['local_lr'],
                  momentum=config['momentum'],
                  weight_decay=config['weight_decay'])
  threat = build_threat(
      config, num_classes=setup.num_classes, input_shape=setup.input_shape,
      test_x=dataset.test_x, test_y=dataset.test_y,
      validation=(setup.validation_x, setup.validation_y),
      apply_fn=model.apply)
  method_kwargs = {}
  server_data = ()
  if config['method'] == 'sdfc':
    if not config['validation_size']:
      raise ValueError('--method=sdfc needs a clean validation sample: '
                       '--validation_fraction > 0 and --validation_size > 0')
    method_kwargs = dict(
        lam=config['sdfc_lambda'], components=config['sdfc_components'],
        importance=config['sdfc_importance'],
        stiffness=config['sdfc_stiffness'], fisher_mode=config['sdfc_fisher'])
    server_data = tuple(map(jnp.asarray, pad_to_batches(
        setup.validation_x, setup.validation_y, config['batch_size'])))
  method = get_method(config['method'], model=model, local=local,
                      optimizer=optimizer, server_lr=config['server_lr'],
                      proximal_mu=config['fedprox_mu'],
                      aggregator=threat.aggregator, poison=threat.poison,
                      **method_kwargs)
  round_config = RoundConfig(
      num_clients=config['num_clients'],
      clients_per_round=config['clients_per_round'], strategy=strategy,
      chunk_size=chunk_size, num_devices=num_devices if mesh else 1)
  round_step = make_round_step(method, round_config, mesh=mesh,
                               threat=threat.threat)

  replicated = NamedSharding(mesh, P()) if mesh else None
  put = functools.partial(jax.device_put, device=replicated)
  data = put(jax.tree.map(jnp.asarray, setup.train))
  test = put(tuple(map(jnp.asarray, setup.test)))
  local_test = put(tuple(map(jnp.asarray, setup.local_test)))
  server_data = put(server_data)
  triggered = None
  if threat.triggered_test is not None:
    triggered = put(tuple(map(jnp.asarray, pad_to_batches(
        *threat.triggered_test, config['eval_batch_size']))))

  init_key = jax.random.key(config['seed'])
  state = put(init_server_state(method, model.init(init_key),
                                config['num_clients'], config['seed'] + 1))
  checkpointer = Checkpointer(os.path.join(workdir, 'checkpoints'),
                              keep=config['checkpoints_keep'])
  restored = checkpointer.restore_latest(state)
  if restored is not None:
    state = put(restored[1])
    logging.info('resumed from round %d in %s', restored[0], workdir)
  start_round = int(state.round)
  metrics_path = os.path.join(workdir, 'metrics.jsonl')
  rows = truncate_metrics(metrics_path, start_round)

  step_fn = jax.jit(round_step, donate_argnums=0)
  t0 = time.perf_counter()
  compiled = step_fn.lower(state, data, server_data).compile()
  compile_seconds = time.perf_counter() - t0
  eval_fn = jax.jit(functools.partial(evaluate, model.apply))
  eval_clients_fn = jax.jit(functools.partial(evaluate_clients, model.apply))
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  flops_per_round = float((cost or {}).get('flops', float('nan')))
  logging.info('round program compiled in %.1fs (%s, %s, conv=%s, %d '
               'device(s))', compile_seconds, backend, strategy, conv_impl,
               num_devices)

  num_rounds = config['num_rounds']
  round_times = []
  # Cumulative detection counts continue from the last logged row (exact on
  # resume when --checkpoint_every is a multiple of --eval_every).
  detection_totals = {k: (rows[-1].get('cumulative_' + k, 0.0) if rows
                          else 0.0)
                      for k in ('det_tp', 'det_fp', 'det_fn', 'det_tn')}
  for rnd in range(start_round + 1, num_rounds + 1):
    t0 = time.perf_counter()
    state, metrics = compiled(state, data, server_data)
    metrics = jax.device_get(metrics)
    seconds = time.perf_counter() - t0
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
    if rnd % config['eval_every'] == 0 or rnd == num_rounds:
      test_m = jax.device_get(eval_fn(state.params, *test))
      local_m = jax.device_get(eval_clients_fn(state.params, *local_test))
      has_local = local_m['count'] > 0
      row = {
          'round': rnd,
          'test_accuracy': float(test_m['accuracy']),
          'test_loss': float(test_m['loss']),
          'local_accuracy': (float(np.mean(local_m['accuracy'][has_local]))
                             if has_local.any() else None),
          'round_seconds': seconds,
          'samples_per_second': samples / seconds,
      }
      row.update({k: _json_number(v) for k, v in metrics.items()})
      if triggered is not None:
        asr = float(eval_fn(state.params, *triggered)['accuracy'])
        row['attack_success_rate'] = asr
        row['backdoor_failure_rate'] = 1.0 - asr
        row['tradeoff_v'] = (row['test_accuracy'] + 1.0 - asr) / 2
      rows.append(row)
      with open(metrics_path, 'a') as f:
        f.write(json.dumps(row) + '\n')
        f.flush()
        os.fsync(f.fileno())
      line += f" test_acc {row['test_accuracy']:.4f}"
      if row['local_accuracy'] is not None:
        line += f" local_acc {row['local_accuracy']:.4f}"
      if 'attack_success_rate' in row:
        line += f" asr {row['attack_success_rate']:.4f}"
    eta = np.mean(round_times[-5:]) * (num_rounds - rnd)
    logging.info('%s eta %.0fs', line, eta)
    if rnd % config['checkpoint_every'] == 0 or rnd == num_rounds:
      checkpointer.save(rnd, state)
  checkpointer.close()

  final = rows[-1] if rows else {}
  last5 = {}
  for key in ('test_accuracy', 'local_accuracy', 'attack_success_rate',
              'backdoor_failure_rate', 'tradeoff_v'):
    values = [r[key] for r in rows[-5:] if r.get(key) is not None]
    if values:
      last5[key] = float(np.mean(values))
  summary = {
      'final': final,
      # The SDFC paper reports A, R and V as means over the last 5 rounds.
      'final_mean_last5': last5,
      'rounds_completed': int(state.round),
      'config': {k: v for k, v in config.items() if k != 'overwrite'},
      'resolved': {'client_execution': strategy, 'chunk_size': chunk_size,
                   'conv_impl': conv_impl, 'compute_dtype': compute_dtype,
                   'num_devices': num_devices,
                   'steps_per_round': local.num_steps,
                   'padded_client_size': n_max},
      'compile_seconds': compile_seconds,
      'flops_per_round': flops_per_round,
      'mean_round_seconds': (float(np.mean(round_times)) if round_times
                             else None),
      'packages': package_versions(),
      'device': device_info(),
      'params_sha256': params_sha256(state.params),
  }
  _write_json(os.path.join(workdir, 'summary.json'), summary)
  if rows:
    plot_curves(os.path.join(workdir, 'curves.png'), rows,
                f"{config['method']} / {config['dataset']} / "
                f"{config['model']}")
  return summary
