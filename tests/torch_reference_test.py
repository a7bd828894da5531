"""The PyTorch reference computes the same local training as fedrobust.

Skipped unless torch is installed (`pip install -e .[bench]`); the
benchmark's speed ratio only means something if both sides do this work.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip('torch')

# pylint: disable=g-import-not-at-top,wrong-import-position
from benchmarks import torch_reference as tr
from fedrobust import engine
from fedrobust.models import get_model


@pytest.mark.parametrize('name', ['simple_cnn', 'mlp'])
def test_local_sgd_matches_fedrobust(name):
  steps, batch = 4, 8
  model = get_model(name, num_classes=10, input_shape=(28, 28, 1),
                    conv_impl='xla')
  params = model.init(jax.random.key(1))
  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, (32, 28, 28, 1), dtype=np.uint8)
  y = rng.integers(0, 10, (32,)).astype(np.int32)
  batches = [rng.choice(32, batch, replace=False) for _ in range(steps)]

  loss_fn = engine.classification_loss(model.apply)
  opt = engine.sgd(learning_rate=0.05, momentum=0.9, weight_decay=1e-3)
  opt_state = opt.init(params)
  p = params
  for idx in batches:
    grads, _ = jax.grad(loss_fn, has_aux=True)(
        p, jnp.asarray(x[idx]), jnp.asarray(y[idx]),
        jnp.ones((batch,), bool), None)
    updates, opt_state = opt.update(grads, opt_state, p)
    p = optax.apply_updates(p, updates)

  torch.set_default_dtype(torch.float32)
  net = tr.MODELS[name]()
  tr.load_flax_params(net, jax.device_get(params))
  tr.local_train(net, torch.from_numpy(x), torch.from_numpy(y).long(),
                 steps=steps, batch_size=batch, lr=0.05, momentum=0.9,
                 weight_decay=1e-3, batches=batches)
  expected = tr.MODELS[name]()
  tr.load_flax_params(expected, jax.device_get(p))
  np.testing.assert_allclose(tr.flat_params(net).numpy(),
                             tr.flat_params(expected).numpy(),
                             rtol=2e-4, atol=2e-5)
  # and the copy is not a no-op: training moved the weights
  start = tr.MODELS[name]()
  tr.load_flax_params(start, jax.device_get(params))
  assert np.abs(tr.flat_params(start).numpy()
                - tr.flat_params(net).numpy()).max() > 1e-3


def test_median_matches_numpy():
  rng = np.random.default_rng(0)
  for c in (4, 5):
    d = rng.normal(size=(c, 7)).astype(np.float32)
    np.testing.assert_allclose(tr.median(torch.from_numpy(d)).numpy(),
                               np.median(d, axis=0), rtol=1e-6)
