"""Horus's server rule (Horus Sec. V-B/C, Algorithm 1 lines 10-19).

Per round, for every client c of the group (aligned, zero-padded LoRA
factors of the shared layers, or full kernels in the full-parameter
variants):

  1. Its matrices are its current values, params + update (Horus scores
     the client's LoRA-A itself, not its change).
  2. HOPS (Eq. 2-4, aggregators/spectral.py) on the singular values of each
     detection matrix: LoRA-A (`detect='a'`, the paper's choice), LoRA-B
     ('b') or both ('ab'); full-parameter trees use their kernels. A
     client's score is the mean of its per-layer scores (each layer's HOPS
     is already normalised by the round's statistics, so layers of
     different shapes weigh alike).
  3. Detection (Eq. 5): theta = the p-th percentile (linear interpolation,
     as numpy's default) of the real clients' scores; clients with
     S > theta, or with a non-finite matrix, are excluded.
  4. Projection-guided weights (Eq. 7-8): alpha_c = |<v_c, v_g>| per
     matrix, v_c the client's first singular vector along the matrix's
     input side (the paper's first right singular vector of A in R^{r x
     d_in}; our factors are stored transposed, so it is the first LEFT
     singular vector of `a` [d_in, r] and of `b` [r, d_out]), v_g the same
     vector of the previous round's aggregate. In the first round (no v_g
     yet) alpha = 1. Vectors (biases) take the mean alpha of the client's
     matrices.
  5. Masked, alpha-weighted mean (Eq. 6 and 9): per coordinate over the
     kept clients that own it (coverage), sum alpha M x / sum alpha M.
     Since every client started from the same broadcast, averaging the
     updates gives the same new global values as averaging the values.
  6. v_g <- the first singular vector of each aggregated matrix.

`projection=False` is Table III's "w/o weight" (alpha = 1, FedAvg on the
kept clients). info: 'weights' (alpha, mean over matrices, 0 if excluded),
'hops' (S_c), 'threshold' (theta), 'excluded' (count).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.aggregators import spectral
from fedrobust.aggregators.base import Aggregator
from fedrobust.aggregators.mean import (check_num_byzantine,
                                        covered_weighted_mean, setting)

DETECT = ('a', 'b', 'ab')


class HorusState(NamedTuple):
  directions: Any        # per leaf: the previous aggregate's v_g (or ())
  have: jax.Array        # bool[]: v_g exists (after the first round)


def masked_percentile(values: jax.Array, mask: jax.Array,
                      p: float) -> jax.Array:
  """numpy.percentile(values[mask], p) (linear interpolation); 0 if none."""
  n = jnp.sum(mask)
  ordered = jnp.sort(jnp.where(mask, values, jnp.inf))
  pos = (jnp.maximum(n, 1) - 1).astype(jnp.float32) * (p / 100.0)
  lo = jnp.floor(pos).astype(jnp.int32)
  hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
  frac = pos - lo
  value = ordered[lo] + frac * (ordered[hi] - ordered[lo])
  return jnp.where(n > 0, jnp.where(frac > 0, value, ordered[lo]), 0.0)


def _key_name(path) -> str:
  last = path[-1]
  return str(getattr(last, 'key', getattr(last, 'name', last)))


def _matrix(leaf: jax.Array) -> jax.Array:
  """[C, d0, d1, ...] -> [C, d0 * ... , d_last] (a conv kernel's view)."""
  return leaf.reshape(leaf.shape[0], -1, leaf.shape[-1])


def horus(*, num_byzantine: int = 0, lam: float = 0.5, top_k: int = 5,
          percentile: float = 95.0, detect: str = 'a',
          projection: bool = True, exclude_ties: bool = True,
          sv_method: str = 'auto') -> Aggregator:
  """Horus's HOPS detection plus projection-guided aggregation.

  Args:
    num_byzantine: ignored (Horus needs no f).
    lam: HOPS's lambda in [0, 1] (Eq. 4).
    top_k: k of the top-k energy ratio (Eq. 3; the paper's 5).
    percentile: p of the detection threshold (Eq. 5; the paper's 95).
    detect: 'a', 'b' or 'ab' (Table III's b_detect / ab_detect).
    projection: projection-guided weights (Eq. 8); False is "w/o weight".
    exclude_ties: the benign set is {c | S_c < theta} (Algorithm 1, line
      13): S >= theta is excluded. False reads Eq. 5's prose instead (flag
      S > theta), under which k identical top scores with k/C > 1 - p/100
      pull theta up to their value and nobody is excluded (colluders
      sending one update); with ties excluded they all go. Without ties
      the two readings agree unless theta equals a score exactly (p = 100
      excludes the maximum). A client at the round's lowest score is never
      excluded, so a round of equal scores keeps everyone.
    sv_method: 'svd' (jnp.linalg.svd per client matrix) or 'gram' (the
      eigen-decomposition of the smaller Gram matrix,
      spectral.first_left_singular): the same singular values and first
      directions within float32 error, in one small batched eigh. 'auto'
      (default) is 'svd' on CPU and 'gram' on GPU/TPU
      (spectral.default_sv_method).

  Returns:
    An Aggregator reading `params` (the group's current global values) and
    `coverage`.
  """
  check_num_byzantine('horus', num_byzantine)
  if not 0.0 <= lam <= 1.0:
    raise setting('horus', 'lam', f'must be in [0, 1], got {lam}')
  if not 0.0 < percentile <= 100.0:
    raise setting('horus', 'percentile', f'must be in (0, 100], got '
                  f'{percentile}')
  if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
    raise setting('horus', 'top_k', f'must be a positive int, got {top_k!r}')
  if detect not in DETECT:
    raise setting('horus', 'detect', f'{detect!r}; expected one of {DETECT}')
  if sv_method not in spectral.SV_CHOICES:
    raise setting('horus', 'sv_method', f'{sv_method!r}; expected one of '
                  f'{spectral.SV_CHOICES}')
  sv_method = spectral.resolve_sv_method(sv_method)

  def matrix_leaves(tree):
    """Flags per leaf: (is a matrix, used for detection)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    names = [_key_name(path) for path, _ in flat]
    matrix = [jnp.ndim(leaf) >= 2 for _, leaf in flat]
    has_factors = any(n in ('a', 'b') for n in names)
    use = []
    for name, is_matrix in zip(names, matrix):
      if not is_matrix:
        use.append(False)
      elif has_factors:
        use.append(name in ('a', 'b') and name in detect)
      else:
        use.append(True)          # full parameters: every kernel
    return matrix, use

  def init(params):
    leaves, treedef = jax.tree.flatten(params)
    # Vectors carry no direction; a 1-element placeholder keeps the state
    # checkpointable (orbax refuses zero-size arrays).
    dirs = [jnp.zeros((_matrix(leaf[None]).shape[1],), jnp.float32)
            if jnp.ndim(leaf) >= 2 else jnp.zeros((1,), jnp.float32)
            for leaf in leaves]
    return HorusState(jax.tree.unflatten(treedef, dirs), jnp.bool_(False))

  def aggregate(updates, mask, state, key, *, params, coverage=None):
    del key
    mask = jnp.asarray(mask, bool)
    up_leaves, treedef = jax.tree.flatten(updates)
    base = jax.tree.leaves(params)
    dirs = jax.tree.leaves(state.directions)
    is_matrix, use = matrix_leaves(params)
    values = [b[None].astype(jnp.float32) + u.astype(jnp.float32)
              for b, u in zip(base, up_leaves)]
    finite = mask
    for v in values:
      finite = finite & jnp.all(jnp.isfinite(v.reshape(v.shape[0], -1)),
                                axis=1)
    safe = [jnp.where(finite.reshape((-1,) + (1,) * (v.ndim - 1)), v, 0.0)
            for v in values]
    scores = []
    for v, used in zip(safe, use):
      if used:
        sv = spectral.singular_values(_matrix(v), sv_method)
        scores.append(spectral.hops_scores(sv, finite, k=min(top_k,
                                                             sv.shape[-1]),
                                           lam=lam))
    score = (jnp.mean(jnp.stack(scores), axis=0) if scores else
             jnp.zeros(mask.shape, jnp.float32))
    # A spectrum that overflowed (a 1e30 client) gives a non-finite score:
    # such a client is excluded and stays out of the threshold.
    finite = finite & jnp.isfinite(score)
    theta = masked_percentile(score, finite, percentile)
    if exclude_ties:     # never everyone: a score at the round's minimum stays
      lowest = jnp.min(jnp.where(finite, score, jnp.inf))
      above = (score >= theta) & (score > lowest)
    else:
      above = score > theta
    kept = finite & ~above
    alphas, new_dirs, v_c = [], [], []
    for v, d, m in zip(safe, dirs, is_matrix):
      if not m:
        v_c.append(None)
        continue
      vc = spectral.first_left_singular(_matrix(v), sv_method)
      v_c.append(vc)
      if projection:
        a = jnp.where(state.have, jnp.abs(vc @ d), 1.0)
      else:
        a = jnp.ones(mask.shape, jnp.float32)
      alphas.append(a)
    mean_alpha = (jnp.mean(jnp.stack(alphas), axis=0) if alphas else
                  jnp.ones(mask.shape, jnp.float32))
    cov_leaves = (jax.tree.leaves(coverage) if coverage is not None else
                  [None] * len(up_leaves))
    out, alpha_iter = [], iter(alphas)
    for u, m, cov in zip(up_leaves, is_matrix, cov_leaves):
      w = next(alpha_iter) if m else mean_alpha
      # A kept client whose alpha is 0 (a direction orthogonal to v_g) adds
      # nothing; if every owner of a coordinate has alpha 0 it stays put.
      out.append(covered_weighted_mean(u, w, kept, cov))
    update = jax.tree.unflatten(treedef, out)
    for b, u, d, m in zip(base, out, dirs, is_matrix):
      if not m:
        new_dirs.append(d)
        continue
      g = (b.astype(jnp.float32) + u.astype(jnp.float32))[None]
      new_dirs.append(spectral.first_left_singular(_matrix(g), sv_method)[0])
    new_state = HorusState(
        jax.tree.unflatten(jax.tree.structure(state.directions), new_dirs),
        jnp.bool_(True))
    weights = jnp.where(kept, mean_alpha, 0.0).astype(jnp.float32)
    info = {'weights': weights, 'hops': jnp.where(mask, score, 0.0),
            'threshold': theta,
            'excluded': jnp.sum(mask & ~kept).astype(jnp.float32)}
    return update, new_state, info

  return Aggregator(init, aggregate, reads=('params', 'coverage'))
