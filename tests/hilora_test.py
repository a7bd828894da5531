"""HiLoRA's cascade on the conformance suite's tiny LoRA case.

The case (tests/methods_test.py) has 4 clients, rank 2, root_rounds=1,
cluster_rounds=1 and K in [2, 2], so round 1 is the root stage (and the
clustering), round 2 the cluster stage and round 3 the leaf stage.
"""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust import engine, models
from fedrobust.cohort import single_cohort
from fedrobust.errors import SettingError
from fedrobust.methods import get_method
from fedrobust.methods.fedlora import lora_modules, products
from fedrobust.transforms import lora
from fedrobust.transforms.base import get_path
from fedrobust.types import Arrivals, LocalData
from tests.engine_test import IMAGE, NUM_CLASSES
from tests.lapack_check import assert_unbatched_lapack
from tests.methods_test import case, run_rounds

NAME = ('hilora', 'plain')


class CascadeTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.method = case(*NAME)[0]
    cls.states = {r: run_rounds(*NAME, r)[0] for r in (1, 2, 3)}

  def test_stages_advance_and_the_root_stage_clusters(self):
    stages = [int(self.states[r].method_state.stage) for r in (1, 2, 3)]
    self.assertEqual(stages, [1, 2, 2])
    ms = self.states[1].method_state
    self.assertEqual(int(ms.num_clusters), 2)
    self.assertEqual(sorted(set(np.asarray(ms.assign).tolist())), [0, 1])
    self.assertTrue(np.all(np.asarray(ms.seen)))

  def test_root_is_its_truncated_product_and_then_frozen(self):
    s1, s2, s3 = (self.states[r] for r in (1, 2, 3))
    root = s1.params[0]
    dense = products(root, 1.0)
    for p in lora_modules(root):
      np.testing.assert_allclose(dense[p], s1.method_state.root_dense[p],
                                 rtol=1e-5, atol=1e-6)
      self.assertLessEqual(np.linalg.matrix_rank(np.asarray(dense[p]),
                                                 tol=1e-5), 2)
    for later in (s2, s3):
      jax.tree.map(np.testing.assert_array_equal, later.params[0], root)

  def test_clusters_train_in_their_stage_only(self):
    s1, s2, s3 = (self.states[r].method_state for r in (1, 2, 3))
    moved = [not np.allclose(get_path(s2.clusters, p)['b'][k],
                             get_path(s1.clusters, p)['b'][k])
             for k in range(2) for p in lora_modules(s1.leaves)]
    self.assertTrue(any(moved))
    jax.tree.map(np.testing.assert_array_equal, s3.clusters, s2.clusters)
    for k in range(2):
      cl = jax.tree.map(lambda l, k=k: l[k], s2.clusters)
      for p, v in products(cl, 1.0).items():
        np.testing.assert_allclose(v, s2.cluster_dense[p][k], rtol=1e-5,
                                   atol=1e-6)
    # Leaves move only in the leaf stage.
    jax.tree.map(np.testing.assert_array_equal, s2.leaves, s1.leaves)
    self.assertFalse(all(jax.tree.leaves(jax.tree.map(
        np.array_equal, s3.leaves, s2.leaves))))

  def test_personal_models_compose_the_three_tiers(self):
    state = self.states[3]
    ms = state.method_state
    headline, tiers, personal = self.method.eval_models(state)
    self.assertTrue(personal.per_client)
    self.assertTrue(tiers.per_client)
    np.testing.assert_array_equal(tiers.index, ms.assign)
    for p in ms.root_dense:
      kernel = get_path(ms.base, p)['kernel']
      np.testing.assert_allclose(
          get_path(headline.params, p)['kernel'],
          kernel + ms.root_dense[p].reshape(kernel.shape), rtol=1e-5,
          atol=1e-6)
      for i in range(4):
        leaf = jax.tree.map(lambda l, i=i: l[i], ms.leaves)
        want = (ms.root_dense[p] + ms.cluster_dense[p][ms.assign[i]]
                + products(leaf, 1.0)[p])
        np.testing.assert_allclose(
            get_path(personal.params, p)['kernel'][i],
            kernel + want.reshape(kernel.shape), rtol=1e-4, atol=1e-5)
        row = int(tiers.index[i])
        np.testing.assert_allclose(
            get_path(tiers.params, p)['kernel'][row],
            kernel + (ms.root_dense[p] + ms.cluster_dense[p][ms.assign[i]]
                      ).reshape(kernel.shape), rtol=1e-4, atol=1e-5)


class InputBasisTest(absltest.TestCase):

  def test_input_update_tracks_the_input_side_change(self):
    """cluster_basis='input_update': after the first root round each
    client's EMA is its A change (delta a, [d_in, r]) over its norm (Eq. 7
    from a zero EMA), and the clustering runs on it."""
    method, _, state, data, server_data = case('hilora', 'input_update')
    ids = jnp.arange(4, dtype=jnp.int32)
    cs = method.client_state(state.method_state, 0, ids)
    outs = jax.vmap(lambda i, c, k: method.client_update(
        0, method.broadcast(state, 0), c,
        LocalData(data.x, data.y, i, data.count[i]), k, server_data))(
            ids, cs, jax.random.split(jax.random.key(0), 4))
    arr = (Arrivals(ids, jnp.ones(4, bool), outs, jnp.zeros(4, jnp.int32)),)
    ms = jax.jit(method.server_update)(state, arr, jax.random.key(1),
                                       server_data)[1]
    for p in lora_modules(state.params[0]):
      da = np.asarray(get_path(outs.delta, p)['a'])        # [4, d_in, r]
      self.assertEqual(ms.ema[p].shape, da.shape)
      self.assertGreater(np.abs(da).max(), 0.0)
      # (a client with one real batch never moves a: b starts at zero, so
      # its first step's a gradient is zero; its EMA stays zero)
      norm = np.linalg.norm(da.reshape(4, -1), axis=1)[:, None, None]
      want = np.where(norm > 0, da / np.maximum(norm, 1e-30), 0.0)
      np.testing.assert_allclose(ms.ema[p], want, rtol=1e-5, atol=1e-6)
    self.assertEqual(int(ms.num_clusters), 2)
    self.assertEqual(sorted(set(np.asarray(ms.assign).tolist())), [0, 1])


class CpuLapackTest(absltest.TestCase):

  def test_no_batched_lapack_call_on_cpu(self):
    """Regression: a batched SVD in the server step (the EMA subspaces,
    the clusters' truncations) deadlocked a MiniLM round on CPU, as in
    Horus (spectral.per_matrix). The round's LAPACK calls must each take
    one matrix."""
    if jax.default_backend() != 'cpu':
      self.skipTest('the CPU path only')
    method, _, state, data, server_data = case(*NAME)
    ids = jnp.arange(4, dtype=jnp.int32)
    cs = method.client_state(state.method_state, 0, ids)

    def round_(state):
      outs = jax.vmap(lambda i, c, k: method.client_update(
          0, method.broadcast(state, 0), c,
          LocalData(data.x, data.y, i, data.count[i]), k, server_data))(
              ids, cs, jax.random.split(jax.random.key(0), 4))
      arr = (Arrivals(ids, jnp.ones(4, bool), outs, jnp.zeros(4, jnp.int32)),)
      return method.server_update(state, arr, jax.random.key(1), server_data)

    assert_unbatched_lapack(self, jax.jit(round_).lower(state).as_text())


class SettingsTest(absltest.TestCase):

  def test_refusals_name_the_setting(self):
    model = models.get_model('mlp', num_classes=NUM_CLASSES,
                             input_shape=IMAGE, hidden=(5,))
    local = engine.LocalConfig(batch_size=4, num_epochs=1, steps_per_epoch=2)
    build = lambda ranks, **kw: get_method(
        'hilora', cohorts=single_cohort(
            model, lora(model, ranks=ranks, targets=('all',)), 4, 4,
            (float(ranks[0]),) * 4),
        local=local, optimizer=engine.sgd(learning_rate=0.1), **kw)
    with self.assertRaisesRegex(SettingError, 'lora_ranks'):
      build((1, 2))
    with self.assertRaisesRegex(SettingError, 'k_min'):
      build((2,), k_min=3, k_max=2)
    with self.assertRaisesRegex(SettingError, 'cluster_basis'):
      build((2,), cluster_basis='nope')
    with self.assertRaisesRegex(SettingError, 'clustering'):
      build((2,), clustering='nope')
    with self.assertRaisesRegex(SettingError, 'probe_epochs'):
      build((2,), probe_epochs=0)
    self.assertEqual(build((2,)).name, 'hilora')

  def test_vanilla_cosine_kmeans_clusters_at_the_end_of_the_root_stage(self):
    """Table 4's ablation row: k-means (K = k_max) on the root round's
    product-space updates; a server step of the tiny case with all four
    clients arriving."""
    method = tiny_hilora(cluster_rounds=1, k_max=2,
                         clustering='cosine_kmeans')
    _, _, state, data, server_data = case(*NAME)
    ms = server_round(method, state, data, server_data,
                      jax.random.key(0)).method_state
    self.assertEqual(int(ms.num_clusters), 2)
    self.assertEqual(sorted(set(np.asarray(ms.assign).tolist())), [0, 1])


def tiny_hilora(**settings):
  """HiLoRA on the tiny case's MLP (rank 2 everywhere), one root round."""
  model = models.get_model('mlp', num_classes=NUM_CLASSES,
                           input_shape=IMAGE, hidden=(5,))
  return get_method(
      'hilora', cohorts=single_cohort(
          model, lora(model, ranks=(2,), targets=('all',)), 4, 4,
          (2.0,) * 4),
      local=engine.LocalConfig(batch_size=4, num_epochs=1, steps_per_epoch=2),
      optimizer=engine.sgd(learning_rate=0.1), root_rounds=1, **settings)


def server_round(method, state, data, server_data, key):
  """One round of the tiny case with all four clients arriving."""
  ids = jnp.arange(4, dtype=jnp.int32)
  cs = method.client_state(state.method_state, 0, ids)
  outs = jax.vmap(lambda i, c, k: method.client_update(
      0, method.broadcast(state, 0), c,
      LocalData(data.x, data.y, i, data.count[i]), k, server_data))(
          ids, cs, jax.random.split(key, 4))
  arr = (Arrivals(ids, jnp.ones(4, bool), outs, jnp.zeros(4, jnp.int32)),)
  params, ms, _ = jax.jit(method.server_update)(
      state, arr, jax.random.fold_in(key, 1), server_data)
  return state._replace(params=params, method_state=ms)


class NoCascadeTest(absltest.TestCase):

  def test_tiers_train_jointly_after_the_clustering(self):
    """cascade=False: the root stage and the clustering as before, then
    root, clusters and leaves all move in the same round, and the root is
    still its rank-r truncated product mean."""
    method = tiny_hilora(cluster_rounds=3, k_min=2, k_max=2, cascade=False)
    _, _, state, data, server_data = case(*NAME)
    s1 = server_round(method, state, data, server_data, jax.random.key(0))
    m1 = s1.method_state
    self.assertEqual(int(m1.stage), 2)     # straight to the joint stage
    self.assertEqual(int(m1.num_clusters), 2)
    s2 = server_round(method, s1, data, server_data, jax.random.key(1))
    m2 = s2.method_state
    self.assertEqual(int(m2.stage), 2)
    for before, after in ((s1.params[0], s2.params[0]),
                          (m1.clusters, m2.clusters),
                          (m1.leaves, m2.leaves)):
      self.assertFalse(all(jax.tree.leaves(jax.tree.map(
          np.array_equal, before, after))))
    dense = products(s2.params[0], 1.0)
    for p in lora_modules(s2.params[0]):
      np.testing.assert_allclose(dense[p], m2.root_dense[p], rtol=1e-5,
                                 atol=1e-6)
      self.assertLessEqual(np.linalg.matrix_rank(np.asarray(dense[p]),
                                                 tol=1e-5), 2)
    # Clusters are not frozen: a third round moves them again.
    s3 = server_round(method, s2, data, server_data, jax.random.key(2))
    self.assertFalse(all(jax.tree.leaves(jax.tree.map(
        np.array_equal, m2.clusters, s3.method_state.clusters))))


if __name__ == '__main__':
  absltest.main()
