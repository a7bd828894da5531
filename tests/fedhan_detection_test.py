"""experiments/analysis/fedhan_detection.py: the detector replayed on logged scores
gives the rule's own exclusions, bans included."""

import itertools
import json
import os
import tempfile

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from experiments.analysis import fedhan_detection as fd
from fedrobust.engine.detection import detection_rates
from fedrobust.aggregators import call_aggregator, get_aggregator
from fedrobust.engine.round import detection_counts


def _rounds(rows):
  """Replay rounds from (round, ids, malicious, scores, staleness) rows."""
  return [{'round': r, 'ids': np.asarray(i), 'malicious': np.asarray(m, bool),
           'score': np.asarray(s, np.float32),
           'staleness': np.asarray(t)} for r, i, m, s, t in rows]


# A floor on a flag's score over the median (min_flag_score).
FLOOR = 2.0


class ReplayTest(absltest.TestCase):

  def test_replay_reproduces_the_rules_exclusions(self):
    """Rounds of the 'fedhan' rule: 4 of 10 clients arrive, clients 8 and 9
    oppose the benign direction at two strengths (so some of their rounds
    overlap the benign ones), and a benign outlier appears once. The replay
    on the logged suspicion gives, round by round, the rule's exclusions
    (weight 0), for a ban at the first and at the second flag, with S_j
    either every client's latest score or the round's arrivals'."""
    n, d, k = 10, 8, 4
    rng = np.random.default_rng(3)
    direction = rng.normal(size=d)
    plan = []
    for r in range(1, 9):
      ids = np.sort(rng.choice(n, k, replace=False)).astype(np.int32)
      u = direction + 0.3 * rng.normal(size=(k, d))
      bad = ids >= 8
      u[bad] = (-1.0 if r % 2 else -0.2) * direction
      if r == 4:
        u[np.flatnonzero(~bad)[0]] = 4.0 * direction
      plan.append((r, ids, bad, jnp.asarray(u, jnp.float32)))
    totals = {}
    settings = [(s, b, 0.0) for s, b in itertools.product(fd.SCORE_SETS,
                                                          (1, 2))]
    settings += [(s, 1, FLOOR) for s in fd.SCORE_SETS]
    for score_set, ban_after, floor in settings:
      agg = get_aggregator('fedhan', num_clients=n, eps=0.3, min_samples=2,
                           detect_start=2, ban_after=ban_after,
                           score_set=score_set, min_flag_score=floor)
      step = jax.jit(lambda u, st, ids, agg=agg: call_aggregator(
          agg, {'w': u}, jnp.ones(k, bool), st, jax.random.key(0), ids=ids,
          staleness=jnp.zeros(k, jnp.int32), coverage=None))
      state = agg.init({'w': jnp.zeros((d,))})
      rows, want = [], dict.fromkeys(fd.COUNTS, 0)
      excluded = []
      for r, ids, bad, u in plan:
        _, state, info = step(u, state, jnp.asarray(ids))
        excluded.append(np.asarray(info['weights']) == 0)
        counts = detection_counts(info['weights'], jnp.asarray(bad),
                                  jnp.ones(k, bool))
        for key in fd.COUNTS:
          want[key] += int(counts[key])
        rows.append((r, ids, bad, np.asarray(info['suspicion']),
                     np.zeros(k, int)))
      got = fd.replay(_rounds(rows), eps=0.3, min_samples=2,
                      ban_after=ban_after, detect_start=2, num_clients=n,
                      score_set=score_set, min_flag_score=floor)
      self.assertEqual(got, want, (score_set, ban_after, floor))
      totals[score_set, ban_after, floor] = np.stack(excluded)
      # The case is not trivial: both kinds of error and of success occur
      # for one of the settings at least.
      self.assertGreater(want['det_tp'], 0)
      self.assertGreater(want['det_tn'], 0)
    self.assertGreater(want['det_fp'] + want['det_fn'], 0, want)
    # The two readings of S_j exclude different arrivals here.
    for ban_after in (1, 2):
      self.assertFalse(np.array_equal(totals['clients', ban_after, 0.0],
                                      totals['arrivals', ban_after, 0.0]))
    # The floor on a flag's score changes what is excluded, in both.
    for score_set in fd.SCORE_SETS:
      self.assertFalse(np.array_equal(totals[score_set, 1, 0.0],
                                      totals[score_set, 1, FLOOR]))

  def test_bans_carry_and_the_ceiling_flags_separable_rounds(self):
    rows = [
        (1, [0, 1, 2], [0, 0, 0], [0.0, 0.0, 0.0], [0, 0, 0]),   # unscored
        (2, [0, 1, 2, 3, 4], [0, 0, 0, 0, 1],
         [1.0, 1.02, 0.98, 1.01, 3.0], [0, 0, 0, 0, 0]),
        (3, [4, 0, 1], [1, 0, 0], [1.0, 1.0, 1.0], [0, 0, 0]),
        (4, [5, 0, 1, 2], [1, 0, 0, 0], [1.5, 1.0, 1.1, 0.9], [3, 0, 0, 0]),
    ]
    rounds = _rounds(rows)
    kw = dict(eps=0.25, min_samples=2, detect_start=2, num_clients=6,
              score_set='arrivals')
    # Round 2 flags client 4; banned at once, its round-3 arrival counts
    # as excluded. Round 4's attacker is unscored (4 - 1 - 3 < 1).
    self.assertEqual(fd.replay(rounds, ban_after=1, **kw),
                     {'det_tp': 2, 'det_fp': 0, 'det_fn': 1, 'det_tn': 12})
    self.assertEqual(fd.replay(rounds, ban_after=2, **kw),
                     {'det_tp': 1, 'det_fp': 0, 'det_fn': 2, 'det_tn': 12})
    # The ceiling: round 2 separable, round 3 not (tie), round 4 unscored.
    self.assertEqual(fd.separable_ceiling(rounds, 2),
                     {'det_tp': 1, 'det_fp': 0, 'det_fn': 2, 'det_tn': 12})
    self.assertEqual(fd.separable_ceiling(rounds, 3)['det_tp'], 0)
    r = detection_rates({'det_tp': 1, 'det_fp': 0, 'det_fn': 2,
                         'det_tn': 12}, '')
    self.assertAlmostEqual(r['detection_accuracy'], 13 / 15)
    self.assertAlmostEqual(r['detection_fnr'], 2 / 3)


class LoadTest(absltest.TestCase):

  def _run(self, config, rows):
    d = tempfile.mkdtemp()
    with open(os.path.join(d, 'config.json'), 'w') as f:
      json.dump(config, f)
    with open(os.path.join(d, 'rounds.jsonl'), 'w') as f:
      for row in rows:
        f.write(json.dumps(row) + '\n')
    return d

  def test_reads_arrivals_and_refuses_what_it_cannot_replay(self):
    row = {'round': 1, 'det_tp': 0.0, 'det_fp': 1.0, 'det_fn': 0.0,
           'det_tn': 1.0,
           'clients': {'id': [3, 4], 'malicious': [False, True],
                       'suspicion': [0.5, 0.7], 'staleness': [0.0, 1.0]}}
    cfg = {'method': 'fedhan', 'fedhan_unlearn_round': 0}
    _, rounds = fd.load_arrivals(self._run(cfg, [row]))
    np.testing.assert_array_equal(rounds[0]['ids'], [3, 4])
    np.testing.assert_array_equal(rounds[0]['staleness'], [0, 1])
    self.assertEqual(rounds[0]['det_fp'], 1.0)
    with self.assertRaisesRegex(ValueError, 'expected fedhan'):
      fd.load_arrivals(self._run({'method': 'sdfc'}, [row]))
    with self.assertRaisesRegex(ValueError, 'told mode'):
      fd.load_arrivals(self._run(dict(cfg, fedhan_unlearn_round=20), [row]))
    bare = {k: v for k, v in row.items() if k != 'clients'}
    with self.assertRaisesRegex(ValueError, 'log_clients'):
      fd.load_arrivals(self._run(cfg, [bare]))
    with self.assertRaisesRegex(ValueError, 'no config.json'):
      fd.load_arrivals(tempfile.mkdtemp())


if __name__ == '__main__':
  absltest.main()
