"""HiLoRA's subspace kernels against NumPy references (seeds/002 Sec. 3)."""

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.methods import fedlora
from fedrobust.methods.hilora import subspace as hs


def _orthonormal(rng, p, r):
  return np.linalg.qr(rng.normal(size=(p, r)))[0].astype(np.float32)


def _near(rng, base, noise):
  """An orthonormal basis of a small perturbation of `base`."""
  return _orthonormal_of(base + noise * rng.normal(size=base.shape))


def _orthonormal_of(x):
  return np.linalg.qr(x)[0].astype(np.float32)


class PrincipalAnglesTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_cosines_and_distance_match_numpy_svd(self):
    rng = np.random.default_rng(0)
    u, v = _orthonormal(rng, 12, 3), _orthonormal(rng, 12, 3)
    cos = self.variant(hs.principal_cosines)(u, v)
    ref = np.linalg.svd(u.T @ v, compute_uv=False)
    np.testing.assert_allclose(cos, ref, atol=1e-5)
    # Eq. 8 is 1 - mean cos^2 of the principal angles.
    dist = self.variant(hs.subspace_distance)(u, v)
    np.testing.assert_allclose(dist, 1 - np.mean(ref ** 2), atol=1e-5)
    self.assertAlmostEqual(float(self.variant(hs.subspace_distance)(u, u)),
                           0.0, places=5)
    # A subspace orthogonal to u is at distance 1.
    w = _orthonormal_of(np.eye(12)[:, :6] @ rng.normal(size=(6, 3)))
    uo = _orthonormal_of(np.eye(12)[:, 6:] @ rng.normal(size=(6, 3)))
    self.assertAlmostEqual(float(hs.subspace_distance(w, uo)), 1.0, places=5)

  def test_subspace_spans_the_basis_and_is_orthonormal(self):
    rng = np.random.default_rng(1)
    b = rng.normal(size=(10, 3)).astype(np.float32)
    u = np.asarray(hs.subspace(jnp.asarray(b)))
    np.testing.assert_allclose(u.T @ u, np.eye(3), atol=1e-5)
    np.testing.assert_allclose(u @ (u.T @ b), b, atol=1e-4)
    self.assertEqual(hs.subspace(jnp.asarray(b), 2).shape, (10, 2))
    # Our factor b [r, d_out] is the paper's B transposed.
    np.testing.assert_array_equal(hs.basis_of(jnp.asarray(b.T)), b)

  def test_distance_matrix_averages_modules(self):
    rng = np.random.default_rng(2)
    mods = [np.stack([_orthonormal(rng, 8, 2) for _ in range(4)]),
            np.stack([_orthonormal(rng, 6, 2) for _ in range(4)])]
    d = np.asarray(hs.distance_matrix([jnp.asarray(m) for m in mods]))
    for i in range(4):
      for j in range(4):
        ref = np.mean([1 - np.sum((m[i].T @ m[j]) ** 2) / 2 for m in mods])
        self.assertAlmostEqual(d[i, j], 0.0 if i == j else ref, places=5)


class EmaTest(absltest.TestCase):

  def test_eq7_recurrence(self):
    rng = np.random.default_rng(3)
    b1, b2 = rng.normal(size=(2, 5, 2)).astype(np.float32)
    bar1 = hs.ema_basis(jnp.zeros((5, 2)), b1, 0.9)
    np.testing.assert_allclose(bar1, b1 / np.linalg.norm(b1), atol=1e-6)
    bar2 = hs.ema_basis(bar1, b2, 0.9)
    ref = 0.9 * np.asarray(bar1) + 0.1 * b2 / np.linalg.norm(b2)
    np.testing.assert_allclose(bar2, ref / np.linalg.norm(ref), atol=1e-6)


class EigengapTest(absltest.TestCase):

  def _block_affinity(self, sizes, off=0.02):
    n = sum(sizes)
    s = np.full((n, n), off, np.float32)
    start = 0
    for size in sizes:
      s[start:start + size, start:start + size] = 1.0
      start += size
    return s

  def test_block_diagonal_affinity_gives_its_number_of_blocks(self):
    for sizes in [(3, 4, 3), (2, 2, 2, 2), (5, 5)]:
      s = jnp.asarray(self._block_affinity(sizes))
      mask = jnp.ones(s.shape[0], bool)
      eig, _ = hs.laplacian_spectrum(s, mask)
      ref = np.linalg.eigvalsh(
          np.eye(len(s)) - s / np.sqrt(np.outer(s.sum(1), s.sum(1))))
      np.testing.assert_allclose(eig, ref, atol=1e-5)
      k = hs.eigengap_k(eig, mask, k_min=2, k_max=6)
      self.assertEqual(int(k), len(sizes))

  def test_masked_slots_change_neither_k_nor_the_labels(self):
    rng = np.random.default_rng(4)
    truth = np.repeat(np.arange(3), [3, 4, 3])
    centres = [_orthonormal(rng, 16, 2) for _ in range(3)]
    subs = np.stack([_near(rng, centres[t], 0.05) for t in truth])
    dist = hs.distance_matrix([jnp.asarray(subs)])
    labels, k, _ = jax.jit(hs.spectral_clusters, static_argnames=(
        'k_min', 'k_max'))(dist, jnp.ones(10, bool), k_min=2, k_max=6)
    self.assertEqual(int(k), 3)
    self.assertEqual(hs.adjusted_rand_index(truth, np.asarray(labels)), 1.0)
    # Two absent slots holding garbage, one in the middle.
    junk = np.stack([_orthonormal(rng, 16, 2) for _ in range(2)])
    padded = np.concatenate([subs[:5], junk[:1], subs[5:], junk[1:]])
    mask = np.ones(12, bool)
    mask[[5, 11]] = False
    labels2, k2, _ = hs.spectral_clusters(
        hs.distance_matrix([jnp.asarray(padded)]), jnp.asarray(mask),
        k_min=2, k_max=6)
    self.assertEqual(int(k2), 3)
    self.assertEqual(list(np.asarray(labels2)[[5, 11]]), [-1, -1])
    np.testing.assert_array_equal(np.asarray(labels2)[mask],
                                  np.asarray(labels))

  def test_bad_k_range_is_refused(self):
    with self.assertRaisesRegex(ValueError, 'k_min'):
      hs.spectral_clusters(jnp.zeros((4, 4)), jnp.ones(4, bool), k_min=3,
                           k_max=2)


class RouteTest(absltest.TestCase):

  def test_unseen_client_goes_to_the_nearest_existing_cluster(self):
    rng = np.random.default_rng(5)
    clusters = np.stack([_orthonormal(rng, 16, 2) for _ in range(4)])
    u = _near(rng, clusters[2], 0.05)
    valid = jnp.ones(4, bool)
    self.assertEqual(int(hs.route(u, clusters, valid)), 2)
    self.assertNotEqual(int(hs.route(u, clusters, valid.at[2].set(False))),
                        2)

  def test_scores_are_one_minus_the_distance_and_average_over_modules(self):
    rng = np.random.default_rng(6)
    clusters = np.stack([_orthonormal(rng, 16, 2) for _ in range(3)])
    u = _orthonormal(rng, 16, 2)
    scores = np.asarray(hs.route_scores(u, clusters))
    want = [1 - float(hs.subspace_distance(u, c)) for c in clusters]
    np.testing.assert_allclose(scores, want, rtol=1e-5)
    np.testing.assert_allclose(hs.route_scores(clusters[1], clusters)[1], 1,
                               rtol=1e-5)
    # Module 1 points at cluster 0 weakly, module 2 at cluster 1 strongly.
    m1 = np.array([0.6, 0.5, 0.0])
    m2 = np.array([0.1, 0.9, 0.0])
    self.assertEqual(int(hs.best_cluster((m1 + m2) / 2, jnp.ones(3, bool))),
                     1)


class CosineKmeansTest(absltest.TestCase):

  def test_gram_embedding_keeps_distances(self):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(6, 40)).astype(np.float32)
    emb = np.asarray(hs.gram_embedding(jnp.asarray(x @ x.T),
                                       jnp.ones(6, bool)))
    d = lambda a: np.linalg.norm(a[:, None] - a[None], axis=-1)
    np.testing.assert_allclose(d(emb), d(x), rtol=1e-3, atol=1e-3)

  def test_groups_by_direction_whatever_the_norm(self):
    rng = np.random.default_rng(8)
    dirs = rng.normal(size=(3, 50))
    truth = np.array([0, 0, 1, 1, 2, 2, 0, 1, 2, 0])
    x = np.stack([dirs[t] * rng.uniform(0.1, 10) + 0.05 * rng.normal(size=50)
                  for t in truth]).astype(np.float32)
    # Two garbage slots, masked.
    x = np.concatenate([x, np.full((2, 50), 1e6, np.float32)])
    mask = jnp.asarray([True] * 10 + [False] * 2)
    labels = np.asarray(hs.cosine_kmeans(jnp.asarray(x @ x.T), mask, 3))
    self.assertEqual(labels[10:].tolist(), [-1, -1])
    self.assertEqual(hs.adjusted_rand_index(truth, labels[:10]), 1.0)


class PenaltyTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_orthogonality_penalty_and_its_gradient(self):
    rng = np.random.default_rng(6)
    frozen = rng.normal(size=(7, 2)).astype(np.float32)
    b = rng.normal(size=(7, 3)).astype(np.float32)
    value, grad = self.variant(jax.value_and_grad(
        hs.orthogonality_penalty, argnums=1))(frozen, b)
    np.testing.assert_allclose(value, np.sum((frozen.T @ b) ** 2), rtol=1e-5)
    # d/dB ||R^T B||_F^2 = 2 R R^T B.
    np.testing.assert_allclose(grad, 2 * frozen @ frozen.T @ b, rtol=1e-4,
                               atol=1e-5)
    ortho = _orthonormal(rng, 7, 4)
    self.assertAlmostEqual(float(hs.orthogonality_penalty(
        ortho[:, :2], ortho[:, 2:])), 0.0, places=5)


class ProductSpaceTest(absltest.TestCase):

  def test_weighted_product_mean_then_truncated_svd_matches_numpy(self):
    rng = np.random.default_rng(7)
    scale, rank = 2.0, 2
    a = rng.normal(size=(3, 6, 4)).astype(np.float32)   # [C, d_in, r]
    b = rng.normal(size=(3, 4, 5)).astype(np.float32)   # [C, r, d_out]
    w = np.array([0.5, 0.3, 0.2], np.float32)
    dense = np.einsum('c,cir,cro->io', w, a, b) * scale
    factors = fedlora.svd_factors({'m': jnp.asarray(dense)}, rank, scale)
    got = scale * np.asarray(factors['m']['a'] @ factors['m']['b'])
    u, sv, vt = np.linalg.svd(dense)
    np.testing.assert_allclose(got, (u[:, :rank] * sv[:rank]) @ vt[:rank],
                               rtol=1e-4, atol=1e-4)

  def test_relative_step(self):
    old, new = jnp.ones((2, 2)), jnp.ones((2, 2)) * 1.5
    self.assertAlmostEqual(float(hs.relative_step(old, new)), 0.5, places=5)


class AriTest(absltest.TestCase):

  def test_hand_worked_and_invariances(self):
    # Contingency [[2,0,0],[0,1,1]]: index 1, rows 2, cols 1, n = 4:
    # expected 2 * 1 / 6, ARI = (1 - 1/3) / (3/2 - 1/3) = 4/7.
    self.assertAlmostEqual(hs.adjusted_rand_index([0, 0, 1, 1], [0, 0, 1, 2]),
                           4 / 7)
    self.assertEqual(hs.adjusted_rand_index([0, 0, 1, 1, 2],
                                            [5, 5, 3, 3, 9]), 1.0)
    self.assertLess(hs.adjusted_rand_index([0, 0, 1, 1], [0, 1, 0, 1]), 0)
    # Masked (-1) slots are left out.
    self.assertEqual(hs.adjusted_rand_index([0, 0, 1, 1, 0],
                                            [1, 1, 0, 0, -1]), 1.0)


if __name__ == '__main__':
  absltest.main()
