"""MDA, SMEA and MoNNA against NumPy transcriptions of ByzFL's rules
(byzfl/aggregators/aggregators.py: MDA, SMEA, MoNNA). The shared
conformance suite (tests/aggregators_test.py) covers masking, NaN/Inf,
permutation invariance and retracing."""

import itertools

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from fedrobust.errors import SettingError
from tests.clustered_test import run


def byzfl_mda(x, f):
  """ByzFL MDA: the subset of n - f with the least max pairwise distance."""
  n = len(x)
  dist = np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1))
  best, best_d = None, np.inf
  for s in itertools.combinations(range(n), n - f):
    d = max(dist[i, j] for i, j in itertools.combinations(s, 2))
    if d < best_d:
      best, best_d = s, d
  return x[list(best)].mean(0), best, best_d


def byzfl_smea(x, f):
  """ByzFL SMEA with the exact top eigenvalue of each subset's covariance
  (ByzFL estimates it with one power step from a random vector)."""
  n = len(x)
  best, best_l = None, np.inf
  for s in itertools.combinations(range(n), n - f):
    sub = x[list(s)]
    diffs = sub - sub.mean(0)
    lam = np.linalg.eigvalsh(diffs.T @ diffs / len(s))[-1]
    if lam < best_l:
      best, best_l = s, lam
  return x[list(best)].mean(0), best, best_l


def monna_median(x, f):
  """ByzFL MoNNA with vectors[idx] replaced by the coordinate-wise median."""
  pivot = np.median(x, axis=0)
  dist = np.linalg.norm(x - pivot, axis=1)
  keep = np.argsort(dist, kind='stable')[:len(x) - f]
  return x[keep].mean(0), tuple(sorted(keep))


def byzfl_caf(x, f):
  """ByzFL CAF with the exact top eigenpair (ByzFL: one power step from a
  random vector)."""
  n = len(x)
  c = np.ones(n)
  best_lam, best_mu, best_w = np.inf, x.mean(0), c / n
  while c.sum() > n - 2 * f:
    mu = (c[:, None] * x).sum(0) / c.sum()
    diffs = x - mu
    cov = (c[:, None] * diffs).T @ diffs / c.sum()
    vals, vecs = np.linalg.eigh(cov)
    lam, v = vals[-1], vecs[:, -1]
    if lam < best_lam:
      best_lam, best_mu, best_w = lam, mu, c / c.sum()
    tau = (diffs @ v) ** 2
    c = c * (1 - tau / tau.max())
  return best_mu, best_w


def points(seed, n=9, d=6, outliers=2):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d))
  x[:outliers] = x[:outliers] * 4.0 + 3.0          # a spread-out minority
  return x


class SubsetRulesTest(parameterized.TestCase):

  @parameterized.product(seed=(0, 1, 2), name=('mda', 'smea'))
  def test_subset_rules_golden_byzfl(self, seed, name):
    """The chosen subset, its mean and its score (diameter or top
    covariance eigenvalue)."""
    x, f = points(seed), 2
    reference = {'mda': byzfl_mda, 'smea': byzfl_smea}[name]
    want, members, score = reference(x, f)
    got, _, info = run(name, x, num_byzantine=f)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.flatnonzero(info['weights']), members)
    np.testing.assert_allclose(float(info['score']), score, rtol=1e-3)

  @parameterized.parameters(0, 1, 2)
  def test_monna_golden_byzfl(self, seed):
    x, f = points(seed), 3
    want, members = monna_median(x, f)
    got, _, info = run('monna', x, num_byzantine=f)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.flatnonzero(info['weights']), members)

  @parameterized.parameters(0, 1, 2)
  def test_caf_golden_byzfl(self, seed):
    x, f = points(seed), 2
    want, weights = byzfl_caf(x, f)
    got, _, info = run('caf', x, num_byzantine=f)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(info['weights'], weights, atol=1e-4)
    # Shift and scale equivariant (the rows are centred and scaled inside).
    shifted, _, _ = run('caf', 1e3 * x + 50.0, num_byzantine=f)
    np.testing.assert_allclose(shifted, 1e3 * want + 50.0, rtol=1e-3)

  def test_masked_slots_are_kept_out_of_every_subset(self):
    """Two absent slots: the rule equals the rule on the real rows."""
    x, f = points(4), 2
    padded = np.insert(x, [2, 6], np.nan, axis=0)
    mask = np.insert(np.ones(len(x), bool), [2, 6], False)
    for name in ('mda', 'smea'):
      want, _, _ = run(name, x, num_byzantine=f)
      got, _, info = run(name, padded, mask, num_byzantine=f)
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
      self.assertEqual(np.asarray(info['weights'])[~mask].tolist(), [0, 0])

  def test_too_many_subsets_names_the_argument(self):
    with self.assertRaises(SettingError) as ctx:
      run('mda', points(0, n=30), num_byzantine=8, max_subsets=1000)
    self.assertEqual(ctx.exception.argument, 'num_byzantine')
    self.assertIn('comb(30, 8)', str(ctx.exception))
    with self.assertRaises(SettingError) as ctx:
      run('smea', points(0), num_byzantine=1, power_iters=0)
    self.assertEqual(ctx.exception.argument, 'power_iters')
    with self.assertRaises(SettingError) as ctx:
      run('monna', points(0), num_byzantine=1, pivot=0)
    self.assertEqual(ctx.exception.argument, 'pivot')


if __name__ == '__main__':
  absltest.main()
