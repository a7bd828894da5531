"""The plain mean, and the small helpers every rule module shares.

Mean:  u = (1/n) sum_{c: mask_c} x_c,  n = sum_c mask_c.

It is the non-robust baseline (FedAvg's server step with equal weights;
weighting by client size is the method's job, not this rule's). A single
Byzantine client moves it arbitrarily far (breakdown point 0).

Guarantees it cannot give: with one real client sending NaN or +-Inf the
output is NaN/Inf, and a 1e30-scaled update gives an output of order
1e30/n. Masked slots are inert (they are selected away, never multiplied
by zero).

The helpers below (flattening, the static client-count check, overflow-safe
norms) are used by coordinatewise.py, krum.py, robust_mean.py and dnc.py.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedrobust.aggregators.base import Aggregator, stateless_init
from fedrobust.tree import masked_weighted_mean, ravel_clients, unravel_like

# Requirement on n (clients in a round) as a function of f: (text, min n).
Requirement = tuple[str, Callable[[int], int]]

REQUIREMENTS: dict[str, Requirement] = {
    'mean': ('n >= 1', lambda f: 1),
}


# ----------------------------------------------------------------------------
# Helpers shared by the rule modules.
# ----------------------------------------------------------------------------


def check_num_byzantine(name: str, num_byzantine: Any) -> int:
  """Static check of f; returns it as a Python int."""
  if isinstance(num_byzantine, bool) or not isinstance(num_byzantine, int):
    raise ValueError(f'--num_byzantine must be a Python int for '
                     f'--aggregator={name}, got {num_byzantine!r}')
  if num_byzantine < 0:
    raise ValueError(f'--num_byzantine must be >= 0 for --aggregator={name}, '
                     f'got {num_byzantine}')
  return num_byzantine


def require_clients(name: str, n: int, f: int,
                    requirement: Requirement) -> None:
  """Raises ValueError unless n clients satisfy the rule's requirement."""
  text, min_clients = requirement
  needed = min_clients(f)
  if n < needed:
    raise ValueError(
        f'--aggregator={name} needs {text} clients per round; with '
        f'--num_byzantine={f} that is n >= {needed}, got n={n}')


def flatten(updates: Any) -> tuple[jax.Array, Any]:
  """Stacked tree (leaves [C, ...]) -> (float32[C, D], one client's spec)."""
  like = jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype), updates)
  return ravel_clients(updates).astype(jnp.float32), like


def unflatten(flat: jax.Array, like: Any) -> Any:
  """float[D] -> one client's tree (leaf dtypes of `like`)."""
  return unravel_like(flat, like)


def static_num_clients(updates: Any) -> int:
  """C, the static leading dimension of the stacked updates."""
  return jax.tree.leaves(updates)[0].shape[0]


def finite_rows(x: jax.Array) -> jax.Array:
  """bool[C]: True where every coordinate of row c is finite."""
  return jnp.all(jnp.isfinite(x), axis=1)


def safe_norm(x: jax.Array, axis: int = -1) -> jax.Array:
  """Euclidean norm that does not overflow for finite (even 1e30) entries.

  ||x|| = s * sqrt(sum (x / s)^2) with s = max |x|; 0 for a zero vector.
  Rows holding Inf or NaN give NaN; callers select those away.
  """
  scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  safe = jnp.where(scale > 0, scale, 1.0)
  root = jnp.sqrt(jnp.sum(jnp.square(x / safe), axis=axis))
  return jnp.squeeze(scale, axis=axis) * root


def zeros_if_empty(n: jax.Array, flat: jax.Array) -> jax.Array:
  """The aggregate is the zero update when no real client took part."""
  return jnp.where(n > 0, flat, jnp.zeros_like(flat))


# ----------------------------------------------------------------------------
# The rule.
# ----------------------------------------------------------------------------


def mean(*, num_byzantine: int = 0) -> Aggregator:
  """Unweighted mean over the real clients.

  u = (1/n) sum_{c: mask_c} x_c. Returns zeros when n = 0.

  Args:
    num_byzantine: f; accepted for a uniform interface and ignored (the
      mean tolerates no Byzantine client).

  Returns:
    An Aggregator. info['weights'] is 1/n on real clients, 0 on masked.
  """
  num_byzantine = check_num_byzantine('mean', num_byzantine)

  def aggregate(updates, mask, state, key):
    """updates: leaves [C, ...]; mask: bool[C] -> one client's tree."""
    del key
    require_clients('mean', static_num_clients(updates), num_byzantine,
                    REQUIREMENTS['mean'])
    mask = jnp.asarray(mask, bool)
    ones = jnp.ones(mask.shape, jnp.float32)
    update = masked_weighted_mean(updates, ones, mask)
    n = jnp.sum(mask)
    weights = jnp.where(mask, 1.0 / jnp.maximum(n, 1), 0.0).astype(
        jnp.float32)
    return update, state, {'weights': weights}

  return Aggregator(stateless_init, aggregate)
