"""Layers whose lowering is a compile-time choice, not a parameter choice.

A convolution's parameters are the same whichever way it is computed, so the
lowering (`conv_impl`) is a static attribute of the module and never part of
a checkpoint. On XLA:CPU a convolution inside `lax.scan`, and a convolution
whose weights are batched by `vmap` (it becomes a grouped convolution), run
several times slower than a plain matmul over image patches. On one H100 the
same holds under vmap: the simple CNN's round at C = 100 ran 2.66x faster as
patches (BUILD_NOTES §4b, session 22). TPU keeps the native convolution
(unmeasured there). `default_conv_impl()` picks per backend.

LoRA: every layer here reads optional low-rank factors from the variable
collection 'lora' at its own module path ({'a': [d_in, r], 'b': [r, d_out]},
with the alpha/r scale already folded into b by `fedrobust.transforms`).
`Dense` applies them factored, x W + (x a) b, so the merged d_in x d_out
matrix is never formed and a frozen W stays shared across vmapped clients;
`Conv` and the LSTM's recurrent kernel add a b (reshaped) to their small
kernels instead. A layer without factors in 'lora' is unchanged.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import linen as nn
import numpy as np

ConvImpl = Literal['xla', 'im2col']
CONV_IMPLS = ('xla', 'im2col')


def default_conv_impl(backend: str | None = None) -> ConvImpl:
  """'im2col' on CPU and GPU, 'xla' on TPU (measured in BUILD_NOTES.md)."""
  backend = backend or jax.default_backend()
  return 'xla' if backend == 'tpu' else 'im2col'


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


LORA = 'lora'
# Routed LoRA (FedALT): a module whose 'lora' entry also holds 'a0', 'b0'
# (a second, frozen adapter) and ROUTE ([d_in, 2]) mixes the two per token,
# x W + g0 (x a0) b0 + g1 (x a) b with g = softmax(x route).
ROUTE = 'route'


def lora_factors(module: nn.Module) -> tuple[jax.Array, jax.Array] | None:
  """(a [d_in, r], b [r, d_out]) from the 'lora' collection, or None."""
  if module.has_variable(LORA, 'a'):
    return module.get_variable(LORA, 'a'), module.get_variable(LORA, 'b')
  return None


def lora_merged(module: nn.Module, kernel: jax.Array) -> jax.Array:
  """kernel + (a b) reshaped to the kernel, if the module has factors.

  The kernel is read as a [prod(shape[:-1]), shape[-1]] matrix (a conv's
  [kh*kw*cin, cout]).
  """
  factors = lora_factors(module)
  if factors is None:
    return kernel
  if module.has_variable(LORA, ROUTE):
    raise ValueError(f'{module.name}: routed LoRA (a router over two '
                     'adapters) applies to Dense layers only, not to a '
                     'merged kernel')
  a, b = factors
  return kernel + (a @ b).reshape(kernel.shape).astype(kernel.dtype)


# Probes for per-example statistics (methods/fisher.py's factored Fisher).
# Each Dense and Conv sows its input into PROBE_INPUTS and adds a zero
# perturbation from PROBE_OUTPUTS to its output; the gradient with respect
# to that perturbation is the layer's per-example output gradient. Both
# are no-ops (nothing traced) unless the collections are passed or
# mutable, so ordinary applies compile to the same program.
PROBE_INPUTS = 'probe_inputs'
PROBE_OUTPUTS = 'probe_outputs'


class Dense(nn.Module):
  """flax.linen.Dense's parameters (names, shapes, init) on `matmul`."""
  features: int
  dtype: jnp.dtype | None = None
  use_bias: bool = True

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.param('kernel', nn.initializers.lecun_normal(),
                        (x.shape[-1], self.features))
    factors = lora_factors(self)
    if self.dtype is not None:
      x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
    out = matmul(x, kernel)
    if factors is not None:
      a, b = (f.astype(kernel.dtype) for f in factors)
      low = matmul(matmul(x, a), b)
      if self.has_variable(LORA, ROUTE):
        a0, b0, route = (self.get_variable(LORA, n).astype(kernel.dtype)
                         for n in ('a0', 'b0', ROUTE))
        gate = jax.nn.softmax(matmul(x, route), axis=-1)
        low = gate[..., 1:] * low + gate[..., :1] * matmul(matmul(x, a0), b0)
      out = out + low
    self.sow(PROBE_INPUTS, 'x', x)
    if not self.use_bias:
      return self.perturb('out', out, collection=PROBE_OUTPUTS)
    bias = self.param('bias', nn.initializers.zeros, (self.features,))
    if self.dtype is not None:
      bias = bias.astype(self.dtype)
    out = out + bias.reshape((1,) * (out.ndim - 1) + (-1,))
    return self.perturb('out', out, collection=PROBE_OUTPUTS)


def same_padding(x: jax.Array, kh: int, kw: int) -> jax.Array:
  ph, pw = kh - 1, kw - 1
  return jnp.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2),
                     (0, 0)))


# Input channels up to which the 'im2col' lowering computes the forward
# pass by shift-and-add instead of materialising the patch matrix.
SHIFT_ADD_MAX_CIN = 3


def _kernel_offsets(kh: int, kw: int) -> list[tuple[int, int]]:
  return [(i, j) for i in range(kh) for j in range(kw)]


def window_index(h: int, w: int, cin: int, kh: int, kw: int) -> np.ndarray:
  """int [Ho*Wo, kh*kw*Cin]: for each VALID output pixel (row-major), the
  positions in one example's flattened [H, W, Cin] input of its window, in
  the kernel's (kh, kw, Cin) order. Gathering with it builds im2col
  patches in one op (slices joined materialise every window first)."""
  ho, wo = h - kh + 1, w - kw + 1
  r, q, i, j, c = np.ix_(np.arange(ho), np.arange(wo), np.arange(kh),
                         np.arange(kw), np.arange(cin))
  return (((r + i) * w + (q + j)) * cin + c).reshape(ho * wo, kh * kw * cin)


@jax.custom_vjp
def conv_shift_add(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """VALID stride-1 convolution for inputs with few channels.

  out = sum over kernel taps (i, j) and input channels c of
  x[:, i:i+Ho, j:j+Wo, c:c+1] * kernel[i, j, c], one fused elementwise loop
  on XLA:CPU. For a 1-channel 28x28 input it is about 5x faster than
  building the [N*Ho*Wo, kh*kw] patch matrix. Autodiff of that sum would
  take the kernel gradient as kh*kw*Cin separate reductions over the output
  gradient, which is slow, so the VJP is hand-written: the kernel gradient
  is one GEMM of tap-major patches [kh*kw*Cin, N*Ho*Wo] with the output
  gradient [N*Ho*Wo, Cout] (BUILD_NOTES §4 has the measurements).

  Args:
    x: float[N, H, W, Cin].
    kernel: float[kh, kw, Cin, Cout].

  Returns:
    float[N, H-kh+1, W-kw+1, Cout].
  """
  kh, kw, cin, _ = kernel.shape
  _, h, w, _ = x.shape
  ho, wo = h - kh + 1, w - kw + 1
  # Sum the taps in float32 at least, as a GEMM accumulates (bf16 compute).
  acc_dtype = jnp.promote_types(jnp.result_type(x, kernel), jnp.float32)
  out = None
  for i, j in _kernel_offsets(kh, kw):
    for c in range(cin):
      tap = kernel[i, j, c].reshape(1, 1, 1, -1)
      term = (x[:, i:i + ho, j:j + wo, c:c + 1] * tap).astype(acc_dtype)
      out = term if out is None else out + term
  return out.astype(jnp.result_type(x, kernel))


def _conv_shift_add_fwd(x, kernel):
  return conv_shift_add(x, kernel), (x, kernel)


def _conv_shift_add_bwd(res, g):
  x, kernel = res
  kh, kw, cin, cout = kernel.shape
  n, h, w, _ = x.shape
  ho, wo = h - kh + 1, w - kw + 1
  taps = kh * kw * cin
  g2d = g.reshape(-1, cout)
  # Tap-major patches [kh*kw*Cin, N*Ho*Wo] in one gather from the
  # flattened input with a static index, row (i, j, c), column (example,
  # output pixel): written in the order the GEMM reads, and under vmap
  # with the client axis in front. Taking the windows as slices and
  # joining them materialised every window, then the matrix, then (vmap
  # left the client axis second) its transpose: 29% of the simple CNN's
  # round against 13% for the gather (BUILD_NOTES §4b, session 27).
  index = (window_index(h, w, cin, kh, kw).T[:, None, :]
           + (np.arange(n) * (h * w * cin))[None, :, None])
  patches = x.reshape(-1)[index.reshape(taps, n * ho * wo)]
  dkernel = (patches @ g2d).reshape(kernel.shape)
  # The input gradient is the transpose of taking shifted windows: each
  # tap's share, padded back to its place (dead code, and removed by XLA,
  # when x is data).
  per_tap = (g2d @ kernel.reshape(taps, cout).T).reshape(
      n, ho, wo, kh * kw, cin)
  dx = sum(jnp.pad(per_tap[:, :, :, t], ((0, 0), (i, h - ho - i),
                                         (j, w - wo - j), (0, 0)))
           for t, (i, j) in enumerate(_kernel_offsets(kh, kw)))
  return dx.astype(x.dtype), dkernel.astype(kernel.dtype)


conv_shift_add.defvjp(_conv_shift_add_fwd, _conv_shift_add_bwd)


def conv2d(x: jax.Array, kernel: jax.Array, *, padding: str,
           impl: ConvImpl) -> jax.Array:
  """Stride-1 2-D convolution, NHWC input and HWIO kernel.

  Args:
    x: float[N, H, W, Cin].
    kernel: float[kh, kw, Cin, Cout].
    padding: 'VALID' or 'SAME'.
    impl: 'xla' (lax.conv) or 'im2col' (shifted slices, one matmul; for
      Cin <= SHIFT_ADD_MAX_CIN, conv_shift_add).

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
    x = same_padding(x, kh, kw)
  elif padding != 'VALID':
    raise ValueError(f'padding must be VALID or SAME, got {padding!r}')
  if cin <= SHIFT_ADD_MAX_CIN:
    return conv_shift_add(x, kernel)
  n, h, w, _ = x.shape
  ho, wo = h - kh + 1, w - kw + 1
  cols = jnp.stack([x[:, i:i + ho, j:j + wo, :]
                    for i, j in _kernel_offsets(kh, kw)], axis=3)
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
    kernel = lora_merged(self, self.param(
        'kernel', nn.initializers.lecun_normal(),
        (kh, kw, x.shape[-1], self.features)))
    bias = self.param('bias', nn.initializers.zeros, (self.features,))
    if self.dtype is not None:
      x, kernel, bias = (a.astype(self.dtype) for a in (x, kernel, bias))
    self.sow(PROBE_INPUTS, 'x', x)
    out = conv2d(x, kernel, padding=self.padding, impl=self.impl)
    out = out + bias.reshape((1,) * (out.ndim - 1) + (-1,))
    return self.perturb('out', out, collection=PROBE_OUTPUTS)


def max_pool_2x2(x: jax.Array) -> jax.Array:
  """2x2/stride-2 max pool by reshape (cheap gradient on every backend).

  Odd trailing rows/columns are dropped, as in a VALID pool.
  """
  n, h, w, c = x.shape
  x = x[:, :h // 2 * 2, :w // 2 * 2, :]
  return x.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def pool_relu(x: jax.Array) -> jax.Array:
  """ReLU then 2x2 max pool, computed as pool then ReLU.

  Max and ReLU commute exactly (ReLU is monotone and both only select
  values), and the gradients agree bit for bit: where the window's maximum
  is <= 0 both give zero, and elsewhere they route the same share to the
  same positions. Pooling first runs the ReLU and its backward select on a
  quarter of the elements: on XLA:CPU the simple CNN's round is 7-13%
  faster (BUILD_NOTES §4b, session 28).
  """
  return nn.relu(max_pool_2x2(x))
