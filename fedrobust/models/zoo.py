"""Model architectures used by the five methods, as flax modules.

Every module maps float[N, H, W, Ch] images to float32 logits [N, classes].
`fedrobust.models.get_model` wraps them as pure `init(key)` / `apply(params,
x)` functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from fedrobust.models.layers import Conv, ConvImpl, Dense, max_pool_2x2


def _flatten(x: jax.Array) -> jax.Array:
  return x.reshape(x.shape[0], -1)


class SimpleCNN(nn.Module):
  """SDFC's simple CNN: conv6-pool-conv16-pool-fc120-fc84-fc84-fc256-fc.

  5x5 VALID convolutions on 28x28 inputs (28->24->12->8->4), as in the SDFC
  reference setup; no resizing.
  """
  num_classes: int
  conv_impl: ConvImpl = 'xla'
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x):
    conv = lambda f: Conv(f, (5, 5), 'VALID', self.conv_impl, self.dtype)
    x = max_pool_2x2(nn.relu(conv(6)(x)))
    x = max_pool_2x2(nn.relu(conv(16)(x)))
    x = _flatten(x)
    for width in (120, 84, 84, 256):
      x = nn.relu(Dense(width, dtype=self.dtype)(x))
    return Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


class CNN(nn.Module):
  """Two 5x5 conv layers (32, 64; SAME, 2x2 pool) and two FC layers (FedHAN)."""
  num_classes: int
  width: int = 32
  hidden: int = 512
  conv_impl: ConvImpl = 'xla'
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x):
    conv = lambda f: Conv(f, (5, 5), 'SAME', self.conv_impl, self.dtype)
    x = max_pool_2x2(nn.relu(conv(self.width)(x)))
    x = max_pool_2x2(nn.relu(conv(2 * self.width)(x)))
    x = nn.relu(Dense(self.hidden, dtype=self.dtype)(_flatten(x)))
    return Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


class VGGSmall(nn.Module):
  """A small VGG: [conv3x3 x2, pool] x 3 stages (32, 64, 128), fc256, fc."""
  num_classes: int
  stages: tuple[int, ...] = (32, 64, 128)
  conv_impl: ConvImpl = 'xla'
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x):
    for features in self.stages:
      for _ in range(2):
        x = nn.relu(Conv(features, (3, 3), 'SAME', self.conv_impl,
                         self.dtype)(x))
      x = max_pool_2x2(x)
    x = nn.relu(Dense(256, dtype=self.dtype)(_flatten(x)))
    return Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


class RowLSTM(nn.Module):
  """Row-wise LSTM classifier: each image row is one time step (Horus RNN)."""
  num_classes: int
  hidden: int = 128
  conv_impl: ConvImpl = 'xla'   # unused; keeps the constructor uniform
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x):
    n, h, w, c = x.shape
    seq = x.reshape(n, h, w * c)
    cell = nn.OptimizedLSTMCell(self.hidden, dtype=self.dtype)
    carry, _ = nn.RNN(cell, return_carry=True)(seq)
    last_hidden = carry[1]
    return Dense(self.num_classes,
                 dtype=self.dtype)(last_hidden).astype(jnp.float32)


class MLP(nn.Module):
  """The FedAvg '2NN': 784-200-200-classes with ReLU."""
  num_classes: int
  hidden: tuple[int, ...] = (200, 200)
  conv_impl: ConvImpl = 'xla'   # unused; keeps the constructor uniform
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x):
    x = _flatten(x)
    for width in self.hidden:
      x = nn.relu(Dense(width, dtype=self.dtype)(x))
    return Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)
