"""Model architectures used by the five methods, as flax modules.

Every module maps float[N, H, W, Ch] images to float32 logits [N, classes]
and takes `train` (True inside local training; no zoo model has dropout
yet, but the flag and a 'dropout' rng reach every module).
`fedrobust.models.get_model` wraps them as pure `init(key)` / `apply(params,
x, *, train, key)` functions.

Each module also declares
  * `roles()`: role name -> module path, for the layers other components
    address by meaning across architectures: 'first' (the feature-first
    layer) and 'head' (the classifier). Horus puts LoRA on both; FedAvg
    over cohorts shares the head;
  * `width_units(shapes)`: for every parameter leaf, per axis, the number
    of hidden units the axis indexes (unit of index i = i mod units), or 0
    for an axis that is not sliced (input pixels, classes, kernel taps).
    The width transform (HeteroFL/FedRolex) keeps a prefix of the units of
    every hidden layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from fedrobust.models.layers import Conv, ConvImpl, Dense, lora_merged


def _flatten(x: jax.Array) -> jax.Array:
  return x.reshape(x.shape[0], -1)


def chain_width_units(shapes: dict, order: list[str]) -> dict:
  """width_units of a plain chain of Conv/Dense layers in `order`.

  The input axis of layer l indexes layer l-1's output units (for a Dense
  after a flatten of [H, W, C] the flattened index i is channel i mod C, as
  NHWC flattening puts channels last); the first layer's input and the
  last layer's output are not sliced.
  """
  out, prev = {}, 0
  for n, name in enumerate(order):
    kernel = shapes[name]['kernel'].shape
    units = 0 if n == len(order) - 1 else kernel[-1]
    out[name] = {'kernel': (0,) * (len(kernel) - 2) + (prev, units),
                 'bias': (units,)}
    prev = units
  return out


class SimpleCNN(nn.Module):
  """SDFC's simple CNN: conv6-pool-conv16-pool-fc120-fc84-fc84-fc256-fc.

  5x5 VALID convolutions on 28x28 inputs (28->24->12->8->4), as in the SDFC
  paper's setup; the release resizes to 32x32 (32->28->14->10->5, a 400-unit
  flatten) and has no ReLU after fc256 (`release=True`,
  'simple_cnn_release').
  """
  num_classes: int
  conv_impl: ConvImpl = 'xla'
  dtype: jnp.dtype | None = None
  # The SDFC release's variant: no ReLU after the 256-unit layer.
  release: bool = False

  ORDER = ('Conv_0', 'Conv_1', 'Dense_0', 'Dense_1', 'Dense_2', 'Dense_3',
           'Dense_4')

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    conv = lambda f: Conv(f, (5, 5), 'VALID', self.conv_impl, self.dtype,
                          pool=True)
    x = conv(6)(x)
    x = conv(16)(x)
    x = _flatten(x)
    for width in (120, 84, 84, 256):
      x = Dense(width, dtype=self.dtype)(x)
      if not (self.release and width == 256):
        x = nn.relu(x)
    return Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)

  def roles(self):
    return {'first': 'Conv_0', 'head': 'Dense_4'}

  def width_units(self, shapes):
    return chain_width_units(shapes, list(self.ORDER))


class CNN(nn.Module):
  """Two 5x5 conv layers (32, 64; SAME, 2x2 pool) and two FC layers (FedHAN)."""
  num_classes: int
  width: int = 32
  hidden: int = 512
  conv_impl: ConvImpl = 'xla'
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    conv = lambda f: Conv(f, (5, 5), 'SAME', self.conv_impl, self.dtype,
                          pool=True)
    x = conv(self.width)(x)
    x = conv(2 * self.width)(x)
    x = nn.relu(Dense(self.hidden, dtype=self.dtype)(_flatten(x)))
    return Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)

  def roles(self):
    return {'first': 'Conv_0', 'head': 'Dense_1'}

  def width_units(self, shapes):
    return chain_width_units(shapes, ['Conv_0', 'Conv_1', 'Dense_0',
                                      'Dense_1'])


class VGGSmall(nn.Module):
  """A small VGG: [conv3x3 x2, pool] x 3 stages (32, 64, 128), fc256, fc."""
  num_classes: int
  stages: tuple[int, ...] = (32, 64, 128)
  conv_impl: ConvImpl = 'xla'
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    conv = lambda f, pool=False: Conv(f, (3, 3), 'SAME', self.conv_impl,
                                      self.dtype, pool=pool)
    for features in self.stages:
      x = nn.relu(conv(features)(x))
      x = conv(features, pool=True)(x)
    x = nn.relu(Dense(256, dtype=self.dtype)(_flatten(x)))
    return Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)

  def roles(self):
    return {'first': 'Conv_0', 'head': 'Dense_1'}

  def width_units(self, shapes):
    convs = [f'Conv_{i}' for i in range(2 * len(self.stages))]
    return chain_width_units(shapes, convs + ['Dense_0', 'Dense_1'])


class Recurrent(nn.Module):
  """The LSTM's hidden-to-gates kernel [H, 4H] (orthogonal init), run as a
  lax.scan over time. Gate order i, f, g, o; c' = s(f) c + s(i) tanh(g),
  h' = s(o) tanh(c'). LoRA factors, if any, are merged into the kernel."""
  hidden: int
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, gates_in: jax.Array) -> jax.Array:
    """gates_in: float[N, T, 4H] (input projection) -> last hidden [N, H]."""
    h = self.hidden
    kernel = lora_merged(self, self.param(
        'kernel', nn.initializers.orthogonal(), (h, 4 * h)))
    if self.dtype is not None:
      kernel = kernel.astype(self.dtype)
    n = gates_in.shape[0]
    zeros = jnp.zeros((n, h), gates_in.dtype)

    def step(carry, z_in):
      c, hid = carry
      z = z_in + hid @ kernel
      i, f, g, o = jnp.split(z, 4, axis=-1)
      c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
      hid = jax.nn.sigmoid(o) * jnp.tanh(c)
      return (c, hid), None

    (_, last), _ = jax.lax.scan(step, (zeros, zeros),
                                jnp.swapaxes(gates_in, 0, 1))
    return last


class RowLSTM(nn.Module):
  """Row-wise LSTM classifier: each image row is one time step (Horus RNN).

  The input-to-gates projection of all rows is one Dense ('input', [W*Ch,
  4H]); the recurrence is 'recurrent' ([H, 4H]); the classifier is 'head'.
  """
  num_classes: int
  hidden: int = 128
  conv_impl: ConvImpl = 'xla'   # unused; keeps the constructor uniform
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    n, h, w, c = x.shape
    gates_in = Dense(4 * self.hidden, dtype=self.dtype, name='input')(
        x.reshape(n, h, w * c))
    last = Recurrent(self.hidden, dtype=self.dtype, name='recurrent')(
        gates_in)
    return Dense(self.num_classes, dtype=self.dtype,
                 name='head')(last).astype(jnp.float32)

  def roles(self):
    return {'first': 'input', 'head': 'head'}

  def width_units(self, shapes):
    del shapes
    h = self.hidden
    return {'input': {'kernel': (0, h), 'bias': (h,)},
            'recurrent': {'kernel': (h, h)},
            'head': {'kernel': (h, 0), 'bias': (0,)}}


class MLP(nn.Module):
  """The FedAvg '2NN': 784-200-200-classes with ReLU (optional dropout)."""
  num_classes: int
  hidden: tuple[int, ...] = (200, 200)
  conv_impl: ConvImpl = 'xla'   # unused; keeps the constructor uniform
  dtype: jnp.dtype | None = None

  dropout: float = 0.0    # on each hidden layer's output while training

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = _flatten(x)
    for width in self.hidden:
      x = nn.relu(Dense(width, dtype=self.dtype)(x))
      if self.dropout:
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
    return Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)

  def roles(self):
    return {'first': 'Dense_0', 'head': f'Dense_{len(self.hidden)}'}

  def width_units(self, shapes):
    return chain_width_units(
        shapes, [f'Dense_{i}' for i in range(len(self.hidden) + 1)])
