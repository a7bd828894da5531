"""PF2LoRA's bilevel step and FDLoRA's stages, outer step and fusion."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust import engine, models
from fedrobust.cohort import single_cohort
from fedrobust.local import masked_cross_entropy
from fedrobust.methods import get_method
from fedrobust.methods.dual_lora import (_concat, fuse, fusion_grid,
                                         holdout_order)
from fedrobust.methods.fedlora import add_dense, products
from fedrobust.transforms import lora
from fedrobust.types import Arrivals, ClientOutput, LocalData
from tests.engine_test import IMAGE, NUM_CLASSES, toy_data
from tests.methods_test import case, run_rounds

ETA, BETA = 0.3, 0.7


def pf2lora_case(hypergradient):
  """One client, one local step of plain SGD over all its rows."""
  model = models.get_model('mlp', num_classes=NUM_CLASSES,
                           input_shape=IMAGE, hidden=(5,))
  transform = lora(model, ranks=(3,), targets=('all',))
  cohorts = single_cohort(model, transform, 2, 2, (3.0, 3.0))
  local = engine.LocalConfig(batch_size=8, num_epochs=1, steps_per_epoch=1)
  method = get_method('pf2lora', cohorts=cohorts, local=local,
                      optimizer=engine.sgd(learning_rate=ETA, momentum=0.0),
                      client_rank=2, lower_lr=BETA,
                      hypergradient=hypergradient)
  data = toy_data([5, 8], 8, seed=3)
  config = engine.RoundConfig(num_clients=2, clients_per_round=2,
                              strategy='vmap')
  state = engine.init_server_state(method, model.init(jax.random.key(0)), 2,
                                   seed=1, config=config, data=data)
  return method, transform, data, state


class PF2LoRAStepTest(parameterized.TestCase):

  @parameterized.parameters('first_order', 'unrolled', 'joint')
  def test_one_local_step_is_the_bilevel_step(self, hypergradient):
    method, transform, data, state = pf2lora_case(hypergradient)
    base = state.method_state.base
    x = state.params[0]
    # A client adapter with a non-zero product, so the modes differ.
    y = jax.tree.map(lambda l: jax.random.normal(jax.random.key(l.size),
                                                 l.shape[1:]) * 0.5,
                     state.method_state.own)
    local = LocalData(data.x, data.y, jnp.int32(0), data.count[0])
    out = method.client_update(0, method.broadcast(state, 0), y, local,
                               jax.random.key(2), {})
    rows = jnp.arange(5)
    xs, ys = data.x[0, rows], data.y[0, rows]

    def f(xx, yy):
      logits = transform.apply(base, _concat(xx, yy), xs)
      return masked_cross_entropy(logits, ys, jnp.ones(5, bool))[0]

    gy = jax.grad(f, argnums=1)(x, y)
    y1 = jax.tree.map(lambda v, g: v - BETA * g, y, gy)
    if hypergradient == 'first_order':
      gx = jax.grad(f)(x, y1)
    elif hypergradient == 'unrolled':
      gx = jax.grad(lambda xx: f(xx, jax.tree.map(
          lambda v, g: v - BETA * g, y, jax.grad(f, argnums=1)(xx, y))))(x)
    else:
      gx = jax.grad(f)(x, y)
    chex.assert_trees_all_close(out.client_state, y1, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(out.delta, jax.tree.map(lambda g: -ETA * g,
                                                        gx),
                                rtol=1e-4, atol=1e-6)
    # The three estimators really differ on this client.
    other = 'joint' if hypergradient != 'joint' else 'first_order'
    gx_other = jax.grad(f)(x, y) if other == 'joint' else jax.grad(f)(x, y1)
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(gx), jax.tree.leaves(gx_other)))
    self.assertGreater(diff, 1e-4)

  def test_personal_model_is_both_levels(self):
    method = case('pf2lora', 'plain')[0]
    state = run_rounds('pf2lora', 'plain', 2)[0]
    ms, x = state.method_state, state.params[0]
    glob, personal = method.eval_models(state)
    # The conformance LoRA has alpha = r_max, so the scale is 1.
    chex.assert_trees_all_close(glob.params,
                                add_dense(ms.base, products(x, 1.0)))
    for k in range(4):
      y = jax.tree.map(lambda l, k=k: l[k], ms.own)
      self.assertTrue(any(float(jnp.max(jnp.abs(v))) > 0
                          for v in products(y, 1.0).values()))
      chex.assert_trees_all_close(
          jax.tree.map(lambda l, k=k: l[k], personal.params),
          add_dense(ms.base, products(_concat(x, y), 1.0)),
          rtol=1e-5, atol=1e-6)

  def test_refuses_a_client_rank_not_below_r(self):
    model = models.get_model('mlp', num_classes=NUM_CLASSES,
                             input_shape=IMAGE, hidden=(5,))
    cohorts = single_cohort(model, lora(model, ranks=(2,)), 2, 2, (2.0, 2.0))
    with self.assertRaisesRegex(Exception, 'client_rank'):
      get_method('pf2lora', cohorts=cohorts,
                 local=engine.LocalConfig(batch_size=4, num_epochs=1,
                                          steps_per_epoch=1),
                 optimizer=engine.sgd(learning_rate=0.1), client_rank=2)


class FDLoRATest(absltest.TestCase):

  def test_stage_one_sets_the_global_to_the_mean_personal_adapter(self):
    s1 = run_rounds('fdlora', 'plain', 1)[0]
    own, counts = s1.method_state.own, np.array([5, 8, 3, 6], np.float32)
    want = jax.tree.map(lambda l: np.tensordot(counts / counts.sum(),
                                               np.asarray(l), 1), own)
    chex.assert_trees_all_close(s1.params[0], want, rtol=1e-5, atol=1e-6)
    # Every client trained its own adapter: the rows differ.
    leaf = jax.tree.leaves(own)[0]
    self.assertFalse(np.allclose(leaf[0], leaf[1]))

  def test_outer_step_is_nesterov_on_the_mean_delta(self):
    method = case('fdlora', 'plain')[0]
    s1 = run_rounds('fdlora', 'plain', 1)[0]
    theta = s1.params[0]
    ids = jnp.arange(4, dtype=jnp.int32)
    counts = jnp.asarray([5.0, 8.0, 3.0, 6.0])

    def arrivals(seed):
      deltas = jax.tree.map(lambda l: jnp.asarray(
          np.random.default_rng(seed).normal(size=(4, *l.shape)),
          jnp.float32), theta)
      own = jax.tree.map(lambda l: l[ids], s1.method_state.own)
      out = ClientOutput(deltas, counts, (own, jnp.zeros((4, 2))), {})
      return deltas, (Arrivals(ids, jnp.ones(4, bool), out,
                               jnp.zeros(4, jnp.int32)),)

    mean = lambda d: jax.tree.map(
        lambda l: jnp.tensordot(counts / counts.sum(), l, 1), d)
    d2, arr2 = arrivals(1)
    params2, ms2, _ = method.server_update(s1, arr2, jax.random.key(0), {})
    g2 = jax.tree.map(jnp.negative, mean(d2))
    mu = 0.5
    want2 = jax.tree.map(lambda t, g: t - (g + mu * g), theta, g2)
    chex.assert_trees_all_close(params2[0], want2, rtol=1e-5, atol=1e-6)
    s2 = s1._replace(params=params2, method_state=ms2, round=s1.round + 1)
    d3, arr3 = arrivals(2)
    params3, _, _ = method.server_update(s2, arr3, jax.random.key(0), {})
    g3 = jax.tree.map(jnp.negative, mean(d3))
    buf3 = jax.tree.map(lambda a, b: mu * a + b, g2, g3)
    want3 = jax.tree.map(lambda t, g, b: t - (g + mu * b), params2[0], g3,
                         buf3)
    chex.assert_trees_all_close(params3[0], want3, rtol=1e-5, atol=1e-6)

  def test_personal_adapter_syncs_every_h_rounds(self):
    # The conformance case has sync_every=2.
    s1 = run_rounds('fdlora', 'plain', 1)[0]
    s2 = run_rounds('fdlora', 'plain', 1, state=s1)[0]
    s3 = run_rounds('fdlora', 'plain', 1, state=s2)[0]
    same = lambda a, b: all(jax.tree.leaves(jax.tree.map(np.array_equal,
                                                         a, b)))
    self.assertFalse(same(s1.method_state.own, s2.method_state.own))
    self.assertTrue(same(s2.method_state.own, s3.method_state.own))

  def test_fusion_weights_are_grid_points_and_the_personal_models_use_them(
      self):
    method = case('fdlora', 'plain')[0]
    state = run_rounds('fdlora', 'plain', 2)[0]
    grid = fusion_grid(3, 1.5)
    np.testing.assert_allclose(grid, [[a, b] for a in (-1.5, 0, 1.5)
                                      for b in (-1.5, 0, 1.5)])
    w = np.asarray(state.method_state.fusion)
    for row in w:
      self.assertTrue(np.any(np.all(np.isclose(grid, row), axis=1)), row)
    _, personal = method.eval_models(state)
    ms = state.method_state
    transform_scale = 1.0   # alpha = r_max: the conformance LoRA's scale
    for k in range(4):
      mine = jax.tree.map(lambda l, k=k: l[k], ms.own)
      want = add_dense(ms.base, products(
          fuse(ms.fusion[k], mine, state.params[0]), transform_scale))
      got = jax.tree.map(lambda l, k=k: l[k], personal.params)
      chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


  def test_holdout_rows_never_reach_local_training(self):
    model = models.get_model('mlp', num_classes=NUM_CLASSES,
                             input_shape=IMAGE, hidden=(5,))
    transform = lora(model, ranks=(2,), targets=('all',))
    cohorts = single_cohort(model, transform, 2, 2, (2.0, 2.0))
    data = toy_data([10, 8], 10, seed=5)
    config = engine.RoundConfig(num_clients=2, clients_per_round=2,
                                strategy='vmap')

    def deltas(holdout, x):
      method = get_method(
          'fdlora', cohorts=cohorts,
          local=engine.LocalConfig(batch_size=4, num_epochs=1,
                                   steps_per_epoch=3),
          optimizer=engine.sgd(learning_rate=0.1), fusion_points=3,
          fusion_holdout=holdout)
      state = engine.init_server_state(method, model.init(jax.random.key(0)),
                                       2, seed=1, config=config, data=data)
      own = jax.tree.map(lambda l: l[0], state.method_state.own)
      local = LocalData(x, data.y, jnp.int32(0), data.count[0])
      return method.client_update(0, method.broadcast(state, 0), own, local,
                                  jax.random.key(3), {}).delta

    order = np.asarray(holdout_order(jnp.int32(0), jnp.int32(10), 10))
    self.assertEqual(sorted(order), list(range(10)))
    held = order[8:]            # min(16, 10 // 5) = 2 rows held out
    other = data.x.at[0, held].set(255 - data.x[0, held])
    chex.assert_trees_all_equal(deltas(True, data.x), deltas(True, other))
    # Without the hold-out the same rows are trained on.
    diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                        deltas(False, data.x), deltas(False, other))
    self.assertGreater(max(jax.tree.leaves(diff)), 0.0)


if __name__ == '__main__':
  absltest.main()
