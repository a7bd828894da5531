"""The federated-LoRA baselines' server rules against hand computations.

The engine contract (finite, masked arrivals inert, no retrace, exact
resume) is checked for every method in methods_test; here each rule is
checked for what makes it that method.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from fedrobust import models
from fedrobust.methods import fedlora
from fedrobust.transforms import lora
from fedrobust.transforms.base import get_path
from fedrobust.types import Arrivals, LocalData
from tests import methods_test


def client_outputs(name, n=3):
  """(method, state, stacked outputs of clients 0..n-1, arrivals)."""
  method, _, state, data, server_data = methods_test.case(name, 'plain')
  ids = jnp.arange(n, dtype=jnp.int32)
  client_state = method.client_state(state.method_state, 0, ids)
  outs = [method.client_update(
      0, method.broadcast(state, 0),
      jax.tree.map(lambda leaf, i=i: leaf[i], client_state),
      LocalData(data.x, data.y, ids[i], data.count[i]),
      jax.random.key(i), server_data) for i in range(n)]
  stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *outs)
  arrivals = (Arrivals(ids, jnp.ones(n, bool), stacked,
                       jnp.zeros(n, jnp.int32)),)
  return method, state, stacked, arrivals, server_data


def tiny_lora():
  """The transform methods_test.case builds (ranks 1 and 2)."""
  model = models.get_model('mlp', num_classes=methods_test.NUM_CLASSES,
                           input_shape=methods_test.IMAGE, hidden=(5,))
  return lora(model, ranks=(1, 2), targets=('all',))


def weights_of(stacked):
  w = np.asarray(stacked.weight, np.float64)
  return w / w.sum()


class HelpersTest(absltest.TestCase):

  def test_svd_factors_rebuild_the_truncated_product(self):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(7, 5)).astype(np.float32)
    for rank, scale in ((5, 1.0), (2, 4.0)):
      f = fedlora.svd_factors({'m': jnp.asarray(w)}, rank, scale)['m']
      u, s, vt = np.linalg.svd(w, full_matrices=False)
      want = (u[:, :rank] * s[:rank]) @ vt[:rank]
      np.testing.assert_allclose(scale * f['a'] @ f['b'], want, atol=1e-5)
      # a has orthonormal columns; every singular value sits in b.
      np.testing.assert_allclose(f['a'].T @ f['a'], np.eye(rank), atol=1e-5)
    # A rank above the matrix's size pads with zero columns.
    f = fedlora.svd_factors({'m': jnp.asarray(w)}, 8, 1.0)['m']
    self.assertEqual(f['a'].shape, (7, 8))
    np.testing.assert_array_equal(f['a'][:, 5:], 0)
    np.testing.assert_allclose(f['a'] @ f['b'], w, atol=1e-5)

  def test_products_and_add_dense_equal_the_transform_merge(self):
    state = methods_test.case('flora', 'plain')[2]
    rng = np.random.default_rng(1)
    trainable = jax.tree.map(
        lambda l: jnp.asarray(rng.normal(size=l.shape), jnp.float32),
        state.params[0])
    t = tiny_lora()
    base = state.method_state.base
    for rank in (1.0, 2.0):
      merged = t.merge(base, trainable, jnp.float32(rank))
      dense = fedlora.products(trainable, t.factor_scale(jnp.float32(rank)))
      chex.assert_trees_all_close(fedlora.add_dense(base, dense), merged,
                                  atol=1e-5)

  def test_fair_residual_recovers_a_reachable_product(self):
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.normal(size=(12, 3)), jnp.float32)
    b_star = jnp.asarray(rng.normal(size=(3, 6)), jnp.float32)
    b_bar = b_star + 0.3 * jnp.asarray(rng.normal(size=(3, 6)), jnp.float32)
    ideal = 2.0 * a @ b_star
    cos = lambda b: float(jnp.vdot(ideal, 2.0 * a @ b) / (
        jnp.linalg.norm(ideal) * jnp.linalg.norm(2.0 * a @ b)))
    fixed = fedlora.fair_residual(ideal, a, b_bar, 2.0, lam=0.0, steps=300,
                                  lr=0.01)
    self.assertLess(cos(b_bar), 0.99)
    self.assertGreater(cos(fixed), 0.999)
    # A strong regulariser keeps b near b_bar (LoRA-FAIR's trade-off).
    held = fedlora.fair_residual(ideal, a, b_bar, 2.0, lam=100.0,
                                 steps=300, lr=0.01)
    self.assertLess(float(jnp.linalg.norm(held - b_bar)),
                    0.2 * float(jnp.linalg.norm(fixed - b_bar)))
    # b = 0 (nothing trained yet) stays 0.
    zero = fedlora.fair_residual(ideal, a, jnp.zeros_like(b_bar), 2.0,
                                 lam=0.01, steps=10, lr=0.01)
    np.testing.assert_array_equal(zero, 0)

  def test_communication_bytes(self):
    modules = {'q': (384, 384), 'v': (384, 384), 'head': (384, 2)}
    full8 = 8 * (768 + 768 + 386) * 4
    self.assertEqual(fedlora.communication_bytes('fedit', modules, rank=8),
                     (full8, full8))
    ffa = (8 * 384 * 2 + 8 * 386) * 4
    self.assertEqual(fedlora.communication_bytes('ffa_lora', modules,
                                                 rank=8), (ffa, ffa))
    up, down = fedlora.communication_bytes('flora', modules, rank=2,
                                           round_ranks=(2, 4, 8, 16))
    self.assertEqual(up, 2 * 1922 * 4)
    self.assertEqual(down, 30 * 1922 * 4)
    self.assertEqual(fedlora.communication_bytes(
        'rfd_lora', modules, rank=4, round_ranks=(2, 16), anchors=845,
        classes=2), (845 * 2 * 4, 16 * 1922 * 4))
    with self.assertRaisesRegex(ValueError, 'unknown method'):
      fedlora.communication_bytes('fedsgd', modules, rank=8)


class RulesTest(absltest.TestCase):

  def test_ffa_lora_freezes_a_outside_the_head(self):
    method, state, stacked, arrivals, server_data = client_outputs(
        'ffa_lora')
    paths = fedlora.lora_modules(state.params[0])
    self.assertLen(paths, 2)            # the MLP's hidden layer and head
    head = models.get_model('mlp', num_classes=methods_test.NUM_CLASSES,
                            input_shape=methods_test.IMAGE,
                            hidden=(5,)).roles['head']
    for path in paths:
      d = get_path(stacked.delta, path)
      if path == head:
        self.assertGreater(float(jnp.abs(d['a']).max()), 0)
      else:
        np.testing.assert_array_equal(d['a'], 0)   # frozen, exactly
      self.assertGreater(float(jnp.abs(d['b']).max()), 0)
    params, *_ = method.server_update(state, arrivals, jax.random.key(0),
                                      server_data)
    for path in paths:
      if path != head:
        np.testing.assert_array_equal(get_path(params[0], path)['a'],
                                      get_path(state.params[0], path)['a'])

  def test_flora_merges_the_exact_weighted_sum_of_products(self):
    method, state, stacked, arrivals, server_data = client_outputs('flora')
    params, ms, _ = method.server_update(state, arrivals, jax.random.key(0),
                                         server_data)
    # Each client's upload is its product s_k a_k b_k (the start has b = 0,
    # so the product is the change); the base gains their weighted mean.
    w = weights_of(stacked)
    for path, d in stacked.delta.items():
      want = np.tensordot(w, np.asarray(d, np.float64), 1)
      before = get_path(state.method_state.base, path)['kernel']
      after = get_path(ms.base, path)['kernel']
      np.testing.assert_allclose(np.asarray(after - before).reshape(
          want.shape), want, atol=1e-6)
      self.assertGreater(np.abs(want).max(), 0)
    # Fresh factors every round: b = 0 and a new a.
    for path in fedlora.lora_modules(params[0]):
      np.testing.assert_array_equal(get_path(params[0], path)['b'], 0)
      self.assertFalse(np.allclose(get_path(params[0], path)['a'],
                                   get_path(state.params[0], path)['a']))
    chex.assert_trees_all_equal(
        jax.tree.map(jnp.zeros_like, ms.dense), ms.dense)
    # The evaluated model is the merged base.
    (model,) = method.eval_models(state._replace(params=params,
                                                 method_state=ms))
    chex.assert_trees_all_close(model.params, ms.base)

  def test_flexlora_truncates_the_product_mean_to_each_rank(self):
    method, state, stacked, arrivals, server_data = client_outputs(
        'flexlora')
    params, ms, _ = method.server_update(state, arrivals, jax.random.key(0),
                                         server_data)
    w = weights_of(stacked)
    t = tiny_lora()
    for path, d in stacked.delta.items():
      # W_g = 0 before round 1, so the deltas are the products.
      want = np.tensordot(w, np.asarray(d, np.float64), 1)
      np.testing.assert_allclose(ms.dense[path], want, atol=1e-6)
      f = get_path(params[0], path)
      u, s, vt = np.linalg.svd(want)
      top2 = (u[:, :2] * s[:2]) @ vt[:2]
      np.testing.assert_allclose(t.factor_scale(None) * f['a'] @ f['b'],
                                 top2, atol=1e-5)
    # A rank-1 client starts the next round from the rank-1 truncation.
    state2 = state._replace(params=params, method_state=ms)
    spec = jnp.float32(1.0)
    start = {p: {'a': get_path(params[0], p)['a'],
                 'b': get_path(params[0], p)['b'] *
                      t.factor_scale(None) / t.factor_scale(spec)}
             for p in fedlora.lora_modules(params[0])}
    cov = t.coverage(params[0], spec, 2)
    for p in start:
      c = get_path(cov, p)
      prod = t.factor_scale(spec) * ((start[p]['a'] * c['a']) @
                                     (start[p]['b'] * c['b']))
      u, s, vt = np.linalg.svd(np.asarray(ms.dense[p], np.float64))
      np.testing.assert_allclose(prod, (u[:, :1] * s[:1]) @ vt[:1],
                                 atol=1e-5)
    # The evaluated model is W0 + W_g, untruncated.
    (m,) = method.eval_models(state2)
    chex.assert_trees_all_close(
        m.params, fedlora.add_dense(ms.base, ms.dense), atol=1e-6)

  def test_lora_fair_moves_b_toward_the_ideal_product(self):
    method, state, stacked, arrivals, server_data = client_outputs(
        'lora_fair')
    fedit_params, *_ = methods_test.case('fedit', 'plain')[0].server_update(
        state, arrivals, jax.random.key(0), server_data)
    params, *_ = method.server_update(state, arrivals, jax.random.key(0),
                                      server_data)
    t = tiny_lora()
    w = weights_of(stacked)
    specs = jnp.asarray((1.0, 2.0, 2.0))
    finals = jax.tree.map(lambda s, c, d: s[None] * c + d, state.params[0],
                          stacked.coverage, stacked.delta)
    per = jax.vmap(fedlora.products)(finals, t.factor_scale(specs))
    for path in fedlora.lora_modules(params[0]):
      ideal = np.tensordot(w, np.asarray(per[path], np.float64), 1)
      cos = lambda f: float(np.vdot(ideal, f['a'] @ f['b']) / (
          np.linalg.norm(ideal) * np.linalg.norm(f['a'] @ f['b'])))
      fair, avg = get_path(params[0], path), get_path(fedit_params[0], path)
      np.testing.assert_array_equal(fair['a'], avg['a'])   # A untouched
      self.assertGreater(cos(fair), cos(avg))


if __name__ == '__main__':
  absltest.main()
