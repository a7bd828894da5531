"""Tests for fedrobust.models: registry, shapes, conv lowerings agree."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust import models
from fedrobust.models import layers


class ConvTest(parameterized.TestCase):

  # Cin 1 and 3 take the shift-and-add path, Cin 6 the patch matrix.
  @parameterized.parameters(('VALID', 5, 3), ('SAME', 5, 3), ('SAME', 3, 3),
                            ('VALID', 5, 1), ('SAME', 3, 1), ('VALID', 3, 6))
  def test_im2col_matches_xla(self, padding, size, cin):
    kx, kk, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 9, 8, cin))
    kernel = jax.random.normal(kk, (size, size, cin, 4))
    ref, ref_vjp = jax.vjp(
        lambda x, k: layers.conv2d(x, k, padding=padding, impl='xla'),
        x, kernel)
    out, out_vjp = jax.vjp(
        lambda x, k: layers.conv2d(x, k, padding=padding, impl='im2col'),
        x, kernel)
    chex.assert_trees_all_close(out, ref, rtol=1e-5, atol=1e-5)
    g = jax.random.normal(kg, ref.shape)
    chex.assert_trees_all_close(out_vjp(g), ref_vjp(g), rtol=1e-4, atol=1e-4)

  def test_shift_add_vjp_under_vmap(self):
    # Per-client kernels (vmap) through the hand-written VJP agree with XLA,
    # and the gradient really goes through the custom VJP.
    x = jax.random.normal(jax.random.key(3), (2, 3, 7, 7, 1))
    kernel = jax.random.normal(jax.random.key(4), (2, 3, 3, 1, 2))

    def loss(impl):
      return lambda k, x: jnp.sum(jnp.sin(layers.conv2d(
          x, k, padding='VALID', impl=impl)))
    grad = jax.vmap(jax.grad(loss('im2col')))
    ref = jax.vmap(jax.grad(loss('xla')))(kernel, x)
    chex.assert_trees_all_close(grad(kernel, x), ref, rtol=1e-4, atol=1e-4)
    self.assertIn('custom_vjp_call', str(jax.make_jaxpr(grad)(kernel, x)))

  def test_max_pool_matches_numpy(self):
    x = np.random.default_rng(0).normal(size=(2, 5, 4, 3)).astype(np.float32)
    ref = x[:, :4, :4].reshape(2, 2, 2, 2, 2, 3).max(axis=(2, 4))
    np.testing.assert_array_equal(layers.max_pool_2x2(jnp.asarray(x)), ref)

  def test_pool_relu_is_relu_then_pool_bit_for_bit(self):
    # Ties, exact zeros and all-negative windows included: values and
    # gradients of pool-then-ReLU equal ReLU-then-pool exactly.
    x = np.random.default_rng(1).normal(size=(3, 6, 6, 4)).astype(np.float32)
    x[0, :2, :2, 0] = [[2.0, 2.0], [-1.0, 0.0]]
    x[0, :2, 2:4, 1] = [[0.0, -1.0], [-2.0, -3.0]]
    x[1, 2:4, :2, 2] = [[-1.0, -2.0], [-3.0, -4.0]]
    x[2, :2, :2, 3] = [[0.0, 0.0], [0.0, 0.0]]
    g = np.random.default_rng(2).normal(size=(3, 3, 3, 4)).astype(np.float32)
    ref, ref_vjp = jax.vjp(lambda a: layers.max_pool_2x2(jax.nn.relu(a)), x)
    out, out_vjp = jax.vjp(jax.jit(layers.pool_relu), x)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(out_vjp(g)[0], ref_vjp(g)[0])
    self.assertEqual(float(out_vjp(g)[0][0, 0, 0, 0]), g[0, 0, 0, 0] / 2)

  # simple_cnn's two convs (5x5 VALID on 28x28 with one channel, on 12x12
  # with six), cnn's (5x5 SAME) and vgg_small's pooled conv (3x3 SAME).
  @parameterized.parameters(('VALID', 5, 1, 28), ('VALID', 5, 6, 12),
                            ('SAME', 5, 3, 8), ('SAME', 3, 4, 6))
  def test_conv_pool_block_is_conv_then_pool(self, padding, size, cin, hw):
    kx, kk, kb, kg = jax.random.split(jax.random.key(5), 4)
    x = jax.random.normal(kx, (2, 3, hw, hw, cin))      # 2 clients
    kernel = jax.random.normal(kk, (2, size, size, cin, 5))
    bias = jax.random.normal(kb, (2, 5))

    def ref(x, k, b):
      out = layers.conv2d(x, k, padding=padding, impl='xla')
      out = out + b.reshape(1, 1, 1, -1)
      return layers.max_pool_2x2(out)

    def fused(x, k, b):
      return layers.conv_pool_block(x, k, b, padding=padding)

    self.assertTrue(layers.block_fits(x.shape[1:], kernel.shape[1:],
                                      padding))
    want, want_vjp = jax.vjp(jax.vmap(ref), x, kernel, bias)
    got, got_vjp = jax.vjp(jax.vmap(fused), x, kernel, bias)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    g = jax.random.normal(kg, want.shape)
    chex.assert_trees_all_close(got_vjp(g), want_vjp(g), rtol=1e-4,
                                atol=1e-4)
    # The block layout, undone, is the convolution itself.
    full = jax.vmap(lambda x, k: layers.blocks_to_image(
        layers.conv_blocks(x, k, padding=padding)))(x, kernel)
    chex.assert_trees_all_close(
        full, jax.vmap(lambda x, k: layers.conv2d(
            x, k, padding=padding, impl='xla'))(x, kernel),
        rtol=1e-5, atol=1e-5)

  def test_conv_pool_block_refuses_an_odd_output(self):
    # 5x5 VALID on 9x9 leaves a 5x5 output; its pool drops a row the
    # blocks cannot, so the Conv layer keeps the unfused route there.
    self.assertFalse(layers.block_fits((1, 9, 9, 1), (5, 5, 1, 2), 'VALID'))
    self.assertFalse(layers.block_fits((1, 7, 8, 1), (3, 3, 1, 2), 'SAME'))
    with self.assertRaisesRegex(ValueError, 'even output'):
      layers.conv_pool_block(jnp.zeros((1, 9, 9, 1)), jnp.zeros((5, 5, 1, 2)),
                             jnp.zeros(2), padding='VALID')
    conv = lambda impl: layers.Conv(2, (5, 5), 'VALID', impl, pool=True)
    x = jax.random.normal(jax.random.key(6), (2, 9, 9, 1))
    variables = conv('im2col').init(jax.random.key(7), x)
    variables = {'params': variables['params']}
    np.testing.assert_array_equal(conv('block').apply(variables, x),
                                  conv('im2col').apply(variables, x))

  def test_unknown_impl(self):
    with self.assertRaisesRegex(ValueError, 'conv impl'):
      layers.conv2d(jnp.zeros((1, 4, 4, 1)), jnp.zeros((3, 3, 1, 1)),
                    padding='SAME', impl='fft')


# The image models (MiniLM reads token ids: tests/bert_test.py,
# tests/text_engine_test.py).
IMAGE_MODELS = sorted(name for name, m in models.MODELS.items()
                      if m is not models.TEXT_MODEL)


class RegistryTest(parameterized.TestCase):

  @parameterized.parameters(*IMAGE_MODELS)
  def test_init_apply_shapes(self, name):
    model = models.get_model(name, num_classes=10, input_shape=(28, 28, 1))
    params = model.init(jax.random.key(0))
    logits = jax.jit(model.apply)(params, jnp.zeros((3, 28, 28, 1)))
    chex.assert_shape(logits, (3, 10))
    chex.assert_type(logits, jnp.float32)
    chex.assert_tree_all_finite(logits)

  def test_impls_share_params_and_outputs(self):
    xla = models.get_model('simple_cnn', num_classes=10,
                           input_shape=(28, 28, 1), conv_impl='xla')
    col = models.get_model('simple_cnn', num_classes=10,
                           input_shape=(28, 28, 1), conv_impl='im2col')
    params = xla.init(jax.random.key(1))
    chex.assert_trees_all_equal_shapes(params, col.init(jax.random.key(1)))
    x = jax.random.normal(jax.random.key(2), (4, 28, 28, 1))
    chex.assert_trees_all_close(col.apply(params, x), xla.apply(params, x),
                                rtol=1e-4, atol=1e-4)

  @parameterized.parameters('simple_cnn', 'cnn', 'vgg_small')
  def test_block_impl_matches_im2col(self, name):
    get = lambda impl: models.get_model(name, num_classes=10,
                                        input_shape=(28, 28, 1),
                                        conv_impl=impl)
    col, blk = get('im2col'), get('block')
    params = col.init(jax.random.key(1))
    chex.assert_trees_all_equal(params, blk.init(jax.random.key(1)))
    x = jax.random.normal(jax.random.key(2), (3, 28, 28, 1))
    y = jnp.arange(3)

    def loss(model):
      def f(p):
        logp = jax.nn.log_softmax(model.apply(p, x))
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], 1))
      return jax.value_and_grad(f)
    chex.assert_trees_all_close(loss(blk)(params), loss(col)(params),
                                rtol=1e-4, atol=1e-5)
    # The fused route ran: one gather of block windows per pooled conv with
    # an even output and few channels (layers.BLOCK_MAX_CIN, BLOCK_MAX_COUT:
    # cnn's convs write 32 and 64, vgg_small's pooled convs read 32 and
    # more, so both keep the unfused layers; im2col's forward has no
    # gather: shift-and-add and slices).
    pooled = {'simple_cnn': 2, 'cnn': 0, 'vgg_small': 0}[name]
    jaxpr = str(jax.make_jaxpr(blk.apply)(params, x))
    self.assertEqual(jaxpr.count(' gather['),
                     pooled + str(jax.make_jaxpr(col.apply)(params, x)
                                  ).count(' gather['))
    # The probes (SDFC's factored Fisher) see the fused layers' outputs in
    # block layout (tests/sdfc_test.py checks the Fisher from them).
    _, zeros = blk.probe(params, x)
    _, ref_zeros = col.probe(params, x)
    n, h, w, c = ref_zeros['Conv_0']['out'].shape
    self.assertEqual(zeros['Conv_0']['out'].shape,
                     (n, h // 2, w // 2, 4, c) if pooled else (n, h, w, c))

  def test_default_conv_impl_per_backend(self):
    self.assertEqual(models.default_conv_impl('cpu'), 'block')
    self.assertEqual(models.default_conv_impl('gpu'), 'im2col')
    self.assertEqual(models.default_conv_impl('tpu'), 'xla')

  def test_simple_cnn_layout(self):
    model = models.get_model('simple_cnn', num_classes=10,
                             input_shape=(28, 28, 1))
    params = model.init(jax.random.key(0))
    shapes = [leaf.shape for leaf in jax.tree.leaves(
        {k: params[k]['kernel'] for k in params})]
    self.assertEqual(shapes, [(5, 5, 1, 6), (5, 5, 6, 16), (256, 120),
                              (120, 84), (84, 84), (84, 256), (256, 10)])

  def test_bfloat16_compute_keeps_float32_params_and_logits(self):
    kw = dict(num_classes=10, input_shape=(28, 28, 1), conv_impl='im2col')
    f32 = models.get_model('simple_cnn', **kw)
    bf16 = models.get_model('simple_cnn', dtype=jnp.bfloat16, **kw)
    params = f32.init(jax.random.key(0))
    chex.assert_trees_all_equal_dtypes(params, bf16.init(jax.random.key(0)))
    x = jax.random.uniform(jax.random.key(1), (4, 28, 28, 1))
    ref, out = f32.apply(params, x), bf16.apply(params, x)
    self.assertEqual(out.dtype, jnp.float32)
    self.assertFalse(np.array_equal(out, ref))       # it did compute in bf16
    np.testing.assert_allclose(out, ref, atol=0.05 * np.abs(ref).max())
    self.assertEqual(models.default_compute_dtype('cpu'), 'float32')
    self.assertEqual(models.default_compute_dtype('tpu'), 'bfloat16')

  def test_train_flag_and_key_reach_dropout(self):
    model = models.get_model('mlp', num_classes=10, input_shape=(4, 4, 1),
                             hidden=(64,), dropout=0.5)
    params = model.init(jax.random.key(0))
    x = jnp.ones((2, 4, 4, 1))
    ref = model.apply(params, x)
    chex.assert_trees_all_equal(model.apply(params, x, train=False,
                                            key=jax.random.key(1)), ref)
    a = model.apply(params, x, train=True, key=jax.random.key(1))
    b = model.apply(params, x, train=True, key=jax.random.key(2))
    chex.assert_trees_all_equal(
        a, model.apply(params, x, train=True, key=jax.random.key(1)))
    self.assertFalse(np.allclose(a, b))
    self.assertFalse(np.allclose(a, ref))

  def test_roles_and_width_units(self):
    for name in IMAGE_MODELS:
      model = models.get_model(name, num_classes=10, input_shape=(28, 28, 1))
      params = model.init(jax.random.key(0))
      for role in ('first', 'head'):
        node = params
        for key in model.roles[role].split('/'):
          node = node[key]
        self.assertIn('kernel', node, (name, role))
      if model.width_units is None:     # the ViT slices no widths
        self.assertEqual(name, 'vit')
        continue
      head = model.roles['head'].split('/')[-1]
      self.assertEqual(model.width_units[head]['kernel'][-1], 0)

  def test_sdfc_release_pipeline_and_model(self):
    model = models.get_model('simple_cnn_release', num_classes=10,
                             input_shape=(28, 28, 1),
                             pipeline='sdfc_release')
    params = model.init(jax.random.key(0))
    # 32x32 inputs: 32 -> 28 -> 14 -> 10 -> 5, a 16 * 5 * 5 = 400 flatten.
    self.assertEqual(params['Dense_0']['kernel'].shape, (400, 120))
    x = jax.random.randint(jax.random.key(1), (3, 28, 28, 1), 0, 256,
                           jnp.int32).astype(jnp.uint8)
    evaluation = model.apply(params, x)
    chex.assert_trees_all_equal(evaluation, model.apply(params, x))
    a = model.apply(params, x, train=True, key=jax.random.key(2))
    b = model.apply(params, x, train=True, key=jax.random.key(3))
    self.assertFalse(np.allclose(a, b))          # random crops differ
    from fedrobust.models import pipelines  # pylint: disable=g-import-not-at-top
    prepared = pipelines.sdfc_release().prepare(jnp.full((1, 28, 28, 1),
                                                         255, jnp.uint8))
    chex.assert_shape(prepared, (1, 32, 32, 1))
    np.testing.assert_allclose(prepared, (1 - 0.1307) / 0.3081, rtol=1e-5)
    crop = pipelines.random_crop(jnp.ones((2, 4, 4, 1)), jax.random.key(0),
                                 2)
    chex.assert_shape(crop, (2, 4, 4, 1))

  def test_release_cnn_has_no_relu_after_fc256(self):
    kw = dict(num_classes=10, input_shape=(28, 28, 1))
    paper = models.get_model('simple_cnn', **kw)
    release = models.get_model('simple_cnn_release', **kw)
    params = paper.init(jax.random.key(0))
    # Make fc256's pre-activations negative: the paper's ReLU zeroes them
    # (logits = the last bias), the release's identity does not.
    params['Dense_3']['bias'] = -1e3 * jnp.ones(256)
    params['Dense_4']['bias'] = jnp.arange(10.0)
    x = jnp.zeros((1, 28, 28, 1), jnp.uint8)
    np.testing.assert_allclose(paper.apply(params, x)[0], jnp.arange(10.0))
    self.assertFalse(np.allclose(release.apply(params, x)[0],
                                 jnp.arange(10.0)))

  def test_unknown_model_names_flag(self):
    with self.assertRaisesRegex(ValueError, 'model.*simple_cnn'):
      models.get_model('resnet9000', num_classes=10, input_shape=(28, 28, 1))


if __name__ == '__main__':
  absltest.main()
