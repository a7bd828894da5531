"""Layers whose lowering is a compile-time choice, not a parameter choice.

A convolution's parameters are the same whichever way it is computed, so the
lowering (`conv_impl`) is a static attribute of the module and never part of
a checkpoint. On XLA:CPU a convolution inside `lax.scan`, and a convolution
whose weights are batched by `vmap` (it becomes a grouped convolution), run
several times slower than a plain matmul over image patches. On one H100 the
same holds under vmap: the simple CNN's round at C = 100 ran 2.66x faster as
patches (BUILD_NOTES §4b). 'block' is 'im2col' with each
few-channel convolution that feeds a 2x2 max pool fused with it
(`conv_pool_block`): on XLA:CPU it halves the simple CNN's local step
(BUILD_NOTES §4). TPU keeps the native convolution (unmeasured there).
`default_conv_impl()` picks per backend.

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

ConvImpl = Literal['xla', 'im2col', 'block']
CONV_IMPLS = ('xla', 'im2col', 'block')


def default_conv_impl(backend: str | None = None) -> ConvImpl:
  """'block' on CPU, 'im2col' on GPU, 'xla' on TPU (measured in
  BUILD_NOTES.md; 'block' is unmeasured on GPU and TPU)."""
  backend = backend or jax.default_backend()
  return {'tpu': 'xla', 'cpu': 'block'}.get(backend, 'im2col')


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


# Probes for per-example statistics (methods/sdfc/fisher.py's factored Fisher).
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
  # round against 13% for the gather (BUILD_NOTES §4).
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
      Cin <= SHIFT_ADD_MAX_CIN, conv_shift_add). 'block' computes a lone
      convolution as 'im2col' does (it differs only where a convolution
      is followed by a pool: `conv_pool_block`).

  Returns:
    float[N, H', W', Cout].
  """
  kh, kw, cin, cout = kernel.shape
  if impl == 'xla':
    return jax.lax.conv_general_dilated(
        x, kernel, (1, 1), padding,
        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  if impl not in ('im2col', 'block'):
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


def block_window_index(h: int, w: int, cin: int, kh: int,
                       kw: int) -> np.ndarray:
  """int [(Ho/2)*(Wo/2), (kh+1)*(kw+1)*Cin]: for each 2x2 block of VALID
  output pixels (row-major over blocks), the positions in one example's
  flattened [H, W, Cin] input of the (kh+1) x (kw+1) window that the
  block's four outputs read, in (row, column, Cin) order."""
  ho, wo = h - kh + 1, w - kw + 1
  r, q, i, j, c = np.ix_(np.arange(ho // 2), np.arange(wo // 2),
                         np.arange(kh + 1), np.arange(kw + 1), np.arange(cin))
  return (((2 * r + i) * w + (2 * q + j)) * cin + c).reshape(
      (ho // 2) * (wo // 2), (kh + 1) * (kw + 1) * cin)


def block_kernel(kernel: jax.Array) -> jax.Array:
  """[kh, kw, Cin, Cout] -> [(kh+1)(kw+1)Cin, 4 Cout]: the kernel placed at
  the four offsets (a, b) of a 2x2 output block, zeros elsewhere; column
  (a, b, o) gives output (2r + a, 2q + b, o) from block (r, q)'s window."""
  kh, kw, cin, cout = kernel.shape
  placed = [jnp.pad(kernel, ((a, 1 - a), (b, 1 - b), (0, 0), (0, 0)))
            for a in (0, 1) for b in (0, 1)]
  return jnp.stack(placed, axis=3).reshape((kh + 1) * (kw + 1) * cin,
                                           4 * cout)


# Input and output channels up to which impl 'block' fuses a conv with its
# pool. The block GEMM does (kh+1)(kw+1)/(kh kw) times the multiply-adds
# (1.44x for 5x5, 1.78x for 3x3); it pays where moving a few-channel
# full-resolution output and its patches costs more than the arithmetic.
# On the 2-core box (BUILD_NOTES §4): simple_cnn's 1->6 and
# 6->16 convs fused ran its round 1.5-2.1x faster; fusing cnn's 1->32 conv
# (5x5 SAME, batch 4) cost 3%, with its 32->64 conv as well 10%, and
# vgg_small's 32- and 64-channel 3x3 convs 30%.
BLOCK_MAX_CIN = 8
BLOCK_MAX_COUT = 16


def block_fits(x_shape: tuple[int, ...], kernel_shape: tuple[int, ...],
               padding: str) -> bool:
  """Whether `conv_pool_block` applies: even VALID output height and width
  after the padding (a VALID pool drops an odd last row; the fused route
  does not handle that case)."""
  _, h, w, _ = x_shape
  kh, kw = kernel_shape[:2]
  if padding == 'SAME':
    return h % 2 == 0 and w % 2 == 0
  return (h - kh + 1) % 2 == 0 and (w - kw + 1) % 2 == 0


def conv_blocks(x: jax.Array, kernel: jax.Array, *,
                padding: str) -> jax.Array:
  """conv2d(x, kernel) in 2x2 output blocks: float[N, Ho/2, Wo/2, 4, Cout],
  axis 3 the position (a, b) in the block, row-major (`conv_pool_block`).

  Args:
    x: float[N, H, W, Cin].
    kernel: float[kh, kw, Cin, Cout].
    padding: 'VALID' or 'SAME'; the output height and width must be even
      (`block_fits`).
  """
  if padding == 'SAME':
    x = same_padding(x, *kernel.shape[:2])
  elif padding != 'VALID':
    raise ValueError(f'padding must be VALID or SAME, got {padding!r}')
  if not block_fits(x.shape, kernel.shape, 'VALID'):
    raise ValueError(f'conv_blocks needs an even output; input '
                     f'{x.shape}, kernel {kernel.shape}')
  n, h, w, cin = x.shape
  kh, kw, _, cout = kernel.shape
  ho, wo = h - kh + 1, w - kw + 1
  # One gather with a static index (as conv_shift_add's VJP does); its
  # transpose, the input gradient, is one scatter-add into [N, H*W*Cin].
  windows = x.reshape(n, h * w * cin)[:, block_window_index(h, w, cin, kh,
                                                            kw)]
  out = matmul(windows, block_kernel(kernel))
  return out.reshape(n, ho // 2, wo // 2, 4, cout)


def blocks_to_image(out: jax.Array) -> jax.Array:
  """`conv_blocks`' layout [N, Ho/2, Wo/2, 4, C] back to [N, Ho, Wo, C]."""
  n, hb, wb, _, c = out.shape
  return out.reshape(n, hb, wb, 2, 2, c).transpose(0, 1, 3, 2, 4, 5).reshape(
      n, 2 * hb, 2 * wb, c)


def conv_pool_block(x: jax.Array, kernel: jax.Array, bias: jax.Array, *,
                    padding: str) -> jax.Array:
  """max_pool_2x2(conv2d(x, kernel) + bias), by 2x2 output blocks.

  Each 2x2 block of the convolution's output reads a (kh+1) x (kw+1)
  window of the input, so one GEMM of block windows [N*Ho*Wo/4,
  (kh+1)(kw+1)Cin] with `block_kernel` [.., 4 Cout] gives the four outputs
  of every block side by side (`conv_blocks`), and the pool is a max over
  that axis of 4. Against im2col this reads 2.8x fewer patch values for a
  5x5 kernel (36 against 100 per block and input channel), never writes
  the full-resolution output or its pool mask, and the pool's backward
  scatters into contiguous rows; it does 1.44x the multiply-adds (the
  zeros of the placed kernel). On XLA:CPU the simple CNN's round is about
  1.6-2x faster (BUILD_NOTES §4). Values equal the unfused
  layer's up to float reassociation inside the GEMM; max(a_i + b) =
  max(a_i) + b exactly in floating point (rounding is monotone), so the
  bias is added after the pool.

  Args:
    x: float[N, H, W, Cin].
    kernel: float[kh, kw, Cin, Cout].
    bias: float[Cout].
    padding: 'VALID' or 'SAME'; the output height and width must be even
      (`block_fits`).

  Returns:
    float[N, Ho/2, Wo/2, Cout], before any ReLU.
  """
  out = conv_blocks(x, kernel, padding=padding).max(axis=3)
  return out + bias.reshape(1, 1, 1, -1)


class Conv(nn.Module):
  """Conv layer with flax.linen.Conv's parameter names and shapes."""
  features: int
  kernel_size: tuple[int, int]
  padding: str = 'SAME'
  impl: ConvImpl = 'xla'
  dtype: jnp.dtype | None = None
  # Follow the convolution with ReLU and a 2x2 max pool (`pool_relu`).
  # With impl 'block' the three are fused (`conv_pool_block`) where the
  # output is even and has at most BLOCK_MAX_COUT channels, and the input
  # at most BLOCK_MAX_CIN.
  pool: bool = False

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
    if (self.pool and self.impl == 'block' and x.shape[-1] <= BLOCK_MAX_CIN
        and self.features <= BLOCK_MAX_COUT
        and block_fits(x.shape, kernel.shape, self.padding)):
      if not (self.is_mutable_collection(PROBE_OUTPUTS)
              or self.has_variable(PROBE_OUTPUTS, 'out')):
        return nn.relu(conv_pool_block(x, kernel, bias,
                                       padding=self.padding))
      # Probed (methods/sdfc/fisher.py): the perturbation, and so the output
      # gradient the probe reads, is in block layout [N, Ho/2, Wo/2, 4,
      # Cout]; the Fisher recognises a 5-D probe by its rank.
      out = conv_blocks(x, kernel, padding=self.padding)
      out = self.perturb('out', out + bias.reshape(1, 1, 1, 1, -1),
                         collection=PROBE_OUTPUTS)
      return nn.relu(out.max(axis=3))
    out = conv2d(x, kernel, padding=self.padding, impl=self.impl)
    out = out + bias.reshape((1,) * (out.ndim - 1) + (-1,))
    out = self.perturb('out', out, collection=PROBE_OUTPUTS)
    return pool_relu(out) if self.pool else out


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
  faster (BUILD_NOTES §4).
  """
  return nn.relu(max_pool_2x2(x))
