"""Diagonal empirical Fisher information (SDFC Eq. 5-7), masked and batched.

  M(D)[v] = E_{(x,y) in D} (d/dw_v log p(y | x, w))^2            (Eq. 5, 6)

Per-example gradients come from `vmap(grad)` over one batch at a time
(memory B * |w|), accumulated with `lax.map` over batches; padded examples
are masked out of both the sum and the count, and batches with no real
example are skipped.

Per-example statistics, two implementations (`impl`, same math):
  'vmap'      vmap(grad) over the batch: every example's full gradient.
  'factored'  one backward pass to every Dense / Conv output of the batch
              (the model's `probe`, models/layers.py), then per layer:
              a Dense layer's per-example kernel gradient is the outer
              product a_i delta_i^T, so
                sum_i (a_i delta_i^T)^2 = (a^2)^T (delta^2)
              (and |.| likewise with |a|, |delta|): one matmul, no
              per-example gradient. A conv layer's per-example kernel
              gradient sums patch x delta over positions BEFORE the
              square, so that identity does not hold there; its
              per-example kernel gradients are formed explicitly from the
              input patches (an [N, kh kw Cin, Cout] batched matmul, the
              FLOPs of one weight gradient). Those per-example kernels
              are formed and squared STAT_CHUNK examples at a time in a
              scan on CPU, so each chunk's [c, K, Cout] block stays in
              cache instead of the batch's (1.7-2x faster for the
              simple CNN's convs on the 2-core box, BUILD_NOTES §4b); on
              GPU/TPU in one pass. On CPU, layers with few channels
              form them by kernel offset instead (_conv_route). Needs a
              model whose every parameter belongs to a Dense or Conv
              called once per forward pass; otherwise it falls back to
              'vmap'.

Variants (SDFC ablations and the released code's choice):
  importance='fisher'   squared gradients (Eq. 6);
  importance='abs_grad' absolute gradients (Table 2's alternative);
  mode='per_example'    E over examples of the per-example statistic (the
                        paper's Eq. 5-6);
  mode='released'       the released code's estimator (PrevAbsFedFish.py):
                        per batch it backpropagates the mean of the B x B
                        matrix log p(y_j | x_i) over every pair (i, j) of
                        the batch (`pre[:, label]`), averages those batch
                        gradients over the non-empty batches, and only
                        then squares (or takes |.|):
                          G = mean_b grad_w mean_{i,j in b} log p(y_j|x_i)
                          M = G^2 (fisher) or |G| (abs_grad).
                        mean_{i,j} log p(y_j | x_i) = mean_i sum_c pi_c
                        log p(c | x_i) with pi the batch's label
                        frequencies, which is how it is computed (no B x B
                        matrix; the test checks it against the literal
                        transcription).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedrobust.errors import check_choice
from fedrobust.models.layers import (block_window_index, blocks_to_image,
                                     same_padding, window_index)
from fedrobust.tree import leaf_names

Params = Any
IMPORTANCES = ('fisher', 'abs_grad')
FISHER_MODES = ('per_example', 'released')
FISHER_IMPLS = ('factored', 'vmap')


def _by_path(tree: Any, prefix: tuple[str, ...] = ()) -> dict:
  """Nested dicts -> {module path tuple: {leaf name: leaf}}."""
  out = {}
  for name, value in tree.items():
    if hasattr(value, 'items'):
      out.update(_by_path(value, prefix + (name,)))
    else:
      out.setdefault(prefix, {})[name] = value
  return out


def factored_plan(params: Params, probe_fn: Callable | None, x: jax.Array
                  ) -> bool:
  """Whether the factored per-example statistics cover `params`: every
  leaf is the kernel or bias of a probed layer called once."""
  if probe_fn is None:
    return False
  def shapes(p, xb):
    forward, zeros = probe_fn(p, xb)
    return zeros, forward(zeros)[1]

  zeros, inputs = jax.eval_shape(shapes, params, x)
  layers = _by_path(params)
  probed_out, probed_in = _by_path(zeros), _by_path(inputs)
  for path, leaves in layers.items():
    if set(leaves) - {'kernel', 'bias'} or 'kernel' not in leaves:
      return False
    if path not in probed_out or len(probed_in.get(path, {}).get(
        'x', ())) != 1:
      return False
    if leaves['kernel'].ndim not in (2, 4):
      return False
  return True


# Examples per step of a conv layer's per-example kernel statistics: their
# [c, K, Cout] gradients are formed, squared and summed c at a time.
STAT_CHUNK = 8


def _on_cpu(backend: str | None) -> bool:
  return (backend or jax.default_backend()) == 'cpu'


# Examples per batch of the factored Fisher pass on CPU (fisher_batch_size).
# The pass has no sequential dependency, and each batch pays a fixed cost
# in small per-layer kernels (the Dense products, the conv statistics'
# chunks, the sums): on the 2-core box simple_cnn's Fisher ran 13-17%
# faster at 128 than at 64, and 256 or 512 gained less (BUILD_NOTES §4).
FISHER_BATCH_CPU = 128


def fisher_batch_size(batch_size: int, *, factored: bool,
                      backend: str | None = None) -> int:
  """Examples per Fisher batch when the caller leaves it to us, a multiple
  of the stored batch: the factored per-example pass on CPU takes the
  largest multiple up to FISHER_BATCH_CPU (at least one stored batch);
  per-example gradients by vmap keep the stored batch (their memory is
  batch x |w|), as do GPU and TPU until measured there."""
  if factored and _on_cpu(backend):
    return batch_size * max(1, FISHER_BATCH_CPU // batch_size)
  return batch_size


def merge_batches(x: jax.Array, y: jax.Array, mask: jax.Array,
                  batch_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """[T, B, ...] batches re-cut into batches of `batch_size` examples (a
  multiple of B): k = batch_size / B consecutive batches each, T padded
  with masked empty batches to a multiple of k (fisher_diagonal skips
  those)."""
  t, b = mask.shape
  if batch_size % b:
    raise ValueError(f'batch_size {batch_size} must be a multiple of the '
                     f'stored batch {b}')
  k = batch_size // b
  if k == 1:
    return x, y, mask
  pad = -t % k
  if pad:
    grow = lambda a: jnp.concatenate(
        [a, jnp.zeros((pad,) + a.shape[1:], a.dtype)])
    x, y, mask = grow(x), grow(y), grow(mask)
  cut = lambda a: a.reshape(((t + pad) // k, batch_size) + a.shape[2:])
  return cut(x), cut(y), cut(mask)


def _chunk_size(n: int, backend: str | None = None) -> int:
  """Examples per chunk: the largest divisor of n up to STAT_CHUNK on CPU;
  n (one pass) on GPU/TPU, where the batch's block is no cache problem
  and a scan would serialise the work (the GPU figures of BUILD_NOTES
  §4b ran with one pass)."""
  if not _on_cpu(backend):
    return n
  return max(c for c in range(1, min(n, STAT_CHUNK) + 1) if n % c == 0)


def _conv_route(kernel_shape, backend: str | None = None) -> str:
  """How a conv layer's per-example kernel statistics are formed.

  'patches': im2col patches [N, P, kh kw Cin], then one [kh kw Cin, P] x
  [P, Cout] matmul per example (chunked on CPU, _chunk_size).
  'shifts': for each of the kh kw kernel offsets, the shifted input
  [N, P, Cin] against delta [N, P, Cout]: kh kw matmuls of [Cin, P] x
  [P, Cout] per example, with no patch matrix. Same sums, another order.

  'shifts' is taken on CPU for 3 <= Cin and Cin Cout <= 512, where it won
  in every shape timed on the 2-core box (per 256 examples, patches vs
  shifts: 5x5 6->16 4.6 vs 1.7 ms, 5x5 3->6 18.0 vs 11.0, 5x5 16->32 22.1
  vs 15.4, 3x3 8->16 8.4 vs 5.0); patches won at Cin <= 2 (5x5 1->6 30 vs
  44 ms per 1,024, 5x5 2->8 2.5 vs 3.8) and at Cin Cout >= 1024 (3x3
  32->32 21.0 vs 37.6, 3x3 64->64 87.3 vs 100.4, 5x5 32->64 176 vs 232).
  GPU/TPU keep 'patches' in one pass (BUILD_NOTES §4b's GPU figures).
  A conv fused with its pool (conv_impl 'block') is probed in block
  layout and goes by 'blocks' instead (_layer_stat, _block_stat).
  """
  if not _on_cpu(backend):
    return 'patches'
  cin, cout = kernel_shape[2], kernel_shape[3]
  return 'shifts' if 3 <= cin and cin * cout <= 512 else 'patches'


def _layer_stat(kernel_shape, has_bias, a, delta, stat):
  """Summed per-example stat of one layer's kernel (and bias) gradients.

  a: the layer's input float32[N, ...]; delta: the per-example gradient
  at its output float32[N, ...] (zero rows for masked examples). A conv
  layer goes by _conv_route: 'shifts' in one pass, 'patches'
  _chunk_size(N) examples at a time.
  """
  n = a.shape[0]
  route = _conv_route(kernel_shape) if len(kernel_shape) == 4 else None
  if route is not None and delta.ndim == 5:
    # A fused conv-pool's output gradient, in block layout. Its windows
    # replace the patch matrix ('blocks': 16-24 against 37-47 ms per 1,024
    # examples for simple_cnn's 1->6 conv); 'shifts' reads the
    # full-resolution layout (11 against 31 ms by blocks for its 6->16
    # conv; the whole Fisher 120-132 against 136-149 ms; BUILD_NOTES §4).
    if route == 'patches':
      route = 'blocks'
    else:
      delta = blocks_to_image(delta)
      # Written once: fused into each of the kh*kw einsums, the pool's
      # backward that makes delta ran once per offset.
      delta = jax.lax.optimization_barrier(delta)
  c = _chunk_size(n)
  if route in ('patches', 'blocks') and c < n:
    split = lambda t: t.reshape((n // c, c) + t.shape[1:])

    def add_chunk(carry, chunk):
      kernel, bias = _layer_stat_all(kernel_shape, True, *chunk, stat,
                                     route)
      return (carry[0] + kernel, carry[1] + bias), None

    init = (jnp.zeros(kernel_shape, jnp.float32),
            jnp.zeros(kernel_shape[-1:], jnp.float32))
    (kernel, bias), _ = jax.lax.scan(add_chunk, init, (split(a), split(delta)))
    return kernel, (bias if has_bias else None)
  return _layer_stat_all(kernel_shape, has_bias, a, delta, stat, route)


def _layer_stat_all(kernel_shape, has_bias, a, delta, stat, route=None):
  """_layer_stat over all N examples at once; a conv layer by `route`."""
  n = a.shape[0]
  if len(kernel_shape) == 2:                           # Dense
    a3 = a.reshape(n, -1, a.shape[-1])
    d3 = delta.reshape(n, -1, delta.shape[-1])
    if a3.shape[1] == 1:                               # one vector each
      kernel = jnp.einsum('ni,no->io', stat(a3[:, 0]), stat(d3[:, 0]),
                          precision='highest')
    else:                                              # sum over tokens first
      kernel = jnp.sum(stat(jnp.einsum('nti,nto->nio', a3, d3,
                                       precision='highest')), axis=0)
    bias = jnp.sum(stat(jnp.sum(d3, axis=1)), axis=0)
  elif route == 'blocks':          # a fused conv-pool (layers.conv_blocks)
    kernel, bias = _block_stat(kernel_shape, a, delta, stat)
  else:                                                # Conv, HWIO
    kh, kw, cin, cout = kernel_shape
    if delta.shape[1] == a.shape[1]:                   # SAME
      a = same_padding(a, kh, kw)
    ho, wo = delta.shape[1], delta.shape[2]
    offsets = [(i, j) for i in range(kh) for j in range(kw)]
    d = delta.reshape(n, ho * wo, cout)
    if route == 'shifts':   # one [Cin, P] x [P, Cout] product per offset
      per = jnp.stack([jnp.einsum('nhwc,nhwo->nco',
                                  a[:, i:i + ho, j:j + wo, :], delta,
                                  precision='highest')
                       for i, j in offsets], axis=1)
    else:                   # im2col, in the kernel's (kh, kw, Cin) order
      # One gather with layers.window_index (row: output pixel, column:
      # tap (i, j, c)); stacking kh*kw window slices materialised each
      # window first (BUILD_NOTES §4).
      p = a.reshape(n, -1)[:, window_index(a.shape[1], a.shape[2], cin,
                                           kh, kw)]
      per = jnp.einsum('npk,npo->nko', p, d, precision='highest')
    kernel = jnp.sum(stat(per), axis=0).reshape(kh, kw, cin, cout)
    bias = jnp.sum(stat(jnp.sum(d, axis=1)), axis=0)
  return kernel, (bias if has_bias else None)


def _block_stat(kernel_shape, a, delta, stat):
  """Summed per-example stat of a fused conv-pool layer's gradients.

  delta is the output gradient in block layout [N, Ho/2, Wo/2, 4, Cout]
  (layers.conv_blocks): each example's kernel gradient in block form is
  windows^T delta, [(kh+1)(kw+1)Cin, 4 Cout], and the gradient of the
  kernel itself is the sum of its four placed copies (block_kernel's
  transpose). The same per-example gradients as the im2col route, summed
  in another order.
  """
  kh, kw, cin, cout = kernel_shape
  n = a.shape[0]
  if 2 * delta.shape[1] == a.shape[1]:                 # SAME
    a = same_padding(a, kh, kw)
  d = delta.reshape(n, -1, 4 * cout)
  windows = a.reshape(n, -1)[:, block_window_index(a.shape[1], a.shape[2],
                                                   cin, kh, kw)]
  per = jnp.einsum('npk,npo->nko', windows, d, precision='highest')
  per = per.reshape(n, kh + 1, kw + 1, cin, 2, 2, cout)
  per = sum(per[:, i:i + kh, j:j + kw, :, i, j, :]
            for i in (0, 1) for j in (0, 1))
  kernel = jnp.sum(stat(per), axis=0)
  bias = jnp.sum(stat(jnp.sum(delta.reshape(n, -1, cout), axis=1)), axis=0)
  return kernel, bias


def factored_sums(probe_fn: Callable, params: Params, x: jax.Array,
                  y: jax.Array, mask: jax.Array, stat) -> Params:
  """sum over the batch's real examples of stat(per-example gradient of
  log p(y | x)), as a tree like params, from one backward pass."""
  forward, zeros = probe_fn(params, x)

  def total(perturbations):
    logits, inputs = forward(perturbations)
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_p, y[:, None], axis=-1)[:, 0]
    return jnp.sum(jnp.where(mask, picked, 0.0)), inputs

  deltas, inputs = jax.grad(total, has_aux=True)(zeros)
  deltas, ins = _by_path(deltas), _by_path(inputs)
  stats = {}
  for path, leaves in _by_path(params).items():
    kernel, bias = _layer_stat(
        leaves['kernel'].shape, 'bias' in leaves,
        ins[path]['x'][0].astype(jnp.float32),
        deltas[path]['out'].astype(jnp.float32), stat)
    stats['/'.join(path + ('kernel',))] = kernel
    if bias is not None:
      stats['/'.join(path + ('bias',))] = bias
  return jax.tree.unflatten(jax.tree.structure(params),
                            [stats[name] for name in leaf_names(params)])


def log_likelihood(apply_fn: Callable, params: Params, x: jax.Array,
                   y: jax.Array) -> jax.Array:
  """log p(y | x, w) for uint8 images x [B, ...] -> float[B]."""
  logits = apply_fn(params, x)
  log_p = jax.nn.log_softmax(logits, axis=-1)
  return jnp.take_along_axis(log_p, y[:, None], axis=-1)[:, 0]


def fisher_diagonal(apply_fn: Callable, params: Params, x: jax.Array,
                    y: jax.Array, mask: jax.Array, *,
                    importance: str = 'fisher',
                    mode: str = 'per_example', impl: str = 'vmap',
                    probe_fn: Callable | None = None,
                    batch_size: int = 0) -> Params:
  """Diagonal Fisher (or |grad|) of `params` on a batched example set.

  Args:
    apply_fn: Model.apply, (params, stored images) -> logits.
    params: the model w at which the Fisher is taken.
    x: uint8[T, B, H, W, Ch] examples in T batches.
    y: int32[T, B] labels.
    mask: bool[T, B], False for padding.
    importance: 'fisher' or 'abs_grad'.
    mode: 'per_example' or 'released'.
    impl: 'factored' or 'vmap' for mode 'per_example' (module docstring);
      'factored' needs `probe_fn` (Model.probe) and falls back to 'vmap'
      where the probes do not cover the model.
    probe_fn: Model.probe, or None.
    batch_size: examples per batch of the pass, a multiple of B; 0 picks
      fisher_batch_size. The T batches are re-cut (merge_batches); the
      result is the same sum in another order, except for
      mode='released', whose estimator is defined per batch and always
      keeps the stored batches.

  Returns:
    A tree shaped like params; zeros if there is no real example.
  """
  check_choice('importance', importance, IMPORTANCES)
  check_choice('fisher_mode', mode, FISHER_MODES)
  check_choice('fisher_impl', impl, FISHER_IMPLS)
  stat = jnp.square if importance == 'fisher' else jnp.abs
  factored = (impl == 'factored' and mode == 'per_example' and
              factored_plan(params, probe_fn, x[0]))
  if mode == 'per_example':
    x, y, mask = merge_batches(x, y, mask, batch_size or fisher_batch_size(
        mask.shape[1], factored=factored))

  def one_example_grad(xe, ye):
    return jax.grad(lambda p: log_likelihood(apply_fn, p, xe[None],
                                             ye[None])[0])(params)

  def batch_sum(batch):
    xb, yb, mb = batch
    if factored:
      return (factored_sums(probe_fn, params, xb, yb, mb, stat),
              jnp.sum(mb).astype(jnp.float32))
    if mode == 'per_example':
      grads = jax.vmap(one_example_grad)(xb, yb)
      def masked_sum(g):
        keep = mb.reshape((-1,) + (1,) * (g.ndim - 1))
        return jnp.sum(jnp.where(keep, stat(g), 0.0), axis=0)
      return jax.tree.map(masked_sum, grads), jnp.sum(mb).astype(jnp.float32)
    m = mb.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)

    def cross_label_mean(p):           # mean_{i,j} log p(y_j | x_i)
      log_p = jax.nn.log_softmax(apply_fn(p, xb).astype(jnp.float32), -1)
      freq = jnp.sum(jax.nn.one_hot(yb, log_p.shape[-1]) * m[:, None],
                     axis=0) / n
      return jnp.sum((log_p @ freq) * m) / n

    return jax.grad(cross_label_mean)(params), jnp.float32(1.0)

  def batch_sum_or_skip(batch):
    # A client's data is padded to the largest client's, so its trailing
    # batches may hold no real example (on the SDFC quick preset the
    # largest client is 1.4x the mean). Under lax.map the cond skips
    # them; under vmap it becomes a select with the same result.
    zeros = (jax.tree.map(jnp.zeros_like, params), jnp.float32(0.0))
    return jax.lax.cond(jnp.any(batch[2]), batch_sum, lambda _: zeros, batch)

  # A running sum over the batches, in order: trailing batches of padding
  # add exact zeros, so the result does not depend on how far a client is
  # padded (a reduction over the batch axis would group the sums by its
  # length; replicas of a federation pad clients further than a single
  # run does).
  def accumulate(carry, batch):
    sums, count = carry
    add, n = batch_sum_or_skip(batch)
    return (jax.tree.map(jnp.add, sums, add), count + n), None

  zero = (jax.tree.map(jnp.zeros_like, params), jnp.float32(0.0))
  (sums, counts), _ = jax.lax.scan(accumulate, zero, (x, y, mask))
  total = jnp.maximum(counts, 1.0)
  means = jax.tree.map(lambda s: s / total, sums)
  if mode == 'released':     # square (or |.|) after averaging the batches
    return jax.tree.map(stat, means)
  return means
