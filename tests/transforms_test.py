"""Tests for fedrobust.transforms (identity, LoRA, width) and fedrobust.cohort
alignment."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust import cohort as cohort_lib
from fedrobust import models
from fedrobust import transforms
from fedrobust.errors import SettingError

IMAGE = (6, 6, 1)


def tiny(name, **kwargs):
  defaults = {'simple_cnn': {}, 'cnn': dict(width=4, hidden=8),
              'row_lstm': dict(hidden=4), 'mlp': dict(hidden=(8, 6))}[name]
  shape = (28, 28, 1) if name == 'simple_cnn' else IMAGE
  return models.get_model(name, num_classes=3, input_shape=shape,
                          **{**defaults, **kwargs})


def images(model, n=3, seed=1):
  return jax.random.uniform(jax.random.key(seed), (n, *model.input_shape))


def perturbed(tree, seed=3, scale=0.1):
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      l + scale * jax.random.normal(k, l.shape) for l, k in zip(leaves, keys)])


class LoRATest(parameterized.TestCase):

  @parameterized.parameters('mlp', 'row_lstm', 'cnn')
  def test_factored_apply_equals_merged_weights(self, name):
    """Frozen base + LoRA factors (read by the layers, unmerged) computes
    the same logits as the merged kernels W + (alpha/r) A B."""
    model = tiny(name)
    t = transforms.lora(model, ranks=(2, 4), targets=('first', 'head'))
    base, trainable = t.init(model.init(jax.random.key(0)),
                             jax.random.key(2))
    trainable = perturbed(trainable)
    x = images(model)
    for rank in (2.0, 4.0):
      spec = jnp.float32(rank)
      owned = transforms.masked(trainable, t.coverage(trainable, spec, 0))
      factored = jax.jit(lambda b, tr: t.apply(b, tr, x, spec=spec))(
          base, owned)
      merged = model.apply(t.merge(base, owned, spec), x)
      chex.assert_trees_all_close(factored, merged, rtol=1e-5, atol=1e-5)
      # By hand for the head: W + (alpha / r) a b with alpha = r_max = 4.
      head = model.roles['head']
      by_hand = (base[head]['kernel'] + (4.0 / rank) * owned[head]['a']
                 @ owned[head]['b'])
      np.testing.assert_allclose(t.merge(base, owned, spec)[head]['kernel'],
                                 by_hand, rtol=1e-5, atol=1e-6)

  def test_init_is_the_frozen_model_and_has_the_right_shapes(self):
    model = tiny('cnn')
    params = model.init(jax.random.key(0))
    t = transforms.lora(model, ranks=(8,), targets=('first', 'head'))
    base, trainable = t.init(params, jax.random.key(1))
    self.assertEqual(sorted(trainable), ['Conv_0', 'Dense_1'])
    # Conv_0 kernel [5, 5, 1, 4] is read as a [25, 4] matrix.
    chex.assert_shape(trainable['Conv_0']['a'], (25, 8))
    chex.assert_shape(trainable['Conv_0']['b'], (8, 4))
    chex.assert_shape(trainable['Dense_1']['a'], (8, 8))
    np.testing.assert_array_equal(trainable['Dense_1']['b'], 0.0)
    a = np.asarray(trainable['Conv_0']['a'])
    self.assertGreater(a.std(), 0.5 / np.sqrt(25))   # Gaussian, ~1/sqrt(d)
    self.assertLess(a.std(), 2.0 / np.sqrt(25))
    x = images(model)
    chex.assert_trees_all_close(t.apply(base, trainable, x),
                                model.apply(params, x), rtol=1e-6)
    self.assertIsNone(t.coverage(trainable, None, 0))   # one rank: no mask

  def test_non_native_model_gets_merged_kernels(self):
    model = tiny('mlp')
    foreign = model._replace(lora_native=False)
    t_native = transforms.lora(model, ranks=(3,), targets=('all',))
    t_foreign = transforms.lora(foreign, ranks=(3,), targets=('all',))
    base, trainable = t_native.init(model.init(jax.random.key(0)),
                                    jax.random.key(1))
    trainable = perturbed(trainable)
    x = images(model)
    chex.assert_trees_all_close(t_foreign.apply(base, trainable, x),
                                t_native.apply(base, trainable, x),
                                rtol=1e-5, atol=1e-6)

  def test_uncovered_rank_gets_no_gradient(self):
    model = tiny('mlp')
    t = transforms.lora(model, ranks=(2, 5), targets=('head',))
    base, trainable = t.init(model.init(jax.random.key(0)),
                             jax.random.key(1))
    trainable = perturbed(trainable)
    spec = jnp.float32(2.0)
    cov = t.coverage(trainable, spec, 0)
    x = images(model)

    def loss(tr):
      return jnp.sum(t.apply(base, transforms.masked(tr, cov), x, spec=spec))

    grads = jax.grad(loss)(trainable)
    head = model.roles['head']
    np.testing.assert_array_equal(grads[head]['a'][:, 2:], 0.0)
    np.testing.assert_array_equal(grads[head]['b'][2:], 0.0)
    self.assertGreater(float(jnp.abs(grads[head]['b'][:2]).sum()), 0.0)

  def test_targets(self):
    model = tiny('simple_cnn')
    self.assertEqual(transforms.lora_paths(model, ('Dense_*',)),
                     [f'Dense_{i}' for i in range(5)])
    self.assertEqual(transforms.lora_paths(model, ('first', 'head')),
                     ['Conv_0', 'Dense_4'])
    with self.assertRaises(SettingError) as ctx:
      transforms.lora(model, targets=('attention',))
    self.assertEqual(ctx.exception.argument, 'lora_targets')
    with self.assertRaises(SettingError):
      transforms.lora(model, ranks=(0,))


def embed(narrow_params, coverage):
  """Places a narrow model's params at the covered coordinates of the full
  tree (row-major order is preserved by a product-of-axes mask)."""
  def place(cov, value):
    full = np.zeros(cov.shape, np.float32)
    owned = np.asarray(cov) > 0
    assert owned.sum() == np.size(value), (owned.sum(), np.shape(value))
    full[owned] = np.asarray(value).ravel()
    return full
  return jax.tree.map(place, coverage, narrow_params)


class WidthTest(parameterized.TestCase):

  @parameterized.parameters(
      ('cnn', dict(width=4, hidden=8), dict(width=2, hidden=4), 0.5),
      ('cnn', dict(width=4, hidden=8), dict(width=1, hidden=2), 0.25),
      ('mlp', dict(hidden=(8, 6)), dict(hidden=(4, 3)), 0.5),
      ('row_lstm', dict(hidden=4), dict(hidden=2), 0.5),
  )
  def test_masked_full_model_is_the_narrow_model(self, name, full_kw,
                                                 narrow_kw, ratio):
    """HeteroFL's submodel of ratio p is the full model times the coverage
    mask: with the narrow model's weights at the covered coordinates the
    two compute the same logits (conv->flatten->dense, LSTM gates)."""
    full = tiny(name, **full_kw)
    narrow = tiny(name, **narrow_kw)
    t = transforms.width(full, ratios=(1.0, ratio))
    params = full.init(jax.random.key(0))
    cov = t.coverage(params, jnp.float32(ratio), jnp.int32(0))
    narrow_params = narrow.init(jax.random.key(5))
    x = images(full)
    chex.assert_trees_all_close(
        full.apply(embed(narrow_params, cov), x),
        narrow.apply(narrow_params, x), rtol=1e-5, atol=1e-5)

  def test_fjord_trains_a_drawn_prefix_no_wider_than_the_client(self):
    model = tiny('mlp', hidden=(8, 6))
    params = model.init(jax.random.key(0))
    t = transforms.width(model, ratios=(0.25, 0.5, 1.0),
                         ordered_dropout=True)
    x = images(model)
    spec = jnp.float32(0.5)
    owned = transforms.masked(params, t.coverage(params, spec, 0))
    prefix = {p: model.apply(transforms.masked(
        params, t.coverage(params, jnp.float32(p), 0)), x)
              for p in (0.25, 0.5, 1.0)}
    seen = set()
    for k in range(12):
      out = t.apply((), owned, x, spec=spec, train=True,
                    key=jax.random.key(k))
      hits = [p for p, ref in prefix.items() if np.allclose(out, ref,
                                                             atol=1e-6)]
      self.assertLen(hits, 1)
      seen.add(hits[0])
    self.assertEqual(seen, {0.25, 0.5})          # never wider than 0.5
    chex.assert_trees_all_close(t.apply((), owned, x, spec=spec),
                                prefix[0.5], atol=1e-6)   # evaluation

  def test_coverage_prefix_rolling_and_full(self):
    model = tiny('mlp', hidden=(8, 6))
    params = model.init(jax.random.key(0))
    t = transforms.width(model, ratios=(1.0, 0.5))
    cov = t.coverage(params, jnp.float32(0.5), jnp.int32(0))
    np.testing.assert_array_equal(cov['Dense_0']['bias'], [1] * 4 + [0] * 4)
    np.testing.assert_array_equal(cov['Dense_2']['bias'], [1, 1, 1])  # head
    np.testing.assert_array_equal(cov['Dense_2']['kernel'][:, 0],
                                  [1] * 3 + [0] * 3)
    self.assertEqual(float(jnp.sum(t.coverage(params, jnp.float32(1.0), 0)[
        'Dense_1']['kernel'])), 8 * 6)
    rolling = transforms.width(model, ratios=(0.5,), rolling=True)
    cov = rolling.coverage(params, jnp.float32(0.5), jnp.int32(3))
    # Round 3 rolls layer 0's window of 4 of 8 units to units 3..6.
    np.testing.assert_array_equal(cov['Dense_0']['bias'],
                                  [0, 0, 0, 1, 1, 1, 1, 0])
    self.assertIsNone(transforms.width(model).coverage(params, 1.0, 0))
    with self.assertRaises(SettingError):
      transforms.width(model, ratios=(1.5,))


class AlignTest(absltest.TestCase):

  def test_masked_average_of_two_shapes_by_hand(self):
    """Horus Sec. V-C.1: zero-pad to the largest shape, average each entry
    over the clients that have it."""
    a = {'k': jnp.array([[[1.0, 2.0], [3.0, 4.0]]])}          # [1, 2, 2]
    b = {'k': jnp.array([[[10.0, 20.0, 30.0]], [[7.0, 8.0, 9.0]]])}  # [2,1,3]
    shapes = cohort_lib.aligned_shapes([{'k': a['k'][0]}, {'k': b['k'][0]}])
    self.assertEqual(shapes['k'].shape, (2, 3))
    updates, cov = cohort_lib.align_stacked([a, b], [None, None], shapes)
    chex.assert_shape(updates['k'], (3, 2, 3))
    num = jnp.sum(updates['k'] * cov['k'], 0)
    den = jnp.sum(cov['k'], 0)
    avg = np.asarray(num / jnp.maximum(den, 1))
    expected = np.array([[(1 + 10 + 7) / 3, (2 + 20 + 8) / 3, (30 + 9) / 2],
                         [3.0, 4.0, 0.0]])
    np.testing.assert_allclose(avg, expected, rtol=1e-6)
    np.testing.assert_array_equal(den, [[3, 3, 2], [1, 1, 0]])
    trimmed = cohort_lib.trim_to({'k': jnp.asarray(avg)},
                                 {'k': a['k'][0]})
    np.testing.assert_allclose(trimmed['k'], expected[:, :2])

  def test_kernels_of_different_ranks_align_as_matrices(self):
    """A conv kernel [kh, kw, cin, out] shared with a dense kernel [in, out]
    is aligned as its [kh*kw*cin, out] matrix, and trims back to its own
    shape exactly."""
    conv = jnp.arange(2 * 2 * 1 * 3, dtype=jnp.float32).reshape(2, 2, 1, 3)
    dense = jnp.full((5, 2), 100.0)
    shapes = cohort_lib.aligned_shapes([{'k': conv}, {'k': dense}])
    self.assertEqual(shapes['k'].shape, (5, 3))
    updates, cov = cohort_lib.align_stacked(
        [{'k': conv[None]}, {'k': dense[None]}], [None, None], shapes)
    chex.assert_shape(updates['k'], (2, 5, 3))
    avg = np.asarray(jnp.sum(updates['k'] * cov['k'], 0)
                     / jnp.maximum(jnp.sum(cov['k'], 0), 1))
    matrix = np.arange(12, dtype=np.float32).reshape(4, 3)
    expected = np.zeros((5, 3), np.float32)
    expected[:4] = matrix
    expected[:, :2] += 100.0
    expected[:4, :2] /= 2
    np.testing.assert_allclose(avg, expected, rtol=1e-6)
    back = cohort_lib.trim_to({'k': jnp.asarray(avg)}, {'k': conv})
    chex.assert_shape(back['k'], (2, 2, 1, 3))
    np.testing.assert_allclose(back['k'].reshape(4, 3), expected[:4])

  def test_roles_split_and_join(self):
    model = tiny('mlp')
    params = model.init(jax.random.key(0))
    shared, private = cohort_lib.split_roles(params, model, ('head',))
    self.assertEqual(sorted(shared), ['head'])
    self.assertNotIn('Dense_2', private)
    chex.assert_trees_all_equal(
        cohort_lib.join_roles(private, shared, model), params)
    with self.assertRaises(SettingError):
      cohort_lib.split_roles(params, model, ('decoder',))


if __name__ == '__main__':
  absltest.main()
