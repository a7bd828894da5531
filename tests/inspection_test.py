"""DeepSight and FLARE (fedrobust.aggregators.inspection): golden checks
against NumPy transcriptions of FLPoison's DeepSight (NEUPs, threshold
exceedings) and FLARE (MMD^2_u, nearest-neighbour counts, trust), the
PLR read-out against the hidden layer itself, and one behaviour test per
rule. The model is a 2-layer MLP on 2x2x1 uint8 images (hidden 6, 10
classes); its head is 'Dense_1'.
"""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.aggregators import call_aggregator
from fedrobust.aggregators import inspection
from fedrobust.models.pipelines import normalize

P = 10
HIDDEN = 6


def apply_fn(params, x, **unused):
  del unused
  x = normalize(x, 0.5, 0.5).reshape(x.shape[0], -1)
  h = jax.nn.relu(x @ params['Dense_0']['kernel'] +
                  params['Dense_0']['bias'][None, :])
  return h @ params['Dense_1']['kernel'] + params['Dense_1']['bias'][None, :]


def hidden_np(params, x):
  x = (np.asarray(x, np.float64) / 255.0 - 0.5) / 0.5
  x = x.reshape(len(x), -1)
  return np.maximum(x @ np.asarray(params['Dense_0']['kernel'], np.float64)
                    + np.asarray(params['Dense_0']['bias']), 0.0)


def make_params(rng):
  return {'Dense_0': {'kernel': rng.normal(size=(4, HIDDEN)).astype(
      np.float32), 'bias': np.full(HIDDEN, 0.5, np.float32)},
          'Dense_1': {'kernel': rng.normal(size=(HIDDEN, P)).astype(
              np.float32), 'bias': np.zeros(P, np.float32)}}


def stack(trees):
  return jax.tree.map(lambda *leaves: jnp.asarray(np.stack(leaves)), *trees)


def flare_np(plrs, tau=1.0):
  """FLPoison's FLARE on PLR arrays [n][V, F]: trust scores."""
  n = len(plrs)

  def mmd(x, y):
    xy = np.vstack([x, y])
    d2 = ((xy[:, None] - xy[None]) ** 2).sum(-1)
    k = np.exp(-d2 / x.shape[1])
    m, q = len(x), len(y)
    kx, ky, kxy = k[:m, :m], k[m:, m:], k[:m, m:]
    t1 = (kx.sum() - np.trace(kx)) / (m * (m - 1.0))
    t2 = (ky.sum() - np.trace(ky)) / (q * (q - 1.0))
    return max(0.0, t1 + t2 - 2.0 / (m * q) * kxy.sum())

  mat = np.zeros((n, n))
  for i in range(n):
    for j in range(i + 1, n):
      mat[i, j] = mat[j, i] = mmd(plrs[i], plrs[j])
  k = int(0.5 * n)
  top = np.argsort(mat, axis=1, kind='stable')[:, 1:k]
  count = np.array([np.sum(top == i) for i in range(n)], np.float64)
  scores = np.exp(count / (tau * count.mean()))
  return scores / scores.sum(), mat


def neups_np(dw, db, factor=0.01):
  """FLPoison's get_NEUPs_TEs (torch weights are [P, in]: dw.T here)."""
  out_n, out_t = [], []
  for w, b in zip(dw, db):
    energy = np.abs(b) + np.sum(np.abs(w.T), axis=1)
    sq = energy ** 2
    neup = sq / sq.sum()
    out_n.append(neup)
    out_t.append(np.sum(neup > max(factor, 1 / len(b)) * neup.max()))
  return np.array(out_n), np.array(out_t, np.float64)


class InspectionTest(absltest.TestCase):

  def test_neups_golden(self):
    rng = np.random.default_rng(0)
    dw = rng.normal(size=(5, HIDDEN, P)) * rng.uniform(0, 2, (5, 1, P))
    db = rng.normal(size=(5, P))
    dw[2, :, 3] *= 50                     # one class dominates client 2
    neup, te = inspection.neups(jnp.asarray(dw, jnp.float32),
                                jnp.asarray(db, jnp.float32), 0.01)
    neup_ref, te_ref = neups_np(dw, db)
    np.testing.assert_allclose(neup, neup_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(te, te_ref)
    self.assertLess(te_ref[2], te_ref[0])

  def test_mmd_golden(self):
    rng = np.random.default_rng(1)
    plr = rng.normal(size=(5, 7, 4)) * np.array([1, 1, 1, 1, 3])[:, None,
                                                                None]
    got = np.asarray(inspection.mmd_matrix(jnp.asarray(plr, jnp.float32),
                                           None))
    _, want = flare_np(list(plr))
    np.testing.assert_allclose(got, want, atol=2e-6)

  def test_flare_golden_and_downweights_a_divergent_model(self):
    rng = np.random.default_rng(2)
    params = make_params(rng)
    x = rng.integers(0, 256, (60, 2, 2, 1), dtype=np.uint8)
    y = np.arange(60, dtype=np.int32) % 3      # class 1: 20 examples
    n = 8
    ups = []
    for i in range(n):
      # Updates large enough that no two PLR sets are close to MMD 0 (the
      # reference's unstable argsort makes ties at the clamp ill-defined).
      u = jax.tree.map(lambda p: 0.8 * rng.normal(size=p.shape).astype(
          np.float32), params)
      if i == 5:                               # a wild first layer
        u['Dense_0']['kernel'] = 3.0 * rng.normal(size=(4, HIDDEN)).astype(
            np.float32)
      ups.append(u)
    agg = inspection.flare(server_data=(x, y), apply_fn=apply_fn,
                           output_path='Dense_1', aux_data_num=16)
    # Slot 3 is absent and holds NaN: it must change nothing.
    garbage = jax.tree.map(lambda p: np.full(p.shape, np.nan, np.float32),
                           params)
    slots = ups[:3] + [garbage] + ups[3:]
    mask = np.ones(n + 1, bool)
    mask[3] = False
    out, _, info = jax.jit(lambda u, m: call_aggregator(
        agg, u, m, (), jax.random.key(0),
        params=jax.tree.map(jnp.asarray, params)))(stack(slots),
                                                     jnp.asarray(mask))
    weights = np.asarray(info['weights'])
    self.assertEqual(weights[3], 0.0)
    aux = x[y == 1][:16]
    plrs = [hidden_np(jax.tree.map(lambda p, d: np.asarray(p) + d, params,
                                   u), aux) for u in ups]
    trust, _ = flare_np(plrs)
    _, mat = flare_np(plrs)
    self.assertGreater(np.min(mat + np.eye(n)), 1e-4)     # no ties at 0
    np.testing.assert_allclose(weights[mask], trust, rtol=1e-4, atol=1e-6)
    self.assertAlmostEqual(trust[5], trust.min())   # among the least trusted
    want = sum(t * np.asarray(u['Dense_1']['bias']) for t, u in
               zip(trust, ups))
    np.testing.assert_allclose(out['Dense_1']['bias'], want, rtol=1e-4,
                               atol=1e-6)

  def test_plr_readout_is_the_head_input(self):
    rng = np.random.default_rng(3)
    params = make_params(rng)
    x = rng.integers(0, 256, (5, 2, 2, 1), dtype=np.uint8)
    agg = inspection.flare(server_data=(x, np.ones(5, np.int32)),
                           apply_fn=apply_fn, output_path=None,
                           aux_data_num=5)
    del agg
    w_at, b_at = inspection.head_leaves(params, None, 'flare')
    leaves = jax.tree.leaves(params)
    self.assertEqual(leaves[w_at].shape, (HIDDEN, P))
    self.assertEqual(leaves[b_at].shape, (P,))
    with self.assertRaisesRegex(Exception, 'output_path'):
      inspection.head_leaves(params, 'Dense_9', 'flare')

  def test_deepsight_rejects_a_concentrated_group(self):
    rng = np.random.default_rng(4)
    params = make_params(rng)
    honest, attackers = 10, 5
    common = jax.tree.map(lambda p: 0.05 * rng.normal(size=p.shape), params)
    ups = []
    for i in range(honest + attackers):
      u = jax.tree.map(lambda p, c: (c + 0.01 * rng.normal(size=p.shape))
                       .astype(np.float32), params, common)
      if i >= honest:                      # a backdoor's energy on class 7
        u['Dense_1']['kernel'] = (0.02 * rng.normal(size=(HIDDEN, P)) +
                                  np.eye(P)[7][None] * 0.8).astype(
                                      np.float32)
        u['Dense_1']['bias'] = (np.eye(P)[7] * 0.5 + 0.01 * rng.normal(
            size=P)).astype(np.float32)
      ups.append(u)
    agg = inspection.deepsight(apply_fn=apply_fn, input_shape=(2, 2, 1),
                               output_path='Dense_1', num_samples=256,
                               sample_batch=128)
    out, _, info = jax.jit(lambda u, m: call_aggregator(
        agg, u, m, (), jax.random.key(0),
        params=jax.tree.map(jnp.asarray, params)))(
            stack(ups), jnp.ones(len(ups), bool))
    weights = np.asarray(info['weights'])
    suspicious = np.asarray(info['suspicious'])
    np.testing.assert_array_equal(suspicious[honest:], 1.0)
    np.testing.assert_array_equal(weights[honest:], 0.0)
    self.assertGreaterEqual(np.sum(weights[:honest] > 0), 5)
    self.assertTrue(np.all(np.isfinite(jax.tree.leaves(out)[0])))


if __name__ == '__main__':
  absltest.main()
