"""Tests for SDFC: Fisher diagonal, FDAgg weights, FDReg gradient."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import functools

from fedrobust import engine
from fedrobust.aggregators.mean import fdagg_weights
from fedrobust.cohort import single_cohort
from fedrobust.local import classification_loss
from fedrobust.methods import get_method
from fedrobust import models
from fedrobust.methods.sdfc import fisher as fisher_lib
from fedrobust.methods.sdfc.fisher import factored_plan, fisher_diagonal
from fedrobust.methods.sdfc import SDFCClientState
from fedrobust.transforms import identity
from fedrobust.types import LocalData
from tests.engine_test import NUM_CLASSES, linear_model, toy_data


def numpy_grads(params, x, y):
  """Per-example d log p(y|x) / d(w, b) for softmax regression."""
  xf = (np.asarray(x, np.float64).reshape(len(y), -1) / 255 - 0.5) / 0.5
  z = xf @ np.asarray(params['w'], np.float64) + np.asarray(params['b'])
  p = np.exp(z - z.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  r = np.eye(NUM_CLASSES)[np.asarray(y)] - p      # d log p / d z
  return xf[:, :, None] * r[:, None, :], r          # [n, 4, 3], [n, 3]


class FisherTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.model = linear_model()
    self.params = self.model.init(jax.random.key(3))
    data = toy_data([7], 8, seed=5)
    self.x = data.x[0].reshape(2, 4, 2, 2, 1)
    self.y = data.y[0].reshape(2, 4)
    self.mask = (jnp.arange(8) < 7).reshape(2, 4)

  @parameterized.parameters('fisher', 'abs_grad')
  def test_per_example_matches_numpy(self, importance):
    gw, gb = numpy_grads(self.params, self.x.reshape(8, 2, 2, 1)[:7],
                         self.y.reshape(8)[:7])
    stat = np.square if importance == 'fisher' else np.abs
    got = jax.jit(lambda p, x, y, m: fisher_diagonal(
        self.model.apply, p, x, y, m, importance=importance))(
            self.params, self.x, self.y, self.mask)
    np.testing.assert_allclose(got['w'], stat(gw).mean(0), rtol=1e-4,
                               atol=1e-7)
    np.testing.assert_allclose(got['b'], stat(gb).mean(0), rtol=1e-4,
                               atol=1e-7)

  @parameterized.parameters('fisher', 'abs_grad')
  def test_released_estimator_matches_numpy_transcription(self, importance):
    """The release (PrevAbsFedFish.py), transcribed literally: per batch,
    pre = log_softmax(model(x)); L = pre[:, label].mean() over the B x B
    matrix of log p(y_j | x_i); the batch gradients are averaged over the
    batches and squared (or |.|) after averaging."""
    w = np.asarray(self.params['w'], np.float64)
    b = np.asarray(self.params['b'], np.float64)
    x = np.asarray(self.x, np.float64).reshape(2, 4, -1)
    y = np.asarray(self.y)
    m = np.asarray(self.mask)
    grads_w, grads_b = [], []
    for t in range(2):
      xs = (x[t][m[t]] / 255 - 0.5) / 0.5          # the real examples
      ys = y[t][m[t]]
      z = xs @ w + b
      p = np.exp(z - z.max(1, keepdims=True))
      p /= p.sum(1, keepdims=True)
      n = len(ys)
      # d/dz_i of mean_{i,j} log p(y_j | x_i) = (1/n^2) sum_j (e_{y_j} - p_i)
      dz = np.stack([(np.eye(NUM_CLASSES)[ys] - p[i]).sum(0)
                     for i in range(n)]) / n ** 2
      grads_w.append(xs.T @ dz)
      grads_b.append(dz.sum(0))
    stat = np.square if importance == 'fisher' else np.abs
    got = fisher_diagonal(self.model.apply, self.params, self.x, self.y,
                          self.mask, mode='released', importance=importance)
    np.testing.assert_allclose(got['w'], stat(np.mean(grads_w, 0)),
                               rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(got['b'], stat(np.mean(grads_b, 0)),
                               rtol=1e-4, atol=1e-9)

  @parameterized.product(mode=('per_example', 'released'),
                          importance=('fisher', 'abs_grad'))
  def test_empty_batches_change_nothing(self, mode, importance):
    # Padding batches (a smaller client's tail) are skipped, not counted.
    # Their images are NaN-free garbage; a leak would change the result.
    pad_x = jnp.full((2, 4, 2, 2, 1), 255, jnp.uint8)
    pad_y = jnp.zeros((2, 4), jnp.int32)
    x = jnp.concatenate([self.x[:1], pad_x, self.x[1:]])
    y = jnp.concatenate([self.y[:1], pad_y, self.y[1:]])
    mask = jnp.concatenate([self.mask[:1], jnp.zeros((2, 4), bool),
                            self.mask[1:]])
    fisher = jax.jit(lambda x, y, m: fisher_diagonal(
        self.model.apply, self.params, x, y, m, mode=mode,
        importance=importance))
    chex.assert_trees_all_close(fisher(x, y, mask),
                                fisher(self.x, self.y, self.mask),
                                rtol=1e-6, atol=1e-9)
    empty = fisher(x, y, jnp.zeros_like(mask))
    chex.assert_trees_all_equal(empty, jax.tree.map(jnp.zeros_like,
                                                    self.params))

  def test_merged_batches_give_the_same_fisher(self):
    # Three stored batches of 4 (the last all padding) re-cut into batches
    # of 8: the padded tail batch is skipped, the sums are unchanged.
    x = jnp.concatenate([self.x, jnp.full((1, 4, 2, 2, 1), 9, jnp.uint8)])
    y = jnp.concatenate([self.y, jnp.ones((1, 4), jnp.int32)])
    mask = jnp.concatenate([self.mask, jnp.zeros((1, 4), bool)])
    fisher = jax.jit(lambda x, y, m, b: fisher_diagonal(
        self.model.apply, self.params, x, y, m, batch_size=b),
                     static_argnums=3)
    chex.assert_trees_all_close(fisher(x, y, mask, 8),
                                fisher(self.x, self.y, self.mask, 4),
                                rtol=1e-6, atol=1e-9)
    mx, my, mm = fisher_lib.merge_batches(x, y, mask, 8)
    self.assertEqual(mx.shape, (2, 8, 2, 2, 1))
    np.testing.assert_array_equal(mx[0], x[:2].reshape(8, 2, 2, 1))
    np.testing.assert_array_equal(my[1, :4], y[2])
    np.testing.assert_array_equal(
        mm, np.concatenate([mask.reshape(-1), np.zeros(4, bool)]
                           ).reshape(2, 8))
    with self.assertRaisesRegex(ValueError, 'multiple of the stored'):
      fisher_lib.merge_batches(x, y, mask, 6)

  def test_fisher_batch_size_rule(self):
    size = fisher_lib.fisher_batch_size
    self.assertEqual(size(64, factored=True, backend='cpu'), 128)
    self.assertEqual(size(48, factored=True, backend='cpu'), 96)
    self.assertEqual(size(200, factored=True, backend='cpu'), 200)
    self.assertEqual(size(64, factored=False, backend='cpu'), 64)
    self.assertEqual(size(64, factored=True, backend='gpu'), 64)

  def test_unknown_variant_names_flag(self):
    with self.assertRaisesRegex(ValueError, 'importance'):
      fisher_diagonal(self.model.apply, self.params, self.x, self.y,
                      self.mask, importance='hessian')


class FactoredFisherTest(parameterized.TestCase):
  """impl='factored' (one backward pass, per-layer products) equals
  impl='vmap' (per-example gradients) on zoo models: Dense layers, VALID
  convs (simple_cnn), SAME convs (cnn), with padded examples masked."""

  # conv_impl 'block' (the CPU default) probes the fused conv-pool layers
  # in block layout; 'im2col' probes each conv's full output.
  # batch: the factored pass's batch (fisher_batch_size); 10 keeps the
  # stored batches, 0 the CPU default (the 2 stored batches of 10, padded
  # with 10 empty ones, re-cut into one batch of 120 holding all 12 real
  # examples).
  @parameterized.parameters(
      ('simple_cnn', {'conv_impl': 'block'}, 'fisher', 10),
      ('simple_cnn', {'conv_impl': 'block'}, 'fisher', 0),
      ('simple_cnn', {'conv_impl': 'im2col'}, 'fisher', 10),
      ('cnn', {'width': 4, 'hidden': 16, 'conv_impl': 'block'}, 'fisher',
       10),
      ('cnn', {'width': 4, 'hidden': 16, 'conv_impl': 'im2col'}, 'fisher',
       10),
      ('mlp', {'hidden': (16, 8)}, 'abs_grad', 20))
  def test_factored_equals_vmap(self, name, kwargs, importance, batch):
    model = models.get_model(name, num_classes=10, input_shape=(28, 28, 1),
                             **kwargs)
    params = model.init(jax.random.key(1))
    rng = np.random.default_rng(0)
    # Batches of 10: the conv statistics run in 2 chunks of 5
    # (fisher.STAT_CHUNK), one of them all padding in the second batch.
    x = jnp.asarray(rng.integers(0, 256, (2, 10, 28, 28, 1)), jnp.uint8)
    y = jnp.asarray(rng.integers(0, 10, (2, 10)), jnp.int32)
    mask = jnp.asarray([[True] * 10, [True, True, False] + [False] * 7])
    self.assertEqual(fisher_lib._chunk_size(10, 'cpu'), 5)
    self.assertEqual(fisher_lib._chunk_size(10, 'gpu'), 10)
    # Both conv routes are exercised on CPU: simple_cnn's Conv_1 (6->16)
    # and cnn's Conv_1 (4->8) by shifts, every Conv_0 (1 channel) by
    # patches.
    self.assertEqual(fisher_lib._conv_route((5, 5, 6, 16), 'cpu'), 'shifts')
    self.assertEqual(fisher_lib._conv_route((5, 5, 4, 8), 'cpu'), 'shifts')
    self.assertEqual(fisher_lib._conv_route((5, 5, 1, 6), 'cpu'), 'patches')
    self.assertEqual(fisher_lib._conv_route((5, 5, 6, 16), 'gpu'), 'patches')
    self.assertTrue(factored_plan(params, model.probe, x[0]))

    self.assertEqual(fisher_lib.fisher_batch_size(10, factored=True,
                                                  backend='cpu'), 120)

    def fisher(impl):
      return jax.jit(lambda p: fisher_diagonal(
          model.apply, p, x, y, mask, importance=importance, impl=impl,
          probe_fn=model.probe, batch_size=batch if impl == 'factored'
          else 10))(params)

    want, got = fisher('vmap'), fisher('factored')
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=2e-5,
                                 atol=2e-6 * float(np.max(np.abs(b))))

  def test_models_without_probes_fall_back(self):
    model = linear_model()
    params = model.init(jax.random.key(0))
    x = jnp.zeros((1, 4, 2, 2, 1), jnp.uint8)
    self.assertFalse(factored_plan(params, model.probe, x[0]))
    y = jnp.zeros((1, 4), jnp.int32)
    a = fisher_diagonal(model.apply, params, x, y, jnp.ones((1, 4), bool),
                        impl='factored', probe_fn=model.probe)
    b = fisher_diagonal(model.apply, params, x, y, jnp.ones((1, 4), bool))
    chex.assert_trees_all_close(a, b)


class FDAggTest(absltest.TestCase):

  def test_weights_match_eq10_by_hand(self):
    totals = jnp.array([2.0, 6.0, 4.0, 99.0, jnp.nan])
    mask = jnp.array([True, True, True, False, False])
    normed = np.array([0.0, 1.0, 0.5])
    sig = 1 / (1 + np.exp(normed))      # sigmoid(-T^)
    expected = np.concatenate([sig / sig.sum(), [0.0, 0.0]])
    np.testing.assert_allclose(fdagg_weights(totals, mask), expected,
                               rtol=1e-6)

  def test_equal_totals_give_uniform_weights(self):
    w = fdagg_weights(jnp.array([3.0, 3.0, 3.0, 3.0]), jnp.ones(4, bool))
    np.testing.assert_allclose(w, 0.25)

  def test_softmax_weighting_of_the_release_by_hand(self):
    totals = jnp.array([2.0, 6.0, 4.0, 99.0])
    mask = jnp.array([True, True, True, False])
    e = np.exp(-np.array([0.0, 1.0, 0.5]))      # softmax(-T^)
    np.testing.assert_allclose(
        fdagg_weights(totals, mask, 'softmax'),
        np.concatenate([e / e.sum(), [0.0]]), rtol=1e-6)


class FDRegTest(absltest.TestCase):

  def test_one_step_equals_ce_plus_penalty_gradient(self):
    model = linear_model()
    data = toy_data([4], 4, seed=2)
    local = engine.LocalConfig(batch_size=4, num_epochs=1, steps_per_epoch=1)
    lr, lam = 0.1, 5.0
    method = get_method('sdfc', cohorts=single_cohort(
        model, identity(model), 1, 1), local=local,
                        optimizer=engine.sgd(learning_rate=lr), lam=lam)
    update = jax.jit(functools.partial(method.client_update, 0))
    params = model.init(jax.random.key(0))
    anchor = jax.tree.map(lambda p: p + 0.3, params)
    h = jax.tree.map(lambda p: jnp.linspace(0.0, 2.0, p.size).reshape(
        p.shape), params)
    state = SDFCClientState(anchor, h, jnp.bool_(True))
    u = {'validation': (data.x[0].reshape(1, 4, 2, 2, 1),
                        data.y[0].reshape(1, 4), jnp.ones((1, 4), bool))}
    out = update(
        params, state, LocalData(data.x, data.y, jnp.int32(0), data.count[0]),
        jax.random.key(1), u)
    ce_grad = jax.grad(lambda p: classification_loss(model.apply)(
        p, data.x[0], data.y[0], jnp.ones(4, bool), None)[0])(params)
    expected = jax.tree.map(
        lambda g, hh, w, a: -lr * (g + 2 * lam * hh * (w - a)),
        ce_grad, h, params, anchor)
    chex.assert_trees_all_close(out.delta, expected, rtol=1e-5, atol=1e-7)
    self.assertTrue(bool(out.client_state.seen))
    # First participation: no penalty, so the step is plain CE.
    fresh = SDFCClientState(anchor, h, jnp.bool_(False))
    out = update(
        params, fresh, LocalData(data.x, data.y, jnp.int32(0),
                                 data.count[0]), jax.random.key(1), u)
    chex.assert_trees_all_close(
        out.delta, jax.tree.map(lambda g: -lr * g, ce_grad), rtol=1e-5,
        atol=1e-7)


class FisherBatchSettingTest(absltest.TestCase):

  def test_bad_fisher_batch_names_the_setting(self):
    model = linear_model()
    local = engine.LocalConfig(batch_size=4, num_epochs=1, steps_per_epoch=1)
    build = lambda **kw: get_method(
        'sdfc', cohorts=single_cohort(model, identity(model), 1, 1),
        local=local, optimizer=engine.sgd(learning_rate=0.1), **kw)
    with self.assertRaisesRegex(ValueError, 'fisher_batch.*multiple.*4'):
      build(fisher_batch=6)
    with self.assertRaisesRegex(ValueError, "fisher_batch.*'released'"):
      build(fisher_batch=8, fisher_mode='released')
    build(fisher_batch=8)


class FirstRoundTest(absltest.TestCase):

  def test_anchor_init_penalises_from_the_first_participation(self):
    """anchor_init (the release): at a client's first participation H is
    taken at the incoming model w0, which is also the anchor. Two SGD steps:
    step 1 has zero penalty (w = w0), step 2 has lam sum H0 (w1 - w0)^2."""
    model = linear_model()
    data = toy_data([8], 8, seed=2)
    local = engine.LocalConfig(batch_size=4, num_epochs=1, steps_per_epoch=2)
    lr, lam = 0.1, 5.0
    v = toy_data([8], 8, seed=9)           # U differs from the client's data
    u = {'validation': (v.x[0].reshape(2, 4, 2, 2, 1),
                        v.y[0].reshape(2, 4), jnp.ones((2, 4), bool))}
    params = model.init(jax.random.key(0))
    fresh = SDFCClientState(jax.tree.map(jnp.zeros_like, params),
                            jax.tree.map(jnp.zeros_like, params),
                            jnp.bool_(False))
    outs = {}
    for first_round in ('none', 'anchor_init'):
      method = get_method('sdfc', cohorts=single_cohort(
          model, identity(model), 1, 1), local=local,
                          optimizer=engine.sgd(learning_rate=lr), lam=lam,
                          first_round=first_round)
      outs[first_round] = jax.jit(functools.partial(method.client_update,
                                                    0))(
          params, fresh, LocalData(data.x, data.y, jnp.int32(0),
                                   data.count[0]), jax.random.key(1), u)
    self.assertEqual(float(outs['none'].metrics['fdreg_penalty']), 0.0)
    # H0 at w0 on the client's data (one pass in order) and on U.
    xs, ys = data.x[0].reshape(2, 4, 2, 2, 1), data.y[0].reshape(2, 4)
    mask = jnp.ones((2, 4), bool)
    h0 = jax.tree.map(lambda a, v: jnp.abs(a - v),
                      fisher_diagonal(model.apply, params, xs, ys, mask),
                      fisher_diagonal(model.apply, params, *u['validation']))
    # w1: the first step of the same batch plan (plain CE, zero penalty).
    plan = engine.make_batch_plan(jax.random.split(jax.random.key(1))[0],
                                  data.count[0], config=local)
    rows = plan.index[0]
    g = jax.grad(lambda p: classification_loss(model.apply)(
        p, data.x[0][rows], data.y[0][rows], jnp.ones(4, bool),
        None)[0])(params)
    w1 = jax.tree.map(lambda p, gg: p - lr * gg, params, g)
    penalty2 = sum(float(jnp.sum(h * jnp.square(a - b))) for h, a, b in zip(
        jax.tree.leaves(h0), jax.tree.leaves(w1), jax.tree.leaves(params)))
    np.testing.assert_allclose(
        float(outs['anchor_init'].metrics['fdreg_penalty']),
        (0.0 + penalty2) / 2, rtol=1e-4)
    self.assertGreater(penalty2, 0.0)


if __name__ == '__main__':
  absltest.main()
