"""Horus: HOPS, the detection threshold, projection weights, the pipeline.

The masked alignment of two different shapes against a hand-computed
average is tests/transforms_test.py::AlignTest; HOPS against NumPy is
tests/spectral_test.py.
"""


from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust import engine, models
from fedrobust.aggregators import get_aggregator, call_aggregator, spectral
from fedrobust.aggregators.horus import masked_percentile
from fedrobust.cohort import Cohort
from fedrobust.methods import get_method
from fedrobust.transforms import lora
from tests.engine_test import IMAGE, NUM_CLASSES, toy_data
from tests.lapack_check import assert_unbatched_lapack


def orthonormal(rng, n, k):
  q, _ = np.linalg.qr(rng.normal(size=(n, k)))
  return q[:, :k]


class HopsTest(absltest.TestCase):

  def test_score_is_invariant_to_the_matrix_shape(self):
    """Same singular values, different shapes (a CNN's and an LSTM's
    LoRA-A), same HOPS: the score only reads the spectrum."""
    rng = np.random.default_rng(0)
    spectra = np.sort(rng.uniform(0.1, 3.0, size=(5, 4)), axis=1)[:, ::-1]
    def mats(d):
      return np.stack([orthonormal(rng, d, 4) @ np.diag(s) @
                       orthonormal(rng, 4, 4).T for s in spectra])
    mask = np.ones(5, bool)
    scores = []
    for d in (9, 28, 130):
      sv = spectral.singular_values(jnp.asarray(mats(d), jnp.float32), 'svd')
      np.testing.assert_allclose(sv, spectra, rtol=1e-4, atol=1e-5)
      scores.append(np.asarray(spectral.hops_scores(sv, mask, k=2,
                                                    lam=0.4)))
    np.testing.assert_allclose(scores[0], scores[1], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(scores[0], scores[2], rtol=1e-4, atol=1e-5)

  def test_percentile_matches_numpy(self):
    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 10):
      values = rng.normal(size=12).astype(np.float32)
      mask = np.zeros(12, bool)
      mask[rng.permutation(12)[:n]] = True
      for p in (50.0, 90.0, 95.0, 100.0):
        np.testing.assert_allclose(
            masked_percentile(jnp.asarray(values), jnp.asarray(mask), p),
            np.percentile(values[mask], p), rtol=1e-5, atol=1e-6)


class RuleTest(absltest.TestCase):

  def test_projection_weights_by_hand(self):
    """Clients' A are rank-1, u_c v^T: with the global direction v_g,
    alpha_c = |<u_c, v_g>| (Eq. 8) and the update is sum alpha x / sum
    alpha (Eq. 9). Nobody is excluded (p = 100 under Eq. 5's S > theta;
    Algorithm 1's S >= theta would exclude the top score)."""
    rng = np.random.default_rng(2)
    m, r, c = 6, 3, 4
    u = orthonormal(rng, m, c).T                      # [C, m], unit rows
    v = rng.normal(size=(c, r))
    a = np.einsum('ci,cj->cij', u, v).astype(np.float32)     # [C, m, r]
    agg = get_aggregator('horus', percentile=100.0, exclude_ties=False)
    params = {'layer': {'a': jnp.zeros((m, r)), 'b': jnp.zeros((r, 2))}}
    updates = {'layer': {'a': jnp.asarray(a),
                         'b': jnp.asarray(rng.normal(size=(c, r, 2)),
                                          jnp.float32)}}
    state = agg.init(params)
    g = rng.normal(size=m)
    g /= np.linalg.norm(g)
    gb = rng.normal(size=r)
    gb /= np.linalg.norm(gb)
    state = state._replace(
        directions={'layer': {'a': jnp.asarray(g, jnp.float32),
                              'b': jnp.asarray(gb, jnp.float32)}},
        have=jnp.bool_(True))
    out, new_state, info = call_aggregator(
        agg, updates, jnp.ones(c, bool), state, jax.random.key(0),
        params=params, coverage=None)
    alpha_a = np.abs(u @ g)
    expected = np.einsum('c,cij->ij', alpha_a, a) / alpha_a.sum()
    np.testing.assert_allclose(out['layer']['a'], expected, rtol=1e-4,
                               atol=1e-6)
    b = np.asarray(updates['layer']['b'])
    ub = np.stack([np.linalg.svd(x)[0][:, 0] for x in b])
    alpha_b = np.abs(ub @ gb)
    np.testing.assert_allclose(
        out['layer']['b'], np.einsum('c,cij->ij', alpha_b, b) /
        alpha_b.sum(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(info['weights'], (alpha_a + alpha_b) / 2,
                               rtol=1e-4)
    self.assertEqual(float(info['excluded']), 0.0)
    # The new global direction is the aggregate's first singular vector.
    new_g = np.asarray(new_state.directions['layer']['a'])
    ref = np.linalg.svd(expected)[0][:, 0]
    self.assertAlmostEqual(abs(float(new_g @ ref)), 1.0, places=4)

  def test_first_round_has_unit_weights_and_the_outlier_is_excluded(self):
    """Ten clients with a flat spectrum and one with a rank-1 A: its HOPS is
    the largest and the 95th percentile excludes exactly it."""
    rng = np.random.default_rng(3)
    a = rng.normal(size=(10, 20, 8)).astype(np.float32)
    a[7] = np.outer(rng.normal(size=20), rng.normal(size=8)) * 3
    agg = get_aggregator('horus')
    params = {'l': {'a': jnp.zeros((20, 8)), 'b': jnp.zeros((8, 3))}}
    updates = {'l': {'a': jnp.asarray(a),
                     'b': jnp.zeros((10, 8, 3), jnp.float32)}}
    out, _, info = call_aggregator(
        agg, updates, jnp.ones(10, bool), agg.init(params),
        jax.random.key(0), params=params, coverage=None)
    weights = np.asarray(info['weights'])
    self.assertEqual(int(np.argmax(np.asarray(info['hops']))), 7)
    self.assertEqual(weights[7], 0.0)
    np.testing.assert_allclose(np.delete(weights, 7), 1.0)
    np.testing.assert_allclose(out['l']['a'], np.delete(a, 7, 0).mean(0),
                               rtol=1e-5, atol=1e-6)


  def test_tied_colluders_pass_eq5_and_exclude_ties_removes_them(self):
    """Two identical rank-1 clients top HOPS: theta (p = 95 of 10) equals
    their score, so the paper's S > theta keeps them; S >= theta does not.
    Ten identical clients are all kept under both rules."""
    rng = np.random.default_rng(3)
    a = rng.normal(size=(10, 20, 8)).astype(np.float32)
    a[6] = a[7] = np.outer(rng.normal(size=20), rng.normal(size=8)) * 3
    params = {'l': {'a': jnp.zeros((20, 8)), 'b': jnp.zeros((8, 3))}}
    b = jnp.zeros((10, 8, 3), jnp.float32)
    for ties, kept in ((False, 10), (True, 8)):
      agg = get_aggregator('horus', exclude_ties=ties)
      _, _, info = call_aggregator(
          agg, {'l': {'a': jnp.asarray(a), 'b': b}}, jnp.ones(10, bool),
          agg.init(params), jax.random.key(0), params=params, coverage=None)
      w = np.asarray(info['weights'])
      self.assertEqual(int(np.sum(w > 0)), kept, ties)
      if ties:
        self.assertEqual(w[6], 0.0)
        self.assertEqual(w[7], 0.0)
      same = jnp.broadcast_to(jnp.asarray(a[0]), (10, 20, 8))
      _, _, info = call_aggregator(
          agg, {'l': {'a': same, 'b': b}}, jnp.ones(10, bool),
          agg.init(params), jax.random.key(0), params=params, coverage=None)
      self.assertEqual(float(info['excluded']), 0.0, ties)

  def test_gram_route_gives_the_svd_route_s_result(self):
    """sv_method='gram' (batched eigh of the smaller Gram) against the
    default 'svd', on a round with an excluded outlier and a known global
    direction: same exclusions, weights, update and new directions, within
    float32 error."""
    rng = np.random.default_rng(5)
    a = rng.normal(size=(10, 20, 8)).astype(np.float32)
    a[2] = np.outer(rng.normal(size=20), rng.normal(size=8)) * 3
    b = rng.normal(size=(10, 8, 3)).astype(np.float32)
    params = {'l': {'a': jnp.asarray(rng.normal(size=(20, 8)), jnp.float32),
                    'b': jnp.zeros((8, 3))}}
    results = []
    for method in ('svd', 'gram'):
      agg = get_aggregator('horus', sv_method=method)
      state = agg.init(params)
      state = state._replace(
          directions={'l': {'a': jnp.asarray(orthonormal(rng, 20, 1)[:, 0]
                                             if not results else
                                             results[0][3]['l']['a'],
                                             jnp.float32),
                            'b': jnp.asarray(np.eye(8)[0], jnp.float32)}},
          have=jnp.bool_(True))
      out, new_state, info = call_aggregator(
          agg, {'l': {'a': jnp.asarray(a), 'b': jnp.asarray(b)}},
          jnp.ones(10, bool), state, jax.random.key(0), params=params,
          coverage=None)
      results.append((out, new_state, info, state.directions))
    (o1, s1, i1, _), (o2, s2, i2, _) = results
    self.assertEqual(float(i1['weights'][2]), 0.0)
    np.testing.assert_array_equal(np.asarray(i1['weights']) > 0,
                                  np.asarray(i2['weights']) > 0)
    np.testing.assert_allclose(i2['hops'], i1['hops'], rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(i2['weights'], i1['weights'], rtol=1e-4,
                               atol=1e-6)
    chex.assert_trees_all_close(o2, o1, rtol=1e-4, atol=1e-6)
    for leaf in ('a', 'b'):
      d1 = np.asarray(s1.directions['l'][leaf])
      d2 = np.asarray(s2.directions['l'][leaf])
      self.assertAlmostEqual(abs(float(d1 @ d2)), 1.0, places=4)
    with self.assertRaisesRegex(ValueError, 'sv_method'):
      get_aggregator('horus', sv_method='qr')

  def test_auto_route_is_svd_on_cpu_and_gram_on_accelerators(self):
    """sv_method='auto' (the default) picks the route by backend: on this
    backend it gives the named route's result bit for bit, and a wrong
    resolution (gram on CPU) would differ in the last bits."""
    self.assertEqual(spectral.default_sv_method('cpu'), 'svd')
    self.assertEqual(spectral.default_sv_method('gpu'), 'gram')
    self.assertEqual(spectral.default_sv_method('tpu'), 'gram')
    rng = np.random.default_rng(7)
    a = jnp.asarray(rng.normal(size=(8, 20, 6)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(8, 6, 3)), jnp.float32)
    params = {'l': {'a': jnp.zeros((20, 6)), 'b': jnp.zeros((6, 3))}}
    infos = {}
    for method in ('auto', 'svd', 'gram'):
      agg = get_aggregator('horus', sv_method=method)
      infos[method] = call_aggregator(
          agg, {'l': {'a': a, 'b': b}}, jnp.ones(8, bool), agg.init(params),
          jax.random.key(0), params=params, coverage=None)[2]['hops']
    named = spectral.default_sv_method()
    np.testing.assert_array_equal(infos['auto'], infos[named])
    np.testing.assert_allclose(infos['svd'], infos['gram'], rtol=1e-3,
                               atol=1e-5)

  def test_no_batched_lapack_call_on_cpu(self):
    """Regression: batched LAPACK kernels deadlocked the round on 2 CPU
    devices (spectral.per_matrix). The rule's compiled program may call
    gesdd/syevd on single matrices only, never on a [C, m, n] batch."""
    if jax.default_backend() != 'cpu':
      self.skipTest('the CPU path only')
    agg = get_aggregator('horus')
    params = {'l': {'a': jnp.zeros((20, 8)), 'b': jnp.zeros((8, 3))}}
    updates = {'l': {'a': jnp.ones((6, 20, 8)), 'b': jnp.ones((6, 8, 3))}}
    run = lambda u: call_aggregator(agg, u, jnp.ones(6, bool),
                                    agg.init(params), jax.random.key(0),
                                    params=params, coverage=None)
    gram = jnp.ones((6, 8, 8))
    for fn, arg in ((run, updates), (spectral.singular_values, gram)):
      assert_unbatched_lapack(self, jax.jit(fn).lower(arg).as_text())
    agg_gram = get_aggregator('horus', sv_method='gram')
    run_gram = lambda u: call_aggregator(
        agg_gram, u, jnp.ones(6, bool), agg_gram.init(params),
        jax.random.key(0), params=params, coverage=None)
    assert_unbatched_lapack(self, jax.jit(run_gram).lower(updates).as_text())


def two_architecture_horus(num_clients):
  """(mlp, lstm, cohorts, Horus method): MLP clients at the even ids and
  row-LSTM clients at the odd ones, every client in every round, LoRA on
  'first' and 'head', and a warm-up setup step into private backbones."""
  mlp = models.get_model('mlp', num_classes=NUM_CLASSES,
                         input_shape=IMAGE, hidden=(5,))
  lstm = models.get_model('row_lstm', num_classes=NUM_CLASSES,
                          input_shape=IMAGE, hidden=4)
  targets = ('first', 'head')
  half = num_clients // 2
  cohorts = (Cohort('mlp', mlp, lora(mlp, ranks=(2,), targets=targets),
                    tuple(range(0, num_clients, 2)), half),
             Cohort('lstm', lstm, lora(lstm, ranks=(2,), targets=targets),
                    tuple(range(1, num_clients, 2)), half))
  local = engine.LocalConfig(batch_size=4, num_epochs=1, steps_per_epoch=1)
  method = get_method('horus', cohorts=cohorts, local=local,
                      optimizer=engine.sgd(learning_rate=0.5),
                      share='first,head', warmup_epochs=2,
                      aggregator=get_aggregator('horus', percentile=100.0))
  return mlp, lstm, cohorts, method


class PipelineTest(absltest.TestCase):

  def test_two_architectures_warm_up_and_share_aligned_lora(self):
    """CNN-like MLP and row-LSTM clients: the setup step warms every client
    up into its own backbone, a round aggregates the aligned LoRA factors
    of 'first' and 'head' across both cohorts, and every client's own
    model is evaluated."""
    mlp, lstm, cohorts, method = two_architecture_horus(6)
    config = engine.RoundConfig(
        num_clients=6, clients_per_round=6, strategy='vmap',
        cohorts=tuple(engine.CohortSlots(c.members, 3) for c in cohorts))
    data = toy_data([4, 3, 4, 2, 4, 4], 4, seed=7)
    state = engine.init_server_state(
        method, (mlp.init(jax.random.key(0)), lstm.init(jax.random.key(1))),
        6, seed=0)
    before = state.method_state.backbones
    state = jax.jit(engine.make_setup_step(method, config))(state, data, ())
    after = state.method_state.backbones
    for j in range(2):       # every client's backbone moved, differently
      moved = jax.tree.map(lambda x, y: np.abs(np.asarray(x - y)).max(
          axis=tuple(range(1, x.ndim))), after[j], before[j])
      self.assertTrue(all(np.all(v > 0) for v in jax.tree.leaves(moved)))
      first = jax.tree.leaves(after[j])[0]
      self.assertFalse(np.allclose(first[0], first[1]))
    new_state, metrics = jax.jit(engine.make_round_step(method, config))(
        state, data, ())
    # The aligned 'first' LoRA-A: mlp [4, 2], lstm [2, 16] (4 * hidden)...
    a_mlp = new_state.params[0]['Dense_0']['a']
    a_lstm = new_state.params[1]['input']['a']
    chex.assert_shape(a_mlp, (4, 2))
    chex.assert_shape(a_lstm, (2, 2))
    # ... both trimmed from one aligned aggregate: their common corner is
    # the same numbers.
    np.testing.assert_allclose(a_mlp[:2], a_lstm, rtol=1e-6)
    chex.assert_trees_all_equal(new_state.method_state.backbones, after)
    self.assertEqual(float(metrics['clients_trained']), 6.0)
    evals = method.eval_models(new_state)
    self.assertTrue(all(m.per_client for m in evals))
    chex.assert_shape(jax.tree.leaves(evals[1].params)[0][:, 0], (3,))


if __name__ == '__main__':
  absltest.main()
