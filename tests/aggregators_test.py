"""Tests for fedrobust.aggregators.

(1) A conformance suite over every AGGREGATORS entry; (2) NumPy references
on inputs with an absent slot; (3) sign-flip attackers stay out of the
robust outputs; (4) the client-count and flag checks.

The conformance tests run the check functions of fedrobust.testing (the
checks check_rule runs on a user's rule) on this file's compiled rules.
Every rule is compiled once per slot count (C = 7, and C = 11 for the
masked-slot test) and the compiled function is shared by the tests (the CPU
is slow to compile); it is wrapped in chex.assert_max_traces(n=1), so a
retrace anywhere fails. C = 7 because Bulyan with f = 1 needs n >= 4f+3.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust import aggregators
from fedrobust import testing as rule_checks
from fedrobust.aggregators import krum as krum_lib
from fedrobust.errors import SettingError

C = 7
F = 1
D = 8                  # 'b': [2] then 'w': [3, 2] (tree leaves sorted by key)
# The rules of this package; the server-aided ones need server data and a
# model (tests/aggregators_server_test.py), except foolsgold_ids, which
# needs only the `ids` extra that this suite passes (ids travel with their
# rows, so the permutation test permutes them too). Aliases ('rfa') are
# tested once.
_OWN = {name: factory for name, factory in aggregators.AGGREGATORS.items()
        if name not in aggregators.SERVER_AIDED or name == 'foolsgold_ids'}
NAMES = sorted(name for name, factory in _OWN.items()
               if min(k for k, v in _OWN.items() if v is factory) == name)
PARAMS = {'w': np.zeros((3, 2), np.float32), 'b': np.zeros((2,), np.float32)}
# Rules that promise nothing against a bad client (breakdown point 0).
NON_ROBUST = ('mean', 'weighted_mean', 'fdagg', 'twafl', 'sasgd',
              'federaser', 'crab')
KEY = jax.random.key(0)
# Settings a rule cannot run without (fedhan's per-client cache: N rows).
REQUIRED_HPARAMS = {'fedhan': {'num_clients': 64, 'rollback': 2},
                    'foolsgold_ids': {'num_clients': 64},
                    'fldetector_async': {'num_clients': 64, 'window': 2,
                                         'warmup': 1, 'history': 4},
                    # FLAME's weak-DP noise would break the exact checks
                    # (identical inputs, jit vs eager); its noise has its
                    # own test in tests/clustered_test.py.
                    'flame': {'gamma': 0.0},
                    'federaser': {'num_clients': 64, 'unlearn_round': 2,
                                  'forget': np.arange(64) % 5 == 0},
                    'crab': {'num_clients': 64, 'unlearn_round': 2,
                             'forget': np.arange(64) % 5 == 0}}


def stack(flat):
  """float[K, D] -> stacked updates {'b': [K, 2], 'w': [K, 3, 2]}."""
  flat = np.asarray(flat, np.float32)
  return {'b': flat[:, :2], 'w': flat[:, 2:].reshape(-1, 3, 2)}


def unstack(tree):
  """One client's tree -> float64[D] in ravel order."""
  return np.concatenate([np.asarray(tree['b'], np.float64).ravel(),
                         np.asarray(tree['w'], np.float64).ravel()])


@functools.lru_cache(maxsize=None)
def compiled(name, f=F, slots=C, hparams=()):
  """(Aggregator, jitted aggregate, its trace counter), one compile per
  (rule, f, C, hparams).

  The plain def is wrapped in chex.assert_max_traces(n=1) under a name
  unique to the cache key, so a retrace in any test that shares it fails;
  the counter (fedrobust.testing.count_traces; `.traces`) counts them.
  """
  agg = aggregators.AGGREGATORS[name](
      num_byzantine=f, **{**REQUIRED_HPARAMS.get(name, {}), **dict(hparams)})

  def aggregate(updates, mask, state, key, extras):
    return aggregators.call_aggregator(
        agg, updates, mask, state, key, coverage=None,
        params=jax.tree.map(jnp.asarray, PARAMS), **extras)

  aggregate.__name__ = f'aggregate_{name}_f{f}_c{slots}_{hparams}'
  counted = rule_checks.count_traces(aggregate)
  return agg, jax.jit(chex.assert_max_traces(counted, n=1)), counted


def extras_of_rows(flat):
  """Per-slot extras that travel with the rows (permuting rows permutes
  them): weights in [1, 2) and scores from the rows' values."""
  clean = np.nan_to_num(np.asarray(flat, np.float64), nan=0.0, posinf=0.0,
                        neginf=0.0)
  c = len(flat)
  return {'weights': jnp.asarray(1.0 + np.abs(clean[:, 0]) % 1.0,
                                 jnp.float32),
          'scores': jnp.asarray(np.abs(clean[:, 1]) % 3.0, jnp.float32),
          'ids': jnp.arange(c, dtype=jnp.int32),
          'staleness': jnp.zeros(c, jnp.int32),
          'losses': jnp.asarray(np.abs(clean[:, 2]) % 2.0, jnp.float32)}


def run(name, flat, mask, *, f=F, hparams=(), state=None, key=None,
        slots=None):
  """A fedrobust.testing runner: the extras come from the rows
  (extras_of_rows), so they travel with them and `slots` is not needed."""
  del slots
  agg, fn, _ = compiled(name, f, len(flat), hparams)
  key = KEY if key is None else key
  if state is None:
    state = agg.init(PARAMS)
  out, state, info = fn(stack(flat), jnp.asarray(mask, bool), state, key,
                        extras_of_rows(flat))
  return out, state, info


def random_updates(seed, num=C):
  return np.random.default_rng(seed).normal(size=(num, D)).astype(np.float32)


def absent_slot_inputs(seed=0, absent=2):
  """C random rows, slot `absent` masked out and filled with NaN."""
  x = random_updates(seed)
  x[absent] = np.nan
  mask = np.ones(C, bool)
  mask[absent] = False
  return x, mask


class ConformanceTest(parameterized.TestCase):
  """The same checks for every registered rule: fedrobust.testing's check
  functions on this file's compiled rules and inputs."""

  def assert_passed(self, name, result):
    self.assertTrue(result.passed, f'{name}: {result.name}: {result.detail}')

  @parameterized.parameters(*NAMES)
  def test_shapes_dtypes_and_weights(self, name):
    x, mask = absent_slot_inputs()
    self.assert_passed(name, rule_checks.check_shapes(
        functools.partial(run, name), x, mask, PARAMS))

  @parameterized.parameters(*NAMES)
  def test_masked_slots_are_inert(self, name):
    # Four absent slots between and after the real ones, holding NaN, +Inf,
    # -Inf and 1e30 (rule_checks.MASKED_FILL).
    self.assert_passed(name, rule_checks.check_masked(
        functools.partial(run, name), random_updates(1), atol=1e-6,
        rtol=1e-6))

  @parameterized.parameters(*NAMES)
  def test_permuting_clients_changes_nothing(self, name):
    x, mask = absent_slot_inputs(seed=2)
    perm = np.random.default_rng(3).permutation(C)
    self.assert_passed(name, rule_checks.check_permutation(
        functools.partial(run, name), x, mask, perm, atol=1e-5, rtol=1e-5))

  @parameterized.parameters(*NAMES)
  def test_identical_inputs_come_back(self, name):
    if name == 'foolsgold_ids':
      self.skipTest('FoolsGold gives identical histories weight 0 by '
                    'design (they look like sybils): the output is zero')
    u = random_updates(4, num=1)
    x, mask = absent_slot_inputs()
    self.assert_passed(name, rule_checks.check_identical(
        functools.partial(run, name), x, mask, u[0], atol=1e-5, rtol=1e-5))

  @parameterized.product(name=NAMES, bad=rule_checks.BAD_VALUES)
  def test_finite_with_one_bad_client(self, name, bad):
    if name in NON_ROBUST:
      self.skipTest('the means have no robustness: one NaN/Inf client makes '
                    'them NaN/Inf, a 1e30 client makes them ~1e30/n')
    # Half the coordinates of client 4 NaN or +-Inf, or client 4 * 1e30.
    x, mask = absent_slot_inputs(seed=5)
    self.assert_passed(name, rule_checks.check_finite(
        functools.partial(run, name), x, mask, row=4, bad=(bad,)))

  @parameterized.parameters(*NAMES)
  def test_jit_matches_eager(self, name):
    x, mask = absent_slot_inputs(seed=6)
    agg, _, _ = compiled(name)

    def eager(x, mask, **_):
      return aggregators.call_aggregator(
          agg, stack(x), jnp.asarray(mask), agg.init(PARAMS), KEY,
          coverage=None, params=jax.tree.map(jnp.asarray, PARAMS),
          **extras_of_rows(x))
    self.assert_passed(name, rule_checks.check_jit(
        eager, functools.partial(run, name), x, mask, atol=1e-6, rtol=1e-6))

  @parameterized.parameters(*NAMES)
  def test_no_retrace_across_rounds(self, name):
    _, _, counted = compiled(name)    # chex.assert_max_traces(n=1) too
    rounds = [absent_slot_inputs(seed=10 + round_, absent=round_)
              for round_ in range(3)]  # new values, mask, key and state
    self.assert_passed(name, rule_checks.check_retrace(
        functools.partial(run, name), rounds, lambda: counted.traces))


# ----------------------------------------------------------------------------
# NumPy references (float64), on the real rows of absent_slot_inputs.
# ----------------------------------------------------------------------------


def np_sq_dists(x):
  return np.sum(np.square(x[:, None, :] - x[None, :, :]), axis=-1)


def np_krum_ranking(d2, candidates, n, f):
  """Candidates best first: score over the max(n-f-2, 1) nearest, then the
  sum of all distances to other candidates, then the index."""
  k = max(n - f - 2, 1)
  keys = []
  for i in candidates:
    dists = sorted(d2[i, j] for j in candidates if j != i)
    keys.append((sum(dists[:k]), sum(dists), i))
  return [i for *_, i in sorted(keys)]


def np_bulyan(x, f):
  n = len(x)
  d2 = np_sq_dists(x)
  theta = max(n - 2 * f, 1)
  remaining, selected = list(range(n)), []
  for t in range(theta):
    winner = np_krum_ranking(d2, remaining, n - t, f)[0]
    selected.append(winner)
    remaining.remove(winner)
  s = x[selected]
  med = np.median(s, axis=0)
  beta = max(theta - 2 * f, 1)
  out = np.empty(x.shape[1])
  for d in range(x.shape[1]):
    closest = np.lexsort((s[:, d], np.abs(s[:, d] - med[d])))[:beta]
    out[d] = s[closest, d].mean()
  return out


def np_weiszfeld(x, iters, eps):
  v = np.median(x, axis=0)
  for _ in range(iters):
    beta = (1.0 / len(x)) / np.maximum(eps, np.linalg.norm(x - v, axis=1))
    v = beta @ x / beta.sum()
  return v


def np_centered_clipping(x, v, tau, iters):
  for _ in range(iters):
    diff = x - v
    scale = np.minimum(1.0, tau / np.linalg.norm(diff, axis=1))
    v = v + (scale[:, None] * diff).sum(axis=0) / len(x)
  return v


def np_norm_bounding(x):
  norms = np.linalg.norm(x, axis=1)
  scale = np.minimum(1.0, np.median(norms) / norms)
  return (scale[:, None] * x).sum(axis=0) / len(x)


class ReferenceTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.x, self.mask = absent_slot_inputs(seed=7)
    self.real = self.x[self.mask].astype(np.float64)     # n = 6

  def check(self, name, expected, **kw):
    out, _, info = run(name, self.x, self.mask, **kw)
    np.testing.assert_allclose(unstack(out), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.sum(info['weights']), 1.0, rtol=1e-5)
    return info

  def test_median(self):
    self.check('median', np.median(self.real, axis=0))

  def test_trimmed_mean(self):
    s = np.sort(self.real, axis=0)
    self.check('trimmed_mean', s[F:len(s) - F].mean(axis=0))

  def test_krum(self):
    ranking = np_krum_ranking(np_sq_dists(self.real), range(6), 6, F)
    info = self.check('krum', self.real[ranking[0]])
    real_ids = np.flatnonzero(self.mask)
    np.testing.assert_array_equal(np.flatnonzero(info['selected']),
                                  [real_ids[ranking[0]]])

  def test_multi_krum(self):
    ranking = np_krum_ranking(np_sq_dists(self.real), range(6), 6, F)
    chosen = sorted(ranking[:6 - F])
    info = self.check('multi_krum', self.real[chosen].mean(axis=0))
    real_ids = np.flatnonzero(self.mask)
    np.testing.assert_array_equal(np.flatnonzero(info['selected']),
                                  real_ids[chosen])

  def test_bulyan(self):
    self.check('bulyan', np_bulyan(self.real, F))

  def test_geometric_median(self):
    self.check('geometric_median', np_weiszfeld(self.real, 8, 1e-6))

  def test_norm_bounding(self):
    out, _, info = run('norm_bounding', self.x, self.mask)
    np.testing.assert_allclose(unstack(out), np_norm_bounding(self.real),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        info['norm_bound'], np.median(np.linalg.norm(self.real, axis=1)),
        rtol=1e-5)

  def test_centered_clipping_two_rounds(self):
    hparams = (('tau', 1.0),)       # small enough that clipping is active
    out1, state, _ = run('centered_clipping', self.x, self.mask,
                         hparams=hparams)
    v1 = np_centered_clipping(self.real, np.zeros(D), 1.0, 3)
    np.testing.assert_allclose(unstack(out1), v1, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state, out1)
    x2, mask2 = absent_slot_inputs(seed=8)
    out2, _, _ = run('centered_clipping', x2, mask2, hparams=hparams,
                     state=state)
    v2 = np_centered_clipping(x2[mask2].astype(np.float64), v1, 1.0, 3)
    np.testing.assert_allclose(unstack(out2), v2, rtol=1e-5, atol=1e-6)


class ExtrasTest(parameterized.TestCase):
  """Keyword extras: weights, staleness, scores and per-coordinate coverage."""

  def setUp(self):
    super().setUp()
    rng = np.random.default_rng(11)
    self.x = rng.normal(size=(C, D)).astype(np.float32)
    self.mask = np.ones(C, bool)
    self.mask[3] = False
    self.x[3] = np.nan
    self.cov = (rng.random((C, D)) > 0.35).astype(np.float32)
    self.cov[:, 0] = 0.0                    # a coordinate nobody owns

  def call(self, name, coverage=None, **extras):
    agg = aggregators.get_aggregator(name, num_byzantine=F,
                                     **extras.pop('hparams', {}))
    cov = None if coverage is None else stack(coverage)
    return aggregators.call_aggregator(
        agg, stack(self.x), jnp.asarray(self.mask), agg.init(PARAMS), KEY,
        coverage=cov, **extras)

  @parameterized.parameters('mean', 'weighted_mean', 'median', 'trimmed_mean')
  def test_coverage_matches_numpy_per_coordinate(self, name):
    weights = np.linspace(1.0, 3.0, C).astype(np.float32)
    out, _, info = self.call(name, coverage=self.cov,
                             weights=jnp.asarray(weights))
    expected = []
    for d in range(D):
      rows = self.mask & (self.cov[:, d] > 0)
      v = self.x[rows, d].astype(np.float64)
      if not len(v):
        expected.append(0.0)
      elif name == 'mean':
        expected.append(v.mean())
      elif name == 'weighted_mean':
        expected.append(np.average(v, weights=weights[rows]))
      elif name == 'median':
        expected.append(np.median(v))
      else:
        k = min(F, (len(v) - 1) // 2)
        v = np.sort(v)
        expected.append(v[k:len(v) - k].mean())
    np.testing.assert_allclose(unstack(out), expected, rtol=1e-5, atol=1e-6)
    self.assertEqual(float(np.asarray(info['weights'])[3]), 0.0)

  def test_weighted_mean_with_staleness_discount(self):
    weights = np.array([1, 2, 3, 9, 4, 5, 6], np.float32)
    staleness = np.array([0, 1, 2, 0, 3, 0, 1], np.int32)
    out, _, info = self.call(
        'weighted_mean', weights=jnp.asarray(weights),
        staleness=jnp.asarray(staleness),
        hparams={'staleness_power': 0.5})
    w = weights * (1.0 + staleness) ** -0.5
    w[3] = 0.0
    expected = np.nansum(w[:, None] * np.where(self.mask[:, None], self.x, 0),
                         0) / w.sum()
    np.testing.assert_allclose(unstack(out), expected, rtol=1e-5)
    np.testing.assert_allclose(info['weights'], w, rtol=1e-6)

  def test_fdagg_is_eq10_weights_times_updates(self):
    scores = jnp.asarray([2.0, 6.0, 4.0, 99.0, 1.0, 3.0, 5.0])
    out, _, info = self.call('fdagg', scores=scores)
    alpha = np.asarray(aggregators.mean_lib.fdagg_weights(
        scores, jnp.asarray(self.mask)))
    self.assertEqual(alpha[3], 0.0)
    np.testing.assert_allclose(info['weights'], alpha, rtol=1e-6)
    expected = (alpha[:, None] * np.nan_to_num(self.x)).sum(0)
    np.testing.assert_allclose(unstack(out), expected, rtol=1e-5, atol=1e-6)

  def test_only_declared_extras_are_passed_and_missing_ones_fail(self):
    agg = aggregators.get_aggregator('krum', num_byzantine=1)
    self.assertEqual(agg.reads, ())
    aggregators.call_aggregator(            # unused extras are dropped
        agg, stack(self.x), jnp.asarray(self.mask), (), KEY,
        weights=jnp.ones(C), scores=jnp.ones(C))
    fdagg = aggregators.get_aggregator('fdagg', num_byzantine=0)
    with self.assertRaisesRegex(SettingError, 'scores'):
      aggregators.call_aggregator(fdagg, stack(self.x),
                                  jnp.asarray(self.mask), (), KEY,
                                  weights=jnp.ones(C))
    with self.assertRaisesRegex(SettingError, "'fdagg' reads.*scores"):
      aggregators.check_provided('fdagg', fdagg, {'weights', 'coverage'})


# ----------------------------------------------------------------------------
# Attacks.
# ----------------------------------------------------------------------------


class PairwiseDistanceTest(absltest.TestCase):
  """Krum's centred-Gram distances against float64 differences."""

  def test_gram_is_exact_despite_a_large_shared_component(self):
    rng = np.random.default_rng(0)
    # Updates 1e4 away from the origin that differ by O(1): the plain Gram
    # form |a|^2 + |b|^2 - 2ab loses every digit here in float32.
    x = (1e4 + rng.normal(size=(9, 300))).astype(np.float32)
    valid = np.array([True] * 8 + [False])
    exact = np_sq_dists(x.astype(np.float64))
    got = np.asarray(jax.jit(krum_lib.pairwise_sq_dists)(x, valid))
    np.testing.assert_allclose(got[:8, :8], exact[:8, :8], rtol=1e-4,
                               atol=1e-3)
    self.assertTrue(np.all(np.isinf(got[8])) and np.all(np.isinf(got[:, 8])))
    naive = (np.sum(x * x, 1)[:, None] + np.sum(x * x, 1)[None, :]
             - 2 * x @ x.T)
    self.assertGreater(np.abs(naive[:8, :8] - exact[:8, :8]).max(), 10.0)

  def test_huge_rows_are_infinitely_far_and_others_unchanged(self):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(7, 50)).astype(np.float32)
    x[2] *= 1e30
    valid = np.ones(7, bool)
    for method in krum_lib.DISTANCE_METHODS:
      got = np.asarray(krum_lib.pairwise_sq_dists(x, valid, method))
      keep = [0, 1, 3, 4, 5, 6]
      np.testing.assert_allclose(
          got[np.ix_(keep, keep)],
          np_sq_dists(x[keep].astype(np.float64)), rtol=1e-4, atol=1e-4)
      self.assertTrue(np.all(np.isinf(np.delete(got[2], 2))), method)


class SignFlipTest(parameterized.TestCase):
  """Two attackers among seven send -10x the honest mean (f = 2 < n/2)."""

  @parameterized.parameters('median', 'trimmed_mean', 'krum', 'dnc')
  def test_output_within_honest_range(self, name):
    rng = np.random.default_rng(9)
    honest = (1.0 + 0.5 * rng.normal(size=(5, D))).astype(np.float32)
    attack = np.broadcast_to(-10.0 * honest.mean(axis=0), (2, D))
    x = np.concatenate([honest[:2], attack[:1], honest[2:], attack[1:]])
    out, _, info = run(name, x, np.ones(C, bool), f=2)
    out = unstack(out)
    lo, hi = honest.min(axis=0), honest.max(axis=0)
    self.assertTrue(np.all((out >= lo - 1e-6) & (out <= hi + 1e-6)),
                    (out, lo, hi))
    np.testing.assert_array_equal(np.asarray(info['weights'])[[2, 6]], 0.0)


class DnCGoodSetTest(absltest.TestCase):

  def test_intersection_and_union_of_the_iterations_good_sets(self):
    """The paper's Alg. 2 (and FLPoison) keeps the clients no iteration
    flagged; good_set='union' keeps those at least one iteration kept."""
    x = np.random.default_rng(12).normal(size=(C, D)).astype(np.float32)
    mask = jnp.ones(C, bool)
    for good_set in ('intersection', 'union'):
      agg = aggregators.AGGREGATORS['dnc'](num_byzantine=3, num_iters=6,
                                           subsample_dim=4,
                                           good_set=good_set)
      out, _, info = agg.aggregate(stack(x), mask, (), KEY)
      count = np.asarray(info['flag_count'])
      keep = count == 0 if good_set == 'intersection' else count < 6
      if not keep.any():
        keep = count == count.min()
      np.testing.assert_array_equal(np.asarray(info['weights']) > 0, keep)
      np.testing.assert_allclose(unstack(out), x[keep].mean(0), rtol=1e-5,
                                 atol=1e-6)
    self.assertGreater(int(np.sum(count < 6)), int(np.sum(count == 0)))


  def test_golden_ndss_algorithm_2(self):
    """Golden: DnC as written in Shejwalkar & Houmansadr (NDSS 2021),
    Algorithm 2, transcribed to NumPy (float64, a full SVD): per iteration
    a coordinate subset r, centred rows, the top right singular vector v,
    scores ((x_i[r] - mu) . v)^2, I_good = the n - c m lowest scores, and
    I_final = the intersection of the I_good (FLPoison's dnc.py; 'union'
    for the looser reading). The random subsets are the rule's own
    (fold_in(key, t) permutations), handed to the reference as inputs."""
    rng = np.random.default_rng(21)
    x = rng.normal(size=(C, D)).astype(np.float32)
    x[5] += 4.0                                    # one clear outlier
    f, iters, b = 3, 6, 4
    subsets = [np.asarray(jax.random.permutation(jax.random.fold_in(KEY, t),
                                                 D))[:b]
               for t in range(iters)]

    def reference(good_set):
      final = set(range(C)) if good_set == 'intersection' else set()
      for r in subsets:
        xr = x[:, r].astype(np.float64)
        centred = xr - xr.mean(axis=0)
        v = np.linalg.svd(centred, full_matrices=False)[2][0]
        scores = (centred @ v) ** 2
        good = set(np.argsort(scores)[:C - f].tolist())
        final = final & good if good_set == 'intersection' else final | good
      return sorted(final)

    kept = {}
    for good_set in ('intersection', 'union'):
      want = reference(good_set)
      self.assertNotEmpty(want)
      agg = aggregators.AGGREGATORS['dnc'](num_byzantine=f, num_iters=iters,
                                           subsample_dim=b,
                                           good_set=good_set)
      out, _, info = agg.aggregate(stack(x), jnp.ones(C, bool), (), KEY)
      got = np.flatnonzero(np.asarray(info['weights']) > 0).tolist()
      self.assertEqual(got, want, good_set)
      np.testing.assert_allclose(unstack(out), x[want].mean(0), rtol=1e-5,
                                 atol=1e-6)
      kept[good_set] = want
    self.assertNotIn(5, kept['intersection'])
    self.assertLess(len(kept['intersection']), len(kept['union']))

  def test_unit_normalisation_as_the_sdfc_authors_framework(self):
    """normalize='unit' (MarsFL's DncSever): every update scaled to unit
    norm, scored and averaged; 'score' scores the unit updates and
    averages the raw ones. Lengthening one client's update makes it the
    raw scores' outlier and changes nothing in the unit ones."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(C, D)).astype(np.float32)
    longer = x.copy()
    longer[4] *= 30.0
    agg = lambda mode: aggregators.AGGREGATORS['dnc'](
        num_byzantine=1, num_iters=1, subsample_dim=D, normalize=mode)
    kept = {}
    for mode in ('none', 'score', 'unit'):
      for name, rows in (('x', x), ('longer', longer)):
        out, _, info = agg(mode).aggregate(stack(rows), jnp.ones(C, bool),
                                           (), KEY)
        kept[mode, name] = np.flatnonzero(np.asarray(info['weights']) > 0)
        unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
        want = (unit if mode == 'unit' else rows)[kept[mode, name]].mean(0)
        np.testing.assert_allclose(unstack(out), want, rtol=1e-5,
                                   atol=1e-6)
    self.assertIn(4, kept['none', 'x'])
    self.assertNotIn(4, kept['none', 'longer'])
    for mode in ('score', 'unit'):
      np.testing.assert_array_equal(kept[mode, 'x'], kept[mode, 'longer'])
      self.assertIn(4, kept[mode, 'longer'])
    with self.assertRaisesRegex(ValueError, 'normalize'):
      aggregators.AGGREGATORS['dnc'](num_byzantine=1, normalize='l2')


# ----------------------------------------------------------------------------
# Validation.
# ----------------------------------------------------------------------------


class ValidationTest(parameterized.TestCase):

  @parameterized.parameters(
      ('krum', 4, 1, 'n >= 2f+3'),
      ('multi_krum', 4, 1, 'n >= 2f+3'),
      ('bulyan', 6, 1, 'n >= 4f+3'),
      ('trimmed_mean', 2, 1, '2f < n'),
      ('dnc', 2, 2, 'n > f'),
  )
  def test_check_num_clients_names_the_arguments(self, name, n, f,
                                                 inequality):
    with self.assertRaises(SettingError) as ctx:
      aggregators.check_num_clients(name, n, f)
    self.assertEqual(ctx.exception.argument, 'clients_per_round')
    self.assertIn(f'num_byzantine={f}', str(ctx.exception))
    self.assertIn(repr(name), str(ctx.exception))
    self.assertIn(inequality, str(ctx.exception))
    aggregators.check_num_clients(name, n + 1, f)      # one more suffices

  def test_check_num_clients_accepts_every_rule_at_its_minimum(self):
    for name in NAMES:
      aggregators.check_num_clients(name, 4 * F + 3, F)

  def test_rfa_is_the_geometric_median(self):
    self.assertIs(aggregators.AGGREGATORS['rfa'],
                  aggregators.AGGREGATORS['geometric_median'])

  def test_unknown_aggregator(self):
    with self.assertRaisesRegex(SettingError, 'aggregator.*expected one of'):
      aggregators.get_aggregator('nope', num_byzantine=0)
    with self.assertRaisesRegex(SettingError, '^aggregator'):
      aggregators.check_num_clients('nope', 10, 1)
    with self.assertRaisesRegex(SettingError, '^aggregator_kwargs.*median'):
      aggregators.get_aggregator('median', num_byzantine=0, bogus=1)

  def test_static_check_at_trace_time(self):
    agg = aggregators.get_aggregator('krum', num_byzantine=1)
    x = random_updates(0, num=4)
    with self.assertRaisesRegex(ValueError, 'n >= 2f\\+3.*num_byzantine=1'):
      agg.aggregate(stack(x), jnp.ones(4, bool), (), KEY)

  @parameterized.parameters(
      ('median', {'num_byzantine': -1}, 'num_byzantine'),
      ('multi_krum', {'num_byzantine': 1, 'm': 0}, 'm'),
      ('geometric_median', {'iters': 0}, 'iters'),
      ('centered_clipping', {'tau': 0.0}, 'tau'),
      ('norm_bounding', {'max_norm': -1.0}, 'max_norm'),
      ('dnc', {'num_byzantine': 1, 'subsample_dim': 0}, 'subsample_dim'),
      ('weighted_mean', {'staleness_power': -1.0}, 'staleness_power'),
  )
  def test_bad_hparams_name_the_argument(self, name, kwargs, argument):
    with self.assertRaises(SettingError) as ctx:
      aggregators.get_aggregator(name, **kwargs)
    self.assertEqual(ctx.exception.argument, argument)
    self.assertEqual(ctx.exception.component, f'aggregator {name}')


if __name__ == '__main__':
  absltest.main()
