"""The means (plain, weighted, FDAgg), and the helpers every rule shares.

Mean:          u = (1/n) sum_{c: mask_c} x_c,  n = sum_c mask_c.
Weighted mean: u = sum_c w_c x_c / sum_c w_c, w the method's weights
               (FedAvg: example counts), optionally staleness-discounted.
FDAgg:         u = sum_c alpha_c x_c, alpha = normalised sigmoid(-T^) of
               the method's scores (SDFC Eq. 10).
All three read `coverage` and then average each coordinate over the
clients that own it.

They are the non-robust baselines. A single Byzantine client moves them
arbitrarily far (breakdown point 0).

Guarantees it cannot give: with one real client sending NaN or +-Inf the
output is NaN/Inf, and a 1e30-scaled update gives an output of order
1e30/n. Masked slots are inert (they are selected away, never multiplied
by zero).

The helpers below (flattening, the static client-count check, overflow-safe
norms) are used by coordinatewise.py, krum.py, robust_mean.py and dnc.py.
"""

from __future__ import annotations

import math

from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedrobust.aggregators.base import Aggregator, stateless_init
from fedrobust.errors import SettingError
from fedrobust.tree import (masked_weighted_mean, ravel_clients,
                            unravel_like)

# Requirement on n (clients in a round) as a function of f: (text, min n).
Requirement = tuple[str, Callable[[int], int]]

REQUIREMENTS: dict[str, Requirement] = {
    'mean': ('n >= 1', lambda f: 1),
    'weighted_mean': ('n >= 1', lambda f: 1),
    'fdagg': ('n >= 1', lambda f: 1),
}


# ----------------------------------------------------------------------------
# Helpers shared by the rule modules.
# ----------------------------------------------------------------------------


def check_num_byzantine(name: str, num_byzantine: Any) -> int:
  """Static check of f; returns it as a Python int."""
  if isinstance(num_byzantine, bool) or not isinstance(num_byzantine, int):
    raise SettingError('num_byzantine', f'must be a Python int, got '
                       f'{num_byzantine!r}', component=f'aggregator {name}')
  if num_byzantine < 0:
    raise SettingError('num_byzantine', f'must be >= 0, got {num_byzantine}',
                       component=f'aggregator {name}')
  return num_byzantine


def require_clients(name: str, n: int, f: int,
                    requirement: Requirement) -> None:
  """Raises SettingError unless n clients satisfy the rule's requirement."""
  text, min_clients = requirement
  needed = min_clients(f)
  if n < needed:
    raise SettingError(
        'clients_per_round', f'aggregator {name!r} needs {text} clients per '
        f'round; with num_byzantine={f} that is n >= {needed}, got n={n}')


def setting(name: str, argument: str, message: str) -> SettingError:
  """A SettingError for a rule's own hyperparameter."""
  return SettingError(argument, message, component=f'aggregator {name}')


def check_int(name: str, argument: str, value: Any, *,
              minimum: int = 1) -> int:
  """value, or a SettingError unless it is an int >= minimum."""
  if not (isinstance(value, int) and value >= minimum):
    raise setting(name, argument, f'must be an int >= {minimum}, got '
                  f'{value!r}')
  return value


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


def covered_weighted_mean(tree: Any, weights: jax.Array, mask: jax.Array,
                          coverage: Any | None) -> Any:
  """Per-coordinate weighted mean over the clients that own the coordinate.

  u_i = sum_c w_c m_ci x_ci / sum_c w_c m_ci over real clients c, and 0
  where no real client owns i. With coverage None this is exactly
  tree.masked_weighted_mean. Masked slots are selected away.

  Args:
    tree: leaves [C, ...].
    weights: float[C] >= 0.
    mask: bool[C].
    coverage: None or a tree like `tree` with values in {0, 1}.
  """
  if coverage is None:
    return masked_weighted_mean(tree, weights, mask)
  w = jnp.where(mask, weights, 0.0).astype(jnp.float32)

  def reduce(leaf, cov):
    shape = (-1,) + (1,) * (leaf.ndim - 1)
    keep = mask.reshape(shape)
    wc = w.reshape(shape) * cov.astype(jnp.float32)
    num = jnp.sum(jnp.where(keep, leaf * wc, 0.0), axis=0)
    den = jnp.sum(jnp.where(keep, wc, 0.0), axis=0)
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0),
                     0.0).astype(leaf.dtype)

  return jax.tree.map(reduce, tree, coverage)


# ----------------------------------------------------------------------------
# The rules.
# ----------------------------------------------------------------------------


def mean(*, num_byzantine: int = 0) -> Aggregator:
  """Unweighted mean over the real clients.

  u = (1/n) sum_{c: mask_c} x_c. Returns zeros when n = 0. With coverage,
  each coordinate is averaged over the clients that own it.

  Args:
    num_byzantine: f; accepted for a uniform interface and ignored (the
      mean tolerates no Byzantine client).

  Returns:
    An Aggregator. info['weights'] is 1/n on real clients, 0 on masked.
  """
  num_byzantine = check_num_byzantine('mean', num_byzantine)

  def aggregate(updates, mask, state, key, *, coverage=None):
    """updates: leaves [C, ...]; mask: bool[C] -> one client's tree."""
    del key
    require_clients('mean', static_num_clients(updates), num_byzantine,
                    REQUIREMENTS['mean'])
    mask = jnp.asarray(mask, bool)
    ones = jnp.ones(mask.shape, jnp.float32)
    update = covered_weighted_mean(updates, ones, mask, coverage)
    n = jnp.sum(mask)
    weights = jnp.where(mask, 1.0 / jnp.maximum(n, 1), 0.0).astype(
        jnp.float32)
    return update, state, {'weights': weights}

  return Aggregator(stateless_init, aggregate, reads=('coverage',))


def weighted_mean(*, num_byzantine: int = 0,
                  staleness_power: float = 0.0) -> Aggregator:
  """FedAvg's server rule: the mean weighted by the method's weights.

  u = sum_c w_c x_c / sum_c w_c over real clients, w_c the client's
  example count (McMahan et al. 2017). With coverage, per coordinate over
  its owners (HeteroFL's rule for width-sliced clients, Horus's masked
  average of aligned LoRA factors). With staleness_power a > 0, w_c is
  multiplied by (1 + tau_c)^-a, the polynomial staleness function of
  FedAsync (Xie et al. 2019), tau_c the update's staleness in rounds.

  Not robust: one client moves it arbitrarily far.

  Args:
    num_byzantine: ignored (uniform interface).
    staleness_power: a >= 0; 0 ignores staleness.

  Returns:
    An Aggregator; info['weights'] is w_c (0 on masked slots).
  """
  check_num_byzantine('weighted_mean', num_byzantine)
  if not staleness_power >= 0:
    raise setting('weighted_mean', 'staleness_power',
                  f'must be >= 0, got {staleness_power}')

  def aggregate(updates, mask, state, key, *, weights, coverage=None,
                staleness=None):
    del key
    mask = jnp.asarray(mask, bool)
    w = weights.astype(jnp.float32)
    if staleness_power:
      w = w * jnp.power(1.0 + staleness.astype(jnp.float32),
                        -staleness_power)
    update = covered_weighted_mean(updates, w, mask, coverage)
    return update, state, {'weights': jnp.where(mask, w, 0.0)}

  reads = ('weights', 'coverage') + (('staleness',) if staleness_power
                                     else ())
  return Aggregator(stateless_init, aggregate, reads=reads)


def twafl(*, num_byzantine: int = 0, base: float = math.e / 2) -> Aggregator:
  """TWAFL's temporally weighted aggregation (Chen, Sun and Jin 2019).

  u = sum_c w_c x_c / sum_c w_c with w_c = n_c * base^-(tau_c), n_c the
  client's example count and tau_c its staleness in rounds (the paper's
  t - timestamp_c, base e/2). With coverage, per coordinate over its
  owners. Assumed: the weights are normalised over the round's arrivals
  (an asynchronous round aggregates what arrived, not all N clients).
  """
  check_num_byzantine('twafl', num_byzantine)
  if not base >= 1.0:
    raise setting('twafl', 'base', f'must be >= 1, got {base}')

  def aggregate(updates, mask, state, key, *, weights, staleness,
                coverage=None):
    del key
    mask = jnp.asarray(mask, bool)
    w = weights.astype(jnp.float32) * jnp.power(
        base, -jnp.maximum(staleness, 0).astype(jnp.float32))
    update = covered_weighted_mean(updates, w, mask, coverage)
    return update, state, {'weights': jnp.where(mask, w, 0.0)}

  return Aggregator(stateless_init, aggregate,
                    reads=('weights', 'staleness', 'coverage'))


def sasgd(*, num_byzantine: int = 0) -> Aggregator:
  """Staleness-aware async SGD (Zhang et al. 2016) on a round's arrivals.

  Each update's step is divided by its staleness sigma_c = tau_c + 1 (the
  global versions between the model it read and its application, its own
  included; fresh updates keep lr 1): u = (1/n) sum_c x_c / sigma_c, per
  coordinate over its owners with coverage. Unlike TWAFL the weights are
  not renormalised, so a round of stale updates takes a shorter step.
  """
  check_num_byzantine('sasgd', num_byzantine)

  def aggregate(updates, mask, state, key, *, staleness, coverage=None):
    del key
    mask = jnp.asarray(mask, bool)
    scale = 1.0 / (1.0 + jnp.maximum(staleness, 0).astype(jnp.float32))
    scaled = jax.tree.map(
        lambda x: x * scale.reshape((-1,) + (1,) * (x.ndim - 1)).astype(
            x.dtype), updates)
    update = covered_weighted_mean(scaled, jnp.ones_like(scale), mask,
                                   coverage)
    return update, state, {'weights': jnp.where(mask, scale, 0.0)}

  return Aggregator(stateless_init, aggregate,
                    reads=('staleness', 'coverage'))


FDAGG_WEIGHTINGS = ('sigmoid', 'softmax')


def fdagg_weights(totals: jax.Array, mask: jax.Array,
                  weighting: str = 'sigmoid') -> jax.Array:
  """SDFC Eq. 10: sigmoid(-minmax(T)) normalised over the real clients.

  With weighting='softmax' (the released code): softmax(-minmax(T)) over
  the real clients, i.e. exp(-T^) normalised.

  Args:
    totals: float[C], T_k = sum_v H_{k,v}.
    mask: bool[C].
    weighting: 'sigmoid' (the paper) or 'softmax' (the release).

  Returns:
    float[C] summing to 1 over the mask (0 on masked slots and on clients
    whose T_k is not finite). If all T_k are equal, T^ = 0 for everyone and
    the weights are uniform.
  """
  finite = mask & jnp.isfinite(totals)
  lo = jnp.min(jnp.where(finite, totals, jnp.inf))
  hi = jnp.max(jnp.where(finite, totals, -jnp.inf))
  span = hi - lo
  normed = jnp.where(span > 0, (totals - lo) / jnp.where(span > 0, span, 1.0),
                     0.0)
  score = (jax.nn.sigmoid(-normed) if weighting == 'sigmoid' else
           jnp.exp(-normed))
  score = jnp.where(finite, score, 0.0)
  return score / jnp.maximum(jnp.sum(score), 1e-12)


def fdagg(*, num_byzantine: int = 0, weighting: str = 'sigmoid'
          ) -> Aggregator:
  """SDFC's Fisher-discrepancy aggregation (FDAgg, SDFC Eq. 10).

  alpha_k = sigmoid(-T^_k) / sum_j sigmoid(-T^_j), T^ the min-max
  normalised method scores T_k over the round's real clients, and
  u = sum_k alpha_k x_k. The scores come from the method (`scores`, SDFC's
  T_k = sum_v H_{k,v}); a method that computes none cannot use this rule.

  Args:
    num_byzantine: ignored (uniform interface).
    weighting: 'sigmoid' (the paper's Eq. 10) or 'softmax' (the released
      code).

  Returns:
    An Aggregator; info['weights'] is alpha (0 on masked slots).
  """
  check_num_byzantine('fdagg', num_byzantine)
  if weighting not in FDAGG_WEIGHTINGS:
    raise setting('fdagg', 'weighting', f'{weighting!r}; expected one of '
                  f'{FDAGG_WEIGHTINGS}')

  def aggregate(updates, mask, state, key, *, scores, coverage=None):
    del key
    mask = jnp.asarray(mask, bool)
    weights = fdagg_weights(scores, mask, weighting)
    update = covered_weighted_mean(updates, weights, mask, coverage)
    return update, state, {'weights': weights}

  return Aggregator(stateless_init, aggregate, reads=('scores', 'coverage'))
