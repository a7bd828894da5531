"""The host loop of a run: rounds, logs, checkpoints, restored rows.

`rounds` runs the federation's compiled round from a start round to
--num_rounds, writes each evaluated round's metrics row, checkpoints every
--checkpoint_every rounds (and at the end, and when preempted), and stops
after a diverged round under --on_divergence=stop. `read_logs` picks up a
resumed run's rows and ledger; `restore_rows` rebuilds rows a cut log lost.
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

import numpy as np
from absl import logging

from experiments import workdir as workdir_lib
from experiments.summary import _fmt, client_aucs, replica_rows
from experiments.workdir import WorkdirError
from fedrobust import Federation
from fedrobust.federation import combine_rows
from fedrobust.checkpoint import (CheckpointSpaceError, Checkpointer,
                                  is_primary)
from fedrobust.engine.detection import DETECTION_KEYS, detection_rates


class Writers(NamedTuple):
  """The run's file writers: real on the primary process, no-ops else."""
  json: Any
  row: Any


class Progress:
  """What the host loop accumulates: the metrics rows, and per replica
  (one without --num_seeds) the cumulative detection counts, skipped and
  diverged rounds; the round times."""

  def __init__(self, rows, ledgers: list[dict[str, Any]]):
    self.rows = rows
    self.totals = [dict(l['detection_totals']) for l in ledgers]
    self.skipped_each = [list(l['skipped_rounds']) for l in ledgers]
    self.diverged_each: list[int | None] = [None] * len(ledgers)
    self.preempted_at = None
    self.round_times = []

  @property
  def detection_totals(self) -> dict[str, float]:
    return self.totals[0]

  @property
  def skipped(self) -> list[int]:
    """Rounds skipped as non-finite (by any replica)."""
    return sorted(set().union(*self.skipped_each))

  @property
  def diverged_at(self) -> int | None:
    """The first round a replica's model diverged in."""
    return min((r for r in self.diverged_each if r), default=None)

  def ledger(self, evaluated: bool) -> dict[str, Any]:
    each = [{'detection_totals': t, 'skipped_rounds': s}
            for t, s in zip(self.totals, self.skipped_each)]
    if len(each) == 1:
      return dict(each[0], metrics_row=evaluated)
    return {'replicas': each, 'metrics_row': evaluated}


def read_logs(config: dict[str, Any], start_round: int, restored,
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
  num_seeds = config['num_seeds']
  if ledger is None:
    ledgers = [{
        'detection_totals': {k: (own[-1].get('cumulative_' + k, 0.0)
                                 if own else 0.0) for k in DETECTION_KEYS},
        'skipped_rounds': list(own[-1].get('skipped_rounds', []))
                          if own else []}
               for own in replica_rows(rows, num_seeds)]
    ledger = {}
  else:
    ledgers = ledger.get('replicas', [ledger])
  lost = [] if restored is None else missing_rounds(
      rows, start_round, config['eval_every'],
      bool(ledger.get('metrics_row')))
  return Progress(rows, ledgers), logged, lost, missing


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
  if row.get('test_accuracy_std') is not None:     # replicas: mean ± std
    line += f" ± {_fmt(row['test_accuracy_std'])}"
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


def _count_detection(totals: dict[str, float], metrics, threat) -> None:
  """Adds the round's detection counts to a replica's totals and the
  rates to the round's metrics."""
  if 'det_tp' not in metrics or threat.threat is None:
    return
  for key in totals:
    totals[key] += float(metrics[key])
  metrics.update(detection_rates(metrics, ''))
  metrics.update(detection_rates(totals, 'cumulative_'))
  metrics.update({'cumulative_' + k: v for k, v in totals.items()})


def _save(checkpointer: Checkpointer, rnd: int, state, ledger, workdir):
  try:
    checkpointer.save(rnd, state, ledger=ledger)
  except CheckpointSpaceError as err:
    raise WorkdirError(
        f'--workdir={workdir}: round {rnd} could not be checkpointed: '
        f'{err}. Free space, lower --checkpoints_keep, or pass '
        '--checkpoint_compress; rerun the same command to resume from '
        'the last step') from err


def _replica_round(progress: Progress, i: int, rnd: int, metrics,
                   config: dict[str, Any], threat):
  """Replica i's host bookkeeping of round `rnd`: its per-client rows,
  skipped or diverged round and detection counts. Returns (per-client
  rows, whether its model is not finite)."""
  clients = client_rows(metrics.pop('clients', None))
  nonfinite = bool(metrics['nonfinite_model'])
  if nonfinite and config['on_divergence'] == 'skip_round':
    progress.skipped_each[i].append(rnd)
    logging.warning('round %d: the aggregated model is not finite; the '
                    "round's update is dropped (--on_divergence="
                    'skip_round, %d skipped so far)', rnd,
                    len(progress.skipped_each[i]))
  elif nonfinite and progress.diverged_each[i] is None:
    progress.diverged_each[i] = rnd
  _count_detection(progress.totals[i], metrics, threat)
  return clients, nonfinite


def _one_round(fed: Federation, state, rnd: int, progress: Progress,
               writers: Writers, tracker, preemption):
  """Runs, logs and (when due) evaluates round `rnd`. Returns (state,
  evaluated, stop): stop when the model diverged under --on_divergence=
  stop. With replicas every row carries each replica's values and their
  mean and std (fedrobust.federation.combine_rows)."""
  config = fed.config
  num_rounds, on_divergence = config['num_rounds'], config['on_divergence']
  workdir = config['workdir']
  t0 = time.perf_counter()
  state, each = fed.step_each(state)
  seconds = time.perf_counter() - t0
  done = [_replica_round(progress, i, rnd, m, config, fed.program.threat)
          for i, m in enumerate(each)]
  progress.round_times.append(seconds)
  samples = sum(float(m['examples']) for m in each) * config['local_epochs']
  stop = any(n for _, n in done) and on_divergence == 'stop'
  # Asked at every round boundary: under jax.distributed a collective
  # that every process joins, so all stop after the same round.
  if not stop and rnd < num_rounds and preemption.requested():
    progress.preempted_at = rnd
  if config['log_clients']:
    writers.row(os.path.join(workdir, 'rounds.jsonl'), combine_rows([dict(
        {'round': rnd}, **{k: float(v) for k, v in m.items()},
        round_seconds=seconds, **({'clients': c} if c else {}))
        for m, (c, _) in zip(each, done)], fed.seeds))
  row = None
  if rnd % config['eval_every'] == 0 or rnd == num_rounds or stop:
    t_eval = time.perf_counter()
    evaluations = fed.evaluate_each(state)
    eval_seconds = time.perf_counter() - t_eval
    row = combine_rows([
        metrics_row(rnd, e, m, seconds=seconds, samples=samples,
                    eval_seconds=eval_seconds, clients=c,
                    skipped=progress.skipped_each[i])
        for i, (e, m, (c, _)) in enumerate(zip(evaluations, each, done))],
                       fed.seeds)
    progress.rows.append(row)
    writers.row(os.path.join(workdir, 'metrics.jsonl'), row)
    tracker.log(row)
  eta = np.mean(progress.round_times[-5:]) * (num_rounds - rnd)
  logging.info('%s eta %.0fs', _round_line(
      rnd, num_rounds, combine_rows(each, fed.seeds), seconds, samples,
      row), eta)
  return state, row is not None, stop


def rounds(fed: Federation, state, start_round: int, progress: Progress,
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
