r"""FedHAN's detector replayed on a run's logged suspicion scores.

  python experiments/analysis/fedhan_detection.py --workdir=runs/fedhan_fmnist_quick \
    --eps=0.2,0.25,0.35 --min_samples=2,4 --ban_after=1,2 \
    --min_flag_score=0,1.35

A FedHAN run logs every arrival's suspicion score s_i = ||gchk_i - gbar_i||
(Sec. 3.5.3), staleness and attacker flag in `rounds.jsonl`. This tool
reruns the rule's own detector (`fedhan_cache.detect`: DBSCAN on the scores
over their median, then 2-means) round by round on those scores, keeps the
strikes and bans on the host as the rule does (one strike per flagged
round; banned at the `ban_after`-th; a flag needs a score of at least
`min_flag_score` x the median), and counts each arrival as the engine
does (excluded = banned before the round or flagged in it). It answers in
seconds what a 10-minute run would, for every setting in the grid:
DACC, FPR, FNR and the confusion counts.

Both readings of S_j (`--score_set`, default the run's): 'clients' keeps
each client's latest score (its score at its last scored arrival: a
client's cache rows change only when it arrives) and clusters those of the
unbanned clients (`fedhan_cache.detect_latest`); 'arrivals' clusters the
round's scored arrivals, banned ones included. A run from before the
setting existed used 'arrivals'.

What the replay cannot see:
- a detection-on run's bans changed the models the later scores came
  from; replaying other settings on its scores ignores that feedback (on
  the quick preset, seed 0: the run with detection off gives DACC 0.895 at
  the preset's setting, the run with it on 0.870);
- told mode (`--fedhan_unlearn_round`) and non-finite uploads, which the
  rule excludes without a flag: such runs are refused / not modelled.

For the run's own setting, when its detection was on, the replay must give
the run's summed `det_tp/fp/fn/tn`; `matches_run` says whether it did, which
checks that the replay sees what the run saw.

Also printed: the per-round ceiling, the DACC of flagging exactly the
attackers in every round where some threshold on the scores separates them
from the benign arrivals, and nothing elsewhere (no bans). It bounds any
per-round threshold detector, DBSCAN's included, on these scores.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from typing import Any, Iterable, Sequence

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import workdir as workdir_lib
from fedrobust.engine.detection import DETECTION_KEYS as COUNTS
from fedrobust.engine.detection import detection_rates
from fedrobust.methods.fedhan import cache as fc
from fedrobust.methods.fedhan.rule import SCORE_SETS
from fedrobust.engine.round import detection_counts


def load_arrivals(workdir: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
  """The run's config and, per logged round, its arrivals as arrays.

  Raises:
    ValueError: no FedHAN run in `workdir`, a told-mode run, or a
      rounds.jsonl without per-client rows (--nolog_clients).
  """
  path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(path):
    raise ValueError(f'--workdir={workdir} holds no run (no config.json)')
  config = workdir_lib.read_json_object(path)
  if config.get('method') != 'fedhan':
    raise ValueError(f"--workdir={workdir} ran --method={config.get('method')}"
                     '; expected fedhan')
  if config.get('fedhan_unlearn_round'):
    raise ValueError(f'--workdir={workdir} ran told mode '
                     '(--fedhan_unlearn_round); its bans are not detections')
  rounds_path = os.path.join(workdir, 'rounds.jsonl')
  if not os.path.isfile(rounds_path):
    raise ValueError(f'--workdir={workdir} has no rounds.jsonl (the run needs '
                     '--log_clients)')
  rounds = []
  with open(rounds_path) as f:
    for line in f:
      row = json.loads(line)
      c = row.get('clients')
      if c is None or 'suspicion' not in c:
        raise ValueError(f"{rounds_path}: round {row.get('round')} has no "
                         'per-client suspicion (the run needs --log_clients)')
      rounds.append({
          'round': int(row['round']),
          'ids': np.asarray(c['id'], np.int64),
          'malicious': np.asarray(c['malicious'], bool),
          'score': np.asarray(c['suspicion'], np.float32),
          'staleness': np.asarray(c['staleness'], np.int64),
          **{k: float(row.get(k) or 0.0) for k in COUNTS}})
  return config, rounds


def scored(r: dict[str, Any]) -> np.ndarray:
  """The arrivals the rule scored: a global update existed for the model
  they started from (round - 1 - staleness >= 1)."""
  return (r['round'] - 1 - r['staleness'] >= 1) & (r['score'] > 0)


def _slots(rounds: Sequence[dict[str, Any]]) -> int:
  return max([1] + [len(r['ids']) for r in rounds])


def replay(rounds: Sequence[dict[str, Any]], *, eps: float, min_samples: int,
           ban_after: int, detect_start: int, num_clients: int,
           score_set: str = 'arrivals', min_flag_score: float = 0.0
           ) -> dict[str, int]:
  """Confusion counts of the rule's detection replayed on `rounds`."""
  if score_set not in SCORE_SETS:
    raise ValueError(f'score_set must be one of {SCORE_SETS}, got '
                     f'{score_set!r}')
  slots = _slots(rounds)
  kw = dict(eps=eps, min_samples=min_samples, min_flag_score=min_flag_score)
  detect = jax.jit(lambda x, m: fc.detect(x, m, **kw)[0])
  detect_latest = jax.jit(lambda x, m, ids, ok: fc.detect_latest(
      x, m, ids, ok, **kw)[0])
  strikes = np.zeros(num_clients, np.int64)
  banned = np.zeros(num_clients, bool)
  latest = np.full(num_clients, -1.0, np.float32)
  out = dict.fromkeys(COUNTS, 0)
  for r in rounds:
    k = len(r['ids'])
    ok = scored(r)
    latest[r['ids'][ok]] = r['score'][ok]
    flagged = np.zeros(k, bool)
    if r['round'] >= detect_start and k:
      m = np.zeros(slots, bool)
      m[:k] = ok
      if score_set == 'clients':
        ids = np.full(slots, num_clients, np.int32)
        ids[:k] = r['ids']
        flagged = np.asarray(detect_latest(latest, (latest >= 0) & ~banned,
                                           ids, m))[:k]
      else:
        x = np.zeros(slots, np.float32)
        x[:k] = r['score']
        flagged = np.asarray(detect(x, m))[:k]
    _count(out, banned[r['ids']] | flagged, r['malicious'])
    hit = np.zeros(num_clients, bool)
    hit[r['ids'][flagged]] = True
    strikes += hit
    banned |= strikes >= ban_after
  return out


def separable_ceiling(rounds: Iterable[dict[str, Any]], detect_start: int
                      ) -> dict[str, int]:
  """Counts of flagging exactly the scored attackers in each round from
  `detect_start` where a threshold separates them from every scored benign
  arrival, and nobody elsewhere (no bans)."""
  out = dict.fromkeys(COUNTS, 0)
  for r in rounds:
    mal, ok = r['malicious'], scored(r)
    flagged = np.zeros(len(mal), bool)
    att, ben = mal & ok, ~mal & ok
    if r['round'] >= detect_start and att.any() and (
        not ben.any() or r['score'][att].min() > r['score'][ben].max()):
      flagged = att
    _count(out, flagged, mal)
  return out


def _count(out: dict[str, int], excluded: np.ndarray, mal: np.ndarray):
  """Adds one round's counts, as the engine counts them (weight 0 is
  excluded)."""
  c = detection_counts(jnp.where(excluded, 0.0, 1.0), jnp.asarray(mal),
                       jnp.ones(len(mal), bool))
  for k in COUNTS:
    out[k] += int(c[k])


def _summary(c: dict[str, int]) -> str:
  r = detection_rates(c, '')
  return (f"DACC {r['detection_accuracy']:.3f} FPR {r['detection_fpr']:.3f} "
          f"FNR {r['detection_fnr']:.3f} {c}")


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    config, rounds = load_arrivals(f.workdir)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  # A run from before --fedhan_min_flag_score had none (0).
  own = (float(config['fedhan_eps']), int(config['fedhan_min_samples']),
         int(config['fedhan_ban_after']),
         float(config.get('fedhan_min_flag_score', 0.0)))
  run_set = config.get('fedhan_score_set', 'arrivals')
  score_set = f.score_set or run_set
  grid = list(itertools.product(
      [float(v) for v in f.eps] or [own[0]],
      [int(v) for v in f.min_samples] or [own[1]],
      [int(v) for v in f.ban_after] or [own[2]],
      [float(v) for v in f.min_flag_score] or [own[3]]))
  start = (config['fedhan_detect_start'] if f.detect_start is None
           else f.detect_start)
  n = int(config['num_clients'])
  run = {k: int(sum(r[k] for r in rounds)) for k in COUNTS}
  print(f"{f.workdir}: {len(rounds)} rounds, "
        f"{sum(len(r['ids']) for r in rounds)} arrivals, detection "
        f"{'on' if config['fedhan_detect'] else 'off'} in the run")
  print(f"run's counts: {_summary(run)}")
  ceiling = separable_ceiling(rounds, start)
  print(f'per-round separable ceiling: {_summary(ceiling)}')
  for eps, ms, ban, floor in grid:
    c = replay(rounds, eps=eps, min_samples=ms, ban_after=ban,
               detect_start=start, num_clients=n, score_set=score_set,
               min_flag_score=floor)
    line = (f'{score_set} eps {eps:g} min_samples {ms} ban_after {ban} '
            f'min_flag_score {floor:g}: {_summary(c)}')
    if config['fedhan_detect'] and (eps, ms, ban, floor) == own and (
        score_set == run_set) and (
        f.detect_start in (None, config['fedhan_detect_start'])):
      line += f' matches_run={c == run}'
    print(line)


if __name__ == '__main__':
  # Defined here, not at import: the runner's flags (experiments/main.py)
  # also have --workdir, and tests import both modules.
  flags.DEFINE_string('workdir', None, 'A FedHAN run directory.')
  flags.DEFINE_list('eps', [], "DBSCAN radii to replay (relative to the "
                    "round's median score); default: the run's.")
  flags.DEFINE_list('min_samples', [], "DBSCAN core sizes; default: the "
                    "run's.")
  flags.DEFINE_list('ban_after', [], "Flags before a ban; default: the run's.")
  flags.DEFINE_list('min_flag_score', [], "Floors of a flag over the median "
                    "score; default: the run's (0 for a run from before "
                    'the setting).')
  flags.DEFINE_integer('detect_start', None, "First detecting round; "
                       "default: the run's.")
  flags.DEFINE_enum('score_set', None, SCORE_SETS, "Which scores S_j "
                    "clusters (the rule's score_set); default: the run's "
                    "('arrivals' for a run from before the setting).")
  flags.mark_flag_as_required('workdir')
  app.run(main)
