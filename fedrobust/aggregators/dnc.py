"""Divide-and-Conquer (DnC; Shejwalkar & Houmansadr, NDSS 2021).

For iteration t = 1..T:
  1. sample a coordinate subset r_t of size b = min(D, subsample_dim)
     (without replacement, from `key`; all coordinates when b = D);
  2. centre the real updates on it: z_c = x_c[r_t] - mu, mu their mean;
  3. v = the top right singular vector of Z = [z_c]_c  (n x b);
  4. outlier score s_c = <z_c, v>^2;
  5. flag the floor(filter_frac * f) highest scores.
The good set is the clients never flagged (the intersection of the
per-iteration good sets); the output is their mean.

`normalize` (not in the NDSS algorithm): 'unit' scales every update to
unit L2 norm before scoring and averages the unit updates, so the server
step is at most 1 long; this is the DnC of the SDFC authors' framework
(MarsFL, Sever/DncSever.py, one iteration, union). 'score' scales them for
the scoring only and averages the raw kept updates, which separates the
detection's change from the step's.

Implementation. <z_c, v>^2 = lambda_1 u_c^2 with (lambda_1, u) the top
eigenpair of the n x n Gram matrix Z Z^T, so one C x C eigh replaces the
n x b SVD (exact up to float32 rounding of Z Z^T; the matmul runs at
HIGHEST precision so it does not drop to TF32/bf16 on accelerators). Z is
divided by max|Z| first: singular vectors are scale-invariant, and this
keeps 1e30-scaled updates from overflowing the Gram matrix. The T
iterations run in lax.fori_loop with keys fold_in(key, t). At most n - 1
clients are flagged per iteration.

Departures, for fixed shapes and robustness:
  * A real client with a NaN/Inf coordinate is flagged in every iteration
    and left out of mu and Z; it uses up one of the flags.
  * If every finite real client was flagged at least once (the
    intersection is empty), the good set is the clients flagged the fewest
    times (so an empty intersection degrades gracefully instead of
    returning nothing). With min count 0 this is exactly the paper's rule.

Guarantees: the output is a mean of finite updates, hence finite, whenever
a finite real client exists. Guarantees it cannot give: DnC's filtering is
heuristic (it assumes the attack lives along a dominant direction); with
filter_frac * f below the number of attackers, or attackers spread over
several directions, some can survive. Results depend on `key` through the
coordinate sample (the same key gives the same result for any client
order, up to ties in the scores).

info:
  weights: float32[C], 1/|good| for the good clients, 0 otherwise.
  flag_count: float32[C], in how many iterations each client was flagged
    (0 on masked slots).

References:
  Shejwalkar, Houmansadr. Manipulating the Byzantine: Optimizing Model
  Poisoning Attacks and Defenses for Federated Learning. NDSS 2021.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from fedrobust.aggregators.base import Aggregator, stateless_init
from fedrobust.aggregators.mean import (Requirement, check_num_byzantine,
                                        setting,
                                        finite_rows, flatten,
                                        require_clients, static_num_clients,
                                        unflatten, zeros_if_empty)

REQUIREMENTS: dict[str, Requirement] = {
    'dnc': ('n > f', lambda f: f + 1),
}


def outlier_scores(z: jax.Array) -> jax.Array:
  """Squared projections on the top right singular vector.

  Args:
    z: float32[C, b], centred rows (zeros for rows that take no part).

  Returns:
    float32[C]: <z_c, v>^2 = lambda_1 u_c^2, up to the common factor
    max|z|^2 (the ranking is what matters).
  """
  scale = jnp.max(jnp.abs(z))
  z = z / jnp.where(scale > 0, scale, 1.0)
  gram = jnp.matmul(z, z.T, precision=lax.Precision.HIGHEST)
  eigvals, eigvecs = jnp.linalg.eigh(gram)
  return jnp.maximum(eigvals[-1], 0.0) * jnp.square(eigvecs[:, -1])


NORMALIZE = ('none', 'score', 'unit')


def dnc(*, num_byzantine: int, num_iters: int = 5,
        subsample_dim: int = 10000, filter_frac: float = 1.0,
        good_set: str = 'intersection', normalize: str = 'none'
        ) -> Aggregator:
  """Divide-and-Conquer (Shejwalkar & Houmansadr 2021).

  Args:
    num_byzantine: f.
    num_iters: T, the number of random coordinate subsets.
    subsample_dim: b, coordinates per subset (all of them if D <= b).
    filter_frac: c; each iteration flags floor(c * f) clients.
    good_set: 'intersection' (the paper's Alg. 2 and FLPoison: clients
      never flagged) or 'union' (clients kept by at least one iteration,
      the looser reading some reimplementations use).
    normalize: 'none' (the paper), 'score' (unit-norm updates for the
      scoring only) or 'unit' (unit-norm updates scored and averaged).

  Returns:
    An Aggregator; info as in the module docstring.
  """
  f = check_num_byzantine('dnc', num_byzantine)
  for argument, value in (('num_iters', num_iters),
                          ('subsample_dim', subsample_dim)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise setting('dnc', argument, f'must be a positive int, got {value!r}')
  if not filter_frac >= 0:
    raise setting('dnc', 'filter_frac', f'must be >= 0, got {filter_frac!r}')
  if good_set not in ('intersection', 'union'):
    raise setting('dnc', 'good_set', f"must be 'intersection' or 'union', "
                  f'got {good_set!r}')
  if normalize not in NORMALIZE:
    raise setting('dnc', 'normalize', f'must be one of {NORMALIZE}, got '
                  f'{normalize!r}')
  num_flag = int(filter_frac * f)

  def aggregate(updates, mask, state, key):
    """updates: leaves [C, ...]; mask: bool[C] -> one client's tree."""
    require_clients('dnc', static_num_clients(updates), f,
                    REQUIREMENTS['dnc'])
    mask = jnp.asarray(mask, bool)
    x, like = flatten(updates)
    c, d = x.shape
    finite = finite_rows(x)
    valid = mask & finite
    x = jnp.where(valid[:, None], x, 0.0)
    unit = x / jnp.maximum(jnp.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    scored = x if normalize == 'none' else unit
    if normalize == 'unit':
      x = unit
    n = jnp.sum(mask)
    num_valid = jnp.sum(valid)
    b = min(d, subsample_dim)
    flags_now = jnp.minimum(num_flag, jnp.maximum(n - 1, 0))
    iota = jnp.arange(c, dtype=jnp.int32)

    def one_iteration(t, flag_count):
      if b < d:
        coords = jax.random.permutation(jax.random.fold_in(key, t), d)[:b]
        xs = scored[:, coords]
      else:
        xs = scored
      mu = jnp.sum(xs, axis=0) / jnp.maximum(num_valid, 1)
      z = jnp.where(valid[:, None], xs - mu[None, :], 0.0)
      score = outlier_scores(z)
      # Highest first; non-finite real clients first of all, masked last.
      key_score = jnp.where(valid, -score, -jnp.inf)
      *_, order = lax.sort(((~mask).astype(jnp.int32), key_score, iota),
                           num_keys=2)
      flagged = jnp.zeros((c,), bool).at[order].set(iota < flags_now)
      flagged = (flagged | ~finite) & mask
      return flag_count + flagged.astype(jnp.int32)

    flag_count = lax.fori_loop(0, num_iters, one_iteration,
                               jnp.zeros((c,), jnp.int32))
    fewest = jnp.min(jnp.where(valid, flag_count, num_iters + 1))
    if good_set == 'union':
      good = valid & ((flag_count < num_iters) | (flag_count == fewest))
    else:
      good = valid & (flag_count == fewest)
    num_good = jnp.sum(good)
    weights = jnp.where(good, 1.0 / jnp.maximum(num_good, 1), 0.0).astype(
        jnp.float32)
    flat = jnp.sum(x * weights[:, None], axis=0)
    info = {'weights': weights,
            'flag_count': jnp.where(mask, flag_count, 0).astype(jnp.float32)}
    return unflatten(zeros_if_empty(num_valid, flat), like), state, info

  return Aggregator(stateless_init, aggregate)
