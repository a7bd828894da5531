"""Layers whose lowering is a compile-time choice, not a parameter choice.

A convolution's parameters are the same whichever way it is computed, so the
lowering (`conv_impl`) is a static attribute of the module and never part of
a checkpoint. On XLA:CPU a convolution inside `lax.scan`, and a convolution
whose weights are batched by `vmap` (it becomes a grouped convolution), run
several times slower than a plain matmul over image patches; on GPU/TPU the
native convolution is the fast one. `default_conv_impl()` picks per backend.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import linen as nn

ConvImpl = Literal['xla', 'im2col']
CONV_IMPLS = ('xla', 'im2col')


def default_conv_impl(backend: str | None = None) -> ConvImpl:
  """'im2col' on CPU, 'xla' elsewhere (measured in BUILD_NOTES.md)."""
  backend = backend or jax.default_backend()
  return 'im2col' if backend == 'cpu' else 'xla'


COMPUTE_DTYPES = ('float32', 'bfloat16')


def default_compute_dtype(backend: str | None = None) -> str:
  """'bfloat16' on TPU (its matmul units; f32 matmuls there already run in
  bf16 passes at default precision), 'float32' on CPU and GPU, where the
  small models of this project are not matmul-bound (BUILD_NOTES)."""
  backend = backend or jax.default_backend()
  return 'bfloat16' if backend == 'tpu' else 'float32'


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x[..., K] @ w[K, N] with a hand-written VJP.

  The weight gradient is taken as one 2-D GEMM, x.reshape(-1, K).T @
  g.reshape(-1, N), instead of autodiff's dot_general that contracts all
  leading axes of x and g at once; on XLA:CPU the round of the simple CNN
  is 5-10% faster this way (BUILD_NOTES §4 has the measurement). Same
  values up to float reassociation.
  """
  return x @ w


def _matmul_fwd(x, w):
  return x @ w, (x, w)


def _matmul_bwd(res, g):
  x, w = res
  dx = g @ w.T
  dw = x.reshape(-1, x.shape[-1]).T @ g.reshape(-1, g.shape[-1])
  return dx, dw.astype(w.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


class Dense(nn.Module):
  """flax.linen.Dense's parameters (names, shapes, init) on `matmul`."""
  features: int
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.param('kernel', nn.initializers.lecun_normal(),
                        (x.shape[-1], self.features))
    bias = self.param('bias', nn.initializers.zeros, (self.features,))
    if self.dtype is not None:
      x, kernel, bias = (a.astype(self.dtype) for a in (x, kernel, bias))
    out = matmul(x, kernel)
    return out + bias.reshape((1,) * (out.ndim - 1) + (-1,))


def _same_padding(x: jax.Array, kh: int, kw: int) -> jax.Array:
  ph, pw = kh - 1, kw - 1
  return jnp.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2),
                     (0, 0)))


def conv2d(x: jax.Array, kernel: jax.Array, *, padding: str,
           impl: ConvImpl) -> jax.Array:
  """Stride-1 2-D convolution, NHWC input and HWIO kernel.

  Args:
    x: float[N, H, W, Cin].
    kernel: float[kh, kw, Cin, Cout].
    padding: 'VALID' or 'SAME'.
    impl: 'xla' (lax.conv) or 'im2col' (shifted slices, one matmul).

  Returns:
    float[N, H', W', Cout].
  """
  kh, kw, cin, cout = kernel.shape
  if impl == 'xla':
    return jax.lax.conv_general_dilated(
        x, kernel, (1, 1), padding,
        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  if impl != 'im2col':
    raise ValueError(f'conv impl must be one of {CONV_IMPLS}, got {impl!r}')
  if padding == 'SAME':
    x = _same_padding(x, kh, kw)
  elif padding != 'VALID':
    raise ValueError(f'padding must be VALID or SAME, got {padding!r}')
  n, h, w, _ = x.shape
  ho, wo = h - kh + 1, w - kw + 1
  cols = jnp.stack([x[:, i:i + ho, j:j + wo, :]
                    for i in range(kh) for j in range(kw)], axis=3)
  cols = cols.reshape(n, ho, wo, kh * kw * cin)
  return matmul(cols, kernel.reshape(kh * kw * cin, cout))


class Conv(nn.Module):
  """Conv layer with flax.linen.Conv's parameter names and shapes."""
  features: int
  kernel_size: tuple[int, int]
  padding: str = 'SAME'
  impl: ConvImpl = 'xla'
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kh, kw = self.kernel_size
    kernel = self.param('kernel', nn.initializers.lecun_normal(),
                        (kh, kw, x.shape[-1], self.features))
    bias = self.param('bias', nn.initializers.zeros, (self.features,))
    if self.dtype is not None:
      x, kernel, bias = (a.astype(self.dtype) for a in (x, kernel, bias))
    out = conv2d(x, kernel, padding=self.padding, impl=self.impl)
    return out + bias.reshape((1,) * (out.ndim - 1) + (-1,))


def max_pool_2x2(x: jax.Array) -> jax.Array:
  """2x2/stride-2 max pool by reshape (cheap gradient on every backend).

  Odd trailing rows/columns are dropped, as in a VALID pool.
  """
  n, h, w, c = x.shape
  x = x[:, :h // 2 * 2, :w // 2 * 2, :]
  return x.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))
