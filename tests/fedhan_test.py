"""FedHAN's server pieces: Eq. 3-9 by hand, DBSCAN and 2-means against
NumPy references, detection, and L-BFGS on a quadratic."""

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.aggregators import call_aggregator, clustering, get_aggregator
from fedrobust.aggregators.fldetector import lbfgs_hvp
from fedrobust.methods.fedhan import cache as fc
from fedrobust.methods.fedhan.rule import (SCORE_SETS, recovery_bytes,
                                          safe_step)
from fedrobust.tree import sum_clients

BETA, ALPHA = 0.5, 0.2


def np_dbscan(x, eps, min_samples):
  """Textbook DBSCAN (breadth-first expansion in index order)."""
  x = np.asarray(x, np.float64).reshape(len(x), -1)
  n = len(x)
  dist = np.linalg.norm(x[:, None] - x[None], axis=-1)
  near = dist <= eps
  core = near.sum(1) >= min_samples
  labels = np.full(n, -1)
  cluster = 0
  for i in range(n):
    if not core[i] or labels[i] >= 0:
      continue
    labels[i] = cluster
    queue = [i]
    while queue:
      p = queue.pop(0)
      for q in np.flatnonzero(near[p]):
        if labels[q] < 0:
          labels[q] = cluster
          if core[q]:
            queue.append(q)
    cluster += 1
  return labels


def same_partition(a, b):
  """Equal up to renaming clusters; noise (-1) must match exactly."""
  a, b = np.asarray(a), np.asarray(b)
  if not np.array_equal(a < 0, b < 0):
    return False
  pairs = {(x, y) for x, y in zip(a, b) if x >= 0}
  return (len(pairs) == len({x for x, _ in pairs}) ==
          len({y for _, y in pairs}))


class CacheTest(absltest.TestCase):
  """Three clients, D = 4, two rounds worked by hand (module docstring)."""

  def rounds(self):
    cache = fc.init_cache(3, 4)
    g_a, g_b = jnp.full((4,), 10.0), jnp.full((4,), -10.0)
    # Round 1: client 0 (first half, tau 0), client 1 (all, tau 1); a
    # masked third slot with garbage never writes.
    cache = fc.receive(
        cache, jnp.array([0, 1, 2]), jnp.array([True, True, False]),
        jnp.array([[1., 2, 0, 0], [3, 3, 3, 3], [np.nan] * 4]),
        jnp.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]], bool),
        jnp.array([0, 1, 0]), jnp.stack([g_a, g_b, g_b]),
        round_=jnp.int32(1), beta=BETA)
    r1 = cache
    # Round 2: client 0 (second half, tau 1) and client 2 (coord 0, tau 0).
    cache = fc.receive(
        cache, jnp.array([0, 2]), jnp.array([True, True]),
        jnp.array([[0., 0, 4, 6], [2, 0, 0, 0]]),
        jnp.array([[0, 0, 1, 1], [1, 0, 0, 0]], bool),
        jnp.array([1, 0]), jnp.stack([g_b, g_a]),
        round_=jnp.int32(2), beta=BETA)
    return r1, cache

  def test_imputation_and_weights_eq3_to_6(self):
    r1, r2 = self.rounds()
    np.testing.assert_allclose(r1.gbar, [[1, 2, 0, 0], [3, 3, 3, 3],
                                         [0, 0, 0, 0]])
    np.testing.assert_allclose(fc.weights_at(r1, 1, BETA),
                               [[1, 1, 0, 0], [.5] * 4, [0] * 4])
    self.assertEqual(list(np.asarray(r1.seen)), [True, True, False])
    # Eq. 6, round 1: per coordinate, p' = M (m + alpha m~).
    est1 = fc.aggregate_arrivals(r1, jnp.array([0, 1]),
                                 jnp.array([True, True]), alpha=ALPHA)
    np.testing.assert_allclose(est1, [2.5 / 1.5, 3.5 / 1.5, 3, 3],
                               rtol=1e-6)
    # Round 2 (Eq. 3, 4): client 0 keeps its old first half, weights
    # beta * 1 there and beta^1 on the new half; client 1 only decays.
    np.testing.assert_allclose(r2.gbar, [[1, 2, 4, 6], [3, 3, 3, 3],
                                         [2, 0, 0, 0]])
    np.testing.assert_allclose(fc.weights_at(r2, 2, BETA), [[.5] * 4, [.25] * 4,
                                           [1, 0, 0, 0]])
    # Eq. 9: the global update of the round each model came from.
    np.testing.assert_allclose(r2.gchk, [[10, 10, -10, -10], [-10] * 4,
                                         [10, 0, 0, 0]])
    est2 = fc.aggregate_arrivals(r2, jnp.array([0, 2]),
                                 jnp.array([True, True]), alpha=ALPHA)
    # p'_0 = [.1, .1, .5, .5], p'_2 = [1, 0, 0, 0].
    np.testing.assert_allclose(est2, [2.1 / 1.1, 2, 4, 6], rtol=1e-6)
    self.assertEqual(list(np.asarray(r2.last)), [2, 1, 2])

  def test_history_selection_eq7_8_and_suspicion(self):
    _, r2 = self.rounds()
    ids, mask = jnp.array([0, 2]), jnp.array([True, True])
    est = fc.aggregate_arrivals(r2, ids, mask, alpha=ALPHA)
    e = np.asarray(est)
    cos1 = 3.0 * e.sum() / (6.0 * np.linalg.norm(e))   # [3]*4 vs e
    gt, selected, sim = fc.select_history(
        r2, ids, mask, est, round_=jnp.int32(2), sim_min=0.5, tau_max=1,
        alpha=ALPHA, beta=BETA)
    self.assertAlmostEqual(float(sim[1]), cos1, places=5)
    self.assertEqual(list(np.asarray(selected)), [False, True, False])
    np.testing.assert_allclose(gt, [3, 3, 3, 3], rtol=1e-6)
    # Too stale, or below sim_min: nobody is selected and gtilde is 0.
    for kwargs in (dict(round_=jnp.int32(3), sim_min=0.5, tau_max=1),
                   dict(round_=jnp.int32(2), sim_min=0.999, tau_max=1)):
      gt, selected, _ = fc.select_history(r2, ids, mask, est, alpha=ALPHA,
                                          beta=BETA, **kwargs)
      self.assertFalse(np.any(np.asarray(selected)))
      np.testing.assert_array_equal(gt, np.zeros(4))
    s = fc.suspicion(r2, jnp.array([0, 2, 1]), jnp.array([True, True,
                                                          False]))
    np.testing.assert_allclose(
        s, [np.linalg.norm([9, 8, -14, -16]), 8.0, 0.0], rtol=1e-6)

  def test_jitted_round_matches_eager(self):
    r1, _ = self.rounds()
    args = (jnp.array([0, 2]), jnp.array([True, True]),
            jnp.array([[0., 0, 4, 6], [2, 0, 0, 0]]),
            jnp.array([[0, 0, 1, 1], [1, 0, 0, 0]], bool),
            jnp.array([1, 0]), jnp.ones((2, 4)))
    step = lambda c, *a: fc.receive(c, *a, round_=jnp.int32(2), beta=BETA)
    chex.assert_trees_all_close(jax.jit(step)(r1, *args), step(r1, *args))


class ClusteringTest(absltest.TestCase):

  def test_compacted_passes_read_only_the_kept_rows(self):
    """row_dots / weighted_cache over kept rows only equal the dense sums,
    for kept rows scattered over a cache that is not a multiple of the
    block, and whatever the skipped rows hold."""
    rng = np.random.default_rng(5)
    n, d = 37, 5
    x = rng.normal(size=(n, d)).astype(np.float32)
    v = rng.normal(size=d).astype(np.float32)
    keep = np.zeros(n, bool)
    keep[[0, 6, 17, 35, 36]] = True
    x_bad = np.where(keep[:, None], x, np.nan).astype(np.float32)
    dots = fc.row_dots(jnp.asarray(x_bad), jnp.asarray(v), jnp.asarray(keep),
                       block=4)
    np.testing.assert_allclose(dots, np.where(keep, x @ v, 0.0), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(fc.row_dots(jnp.asarray(x), jnp.asarray(v),
                                           block=8), x @ v, rtol=1e-5,
                               atol=1e-6)
    cache = fc.init_cache(n, d)
    ids = jnp.arange(n, dtype=jnp.int32)
    cov = rng.random((n, d)) > 0.3
    cache = fc.receive(cache, ids, jnp.ones(n, bool), jnp.asarray(x),
                       jnp.asarray(cov), jnp.zeros(n, jnp.int32),
                       jnp.zeros((n, d)), round_=jnp.int32(1), beta=BETA)
    got = fc.weighted_cache(cache, jnp.asarray(keep), round_=jnp.int32(3),
                            beta=BETA, alpha=ALPHA, block=4)
    # Dense reference: Eq. 5-6 (`weighted`) over the whole cache.
    want = fc.weighted(cache.gbar, fc.weights_at(cache, jnp.int32(3), BETA),
                       cache.mask, jnp.asarray(keep), ALPHA)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # By hand: a fresh cache weighs only covered coordinates (beta^2 each).
    p = np.where(cov, BETA ** 2, 0.0) * keep[:, None]
    np.testing.assert_allclose(got, (p * x).sum(0) / p.sum(0), rtol=1e-5,
                               atol=1e-6)

  def test_blocked_slot_passes_match_the_one_shot_ones(self):
    """receive_uploads / slot_norms / aggregate_slots, a block of slots at a
    time, equal receive / suspicion / aggregate_arrivals over all slots at
    once: blocks that split the slots unevenly are not allowed (12 slots
    with block 8 walk 2 blocks of 6, with block 5 4 blocks of 3), a slot
    with a NaN upload is not received, masked slots change nothing."""
    rng = np.random.default_rng(11)
    n, k, h = 20, 12, 4
    shapes = {'a': (3, 5), 'b': (4,)}
    d = 19
    ups = {key: rng.normal(size=(k,) + s).astype(np.float32)
           for key, s in shapes.items()}
    ups['a'][4, 1, 2] = np.nan
    cov = {key: (rng.random((k,) + s) < 0.6).astype(np.float32)
           for key, s in shapes.items()}
    ids = jnp.asarray(rng.choice(n, k, replace=False), jnp.int32)
    mask = jnp.asarray(np.arange(k) != 9)
    ups['b'][9] = np.inf   # a masked slot's garbage
    tau = jnp.asarray(rng.integers(0, 6, k), jnp.int32)
    history = jnp.asarray(rng.normal(size=(h, d)), jnp.float32)
    round_ = jnp.int32(5)
    # A cache that already holds some rows.
    start = fc.receive(fc.init_cache(n, d), jnp.arange(n), jnp.ones(n, bool),
                       jnp.asarray(rng.normal(size=(n, d)), jnp.float32),
                       jnp.asarray(rng.random((n, d)) < 0.5),
                       jnp.zeros(n, jnp.int32), jnp.zeros((n, d)),
                       round_=jnp.int32(2), beta=BETA)
    # One shot, as the rule did before session 27.
    flat = np.concatenate([ups[key].reshape(k, -1) for key in sorted(ups)], 1)
    own = np.concatenate([cov[key].reshape(k, -1) for key in sorted(cov)],
                         1) > 0
    finite = np.asarray(mask) & np.isfinite(flat).all(1)
    clean = np.where(finite[:, None] & own, flat, 0.0)
    src = np.maximum(5 - 1 - np.asarray(tau), 5 - h)
    then = np.where((5 - 1 - np.asarray(tau) >= 1)[:, None],
                    np.asarray(history)[src % h], clean)
    want = fc.receive(start, ids, jnp.asarray(finite), jnp.asarray(clean),
                      jnp.asarray(own), tau, jnp.asarray(then, jnp.float32),
                      round_=round_, beta=BETA)
    keep = jnp.asarray(finite & (np.arange(k) % 4 != 1))
    for block in (8, 5):
      got, got_finite, share = fc.receive_uploads(
          start, history, ups, cov, ids, mask, tau, round_=round_,
          beta=BETA, block=block)
      chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
      np.testing.assert_array_equal(got_finite, finite)
      np.testing.assert_allclose(share, own.mean(1), rtol=1e-6)
      s, g = fc.slot_norms(got, ids, jnp.asarray(finite), block=block)
      np.testing.assert_allclose(s, fc.suspicion(want, ids, finite),
                                 rtol=1e-6, atol=1e-7)
      np.testing.assert_allclose(g, fc.global_norms(want, ids, finite),
                                 rtol=1e-6, atol=1e-7)
      np.testing.assert_allclose(
          fc.aggregate_slots(got, ids, keep, alpha=ALPHA, block=block),
          fc.aggregate_arrivals(want, ids, keep, alpha=ALPHA), rtol=1e-5,
          atol=1e-6)
    self.assertEqual(fc.slot_block(12), 6)
    self.assertEqual(fc.slot_block(13), 1)
    self.assertEqual(fc.slot_block(100), 5)

  def test_sum_clients_is_the_leading_axis_sum(self):
    """tree.sum_clients (a dot) equals jnp.sum(axis=0), weighted or not,
    for float, bool and higher-rank leaves."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(7, 3, 5)).astype(np.float32)
    w = rng.random(7).astype(np.float32)
    np.testing.assert_allclose(sum_clients(jnp.asarray(x)), x.sum(0),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sum_clients(jnp.asarray(x), jnp.asarray(w)),
                               np.tensordot(w, x, 1), rtol=1e-6, atol=1e-6)
    b = x > 0
    np.testing.assert_array_equal(sum_clients(jnp.asarray(b)), b.sum(0))

  def test_dbscan_matches_numpy_on_fixed_points(self):
    rng = np.random.default_rng(0)
    sets = [
        np.array([0.0, 0.1, 0.2, 0.25, 3.0, 3.1, 3.15, 9.0]),   # 2 + noise
        np.array([1.0, 1.05, 1.1, 1.2, 1.3]),                   # one cluster
        np.concatenate([rng.normal(0, .1, 7), rng.normal(5, .1, 3)]),
        rng.normal(size=(12, 2)) * np.array([[1.0, 0.2]]),      # 2-D
    ]
    for x in sets:
      for eps, k in ((0.3, 2), (0.5, 3), (1.0, 4)):
        got = clustering.dbscan(jnp.asarray(x), jnp.ones(len(x), bool),
                                eps=eps, min_samples=k)
        want = np_dbscan(x, eps, k)
        self.assertTrue(same_partition(got, want), (x, eps, k, got, want))

  def test_masked_slots_change_nothing(self):
    x = np.array([0.0, 0.1, 0.2, 3.0, 3.1, 9.0])
    got = clustering.dbscan(jnp.asarray(x), jnp.ones(6, bool), eps=0.3,
                            min_samples=2)
    # Garbage slots inserted and masked: same labels on the real ones
    # (labels are slot indices, so compare partitions).
    xp = np.insert(x, [1, 4], [0.05, 3.05])
    mp = np.insert(np.ones(6, bool), [1, 4], False)
    padded = clustering.dbscan(jnp.asarray(xp), jnp.asarray(mp), eps=0.3,
                               min_samples=2)
    self.assertTrue(same_partition(np.asarray(padded)[mp], got))
    self.assertTrue(np.all(np.asarray(padded)[~mp] == -1))
    self.assertEqual(int(clustering.cluster_count(got)), 2)

  def test_kmeans_matches_numpy_lloyd(self):
    x = np.array([0.1, 0.3, 0.2, 2.0, 2.4, 0.15, 5.0])
    high, w2 = clustering.kmeans2_1d(jnp.asarray(x), jnp.ones(7, bool), 10)
    lo, hi = x.min(), x.max()
    for _ in range(10):
      up = np.abs(x - hi) < np.abs(x - lo)
      lo, hi = x[~up].mean(), x[up].mean()
    up = np.abs(x - hi) < np.abs(x - lo)
    np.testing.assert_array_equal(high, up)
    centre = np.where(up, hi, lo)
    self.assertAlmostEqual(float(w2), float(np.sum((x - centre) ** 2)),
                           places=5)

  def test_detect_flags_the_high_group_only_when_split(self):
    scores = jnp.array([1.0, 1.1, 0.9, 1.05, 6.0, 6.2, 0.0])
    mask = jnp.array([True] * 6 + [False])
    flagged, detected = fc.detect(scores, mask, eps=0.5, min_samples=2)
    self.assertTrue(bool(detected))
    np.testing.assert_array_equal(flagged, [0, 0, 0, 0, 1, 1, 0])
    flagged, detected = fc.detect(jnp.array([1.0, 1.1, 0.9, 1.05]),
                                  jnp.ones(4, bool), eps=0.5, min_samples=2)
    self.assertFalse(bool(detected))
    self.assertFalse(np.any(np.asarray(flagged)))

  def test_min_flag_score_flags_only_high_members_above_it(self):
    """Session 42's example round (scores over the median): attackers 1.48
    and 1.60 above benign 0.78-1.05 and one benign 1.31. 2-means puts 1.31
    in the high cluster; a floor of 1.35 x median leaves it out, and a
    floor above every score flags nobody although DBSCAN splits."""
    x = jnp.array([0.78, 0.85, 0.9, 0.95, 1.0, 1.05, 1.31, 1.48, 1.60, 9.0])
    mask = jnp.array([True] * 9 + [False])
    self.assertEqual(float(np.median(np.asarray(x)[:9])), 1.0)
    scores = 3.0 * x               # the floor is relative to the median
    plain, detected = fc.detect(scores, mask, eps=0.1, min_samples=2)
    self.assertTrue(bool(detected))
    np.testing.assert_array_equal(plain, [0] * 6 + [1, 1, 1, 0])
    floor = 1.35
    gated, detected = fc.detect(scores, mask, eps=0.1, min_samples=2,
                                min_flag_score=floor)
    self.assertTrue(bool(detected))
    np.testing.assert_array_equal(gated, [0] * 7 + [1, 1, 0])
    none, detected = fc.detect(scores, mask, eps=0.1, min_samples=2,
                               min_flag_score=2.0)
    self.assertFalse(bool(detected))
    self.assertFalse(np.any(np.asarray(none)))
    # detect_latest applies the same floor to S_j.
    ids = jnp.array([6, 7], jnp.int32)
    both, _ = fc.detect_latest(scores, mask, ids, jnp.ones(2, bool),
                               eps=0.1, min_samples=2)
    np.testing.assert_array_equal(both, [1, 1])
    one, _ = fc.detect_latest(scores, mask, ids, jnp.ones(2, bool),
                              eps=0.1, min_samples=2, min_flag_score=floor)
    np.testing.assert_array_equal(one, [0, 1])

  def test_detect_latest_clusters_every_clients_score(self):
    """S_j of every client's latest score (Sec. 3.5.3): benign scores
    1.0-1.3 chain into one cluster, the attackers 7 (arriving) and 8 (not)
    form the high one, the banned client 9 is out. Only arriving members
    of the high cluster are flagged. The round's two benign arrivals
    alone (1.0 and 1.3) are two noise points, and 2-means cuts one."""
    latest = jnp.array([1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 2.0, 2.05,
                        5.0, -1.0])
    member = jnp.array([True] * 9 + [False, False])
    ids = jnp.array([0, 6, 7, 3, 11], jnp.int32)      # 11: no client
    scored = jnp.array([True, True, True, False, True])
    flagged, detected = fc.detect_latest(latest, member, ids, scored,
                                         eps=0.25, min_samples=2)
    np.testing.assert_array_equal(flagged, [0, 0, 1, 0, 0])
    self.assertTrue(bool(detected))
    # Without an arriving attacker nothing is flagged, although S_j splits.
    flagged, detected = fc.detect_latest(latest, member, ids[:2],
                                         scored[:2], eps=0.25, min_samples=2)
    np.testing.assert_array_equal(flagged, [0, 0])
    self.assertFalse(bool(detected))
    alone, _ = fc.detect(latest[jnp.array([0, 6])], jnp.ones(2, bool),
                         eps=0.25, min_samples=2)
    np.testing.assert_array_equal(alone, [0, 1])


class RuleTest(absltest.TestCase):
  """The 'fedhan' aggregator over rounds of arrivals."""

  def test_flags_and_bans_the_opposing_clients(self):
    n, d = 10, 6
    agg = get_aggregator('fedhan', num_clients=n)
    params = {'w': jnp.zeros((d,))}
    step = jax.jit(lambda u, m, st, ids, tau, cov: call_aggregator(
        agg, {'w': u}, m, st, jax.random.key(0), ids=ids, staleness=tau,
        coverage={'w': cov}))
    state = agg.init(params)
    rng = np.random.default_rng(0)
    direction = rng.normal(size=d)
    bad = {7, 8}
    banned_at = {}
    for round_ in range(6):
      ids = np.sort(rng.choice(n, 6, replace=False)).astype(np.int32)
      if round_ == 2:
        ids = np.array([0, 1, 2, 3, 7, 8], np.int32)
      u = direction + 0.05 * rng.normal(size=(6, d))
      is_bad = np.isin(ids, list(bad))
      u[is_bad] = -5.0 * direction
      cov = np.ones((6, d), np.float32)
      cov[::2, d // 2:] = 0.0                      # half-width clients
      u = u * cov
      mask = np.ones(6, bool)
      mask[5] = round_ != 4                        # a masked slot once
      _, state, info = step(jnp.asarray(u, jnp.float32), jnp.asarray(mask),
                            state, jnp.asarray(ids),
                            jnp.zeros(6, jnp.int32), jnp.asarray(cov))
      for i in np.flatnonzero(np.asarray(state.banned)):
        banned_at.setdefault(int(i), round_)
      w = np.asarray(info['weights'])
      if round_ == 0:      # no global update yet: nobody is scored
        self.assertTrue(np.all(w[mask] > 0.0))
      else:
        self.assertTrue(np.all(w[is_bad & mask] == 0.0), round_)
        self.assertTrue(np.all(w[~is_bad & mask] > 0.0), round_)
    self.assertEqual(set(banned_at), bad)
    self.assertTrue(np.all(np.isfinite(np.asarray(state.cache.gbar))))

  @staticmethod
  def _opposed_rounds(seed, outlier_round, outlier_scale, n=8, d=6,
                      rounds=4):
    """Rounds of n uploads near one direction, clients 6 and 7 opposing
    it (-5x), and benign client 0 at outlier_scale x in outlier_round."""
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=d)
    out = []
    for round_ in range(rounds):
      u = direction + 0.05 * rng.normal(size=(n, d))
      u[6:] = -5.0 * direction
      if round_ == outlier_round:
        u[0] = outlier_scale * direction
      out.append(jnp.asarray(u, jnp.float32))
    return out

  @staticmethod
  def _run_all_arriving(updates, **kwargs):
    """The final state and per-round info of the rule with every client
    arriving fresh each round."""
    n, d = updates[0].shape
    agg = get_aggregator('fedhan', num_clients=n, **kwargs)
    step = jax.jit(lambda u, st: call_aggregator(
        agg, {'w': u}, jnp.ones(n, bool), st, jax.random.key(0),
        ids=jnp.arange(n, dtype=jnp.int32),
        staleness=jnp.zeros(n, jnp.int32), coverage=None))
    state = agg.init({'w': jnp.zeros((d,))})
    infos = []
    for u in updates:
      _, state, info = step(u, state)
      infos.append(jax.tree.map(np.asarray, info))
    return state, infos

  def test_banned_uploads_are_scored_but_never_aggregated(self):
    """With the arrivals' scores as S_j, once banned the attackers'
    uploads still enter the clustering, so a round whose only outlier is
    benign is not cut there, and no second recovery starts."""
    state, infos = self._run_all_arriving(
        self._opposed_rounds(1, outlier_round=3, outlier_scale=2.5),
        rollback=2, score_set='arrivals')
    np.testing.assert_array_equal(np.flatnonzero(state.banned), [6, 7])
    self.assertEqual(float(infos[1]['recovered']), 1.0)
    last = infos[3]
    self.assertTrue(np.all(last['weights'][:6] > 0), last['weights'])
    np.testing.assert_array_equal(last['weights'][6:], [0.0, 0.0])
    self.assertEqual(float(last['recovered']), 0.0)
    self.assertGreater(last['suspicion'][6], last['suspicion'][0])
    np.testing.assert_array_equal(np.asarray(state.cache.last)[6:], [4, 4])

  def test_ban_after_k_flags_spares_a_one_off_outlier(self):
    """With ban_after=2 a benign client flagged in one round misses that
    round only; the attackers, flagged every round, are banned at their
    second flag, and that round starts the recovery."""
    rounds = self._opposed_rounds(2, outlier_round=1, outlier_scale=6.0)
    state, infos = self._run_all_arriving(rounds, rollback=2, ban_after=2,
                                          score_set='arrivals')
    self.assertTrue(infos[1]['flagged'][0], infos[1]['suspicion'])
    self.assertEqual(infos[1]['weights'][0], 0.0)
    np.testing.assert_array_equal(infos[1]['weights'][6:], [0.0, 0.0])
    self.assertEqual(float(infos[1]['recovered']), 0.0)   # first flags
    self.assertEqual(float(infos[2]['recovered']), 1.0)   # second flags
    self.assertGreater(infos[3]['weights'][0], 0.0)      # back in
    np.testing.assert_array_equal(np.flatnonzero(state.banned), [6, 7])
    np.testing.assert_array_equal(np.asarray(state.strikes)[[0, 6, 7]],
                                  [1, 3, 3])   # still scored once banned
    state1, infos1 = self._run_all_arriving(rounds, rollback=2,
                                            ban_after=1,
                                            score_set='arrivals')
    self.assertEqual(float(infos1[1]['recovered']), 1.0)
    self.assertIn(0, np.flatnonzero(state1.banned))
    self.assertEqual(infos1[3]['weights'][0], 0.0)

  def test_min_flag_score_reaches_the_rule_in_both_score_sets(self):
    """The opposing clients score far above the benign ones: a floor under
    their relative score keeps their flags, one above it flags nobody."""
    rounds = self._opposed_rounds(3, outlier_round=-1, outlier_scale=1.0)
    for score_set in SCORE_SETS:
      _, base = self._run_all_arriving(rounds, score_set=score_set)
      _, low = self._run_all_arriving(rounds, score_set=score_set,
                                      min_flag_score=2.0)
      _, high = self._run_all_arriving(rounds, score_set=score_set,
                                       min_flag_score=1e9)
      np.testing.assert_array_equal(base[1]['flagged'], [0] * 6 + [1, 1])
      np.testing.assert_array_equal(low[1]['flagged'], base[1]['flagged'])
      for r in range(1, len(rounds)):
        # Later the floor can only spare (a benign arrival, once 6 and 7
        # are out of the clustering), never add.
        self.assertFalse(np.any(low[r]['flagged'] & ~base[r]['flagged']))
        self.assertFalse(np.any(high[r]['flagged']), (score_set, r))
        self.assertTrue(np.all(high[r]['weights'] > 0), (score_set, r))

  def test_clients_score_set_keeps_each_clients_latest_score(self):
    """The state's score is each client's suspicion at its last scored
    arrival (its cache rows change only then), -1 before; banned clients
    leave S_j, so once the attackers are banned a benign outlier is cut
    (where the arrivals' S_j keeps the banned in, see above), and the
    banned, though still scored, take no more strikes."""
    n, d = 8, 6
    agg = get_aggregator('fedhan', num_clients=n, detect=False,
                         score_set='clients')
    step = jax.jit(lambda u, m, st, ids: call_aggregator(
        agg, {'w': u}, m, st, jax.random.key(0), ids=ids,
        staleness=jnp.zeros(ids.shape[0], jnp.int32), coverage=None))
    state = agg.init({'w': jnp.zeros((d,))})
    np.testing.assert_array_equal(state.score, -np.ones(n))
    rng = np.random.default_rng(4)
    arrived_scored = np.zeros(n, bool)
    for round_ in range(1, 5):
      ids = np.sort(rng.choice(n, 4, replace=False)).astype(np.int32)
      mask = np.array([True, True, True, round_ != 3])
      u = rng.normal(size=(4, d)).astype(np.float32)
      u[~mask] = np.nan                          # a masked garbage slot
      _, state, _ = step(jnp.asarray(u), jnp.asarray(mask), state,
                         jnp.asarray(ids))
      if round_ >= 2:                            # a global update exists
        arrived_scored[ids[mask]] = True
    every = jnp.arange(n, dtype=jnp.int32)
    expect = np.where(arrived_scored, np.asarray(fc.suspicion(
        state.cache, every, jnp.ones(n, bool))), -1.0)
    np.testing.assert_allclose(state.score, expect, rtol=1e-6)
    self.assertTrue(arrived_scored.any() and not arrived_scored.all())

    state, infos = self._run_all_arriving(
        self._opposed_rounds(1, outlier_round=3, outlier_scale=2.5),
        rollback=2, score_set='clients')
    np.testing.assert_array_equal(infos[1]['flagged'], [0] * 6 + [1, 1])
    np.testing.assert_array_equal(np.asarray(state.strikes)[6:], [1, 1])
    for info in infos[2:]:
      np.testing.assert_array_equal(info['weights'][6:], [0.0, 0.0])
      self.assertFalse(np.any(info['flagged'][6:]))
    self.assertTrue(infos[3]['flagged'][0], infos[3]['suspicion'])
    self.assertTrue(np.all(np.asarray(state.score)[6:] >
                           np.asarray(state.score)[1:6].max()))

  def test_history_info_measures_the_eq8_term(self):
    """'history_share' and 'history_cos' against the difference the term
    makes to the returned update (the same rule with sim_min = 1 selects
    nothing), 'history_sim' against the cosines of the cached rows, and
    'history_age' against the rounds since they arrived."""
    n, d = 6, 5
    rng = np.random.default_rng(3)
    first = rng.normal(size=(n, d)).astype(np.float32) + 1.0
    second = rng.normal(size=(n, d)).astype(np.float32) + 1.0
    mask2 = np.array([True, True, True, False, False, False])

    def run(sim_min):
      agg = get_aggregator('fedhan', num_clients=n, detect=False,
                           sim_min=sim_min, tau_max=5)
      step = lambda u, m, st: call_aggregator(
          agg, {'w': jnp.asarray(u)}, jnp.asarray(m), st, jax.random.key(0),
          ids=jnp.arange(n, dtype=jnp.int32),
          staleness=jnp.zeros(n, jnp.int32), coverage=None)
      state = agg.init({'w': jnp.zeros((d,))})
      _, state, _ = step(first, np.ones(n, bool), state)
      _, state, _ = step(second, np.ones(n, bool), state)   # round 2
      out, _, info = step(second, mask2, state)             # round 3
      return np.asarray(out['w']), jax.tree.map(np.asarray, info)

    plain, info0 = run(1.0)
    mixed, info = run(-1.0)
    self.assertEqual(float(info0['history_selected']), 0.0)
    for key in ('history_share', 'history_cos', 'history_sim',
                'history_age'):
      self.assertEqual(float(info0[key]), 0.0, key)
    self.assertEqual(float(info['history_selected']), 3.0)
    extra = mixed - plain                     # alpha g~
    self.assertGreater(np.linalg.norm(extra), 0.0)
    self.assertAlmostEqual(float(info['history_share']),
                           np.linalg.norm(extra) / np.linalg.norm(plain),
                           places=5)
    self.assertAlmostEqual(
        float(info['history_cos']), float(extra @ plain) / (
            np.linalg.norm(extra) * np.linalg.norm(plain)), places=5)
    rows = second[3:]                         # cached in round 2
    sims = rows @ plain / (np.linalg.norm(rows, axis=1)
                           * np.linalg.norm(plain))
    self.assertAlmostEqual(float(info['history_sim']), float(sims.mean()),
                           places=5)
    self.assertEqual(float(info['history_age']), 1.0)

  def test_masked_and_banned_slots_change_nothing(self):
    agg = get_aggregator('fedhan', num_clients=4, detect=False)
    params = {'w': jnp.zeros((3,))}
    run = lambda u, m, ids: call_aggregator(
        agg, {'w': jnp.asarray(u, jnp.float32)}, jnp.asarray(m),
        agg.init(params), jax.random.key(0), ids=jnp.asarray(ids),
        staleness=jnp.zeros(len(ids), jnp.int32), coverage=None)
    out, st, _ = run([[1., 2, 3], [3, 2, 1]], [True, True], [0, 1])
    out2, st2, _ = run([[1., 2, 3], [np.nan] * 3, [3, 2, 1]],
                       [True, False, True], [0, 3, 1])
    np.testing.assert_allclose(out['w'], out2['w'])
    chex.assert_trees_all_close(st, st2)


class RecoveryTest(absltest.TestCase):
  """Sec. 3.5.4: rollback and replay without the detected clients."""

  def run_rounds(self, rollback, dtype='float32', **kwargs):
    """Four benign clients send d, two attackers -5 d, every round, full
    width, no staleness. Detection may flag from round 4 only, so rounds
    1-3 take the attackers in. Updates do not depend on the model, so the
    applied updates are constant after the attack is removed and no
    L-BFGS pair has curvature: the replay is exactly the benign trajectory.
    Returns the sum of the returned updates (the model's displacement),
    the per-round infos and the final state."""
    n, dim = 6, 4
    kwargs = dict(dict(detect_start=4, history=8), **kwargs)
    agg = get_aggregator('fedhan', num_clients=n, rollback=rollback,
                         recovery_slots=8, cache_dtype=dtype, **kwargs)
    d = np.array([1.0, -2.0, 0.5, 1.5], np.float32)
    u = np.stack([d] * 4 + [-5.0 * d] * 2)
    ids = jnp.arange(n, dtype=jnp.int32)
    step = jax.jit(lambda st: call_aggregator(
        agg, {'w': jnp.asarray(u)}, jnp.ones(n, bool), st,
        jax.random.key(0), ids=ids, staleness=jnp.zeros(n, jnp.int32),
        coverage=None))
    state = agg.init({'w': jnp.zeros((dim,))})
    moved, infos = np.zeros(dim), []
    for _ in range(5):
      out, state, info = step(state)
      moved += np.asarray(out['w'])
      infos.append(jax.tree.map(np.asarray, info))
    return moved, infos, state, d

  def test_replay_removes_the_attackers_from_the_rolled_back_rounds(self):
    moved, infos, state, d = self.run_rounds(rollback=3)
    self.assertEqual([float(i['recovered']) for i in infos],
                     [0, 0, 0, 1, 0])
    self.assertEqual(float(infos[3]['replayed']), 3.0)
    np.testing.assert_array_equal(np.asarray(state.banned),
                                  [False] * 4 + [True] * 2)
    # Rounds 1-3 mixed: (4 d - 10 d) / 6 = -d each. The replay rewrites
    # them to d, so after 5 rounds the model moved 5 d.
    np.testing.assert_allclose(moved, 5 * d, rtol=1e-5)
    self.assertAlmostEqual(float(infos[3]['recovery_shift']),
                           float(np.linalg.norm(6 * d)), places=4)
    # Without recovery the three poisoned rounds stay: -3 d + 2 d.
    moved0, infos0, _, _ = self.run_rounds(rollback=0)
    np.testing.assert_allclose(moved0, -d, rtol=1e-5)
    self.assertEqual(sum(float(i['recovered']) for i in infos0), 0.0)

  def test_told_mode_replays_from_the_start_without_the_told_clients(self):
    """Told in round 4 (detection off), a rollback of 3 replays rounds
    1-3 from the initial model: as with detection, the model moves 5 d;
    told without a rollback the attackers are only banned from round 4.
    The default history grows with the rollback."""
    forget = np.arange(6) >= 4
    told = dict(detect=False, unlearn_round=4, forget=forget, history=None)
    moved, infos, state, d = self.run_rounds(rollback=3, **told)
    self.assertEqual([float(i['recovered']) for i in infos],
                     [0, 0, 0, 1, 0])
    self.assertEqual(float(infos[3]['replayed']), 3.0)
    np.testing.assert_allclose([i['weights'][5] for i in infos],
                               [1 / 6] * 3 + [0.0] * 2, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(state.banned), forget)
    np.testing.assert_allclose(moved, 5 * d, rtol=1e-5)
    moved, infos, state, _ = self.run_rounds(rollback=0, **told)
    self.assertEqual(sum(float(i['recovered']) for i in infos), 0.0)
    np.testing.assert_allclose(moved, -3 * d + 2 * d, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(state.banned), forget)
    # Told nobody new (the detector banned them first): no second recovery.
    moved, infos, _, _ = self.run_rounds(
        rollback=3, unlearn_round=5, forget=forget)
    self.assertEqual([float(i['recovered']) for i in infos],
                     [0, 0, 0, 1, 0])
    np.testing.assert_allclose(moved, 5 * d, rtol=1e-5)
    agg = get_aggregator('fedhan', num_clients=6, rollback=30,
                         unlearn_round=31, forget=forget)
    self.assertEqual(agg.init({'w': jnp.zeros((2,))}).history.shape,
                     (32, 2))

  def test_replay_drops_a_historical_term_that_took_a_banned_row(self):
    """Client 5 uploads 3 d in round 1 only; in rounds 2-3 its cached row
    (cosine 1 with the arrivals' d) is Eq. 7's only candidate, so those
    rounds apply d + alpha 3 d. Told in round 4, the replay of rounds 1-3
    takes neither its upload nor the two historical terms that took its
    row: the model moves d a round. No L-BFGS pair has curvature (the
    applied updates grow, then stay), so the replay is exact."""
    n, dim = 6, 4
    d = np.array([1.0, -2.0, 0.5, 1.5], np.float32)
    u = jnp.asarray(np.stack([d] * 5 + [3.0 * d]))
    ids = jnp.arange(n, dtype=jnp.int32)
    agg = get_aggregator('fedhan', num_clients=n, detect=False, rollback=3,
                         recovery_slots=8, unlearn_round=4,
                         forget=np.arange(n) == 5)
    step = jax.jit(lambda mask, st: call_aggregator(
        agg, {'w': u}, mask, st, jax.random.key(0), ids=ids,
        staleness=jnp.zeros(n, jnp.int32), coverage=None))
    state = agg.init({'w': jnp.zeros((dim,))})
    moved, infos = np.zeros(dim), []
    for round_ in range(1, 5):
      out, state, info = step(jnp.asarray(np.arange(n) < (6 if round_ == 1
                                                          else 5)), state)
      moved += np.asarray(out['w'])
      infos.append(jax.tree.map(np.asarray, info))
    self.assertEqual([float(i['history_selected']) for i in infos],
                     [0, 1, 1, 0])
    self.assertEqual(float(infos[3]['replayed']), 3.0)
    self.assertEqual(float(infos[3]['recovery_history_dropped']), 2.0)
    np.testing.assert_allclose(moved, 4 * d, rtol=1e-5)

  def test_a_later_recovery_stops_at_the_earlier_one(self):
    """Client 6 sends d until round 4 and -5 d from round 5: flagged in
    round 5, right after the recovery of round 4. Rounds 2-4 were replayed
    already, so the second recovery replays nothing; the model still moves
    d per round from then on."""
    n, dim = 7, 4
    agg = get_aggregator('fedhan', num_clients=n, detect_start=4,
                         rollback=3, recovery_slots=8, history=8)
    d = np.array([1.0, -2.0, 0.5, 1.5], np.float32)
    ids = jnp.arange(n, dtype=jnp.int32)
    step = jax.jit(lambda u, st: call_aggregator(
        agg, {'w': u}, jnp.ones(n, bool), st, jax.random.key(0), ids=ids,
        staleness=jnp.zeros(n, jnp.int32), coverage=None))
    state = agg.init({'w': jnp.zeros((dim,))})
    moved, replayed = np.zeros(dim), []
    for round_ in range(1, 7):
      late = d if round_ < 5 else -5.0 * d
      u = jnp.asarray(np.stack([d] * 4 + [-5.0 * d] * 2 + [late]))
      out, state, info = step(u, state)
      moved += np.asarray(out['w'])
      replayed.append(float(info['replayed']))
    self.assertEqual(replayed, [0, 0, 0, 3, 0, 0])
    np.testing.assert_array_equal(np.asarray(state.banned),
                                  [False] * 4 + [True] * 3)
    np.testing.assert_allclose(moved, 6 * d, rtol=1e-5)

  def test_rollback_reaches_only_the_stored_rounds(self):
    # m = 2 replays rounds 2-3; round 1's poisoned -d stays.
    moved, infos, _, d = self.run_rounds(rollback=2)
    self.assertEqual(float(infos[3]['replayed']), 2.0)
    np.testing.assert_allclose(moved, 3 * d, rtol=1e-5)

  def test_bfloat16_cache_matches_float32(self):
    moved, _, state, d = self.run_rounds(rollback=3, dtype='bfloat16')
    # Stored as bfloat16 bit patterns (an in-place integer scatter on CPU).
    self.assertEqual(state.cache.gbar.dtype, jnp.uint16)
    self.assertEqual(state.cache.gbar.nbytes, 6 * 4 * 2)
    np.testing.assert_allclose(fc.decode(state.cache.gbar)[0], d, rtol=1e-2)
    np.testing.assert_allclose(moved, 5 * d, rtol=2e-2)

  def quadratic_run(self, **kwargs):
    """Four benign clients take a gradient step lr (c_i - w) toward their
    own optimum c_i; two attackers send a fixed 3-vector. Detection may
    flag from round 4, so rounds 1-3 take the attackers in. The fake
    `retrain` hook computes a benign client's step from the model it is
    given (an attacker's is never asked for: banned). Returns the final
    model, the infos and the hook's calls."""
    n, dim, lr = 6, 4, 0.3
    rng = np.random.default_rng(7)
    c = (np.array([1.0, -2.0, 0.5, 1.5]) +
         0.05 * rng.normal(size=(4, dim))).astype(np.float32)
    bad = np.full((2, dim), 3.0, np.float32)
    calls = []

    def retrain(values, ids, mask, salt):
      calls.append(salt)
      w = values['w']
      cc = jnp.asarray(np.concatenate([c, bad]))[ids]
      steps = lr * (cc - w[None])
      return {'w': steps}, None

    agg = get_aggregator('fedhan', num_clients=n, detect_start=4,
                         rollback=3, recovery_slots=8, history=8, **kwargs)
    ids = jnp.arange(n, dtype=jnp.int32)
    step = jax.jit(lambda w, st: call_aggregator(
        agg, {'w': jnp.concatenate([lr * (jnp.asarray(c) - w[None]),
                                    jnp.asarray(bad)])},
        jnp.ones(n, bool), st, jax.random.key(0), ids=ids,
        staleness=jnp.zeros(n, jnp.int32), coverage=None,
        params={'w': w}, retrain=retrain))
    state = agg.init({'w': jnp.zeros((dim,))})
    w, infos = jnp.zeros((dim,)), []
    for _ in range(4):
      out, state, info = step(w, state)
      w = w + out['w']
      infos.append(jax.tree.map(np.asarray, info))
    # The benign clients alone for 4 rounds (full width, no staleness, no
    # historical candidates: Eq. 5-6 is their plain mean).
    ref = np.zeros(dim, np.float32)
    for _ in range(4):
      ref = ref + lr * (c.mean(0) - ref)
    return np.asarray(w), ref, infos, calls

  def test_exact_rounds_replay_the_benign_trajectory(self):
    """With every replayed round exact (T_w = m), or T_c = 2 (round 2 of 3
    exact), the exact rounds' (Delta w, Delta g) pair gives L-BFGS the true
    Hessian of this quadratic (lr I), so the recovered model is the benign
    clients' own 4-round trajectory; the estimated replay (trajectory
    pairs) is not."""
    for kwargs, exact_rounds, trainings, scored in (
        (dict(exact_warmup=3), 3, 20, 1), (dict(exact_every=2), 1, 8, 0)):
      w, ref, infos, calls = self.quadratic_run(**kwargs)
      # With T_w = 3, round 2's change is predicted from round 1's pair
      # (round 0 starts at the recorded model: no pair): exactly, since
      # the Hessian is lr I. With T_c = 2 no exact round has a pair before.
      self.assertEqual(float(infos[3]['recovery_lbfgs_scored']), scored)
      self.assertLess(float(infos[3]['recovery_lbfgs_error']), 1e-4)
      self.assertEqual([float(i['recovered']) for i in infos], [0, 0, 0, 1])
      self.assertEqual(float(infos[3]['recovery_exact_rounds']),
                       exact_rounds)
      # An exact round retrains the 4 benign clients twice: from the
      # replayed model and from the recorded one (the pair's same
      # batches); once in replayed round 0, where the two are the same.
      self.assertEqual(float(infos[3]['recovery_client_rounds']),
                       trainings)
      self.assertLen(calls, 2)   # traced once each, inside the replay
      np.testing.assert_allclose(w, ref, rtol=1e-5, atol=1e-6)
    w0, ref0, infos0, _ = self.quadratic_run()
    self.assertEqual(float(infos0[3]['recovered']), 1.0)
    self.assertEqual(float(infos0[3]['recovery_client_rounds']), 0.0)
    self.assertGreater(np.abs(w0 - ref0).max(), 1e-3)

  def test_without_exact_rounds_the_stored_updates_replay_uncorrected(self):
    """No exact round, so no L-BFGS pair (lbfgs_pairs='exact', the
    default): rounds 1-3 are replayed as the benign clients' stored steps,
    taken at the recorded (poisoned) models, and round 4 adds its own
    arrivals' step. The trajectory's pairs correct that replay."""
    n_benign, lr = 4, 0.3
    rng = np.random.default_rng(7)
    c = (np.array([1.0, -2.0, 0.5, 1.5]) +
         0.05 * rng.normal(size=(4, 4))).astype(np.float32)
    w, replayed = np.zeros(4), np.zeros(4)
    for _ in range(3):   # the recorded rounds, attackers in (mean of 6)
      steps = lr * (c - w[None])
      replayed = replayed + steps.mean(0)
      w = w + (steps.sum(0) + 2 * 3.0) / 6
    expected = replayed + (lr * (c - w[None])).mean(0)
    got, _, infos, _ = self.quadratic_run()
    self.assertEqual(n_benign, len(c))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # The exact-rounds path with no exact round in the window computes the
    # same numbers (BUILD_NOTES §3d's session 41 run used it).
    far, _, _, _ = self.quadratic_run(exact_every=1000)
    np.testing.assert_array_equal(far, got)
    traj, _, infos_t, _ = self.quadratic_run(lbfgs_pairs='trajectory')
    self.assertEqual(float(infos_t[3]['replayed']), 3.0)
    self.assertGreater(np.abs(traj - expected).max(), 1e-3)

  def test_correction_never_moves_the_replay_further_away(self):
    rng = np.random.default_rng(4)
    for _ in range(50):
      delta = rng.normal(size=8).astype(np.float32)
      hv = (rng.normal(size=8) * rng.choice([0.1, 1, 10])).astype(np.float32)
      got = np.asarray(safe_step(jnp.asarray(delta), jnp.asarray(hv)))
      self.assertLessEqual(np.linalg.norm(delta - got),
                           np.linalg.norm(delta) * (1 + 1e-5))
    # A contracting estimate passes unchanged; an expanding one is scaled.
    delta = jnp.ones(4)
    np.testing.assert_allclose(safe_step(delta, 0.5 * delta), 0.5 * delta)
    np.testing.assert_allclose(safe_step(delta, 5.0 * delta), 2.0 * delta)
    np.testing.assert_allclose(safe_step(delta, -delta), 0.0 * delta)

  def test_size_formulas_match_the_state(self):
    # cache_bytes / recovery_bytes plan memory (N = 1000, BUILD_NOTES §3d)
    # without building the state; they must count what init builds.
    for dtype in ('float32', 'bfloat16'):
      agg = get_aggregator('fedhan', num_clients=5, rollback=3,
                           recovery_slots=4, cache_dtype=dtype)
      state = agg.init({'w': jnp.zeros((7,))})
      nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))
      self.assertEqual(nbytes(state.cache),
                       fc.cache_bytes(5, 7, jnp.dtype(dtype)))
      self.assertEqual(nbytes(state.record),
                       recovery_bytes(3, 4, 7, 5, jnp.dtype(dtype)))

  def test_settings_are_checked(self):
    for kwargs, name in ((dict(rollback=4, history=5), 'history'),
                         (dict(cache_dtype='int8'), 'cache_dtype'),
                         (dict(detect_start=0), 'detect_start'),
                         (dict(ban_after=0), 'ban_after'),
                         (dict(exact_warmup=2), 'exact_warmup'),
                         (dict(rollback=2, exact_every=-1), 'exact_every'),
                         (dict(forget=np.ones(3, bool)), 'forget'),
                         (dict(unlearn_round=3), 'forget'),
                         (dict(unlearn_round=3, forget=np.ones(4, bool)),
                          'forget'),
                         (dict(unlearn_round=1, forget=np.ones(3, bool)),
                          'unlearn_round'),
                         (dict(lbfgs_pairs='both'), 'lbfgs_pairs'),
                         (dict(min_flag_score=-0.5), 'min_flag_score')):
      with self.assertRaisesRegex(ValueError, name):
        get_aggregator('fedhan', num_clients=3, **kwargs)


class AsyncBaselinesTest(absltest.TestCase):
  """TWAFL and SASGD, the paper's asynchronous baselines, by hand."""

  def call(self, name, coverage=None):
    u = jnp.array([[2.0, 4.0], [4.0, 8.0], [6.0, 12.0], [1e9, 1e9]])
    return call_aggregator(
        get_aggregator(name), {'w': u}, jnp.array([True, True, True, False]),
        (), jax.random.key(0), weights=jnp.array([1.0, 2.0, 1.0, 5.0]),
        staleness=jnp.array([0, 1, 2, 0]),
        coverage=None if coverage is None else {'w': coverage})

  def test_twafl_weights_by_size_and_e_over_2_per_round_late(self):
    out, _, info = self.call('twafl')
    w = np.array([1.0, 2.0 / (np.e / 2), 1.0 / (np.e / 2) ** 2])
    np.testing.assert_allclose(info['weights'], np.append(w, 0.0),
                               rtol=1e-6)
    want = (w @ np.array([[2, 4], [4, 8], [6, 12]])) / w.sum()
    np.testing.assert_allclose(out['w'], want, rtol=1e-6)

  def test_sasgd_divides_each_step_by_its_staleness(self):
    out, _, _ = self.call('sasgd')
    np.testing.assert_allclose(out['w'], [(2 + 2 + 2) / 3, (4 + 4 + 4) / 3],
                               rtol=1e-6)
    # Width-sliced: coordinate 1 owned by the first client only.
    cov = jnp.array([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    out, _, _ = self.call('sasgd', cov)
    np.testing.assert_allclose(out['w'], [2.0, 4.0], rtol=1e-6)


class LbfgsTest(absltest.TestCase):

  def test_hvp_is_exact_on_a_quadratic_with_conjugate_pairs(self):
    """With d H-conjugate pairs (s_k, H s_k) of a d-dim quadratic, the
    compact L-BFGS matrix is H itself (quadratic termination)."""
    rng = np.random.default_rng(1)
    d = 5
    a = rng.normal(size=(d, d))
    hess = a @ a.T + d * np.eye(d)
    _, vecs = np.linalg.eigh(hess)          # orthogonal and H-conjugate
    s = (vecs.T * rng.uniform(0.5, 2.0, size=(d, 1))).astype(np.float32)
    y = (s @ hess).astype(np.float32)
    v = rng.normal(size=d).astype(np.float32)
    got = jax.jit(lbfgs_hvp)(jnp.asarray(s), jnp.asarray(y),
                             jnp.ones(d, bool), jnp.asarray(v))
    np.testing.assert_allclose(got, hess @ v, rtol=2e-3, atol=2e-3)


if __name__ == '__main__':
  absltest.main()
