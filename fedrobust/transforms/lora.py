"""LoRA (Hu et al. 2022) as a parameter transform over any params tree.

For every targeted kernel W (a conv kernel read as a [kh*kw*cin, cout]
matrix) a client trains two factors and keeps W frozen:

  W' = W + (alpha / r) A B,   A: [d_in, r] ~ N(0, 1/d_in),  B: [r, d_out] = 0

(the paper writes W0 + B A with B zero and A Gaussian acting on column
vectors; here inputs are rows, x W, so our `a` is the paper's A^T and `b`
its B^T, with the same shapes' roles: `a` touches the input). With B = 0
the first forward pass equals the frozen model, as in the paper.

The trainable tree mirrors the params tree down to the targeted modules:
{'Dense_0': {'a': [d_in, r], 'b': [r, d_out]}, ...}, so a model's layers
find their factors at their own module path in the flax 'lora' collection
and apply them factored (models/layers.py): x W + (x a)(s b), never forming
the merged d_in x d_out matrix. A model that is not lora_native gets the
merged kernels instead (same values).

Heterogeneous ranks (HetLoRA, Horus, RFD-LoRA): clients of one cohort may
hold different ranks r_c <= r_max. Every tree has r_max columns/rows; a
client of rank r_c owns the first r_c (its coverage), trains only those,
and uses the scale alpha / r_c. The server averages each factor entry over
the clients that own it (Horus Sec. V-C.1's masked average).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.errors import SettingError
from fedrobust.transforms.base import (Transform, get_path, module_paths,
                                       resolve_targets, set_path)


def lora(model, *, ranks: tuple[int, ...] = (8,), alpha: float = 0.0,
         targets: tuple[str, ...] = ('all',)) -> Transform:
  """LoRA on the kernels of `model` selected by `targets`.

  Args:
    model: a fedrobust.models.Model.
    ranks: the distinct client ranks of this cohort (r_max = the largest).
    alpha: LoRA's alpha; 0 means alpha = r_max (scale 1 at the top rank).
    targets: role names ('first', 'head'), 'all', or globs over module
      paths (see transforms.base.resolve_targets).

  Returns:
    A Transform whose spec is the client's rank (float32[]).
  """
  ranks = tuple(int(r) for r in ranks)
  if not ranks or min(ranks) < 1:
    raise SettingError('lora_ranks', f'must be positive ints, got {ranks}')
  if alpha < 0 or not np.isfinite(alpha):
    raise SettingError('lora_alpha', f'must be >= 0 and finite, got {alpha}')
  r_max = max(ranks)
  alpha = float(alpha) or float(r_max)
  heterogeneous = len(set(ranks)) > 1
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  paths = resolve_targets(tuple(targets), module_paths(shapes), model.roles)
  kernels = {p: get_path(shapes, p)['kernel'].shape for p in paths}

  def init(params, key):
    trainable = {}
    for n, path in enumerate(paths):
      shape = kernels[path]
      d_in, d_out = int(np.prod(shape[:-1])), shape[-1]
      a = jax.random.normal(jax.random.fold_in(key, n), (d_in, r_max),
                            jnp.float32) / np.sqrt(d_in)
      trainable = set_path(trainable, path, {
          'a': a, 'b': jnp.zeros((r_max, d_out), jnp.float32)})
    return params, trainable

  def scale(spec):
    if heterogeneous and spec is not None:
      return alpha / jnp.asarray(spec, jnp.float32)
    return alpha / r_max

  def scaled(trainable, spec):
    s = scale(spec)
    out = {}
    for path in paths:
      f = get_path(trainable, path)
      out = set_path(out, path, {'a': f['a'], 'b': f['b'] * s})
    return out

  def coverage(trainable, spec, round_number):
    del round_number
    if not heterogeneous:
      return None
    rank = jnp.asarray(spec, jnp.float32)
    out = {}
    for path in paths:
      f = get_path(trainable, path)
      cols = (jnp.arange(r_max) < rank).astype(jnp.float32)
      out = set_path(out, path, {
          'a': jnp.broadcast_to(cols[None, :], f['a'].shape),
          'b': jnp.broadcast_to(cols[:, None], f['b'].shape)})
    return out

  def merge(base, trainable, spec=None):
    factors = scaled(trainable, spec)
    full = base
    for path in paths:
      f = get_path(factors, path)
      module = get_path(full, path)
      kernel = module['kernel']
      delta = (f['a'] @ f['b']).reshape(kernel.shape).astype(kernel.dtype)
      full = set_path(full, path, dict(module, kernel=kernel + delta))
    return full

  def apply(base, trainable, x, *, spec=None, train=False, key=None):
    if model.lora_native:
      return model.apply(base, x, train=train, key=key,
                         lora=scaled(trainable, spec))
    return model.apply(merge(base, trainable, spec), x, train=train, key=key)

  return Transform('lora', init, coverage, apply, merge,
                   spec_values=tuple(float(r) for r in sorted(set(ranks))),
                   spec_name='rank', factor_scale=scale)


def lora_paths(model, targets: tuple[str, ...]) -> list[str]:
  """The module paths `targets` selects in `model` (for reporting)."""
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  return resolve_targets(tuple(targets), module_paths(shapes), model.roles)
