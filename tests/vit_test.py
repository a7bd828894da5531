"""The small ViT: patch order, shapes, LoRA on its attention, training."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedrobust import models
from fedrobust.models import bert
from fedrobust.models.vit import patches
from fedrobust.transforms import lora


class ViTTest(absltest.TestCase):

  def test_patches_are_row_major_blocks(self):
    x = np.arange(2 * 4 * 6 * 3, dtype=np.float32).reshape(2, 4, 6, 3)
    out = np.asarray(patches(jnp.asarray(x), 2))
    self.assertEqual(out.shape, (2, 6, 12))
    # patch (row 1, col 2) of image 1 is x[1, 2:4, 4:6, :], flattened.
    np.testing.assert_array_equal(out[1, 1 * 3 + 2],
                                  x[1, 2:4, 4:6, :].reshape(-1))
    with self.assertRaisesRegex(ValueError, 'divisible'):
      patches(jnp.zeros((1, 5, 4, 1)), 2)

  def test_lora_on_query_and_value_is_the_merged_model(self):
    model = models.get_model('vit', num_classes=10, input_shape=(28, 28, 1))
    self.assertEqual(model.roles, {'first': 'patch_embed', 'head': 'head'})
    params = model.init(jax.random.key(0))
    t = lora(model, ranks=(2, 4), alpha=8,
             targets=bert.QV_TARGETS + ('head',))
    base, trainable = t.init(params, jax.random.key(1))
    # Four layers, query and value each, plus the head.
    self.assertLen([p for p in jax.tree_util.tree_leaves_with_path(
        trainable) if p[0][-1].key == 'a'], 9)
    rng = np.random.default_rng(0)
    trainable = jax.tree.map(
        lambda l: jnp.asarray(rng.normal(size=l.shape) * 0.1, jnp.float32),
        trainable)
    x = jnp.asarray(rng.integers(0, 256, (3, 28, 28, 1)), jnp.uint8)
    for rank in (2.0, 4.0):
      spec = jnp.float32(rank)
      cov = t.coverage(trainable, spec, 0)
      owned = jax.tree.map(lambda l, c: l * c, trainable, cov)
      factored = t.apply(base, owned, x, spec=spec)
      merged = model.apply(t.merge(base, owned, spec), x)
      self.assertEqual(factored.shape, (3, 10))
      np.testing.assert_allclose(factored, merged, atol=2e-5)

  def test_a_few_adam_steps_fit_a_small_batch(self):
    model = models.get_model('vit', num_classes=4, input_shape=(8, 8, 1),
                             patch=4, dim=16, depth=1, heads=2, mlp=32)
    rng = np.random.default_rng(1)
    y = np.arange(16) % 4
    x = np.zeros((16, 8, 8, 1), np.uint8)
    for i, label in enumerate(y):       # the class is where the blob is
      r, c = divmod(int(label), 2)
      x[i, 4 * r:4 * r + 4, 4 * c:4 * c + 4] = 200
    x = x + rng.integers(0, 40, x.shape).astype(np.uint8)
    params = model.init(jax.random.key(0))
    opt = optax.adam(1e-2)

    def loss(p):
      logits = model.apply(p, jnp.asarray(x))
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, jnp.asarray(y)).mean()

    @jax.jit
    def step(p, s):
      value, g = jax.value_and_grad(loss)(p)
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s, value

    state = opt.init(params)
    first = None
    for _ in range(60):
      params, state, value = step(params, state)
      first = value if first is None else first
    self.assertLess(float(loss(params)), 0.2 * float(first))


if __name__ == '__main__':
  absltest.main()
