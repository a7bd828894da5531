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
import functools
import os
import time
from typing import Any, NamedTuple

import jax
import numpy as np
from absl import logging

from experiments import backbone
from experiments import preemption as preemption_lib
from experiments import tracking
from experiments import config as config_lib
from experiments import workdir as workdir_lib
from experiments.devices import configure_cpu_devices
from experiments.workdir import ConfigMismatchError, WorkdirError  # noqa
from fedrobust import Federation, Replicas
from fedrobust.checkpoint import (CheckpointError, Checkpointer, barrier,
                                  is_primary)
from fedrobust.data import DEFAULT_FASHION_MNIST_DIR, DataNotFoundError  # noqa
from fedrobust.errors import SettingError
from fedrobust.federation import combine_rows

from fedrobust.federation.builder import (  # noqa: F401 (analysis tools)
    Program, anchor_inputs, build, check_settings, initial_params,
    initial_server_state, resolve as resolve_settings)
from fedrobust.federation.evaluation import Evaluator  # noqa: F401
from fedrobust.methods import METHODS
from fedrobust.types import legacy_states
from experiments.loop import (Progress, Writers, client_rows,  # noqa: F401
                              metrics_row, missing_rounds, read_logs,
                              restore_rows, rounds)
from experiments.summary import (HEADLINE, PACKAGES, client_aucs,  # noqa: F401
                                 device_info, format_summary,
                                 lora_communication, package_versions,
                                 params_sha256, plot_clients, plot_curves,
                                 summarize, upload_bytes, write_outputs)

RESUMABLE_KEYS = config_lib.RESUMABLE_KEYS
EXECUTION_KEYS = config_lib.EXECUTION_KEYS


class FlagError(ValueError):
  """A library SettingError, reported under the flag that set it."""


def default_workdir(config: dict[str, Any]) -> str:
  seeds = str(config['seed'])
  if config['num_seeds'] > 1:
    seeds += f"-{config['seed'] + config['num_seeds'] - 1}"
  return os.path.join('runs', f"{config['method']}_{config['dataset']}_"
                      f"{config['model']}_s{seeds}")


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
  # Several seeds run as replicas of one program (fedrobust.Replicas).
  fed = (Replicas if config['num_seeds'] > 1 else Federation)(config)
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
  if config['num_seeds'] > 1:
    raise ValueError(f"--workdir={workdir} holds {config['num_seeds']} "
                     'seeds as replicas; analysis tools read one seed: run '
                     'the seed of interest alone (--seed=N, --num_seeds=1)')
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


def _prepare(fed: Federation) -> Writers:
  """Prepares the workdir (primary process) and writes the clients'
  histograms."""
  config = fed.config
  workdir = config['workdir']
  primary = is_primary()
  if primary:
    workdir_lib.prepare(config, defaults=config_lib.defaults(),
                        resumable=RESUMABLE_KEYS,
                        execution=config_lib.execution_keys(),
                        normalize=normalize)
  barrier(f'workdir-prepared {workdir}')   # --overwrite may remove files
  writers = Writers(workdir_lib.write_json if primary else lambda *_: None,
                    workdir_lib.append_row if primary else lambda *_: None)
  writers.json(os.path.join(workdir, 'client_histograms.json'),
               _histograms(fed.replica(0).program))
  if fed.num_seeds > 1:       # each replica's own partition
    writers.json(os.path.join(workdir, 'client_histograms_replicas.json'),
                 [dict(_histograms(fed.replica(i).program), seed=seed)
                  for i, seed in enumerate(fed.seeds)])
  return writers


def _histograms(program: Program) -> dict[str, Any]:
  """client_histograms.json: per-client class counts, cohort and spec."""
  cohorts, setup = program.cohorts, program.setup
  cohort_of = np.zeros(len(setup.train.count), int)
  for j, c in enumerate(cohorts):
    cohort_of[list(c.members)] = j
  return {
      'num_classes': setup.num_classes,
      'train_counts': setup.train.count.tolist(),
      'histograms': setup.histograms.tolist(),
      'cohort': [cohorts[j].name for j in cohort_of],
      'spec': ({cohorts[0].transform.spec_name: program.specs.tolist()}
               if cohorts[0].transform.spec_name else {})}


def _pretrained(fed) -> tuple[tuple, dict[str, Any]]:
  """initial_params of every replica, pretrained through
  --pretrained_dir's store when set, logged per cohort."""
  config = fed.config
  out = [_pretrained_one(fed.replica(i), config)
         for i in range(fed.num_seeds)]
  return fed.join([p for p, _ in out]), out[0][1]


def _pretrained_one(fed: Federation, config) -> tuple[tuple, dict]:
  setup = fed.program.setup

  def stored(cohort, params, j, train):
    if not config['pretrained_dir']:
      return train()
    return backbone.load_or_pretrain(
        config['pretrained_dir'], backbone.entry_name(
            cohort.name, params, setup.public_x, setup.public_y,
            fed.config, j),
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


def _run_locked(fed: Federation, started: float,
                preemption: preemption_lib.Preemption) -> dict[str, Any]:
  config = fed.config
  workdir = config['workdir']
  writers = _prepare(fed)
  checkpointer = Checkpointer(os.path.join(workdir, 'checkpoints'),
                              keep=config['checkpoints_keep'],
                              compress=config['checkpoint_compress'])
  state, restored, pretrain_info = _start(fed, checkpointer)
  start_round = int(np.max(np.asarray(state.round)))
  progress, logged, lost, missing = read_logs(config, start_round,
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
  for row in _restore_rows(fed, state, lost, start_round, logged,
                           progress) if lost else ():
    progress.rows.append(row)
    writers.row(os.path.join(workdir, 'metrics.jsonl'), row)
    tracker.log(row)
  del logged
  state = rounds(fed, state, start_round, progress, writers, tracker,
                  checkpointer, preemption)
  checkpointer.close()
  tracker.close()
  summary = summarize(fed, state, progress, {
      'pretrain': pretrain_info, 'compile_seconds': fed.compile_seconds,
      'flops_per_round': flops_per_round,
      'mean_round_seconds': (float(np.mean(progress.round_times))
                             if progress.round_times else None),
      'wall_seconds': time.perf_counter() - started,
      'metrics_missing_before_round': start_round + 1 if missing
                                      else None})
  write_outputs(fed, summary, progress.rows, writers)
  _raise_unfinished(summary, progress, preemption, config)
  return summary


def _restore_rows(fed, state, lost: list[int], start_round: int,
                  logged: dict[int, dict[str, Any]], progress: Progress
                  ) -> list[dict[str, Any]]:
  """The lost metrics rows (loop.restore_rows), replica by replica and
  combined."""
  evaluations = []

  def evaluate(i):
    if not evaluations:
      evaluations.extend(fed.evaluate_each(state))
    return evaluations[i]

  each = [restore_rows(
      lost, start_round, functools.partial(evaluate, i),
      {r: ({k: v for k, v in row['replicas'][i].items() if k != 'seed'}
           if 'replicas' in row else row)
       for r, row in logged.items()},
      fed.config['local_epochs'], progress.skipped_each[i])
          for i in range(fed.num_seeds)]
  return [combine_rows(list(rows), fed.seeds) for rows in zip(*each)]


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
