"""Pre-aggregators (NNM, bucketing, ARC): golden tests against NumPy
transcriptions of ByzFL's definitions and the bucketing paper, and the
conformance contract when composed with a rule (masked slots inert,
finite under NaN / Inf / 1e38 clients, permutation invariance where the
step is symmetric, no retrace)."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust import aggregators
from fedrobust.aggregators import (PRE_AGGREGATORS, call_aggregator,
                                   compose, get_aggregator,
                                   get_pre_aggregator)
from fedrobust.errors import SettingError

C, D, F = 8, 6, 2
MASK = np.array([1, 1, 1, 0, 1, 1, 1, 1], bool)       # slot 3 absent
KEY = jax.random.key(0)


def updates(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(C, D)).astype(np.float32)
  x[6] *= 8.0                                           # an outlier
  return x


def nnm_reference(x, f):
  """ByzFL NNM: x_i -> mean of its n - f nearest vectors (itself in)."""
  n = len(x)
  d = ((x[:, None] - x[None]) ** 2).sum(-1)
  return np.stack([x[np.argsort(d[i], kind='stable')[:n - f]].mean(0)
                   for i in range(n)])


def arc_reference(x, f):
  """ByzFL ARC: clip to the (k+1)-th largest norm, k = floor(2f/n (n-f))."""
  n = len(x)
  k = min(max(int(np.floor(2.0 * f / n * (n - f))), 0), n - 1)
  norms = np.linalg.norm(x, axis=1)
  threshold = np.sort(norms)[n - k - 1]
  return x * np.minimum(1.0, threshold / np.maximum(norms, 1e-12))[:, None]


@functools.lru_cache(maxsize=None)
def composed(pre, rule='mean'):
  agg = compose(get_pre_aggregator(pre, num_byzantine=F),
                get_aggregator(rule, num_byzantine=F))

  def step(u, m, key):
    return call_aggregator(agg, {'w': u}, m, (), key,
                           weights=jnp.ones(C, jnp.float32), coverage=None)
  step.__name__ = f'step_{pre}_{rule}'
  return jax.jit(chex.assert_max_traces(step, n=1))


class GoldenTest(absltest.TestCase):

  def check_against(self, name, reference):
    """pre's real rows equal reference(real rows); masked rows stay 0."""
    x = updates()
    mixed = get_pre_aggregator(name, num_byzantine=F).apply(
        jnp.asarray(x), jnp.asarray(MASK), KEY)
    np.testing.assert_allclose(np.asarray(mixed.flat)[MASK],
                               reference(x[MASK].astype(np.float64), F),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(mixed.flat)[~MASK], 0.0)
    np.testing.assert_array_equal(mixed.mask, MASK)
    return x, mixed

  def test_nnm(self):
    self.check_against('nnm', nnm_reference)

  def test_arc(self):
    x, mixed = self.check_against('arc', arc_reference)
    # n = 7, f = 2: k = floor(4/7 * 5) = 2 updates clipped.
    norms = np.linalg.norm(x[MASK], axis=1)
    clipped = np.linalg.norm(np.asarray(mixed.flat)[MASK], axis=1)
    self.assertEqual(int(np.sum(clipped < norms - 1e-6)), 2)

  def test_bucketing(self):
    """Karimireddy et al. Alg. 1: shuffle, buckets of s, bucket means;
    every real client sits in exactly one bucket."""
    x = updates()
    pre = get_pre_aggregator('bucketing', num_byzantine=F, bucket_size=3)
    self.assertEqual(pre.slots(C), 3)
    mixed = pre.apply(jnp.asarray(x), jnp.asarray(MASK), KEY)
    means = np.asarray(mixed.flat)
    self.assertEqual(means.shape, (3, D))
    np.testing.assert_array_equal(mixed.mask, [True, True, True])
    # Recover each bucket's members from the weight maps: bucket b's
    # forward weight of a one-hot client vector is 1 iff it holds it.
    members = np.stack([np.asarray(mixed.forward(
        jnp.asarray(np.eye(C, dtype=np.float32)[c]))) for c in range(C)])
    self.assertTrue(np.all(members[~MASK] == 0))
    np.testing.assert_array_equal(members[MASK].sum(1), 1.0)
    for b in range(3):
      held = members[:, b] > 0
      np.testing.assert_allclose(means[b], x[held].mean(0), rtol=1e-5,
                                 atol=1e-6)
    self.assertEqual(sorted(members.sum(0).astype(int)), [1, 3, 3])
    # back: a bucket's weight is shared by its members.
    back = np.asarray(mixed.back(jnp.asarray([0.6, 0.3, 0.1])))
    np.testing.assert_allclose(back.sum(), 1.0, rtol=1e-6)
    self.assertEqual(back[3], 0.0)

  def test_errors_name_the_setting(self):
    with self.assertRaisesRegex(SettingError, 'pre_aggregator'):
      get_pre_aggregator('cclip', num_byzantine=1)
    with self.assertRaisesRegex(SettingError, 'bucket_size'):
      get_pre_aggregator('bucketing', num_byzantine=1, bucket_size=0)
    with self.assertRaisesRegex(SettingError, 'pre_aggregator'):
      compose(get_pre_aggregator('nnm', num_byzantine=1),
              aggregators.AGGREGATORS['foolsgold_ids'](num_byzantine=1,
                                                       num_clients=8))


  def test_rules_that_read_the_global_model_compose(self):
    """FLAME reads the global model (`params`), which mixing leaves as it
    is: nnm + FLAME equals FLAME on NNM's mixed rows."""
    x = updates(4)
    params = {'w': jnp.zeros((D,), jnp.float32)}
    pre = get_pre_aggregator('nnm', num_byzantine=F)
    flame = get_aggregator('flame', num_byzantine=F, gamma=0.0)
    agg = compose(pre, flame)
    self.assertIn('params', agg.reads)
    out, _, info = call_aggregator(agg, {'w': jnp.asarray(x)},
                                   jnp.asarray(MASK), (), KEY,
                                   params=params, coverage=None)
    pre_key, rule_key = jax.random.split(KEY)
    mixed = pre.apply(jnp.asarray(x), jnp.asarray(MASK), pre_key)
    want, _, want_info = call_aggregator(flame, {'w': mixed.flat},
                                         mixed.mask, (), rule_key,
                                         params=params, coverage=None)
    np.testing.assert_allclose(out['w'], want['w'], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(info['weights'], mixed.back(
        want_info['weights']), rtol=1e-6, atol=1e-7)
    self.assertTrue(np.all(np.isfinite(np.asarray(out['w']))))


class ConformanceTest(parameterized.TestCase):

  @parameterized.product(pre=sorted(PRE_AGGREGATORS),
                         rule=('mean', 'median'))
  def test_masked_slot_is_inert_and_finite(self, pre, rule):
    x = updates()
    step = composed(pre, rule)
    out, _, info = step(jnp.asarray(x), jnp.asarray(MASK), KEY)
    for garbage in (np.nan, np.inf, 1e38):
      y = x.copy()
      y[3] = garbage
      out2, _, info2 = step(jnp.asarray(y), jnp.asarray(MASK), KEY)
      np.testing.assert_array_equal(out2['w'], out['w'])
      np.testing.assert_array_equal(info2['weights'], info['weights'])
    self.assertEqual(float(info['weights'][3]), 0.0)
    self.assertEqual(info['weights'].shape, (C,))
    # A real client sending NaN / Inf is dropped; 1e38 stays finite under
    # the median.
    for garbage in (np.nan, np.inf) + ((1e38,) if rule == 'median' else ()):
      y = x.copy()
      y[0] = garbage
      out3, _, _ = step(jnp.asarray(y), jnp.asarray(MASK), KEY)
      self.assertTrue(np.all(np.isfinite(out3['w'])), (pre, garbage))

  @parameterized.parameters('nnm', 'arc')
  def test_permutation_invariant(self, pre):
    x = updates()
    perm = np.array([5, 2, 7, 3, 0, 6, 1, 4])
    step = composed(pre, 'median')
    out, _, _ = step(jnp.asarray(x), jnp.asarray(MASK), KEY)
    out_p, _, _ = step(jnp.asarray(x[perm]), jnp.asarray(MASK[perm]), KEY)
    np.testing.assert_allclose(out_p['w'], out['w'], rtol=1e-5, atol=1e-6)

  def test_nnm_pulls_the_outlier_in(self):
    """NNM then the mean: the outlier's row is mixed with its neighbours,
    so the mean moves less than the plain mean."""
    x = updates()
    plain = x[MASK].mean(0)
    out, _, _ = composed('nnm', 'mean')(jnp.asarray(x), jnp.asarray(MASK),
                                        KEY)
    honest = np.delete(x, [3, 6], axis=0).mean(0)
    self.assertLess(np.linalg.norm(np.asarray(out['w']) - honest),
                    np.linalg.norm(plain - honest))


if __name__ == '__main__':
  absltest.main()
