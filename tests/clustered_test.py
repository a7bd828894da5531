"""Meamed, simple clustering and ClippedClustering against NumPy / SciPy
transcriptions of their references (ByzFL, FLPoison, Blades)."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
from scipy.cluster import hierarchy
from scipy.spatial.distance import squareform

from fedrobust.aggregators import AGGREGATORS, call_aggregator
from fedrobust.aggregators import clustered
from fedrobust.aggregators.clustered import linkage_two
from tests.fedhan_test import np_dbscan

KEY = jax.random.key(0)


def run(name, x, mask=None, state=None, **hparams):
  agg = AGGREGATORS[name](**hparams)
  mask = np.ones(len(x), bool) if mask is None else mask
  state = agg.init({'w': jnp.zeros(x.shape[1])}) if state is None else state
  out, state, info = call_aggregator(
      agg, {'w': jnp.asarray(x, jnp.float32)}, jnp.asarray(mask), state, KEY,
      params={'w': jnp.zeros(x.shape[1])})
  return np.asarray(out['w'], np.float64), state, info


class MeamedTest(absltest.TestCase):

  def test_golden_byzfl(self):
    """ByzFL's Meamed: per coordinate, the mean of the n - f values with
    the smallest |x - median| (np.argpartition(abs_diff, n - f - 1)[:n-f])."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(9, 5))
    x[2] *= 30.0
    f = 3
    med = np.median(x, axis=0)
    idx = np.argpartition(np.abs(x - med), 9 - f - 1, axis=0)[:9 - f]
    want = np.take_along_axis(x, idx, axis=0).mean(axis=0)
    got, _, info = run('meamed', x, num_byzantine=f)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    self.assertAlmostEqual(float(np.sum(info['weights'])), 1.0, places=5)


class SimpleClusteringTest(absltest.TestCase):

  def test_majority_cluster_mean(self):
    rng = np.random.default_rng(1)
    a = 1.0 + 0.01 * rng.normal(size=(4, 6))
    b = -1.0 + 0.01 * rng.normal(size=(3, 6))
    x = np.concatenate([b[:1], a[:2], b[1:], a[2:], [[9.0] * 6]])
    got, _, info = run('simple_clustering', x)        # FLPoison's eps 0.05
    np.testing.assert_allclose(got, a.mean(0), rtol=1e-5, atol=1e-6)
    self.assertEqual(float(info['clusters']), 2.0)
    w = np.asarray(info['weights'])
    np.testing.assert_allclose(w[[1, 2, 5, 6]], 0.25, rtol=1e-6)
    # Spread out 100x: the absolute eps sees only noise (a zero update);
    # relative=True scales eps by the median pairwise distance.
    zero, _, _ = run('simple_clustering', 100 * x)
    np.testing.assert_array_equal(zero, 0.0)
    rel, _, _ = run('simple_clustering', 100 * x, eps=0.05, relative=True)
    np.testing.assert_allclose(rel, 100 * a.mean(0), rtol=1e-5)


class ClippedClusteringTest(absltest.TestCase):

  def test_linkage_matches_scipy(self):
    rng = np.random.default_rng(2)
    for trial in range(6):
      method = ('average', 'single')[trial % 2]
      pts = rng.normal(size=(9, 3)) + (trial // 2 % 2) * np.repeat(
          [[0, 0, 0], [3, 0, 0], [0, 3, 0]], 3, axis=0)
      d = np.sqrt(((pts[:, None] - pts[None]) ** 2).sum(-1))
      want = hierarchy.fcluster(hierarchy.linkage(squareform(d, checks=False),
                                                  method=method),
                                t=2, criterion='maxclust')
      got = np.asarray(linkage_two(jnp.asarray(d, jnp.float32),
                                   jnp.ones(9, bool), method))
      same = lambda lab: lab[:, None] == lab[None, :]
      np.testing.assert_array_equal(same(got), same(want), err_msg=method)
    # Masked points take no part.
    mask = np.ones(9, bool)
    mask[[0, 4]] = False
    got = np.asarray(linkage_two(jnp.asarray(d, jnp.float32),
                                 jnp.asarray(mask)))
    self.assertTrue(np.all(got[~mask] == -1))
    sub = d[np.ix_(mask, mask)]
    want = hierarchy.fcluster(hierarchy.linkage(squareform(sub, checks=False),
                                                method='average'),
                              t=2, criterion='maxclust')
    np.testing.assert_array_equal(got[mask][:, None] == got[mask][None],
                                  want[:, None] == want[None])

  def test_golden_blades(self):
    """Blades' Clippedclustering: clip to the median of all norms so far,
    average-linkage 2 clusters on cosine distance, mean of the larger."""
    rng = np.random.default_rng(3)
    history = []
    state = None
    for _ in range(2):
      honest = np.array([1.0, 0.5, 0.0, 0.2]) + 0.2 * rng.normal(size=(6, 4))
      bad = np.array([-1.0, 0.0, 1.0, 0.0]) * 5 + 0.2 * rng.normal(
          size=(3, 4))
      x = np.concatenate([honest[:3], bad, honest[3:]])
      norms = np.linalg.norm(x, axis=1)
      history.extend(norms)
      tau = np.median(history)
      clipped = x * np.minimum(1.0, tau / norms)[:, None]
      unit = clipped / np.linalg.norm(clipped, axis=1, keepdims=True)
      dist = 1.0 - unit @ unit.T
      labels = hierarchy.fcluster(hierarchy.linkage(
          squareform(dist, checks=False), method='average'), t=2,
                                  criterion='maxclust')
      big = np.argmax(np.bincount(labels))
      want = clipped[labels == big].mean(0)
      got, state, info = run('clipped_clustering', x, state=state)
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
      self.assertAlmostEqual(float(info['clip_norm']), tau, places=4)
      np.testing.assert_array_equal(np.asarray(info['weights'])[3:6], 0.0)


class SignGuardTest(absltest.TestCase):

  def test_golden_flpoison(self):
    """FLPoison's SignGuard: norm filter (0.1, 3.0) x median, sign shares
    on a contiguous window of 10% of the coordinates (each share divided by
    its max), DBSCAN(0.05, 3), the largest cluster; clip to the median
    norm and average the clients in both sets."""
    rng = np.random.default_rng(5)
    d = 400
    honest = np.abs(rng.normal(size=(7, d))) * rng.choice(
        [1, 1, 1, -1], size=(7, d))
    flipped = -np.abs(rng.normal(size=(2, d)))           # sign attackers
    huge = 50 * np.abs(rng.normal(size=(1, d)))          # norm attacker
    x = np.concatenate([honest[:3], flipped, honest[3:], huge])
    norms = np.linalg.norm(x, axis=1)
    med = np.median(norms)
    s1 = (norms > 0.1 * med) & (norms < 3.0 * med)
    width = int(0.1 * d)
    start = int(jax.random.randint(KEY, (), 0, d - width + 1))
    w = np.sign(x[:, start:start + width])
    feats = np.stack([(w == v).mean(1) for v in (1, 0, -1)], 1)
    feats = feats / (feats.max(0) + 1e-8)
    labels = np_dbscan(feats, 0.05, 3)
    biggest = np.argmax(np.bincount(labels[labels >= 0]))
    keep = s1 & (labels == biggest)
    clipped = x * np.minimum(1.0, med / norms)[:, None]
    want = clipped[keep].mean(0)
    got, _, info = run('signguard', x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(info['weights']) > 0, keep)
    self.assertFalse(keep[[3, 4, 9]].any())      # both filters acted
    self.assertTrue(keep.sum() >= 5)


class WeakDPTest(absltest.TestCase):

  def test_norm_clipping_noise_per_client(self):
    """FLPoison's NormClipping with weakDP: N(0, std^2) noise on every
    clipped update, then the mean: the mean's noise has std / sqrt(n)."""
    x = np.ones((16, 20000)) * 1e-3
    got, _, _ = run('norm_bounding', x, max_norm=10.0, noise_std=0.05)
    self.assertAlmostEqual(float(np.std(got - 1e-3)), 0.05 / 4, delta=5e-4)
    plain, _, _ = run('norm_bounding', x, max_norm=10.0)
    np.testing.assert_allclose(plain, 1e-3, rtol=1e-5)


def hdbscan_label0(dist, m):
  """HDBSCAN labels (min_samples = 1, min_cluster_size = m > n / 2,
  allow_single_cluster): mutual reachability, scipy's single linkage, the
  condensed tree walked from the root (a side of fewer than m points drops
  out at lambda = 1 / d), and label 0 for the points of largest lambda."""
  n = len(dist)
  off = dist + np.diag(np.full(n, np.inf))
  core = off.min(axis=1)
  reach = np.maximum(np.maximum(core[:, None], core[None, :]), dist)
  np.fill_diagonal(reach, 0.0)
  root = hierarchy.to_tree(hierarchy.linkage(squareform(reach, checks=False),
                                             method='single'))
  lam = np.zeros(n)
  node = root
  while True:
    left, right = node.get_left(), node.get_right()
    if left is None:                      # a single point left
      lam[node.id] = np.inf
      break
    level = 1.0 / max(node.dist, 1e-300)
    big = [c for c in (left, right) if c.get_count() >= m]
    for child in (left, right):
      if child not in big:
        lam[child.pre_order()] = level
    if not big:
      break
    node = big[0]
  return lam == lam.max()


class FlameTest(absltest.TestCase):

  def test_clustering_golden_hdbscan(self):
    rng = np.random.default_rng(5)
    for trial in range(6):
      n = 7 + trial % 4
      x = rng.normal(size=(n, 5))
      x[: n // 3] += 4.0 * rng.normal(size=5)      # a separate minority
      unit = x / np.linalg.norm(x, axis=1, keepdims=True)
      dist = np.clip(1 - unit @ unit.T, 0, 2)
      want = hdbscan_label0(dist, n // 2 + 1)
      got = np.asarray(clustered.hdbscan_majority(
          jnp.asarray(dist, jnp.float32), jnp.ones(n, bool)))
      np.testing.assert_array_equal(got, want, err_msg=str(trial))

  def test_golden_flpoison(self):
    """Admitted clients clipped to the median norm of all, averaged; the
    noise has std gamma * S * std(new tensor)."""
    rng = np.random.default_rng(6)
    honest = rng.normal(size=(7, 400)) * 0.1 + 1.0
    attack = -3.0 * np.ones((3, 400)) + rng.normal(size=(3, 400))
    x = np.concatenate([honest[:4], attack, honest[4:]])
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    admitted = hdbscan_label0(np.clip(1 - unit @ unit.T, 0, 2), 6)
    norms = np.linalg.norm(x, axis=1)
    clip = np.median(norms)
    want = (x[admitted] * np.minimum(1, clip / norms[admitted])[:, None]
            ).mean(0)
    got, _, info = run('flame', x, gamma=0.0)
    np.testing.assert_array_equal(np.flatnonzero(info['weights']),
                                  np.flatnonzero(admitted))
    self.assertFalse(admitted[4:7].any())
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(float(info['clip_norm']), clip, rtol=1e-5)
    noisy, _, _ = run('flame', x, gamma=0.01)
    spread = np.std(want, ddof=1)          # params are zero here
    np.testing.assert_allclose(np.std(noisy - want), 0.01 * clip * spread,
                               rtol=0.15)


class AurorTest(absltest.TestCase):

  def test_indicative_features_and_the_majority_cluster(self):
    """Attackers shift 3 of the output layer's coordinates: those become
    the indicative ones, the attackers the minority cluster, and the
    update the honest mean. After find_rounds the set is frozen."""
    rng = np.random.default_rng(7)
    tree = lambda x: {'body': {'kernel': jnp.asarray(x[:, :4], jnp.float32)},
                      'head': {'kernel': jnp.asarray(x[:, 4:], jnp.float32)}}
    x = rng.normal(size=(9, 10)) * 1e-4
    x[[1, 4, 7], 5:8] += 0.05                   # head coordinates 1-3
    agg = AGGREGATORS['auror'](output_path='head', find_rounds=1)
    one = jax.tree.map(lambda a: a[0], tree(x))
    state = agg.init(one)
    out, state, info = agg.aggregate(tree(x), jnp.ones(9, bool), state, KEY)
    np.testing.assert_array_equal(np.flatnonzero(state.indicative),
                                  [1, 2, 3])
    honest = np.setdiff1d(np.arange(9), [1, 4, 7])
    np.testing.assert_array_equal(np.flatnonzero(info['weights']), honest)
    np.testing.assert_allclose(np.asarray(out['head']['kernel']),
                               x[honest, 4:].mean(0), rtol=1e-5, atol=1e-8)
    # Round 2: the attackers move to other coordinates; the frozen set
    # no longer sees them, so everyone falls in one 2-means split of
    # noise and the set itself is unchanged.
    y = rng.normal(size=(9, 10)) * 1e-4
    y[[1, 4, 7], 8:] += 0.05
    _, state2, _ = agg.aggregate(tree(y), jnp.ones(9, bool), state, KEY)
    np.testing.assert_array_equal(state2.indicative, state.indicative)
    self.assertEqual(int(state2.round), 2)


  def test_delta_scale_puts_the_threshold_in_gradient_units(self):
    """Deltas 100x a gradient: at delta_scale 1 every noisy coordinate
    passes the 0.002 threshold; divided by the step (100) only the shifted
    ones do, as for the gradients themselves."""
    rng = np.random.default_rng(3)
    grads = rng.normal(size=(9, 6)) * 2e-4
    grads[[0, 5], 2:4] += 0.01
    tree = lambda x: {'head': {'kernel': jnp.asarray(x, jnp.float32)}}
    one = jax.tree.map(lambda a: a[0], tree(grads))
    found = {}
    for name, x, scale in (('grads', grads, 1.0),
                           ('deltas', 100 * grads, 1.0),
                           ('scaled', 100 * grads, 100.0)):
      agg = AGGREGATORS['auror'](output_path='head', delta_scale=scale)
      _, state, _ = agg.aggregate(tree(x), jnp.ones(9, bool),
                                  agg.init(one), KEY)
      found[name] = np.flatnonzero(state.indicative)
    np.testing.assert_array_equal(found['grads'], [2, 3])
    self.assertEqual(len(found['deltas']), 6)
    np.testing.assert_array_equal(found['scaled'], [2, 3])
    with self.assertRaisesRegex(ValueError, 'delta_scale'):
      AGGREGATORS['auror'](delta_scale=0.0)


if __name__ == '__main__':
  absltest.main()
