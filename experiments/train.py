"""The host side of a run: workdir, checkpoints, loop, logs, summary.

`run(config)` takes a plain dict with one key per setting
(fedrobust/config.py; main.py builds it from flags, tests build it
directly) and drives a `fedrobust.Federation` built from it: everything
numeric happens in the federation's one compiled round program; this
module adds the workdir, resume, checkpoints, metrics files, TensorBoard,
preemption and the summary. It knows no method, rule or attack by name.

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
import hashlib
import importlib.metadata
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from experiments import backbone
from experiments import preemption as preemption_lib
from experiments import tracking
from experiments import config as config_lib
from experiments import workdir as workdir_lib
from experiments.devices import configure_cpu_devices
from experiments.workdir import ConfigMismatchError, WorkdirError  # noqa
from fedrobust import Federation
from fedrobust.checkpoint import (CheckpointError, CheckpointSpaceError,
                                  Checkpointer, barrier, is_primary)
from fedrobust.cohort import Cohort
from fedrobust.data import DEFAULT_FASHION_MNIST_DIR, DataNotFoundError  # noqa
from fedrobust.engine.detection import DETECTION_KEYS, detection_rates
from fedrobust.engine.round import all_finite
from fedrobust.errors import SettingError

from fedrobust.federation.builder import (  # noqa: F401 (analysis tools)
    Program, anchor_inputs, build, check_settings, initial_params,
    initial_server_state, resolve as resolve_settings)
from fedrobust.federation.evaluation import Evaluator  # noqa: F401
from fedrobust.methods import METHODS, fedlora
from fedrobust.transforms.base import get_path
from fedrobust.types import legacy_states

RESUMABLE_KEYS = config_lib.RESUMABLE_KEYS
EXECUTION_KEYS = config_lib.EXECUTION_KEYS

PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'chex',
            'numpy', 'tensorflow-datasets', 'absl-py')


class FlagError(ValueError):
  """A library SettingError, reported under the flag that set it."""


def default_workdir(config: dict[str, Any]) -> str:
  return os.path.join('runs', f"{config['method']}_{config['dataset']}_"
                      f"{config['model']}_s{config['seed']}")






# ----------------------------------------------------------------------------
# Cohorts: who trains which architecture, with which transform setting.
# ----------------------------------------------------------------------------














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
  if cohort.transform.name != 'lora':
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



# ----------------------------------------------------------------------------
# Files.
# ----------------------------------------------------------------------------


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








# ----------------------------------------------------------------------------
# Evaluation.
# ----------------------------------------------------------------------------






HEADLINE = ('test_accuracy', 'local_accuracy', 'local_accuracy_p10',
            'personal_accuracy', 'personal_accuracy_p10',
            'attack_success_rate',
            'backdoor_failure_rate', 'tradeoff_v', 'robust_accuracy',
            'clean_target_rate')


# ----------------------------------------------------------------------------
# The run.
# ----------------------------------------------------------------------------




class DivergenceError(RuntimeError):
  """The global model became non-finite and --on_divergence=stop (or the
  run ended on a non-finite model)."""

  def __init__(self, message: str, summary: dict[str, Any]):
    super().__init__(message)
    self.summary = summary




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


def resolve(config: dict[str, Any]) -> dict[str, Any]:
  """The library's resolve, plus the default workdir."""
  config = resolve_settings(config)
  if not config.get('workdir'):
    config['workdir'] = default_workdir(config)
  return config


def _run(config: dict[str, Any]) -> dict[str, Any]:
  started = time.perf_counter()
  config = resolve(config)
  check_settings(config)
  # Before anything starts JAX's CPU backend (a no-op once it has).
  configure_cpu_devices(
      config['cpu_devices'], config['clients_per_round'],
      strata=(config['sample_strata'] if config['client_data'] == 'sharded'
              else 1))
  fed = Federation(config)
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
    return _run_locked(fed, started, preemption)


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


class Writers(NamedTuple):
  """The run's file writers: real on the primary process, no-ops else."""
  json: Any
  row: Any


def _prepare(fed: Federation) -> Writers:
  """Prepares the workdir (primary process) and writes the clients'
  histograms."""
  config, program = fed.config, fed.program
  workdir, cohorts = config['workdir'], program.cohorts
  primary = is_primary()
  if primary:
    workdir_lib.prepare(config, defaults=config_lib.defaults(),
                        resumable=RESUMABLE_KEYS,
                        execution=config_lib.execution_keys(),
                        normalize=normalize)
  barrier(f'workdir-prepared {workdir}')   # --overwrite may remove files
  cohort_of = np.zeros(config['num_clients'], int)
  for j, c in enumerate(cohorts):
    cohort_of[list(c.members)] = j
  writers = Writers(workdir_lib.write_json if primary else lambda *_: None,
                    workdir_lib.append_row if primary else lambda *_: None)
  setup = program.setup
  writers.json(os.path.join(workdir, 'client_histograms.json'), {
      'num_classes': setup.num_classes,
      'train_counts': setup.train.count.tolist(),
      'histograms': setup.histograms.tolist(),
      'cohort': [cohorts[j].name for j in cohort_of],
      'spec': ({cohorts[0].transform.spec_name: program.specs.tolist()}
               if cohorts[0].transform.spec_name else {})})
  return writers


def _pretrained(fed: Federation) -> tuple[tuple, dict[str, Any]]:
  """initial_params, pretrained through --pretrained_dir's store when set,
  logged per cohort."""
  config, setup = fed.config, fed.program.setup

  def stored(cohort, params, j, train):
    if not config['pretrained_dir']:
      return train()
    return backbone.load_or_pretrain(
        config['pretrained_dir'], backbone.entry_name(
            cohort.name, params, setup.public_x, setup.public_y, config, j),
        params, train)

  params, info = fed.initial_params(stored)
  for name, entry in info.items():
    logging.info('pretrained %s centrally: %d epochs on %d public '
                 'examples, test accuracy %.4f%s', name,
                 config['pretrain_epochs'], len(setup.public_y),
                 entry['test_accuracy'],
                 ' (stored, read back)' if entry.get('reused') else '')
  return params, info


def _start(fed: Federation, checkpointer: Checkpointer):
  """(state, restored (step, state) or None, pretraining info): the latest
  verified checkpoint, or a fresh (pretrained, set-up) state."""
  config = fed.config
  template = fed.state_template()
  try:
    restored = checkpointer.restore_latest(
        template, legacy=legacy_states(template))
  except CheckpointError as err:
    if not config['overwrite']:
      raise
    logging.warning('%s; --overwrite: starting over from round 0', err)
    restored = None
  if restored is not None:
    logging.info('resumed from round %d in %s', restored[0],
                 config['workdir'])
    if restored[0] > config['num_rounds']:
      raise WorkdirError(
          f"--num_rounds={config['num_rounds']} is below round "
          f"{restored[0]}, where the run in {config['workdir']} already "
          f'is; pass --num_rounds >= {restored[0]} (a run is never cut '
          'back)')
    return fed.put(restored[1]), restored, {}
  params, pretrain_info = _pretrained(fed)
  t0 = time.perf_counter()
  state = fed.init(params)
  if fed.program.method.client_setup is not None:
    jax.block_until_ready(state)
    logging.info('setup step (e.g. local warm-up of every client) took '
                 '%.1fs', time.perf_counter() - t0)
  return state, restored, pretrain_info


class Progress:
  """What the host loop accumulates: the metrics rows, the cumulative
  detection counts, skipped and diverged rounds, round times."""

  def __init__(self, rows, ledger):
    self.rows = rows
    self.detection_totals = dict(ledger['detection_totals'])
    self.skipped = list(ledger['skipped_rounds'])
    self.diverged_at = None
    self.preempted_at = None
    self.round_times = []

  def ledger(self, evaluated: bool) -> dict[str, Any]:
    return {'detection_totals': self.detection_totals,
            'skipped_rounds': self.skipped, 'metrics_row': evaluated}


def _read_logs(config: dict[str, Any], start_round: int, restored,
               checkpointer: Checkpointer):
  """(Progress, logged per-round rows, rounds whose metrics rows are
  lost, whether metrics.jsonl is missing) of a run at `start_round`."""
  primary = is_primary()
  workdir = config['workdir']
  metrics_path = os.path.join(workdir, 'metrics.jsonl')
  missing = start_round > 0 and not os.path.lexists(metrics_path)
  if missing:
    logging.warning('%s is missing although the run is at round %d: rounds '
                    '1..%d have no metrics rows (summary.json records '
                    'this)', metrics_path, start_round, start_round)
  rows = workdir_lib.read_metrics(metrics_path, start_round,
                                  rewrite=primary)
  rounds_path = os.path.join(workdir, 'rounds.jsonl')
  logged = {}
  if config['log_clients'] or os.path.lexists(rounds_path):
    logged = {r['round']: r for r in workdir_lib.read_metrics(
        rounds_path, start_round, rewrite=primary)}
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
  lost = [] if restored is None else missing_rounds(
      rows, start_round, config['eval_every'],
      bool(ledger.get('metrics_row')))
  return Progress(rows, ledger), logged, lost, missing


def _round_line(rnd: int, num_rounds: int, metrics, seconds: float,
                samples: float, row) -> str:
  """The round's log line."""
  line = (f"round {rnd}/{num_rounds} train_loss "
          f"{float(metrics['train_loss']):.4f} {seconds:.2f}s "
          f"{samples / seconds:,.0f} samples/s")
  if 'staleness_mean' in metrics:
    line += (f" arrivals {int(metrics['arrivals'])} staleness "
             f"{float(metrics['staleness_mean']):.2f}")
  if row is None:
    return line
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
  return line


def _count_detection(progress: Progress, metrics, threat) -> None:
  """Adds the round's detection counts to the totals and the rates to the
  round's metrics."""
  if 'det_tp' not in metrics or threat.threat is None:
    return
  for key in progress.detection_totals:
    progress.detection_totals[key] += float(metrics[key])
  metrics.update(detection_rates(metrics, ''))
  metrics.update(detection_rates(progress.detection_totals, 'cumulative_'))
  metrics.update({'cumulative_' + k: v
                  for k, v in progress.detection_totals.items()})


def _save(checkpointer: Checkpointer, rnd: int, state, ledger, workdir):
  try:
    checkpointer.save(rnd, state, ledger=ledger)
  except CheckpointSpaceError as err:
    raise WorkdirError(
        f'--workdir={workdir}: round {rnd} could not be checkpointed: '
        f'{err}. Free space, lower --checkpoints_keep, or pass '
        '--checkpoint_compress; rerun the same command to resume from '
        'the last step') from err


def _one_round(fed: Federation, state, rnd: int, progress: Progress,
               writers: Writers, tracker, preemption):
  """Runs, logs and (when due) evaluates round `rnd`. Returns (state,
  evaluated, stop): stop when the model diverged under --on_divergence=
  stop."""
  config = fed.config
  num_rounds, on_divergence = config['num_rounds'], config['on_divergence']
  workdir = config['workdir']
  t0 = time.perf_counter()
  state, metrics = fed.step(state)
  seconds = time.perf_counter() - t0
  clients = client_rows(metrics.pop('clients', None))
  nonfinite = bool(metrics['nonfinite_model'])
  if nonfinite and on_divergence == 'skip_round':
    progress.skipped.append(rnd)
    logging.warning('round %d: the aggregated model is not finite; the '
                    "round's update is dropped (--on_divergence="
                    'skip_round, %d skipped so far)', rnd,
                    len(progress.skipped))
  elif nonfinite and progress.diverged_at is None:
    progress.diverged_at = rnd
  _count_detection(progress, metrics, fed.program.threat)
  progress.round_times.append(seconds)
  samples = float(metrics['examples']) * config['local_epochs']
  stop = nonfinite and on_divergence == 'stop'
  # Asked at every round boundary: under jax.distributed a collective
  # that every process joins, so all stop after the same round.
  if not stop and rnd < num_rounds and preemption.requested():
    progress.preempted_at = rnd
  if config['log_clients']:
    writers.row(os.path.join(workdir, 'rounds.jsonl'), dict(
        {'round': rnd}, **{k: float(v) for k, v in metrics.items()},
        round_seconds=seconds, **({'clients': clients} if clients else {})))
  row = None
  if rnd % config['eval_every'] == 0 or rnd == num_rounds or stop:
    t_eval = time.perf_counter()
    evaluation = fed.evaluate(state)
    row = metrics_row(rnd, evaluation, metrics, seconds=seconds,
                      samples=samples,
                      eval_seconds=time.perf_counter() - t_eval,
                      clients=clients, skipped=progress.skipped)
    progress.rows.append(row)
    writers.row(os.path.join(workdir, 'metrics.jsonl'), row)
    tracker.log(row)
  eta = np.mean(progress.round_times[-5:]) * (num_rounds - rnd)
  logging.info('%s eta %.0fs', _round_line(rnd, num_rounds, metrics,
                                           seconds, samples, row), eta)
  return state, row is not None, stop


def _rounds(fed: Federation, state, start_round: int, progress: Progress,
            writers: Writers, tracker, checkpointer: Checkpointer,
            preemption):
  """The host loop from start_round + 1 to --num_rounds; checkpoints every
  --checkpoint_every rounds, at the end and when preempted."""
  config = fed.config
  num_rounds = config['num_rounds']
  for rnd in range(start_round + 1, num_rounds + 1):
    state, evaluated, stop = _one_round(fed, state, rnd, progress, writers,
                                        tracker, preemption)
    if stop:
      break                           # the diverged state is not saved
    if (rnd % config['checkpoint_every'] == 0 or rnd == num_rounds
        or progress.preempted_at):
      _save(checkpointer, rnd, state, progress.ledger(evaluated),
            config['workdir'])
    if progress.preempted_at:
      logging.warning('%s: stopped after round %d of %d, checkpointed',
                      preemption.received or 'a signal on another process',
                      rnd, num_rounds)
      break
  return state


def _run_locked(fed: Federation, started: float,
                preemption: preemption_lib.Preemption) -> dict[str, Any]:
  config = fed.config
  workdir = config['workdir']
  writers = _prepare(fed)
  checkpointer = Checkpointer(os.path.join(workdir, 'checkpoints'),
                              keep=config['checkpoints_keep'],
                              compress=config['checkpoint_compress'])
  state, restored, pretrain_info = _start(fed, checkpointer)
  start_round = int(state.round)
  progress, logged, lost, missing = _read_logs(config, start_round,
                                               restored, checkpointer)
  cost = fed.compile(state).cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  flops_per_round = float((cost or {}).get('flops', float('nan')))
  resolved = fed.program.resolved
  logging.info('round program compiled in %.1fs (%s, %s, conv=%s, %d '
               'device(s))', fed.compile_seconds, resolved['backend'],
               resolved['client_execution'], resolved['conv_impl'],
               resolved['num_devices'])
  # TensorBoard drops the earlier events from the first round logged anew
  # on: restored rows too, so none shows twice.
  tracker = (tracking.TensorBoard(
      workdir, None if restored is None
      else min(lost, default=start_round + 1) - 1)
             if is_primary() and config['tensorboard']
             else tracking.NoTracking())
  for row in restore_rows(lost, start_round,
                          lambda: fed.evaluate(state), logged,
                          config['local_epochs'], progress.skipped
                          ) if lost else ():
    progress.rows.append(row)
    writers.row(os.path.join(workdir, 'metrics.jsonl'), row)
    tracker.log(row)
  del logged
  state = _rounds(fed, state, start_round, progress, writers, tracker,
                  checkpointer, preemption)
  checkpointer.close()
  tracker.close()
  summary = _summary(fed, state, progress, {
      'pretrain': pretrain_info, 'compile_seconds': fed.compile_seconds,
      'flops_per_round': flops_per_round,
      'mean_round_seconds': (float(np.mean(progress.round_times))
                             if progress.round_times else None),
      'wall_seconds': time.perf_counter() - started,
      'metrics_missing_before_round': start_round + 1 if missing
                                      else None})
  _write_outputs(fed, summary, progress.rows, writers)
  _raise_unfinished(summary, progress, preemption, config)
  return summary


def _status(state, progress: Progress, on_divergence: str) -> str:
  final_finite = bool(jax.device_get(all_finite(state.params)))
  status = 'completed' if final_finite and not (
      progress.diverged_at and on_divergence == 'stop') else 'diverged'
  if status == 'completed' and progress.preempted_at:
    status = 'preempted'
  return status


def _last5(rows: list[dict[str, Any]]) -> dict[str, float]:
  """The headline metrics' means over the last 5 evaluated rounds (the
  SDFC paper reports A, R and V so)."""
  out = {}
  keys = sorted({k for r in rows[-5:] for k in r
                 if k.split('/', 1)[0] in HEADLINE})
  for key in keys:
    values = [r[key] for r in rows[-5:] if r.get(key) is not None]
    if values:
      out[key] = float(np.mean(values))
  return out


def _cohort_summary(fed: Federation, state) -> dict[str, Any]:
  """Per cohort: model, clients, transform, bytes uploaded and (LoRA
  methods) communicated."""
  program = fed.program
  trainables = jax.eval_shape(lambda s: s.params, state)
  fresh = initial_params(program.cohorts, fed.config['seed'])
  spec = METHODS[fed.config['method']]
  anchors = (int(program.server_data['anchors'].shape[0])
             if 'anchors' in program.server_data else 0)
  cohorts = {c.name: {'model': c.model.name, 'clients': len(c.members),
                      'clients_per_round': c.clients_per_round,
                      'transform': c.transform.name,
                      'upload_bytes_per_client': upload_bytes(
                          c, trainables[j]),
                      'full_model_bytes': 4 * sum(
                          int(np.size(l)) for l in jax.tree.leaves(fresh[j]))}
             for j, c in enumerate(program.cohorts)}
  communication = {
      c.name: (lora_communication(
          fed.config['method'], c, trainables[j], anchors=anchors,
          classes=int(program.setup.num_classes))
               if spec.lora_communication else None)
      for j, c in enumerate(program.cohorts)}
  return {'cohorts': cohorts, 'communication': communication}


def _summary(fed: Federation, state, progress: Progress,
             timing: dict[str, Any]) -> dict[str, Any]:
  """summary.json's content."""
  config, program = fed.config, fed.program
  workdir = config['workdir']
  status = _status(state, progress, config['on_divergence'])
  newcomers = {}
  if program.unseen is not None and status == 'completed':
    newcomers = fed.adapt_unseen(state)
  describe = program.method.describe
  return {
      'status': status,
      'final': progress.rows[-1] if progress.rows else {},
      'final_mean_last5': _last5(progress.rows),
      'rounds_completed': int(state.round),
      'skipped_rounds': progress.skipped,
      'diverged_round': progress.diverged_at,
      'config': {k: v for k, v in config.items()
                 if k not in ('overwrite', 'force_overwrite')},
      'resolved': {k: v for k, v in program.resolved.items()
                   if k != 'backend'},
      **_cohort_summary(fed, state),
      **(describe(state.method_state, program.setup.client_groups)
         if describe is not None else {}),
      **newcomers,
      **timing,
      'packages': package_versions(),
      'device': device_info(),
      'params_sha256': params_sha256(state.params),
      'files': {name: os.path.abspath(os.path.join(workdir, file))
                for name, file in (('summary', 'summary.json'),
                                   ('curves', 'curves.png'),
                                   ('metrics', 'metrics.jsonl'))},
  }


def _write_outputs(fed: Federation, summary: dict[str, Any], rows,
                   writers: Writers) -> None:
  config = fed.config
  workdir = config['workdir']
  writers.json(os.path.join(workdir, 'summary.json'), summary)
  if rows and is_primary():
    title = (f"{config['method']} / {config['dataset']} / "
             f"{config['cohorts'] or config['model']}")
    plot_curves(os.path.join(workdir, 'curves.png'), rows, title)
    if any('clients' in r for r in rows):
      plot_clients(os.path.join(workdir, 'clients.png'), rows, title)


def _raise_unfinished(summary: dict[str, Any], progress: Progress,
                      preemption, config: dict[str, Any]) -> None:
  """Preempted (exit 75) or DivergenceError, after the summary is written."""
  status, workdir = summary['status'], config['workdir']
  if status == 'preempted':
    raise preemption_lib.Preempted(
        f'preempted ({preemption.received or "a signal on another process"})'
        f' after round {progress.preempted_at} of {config["num_rounds"]}: '
        f'round {progress.preempted_at} is checkpointed in {workdir}/'
        'checkpoints. Run the same command again to resume from it.',
        summary)
  if status == 'diverged':
    where = (f'round {progress.diverged_at}' if progress.diverged_at else
             f"round {summary['rounds_completed']}")
    raise DivergenceError(
        f'the global model is not finite (NaN or Inf) after {where}'
        + (': the run stopped there; its last checkpoint is intact'
           if config['on_divergence'] == 'stop' else '') +
        '. Lower the learning rates, pick a robust --aggregator, or pass '
        '--on_divergence=skip_round to drop such rounds. Summary: '
        f"{summary['files']['summary']}", summary)


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
