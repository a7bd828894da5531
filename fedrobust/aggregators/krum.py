"""Krum, Multi-Krum (Blanchard et al. 2017) and Bulyan (El Mhamdi et al. 2018).

Krum. With n real clients and f Byzantine, the score of client i is

  s(i) = sum_{j in N_i} ||x_i - x_j||^2,

N_i the k = n - f - 2 clients closest to i (j != i). Krum returns the update
of argmin_i s(i); Multi-Krum averages the m lowest-scoring updates
(m = n - f by default). Blanchard et al. prove (alpha, f)-Byzantine
resilience for n >= 2f + 3.

Bulyan. Select theta = n - 2f clients by iterated Krum: run Krum on the
remaining set R (with k = |R| - f - 2 neighbours), move the winner from R
into the selection, repeat. Then, per coordinate d, average the
beta = theta - 2f selected values closest to the coordinate-wise median of
the selection. Needs n >= 4f + 3.

Implementation notes.
  * Squared distances come from the Gram matrix, |a|^2 + |b|^2 - 2ab, one
    [C, D] x [D, C] matmul at HIGHEST precision. The plain Gram form
    cancels catastrophically when the updates share a large component, so
    the rows are first centred on a reference update (the one with the
    median norm; an attacker cannot move it with f < n/2, and a 1e30 row
    never is it). Centring keeps every distance exact in exact arithmetic
    and removes the shared component before the subtraction. The exact
    form (differences one row at a time, lax.map, C^2 D memory-bound work)
    stays available as method='exact'; BUILD_NOTES has both timed.
  * n is traced. k = max(n - f - 2, 1): when fewer real clients show up than
    Krum needs (or in Bulyan's last rounds, where |R| - f - 2 < 1) each
    client is scored by its nearest neighbour instead of by nothing.
  * Ties (mutual nearest neighbours tie when k = 1) are broken by the sum of
    the finite distances to every other candidate, then by slot index, so
    the rules are permutation-invariant for inputs in general position.

Non-finite inputs. A client with any NaN/Inf coordinate is at distance +Inf
from everyone and is ranked after every finite client, so it is never
selected while a finite candidate remains; a 1e30-scaled update has
squared distances that overflow to +Inf, which only pushes it further out.
Guarantees: Krum's output is always finite (a finite client's update, or
zeros if no real client is finite); Multi-Krum's and Bulyan's are finite
when at most f real clients are non-finite and n >= 2f + 3 (resp. 4f + 3).
Guarantees they cannot give: the resilience bounds assume n meets the
requirement; with fewer real clients at run time the rules still run but
lose them. Multi-Krum with m > n - f can average an attacker in.

info:
  weights:  float32[C], the weight of each client in the output (Krum:
    one-hot; Multi-Krum: 1/m on the selected; Bulyan: the mean over
    coordinates of each client's weight in the coordinate-wise average).
    Sums to 1 over the real clients; 0 on masked slots.
  selected: float32[C], 1 for a client Krum / Multi-Krum / Bulyan's
    iterated Krum selected.

References:
  Blanchard, El Mhamdi, Guerraoui, Stainer. Machine Learning with
  Adversaries: Byzantine Tolerant Gradient Descent. NeurIPS 2017.
  El Mhamdi, Guerraoui, Rouault. The Hidden Vulnerability of Distributed
  Learning in Byzantium. ICML 2018.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from fedrobust.aggregators.base import Aggregator, stateless_init
from fedrobust.aggregators.coordinatewise import (client_weights,
                                                  coordinate_median)
from fedrobust.aggregators.mean import (Requirement, check_num_byzantine,
                                        setting,
                                        finite_rows, flatten,
                                        require_clients, static_num_clients,
                                        unflatten, zeros_if_empty)

REQUIREMENTS: dict[str, Requirement] = {
    'krum': ('n >= 2f+3', lambda f: 2 * f + 3),
    'multi_krum': ('n >= 2f+3', lambda f: 2 * f + 3),
    'bulyan': ('n >= 4f+3', lambda f: 4 * f + 3),
}


DISTANCE_METHODS = ('gram', 'exact')


def pairwise_sq_dists(x: jax.Array, valid: jax.Array,
                      method: str = 'gram') -> jax.Array:
  """d2[i, j] = ||x_i - x_j||^2.

  Args:
    x: float32[C, D].
    valid: bool[C]; rows that are False (masked or non-finite) are +Inf
      from everyone, themselves included.
    method: 'gram' (centred Gram matrix, one matmul) or 'exact' (row-wise
      differences).

  Returns:
    float32[C, C]; entries may overflow to +Inf for huge updates.
  """
  if method not in DISTANCE_METHODS:
    raise setting('krum', 'method', f'distance method {method!r}; '
                  f'expected one of {DISTANCE_METHODS}')
  x0 = jnp.where(valid[:, None], x, 0.0)
  both = valid[:, None] & valid[None, :]
  if method == 'exact':
    d2 = lax.map(lambda xi: jnp.sum(jnp.square(x0 - xi[None, :]), axis=1),
                 x0)
    return jnp.where(both, d2, jnp.inf)
  # Centre on the valid row of median norm (ties by index).
  norms = jnp.where(valid, jnp.sum(jnp.square(x0), axis=1), jnp.inf)
  n = jnp.sum(valid)
  ref = jnp.argsort(norms)[jnp.maximum((n - 1) // 2, 0)]
  xc = jnp.where(valid[:, None], x0 - x0[ref][None, :], 0.0)
  sq = jnp.sum(jnp.square(xc), axis=1)
  gram = jnp.matmul(xc, xc.T, precision=lax.Precision.HIGHEST)
  d2 = jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * gram, 0.0)
  d2 = jnp.where(jnp.eye(x.shape[0], dtype=bool), 0.0, d2)
  overflow = ~jnp.isfinite(sq[:, None] + sq[None, :]) | jnp.isnan(d2)
  return jnp.where(both & ~overflow, d2, jnp.inf)


def krum_scores(d2: jax.Array, active: jax.Array, n: jax.Array,
                f: int) -> tuple[jax.Array, jax.Array]:
  """Krum scores over the active clients.

  Args:
    d2: float32[C, C] squared distances (+Inf for invalid pairs).
    active: bool[C], the candidate set R (finite clients only).
    n: int32[], |R| counting non-finite members (they are Byzantine).
    f: the Byzantine budget.

  Returns:
    (score, tie) float32[C]: s(i) = sum of the k = max(n - f - 2, 1)
    smallest d2[i, j], j in R, j != i; tie = sum of i's finite distances.
  """
  c = d2.shape[0]
  others = active[:, None] & active[None, :] & ~jnp.eye(c, dtype=bool)
  dm = jnp.where(others, d2, jnp.inf)
  nearest = jnp.sort(dm, axis=1)
  k = jnp.maximum(n - f - 2, 1)
  take = jnp.arange(c)[None, :] < k
  score = jnp.sum(jnp.where(take, nearest, 0.0), axis=1)
  tie = jnp.sum(jnp.where(jnp.isfinite(dm), dm, 0.0), axis=1)
  return score, tie


def krum_order(score: jax.Array, tie: jax.Array, candidate: jax.Array,
               finite: jax.Array) -> jax.Array:
  """Clients best first: candidates, then finite, then score, tie, index."""
  iota = jnp.arange(score.shape[0], dtype=jnp.int32)
  *_, order = lax.sort(((~candidate).astype(jnp.int32),
                        (~finite).astype(jnp.int32), score, tie, iota),
                       num_keys=4)
  return order


def _prepare(name, updates, mask, f):
  require_clients(name, static_num_clients(updates), f, REQUIREMENTS[name])
  mask = jnp.asarray(mask, bool)
  x, like = flatten(updates)
  finite = finite_rows(x)
  valid = mask & finite
  return x, like, mask, finite, valid


def _select_mean(x, selected):
  count = jnp.sum(selected)
  weights = jnp.where(selected, 1.0 / jnp.maximum(count, 1), 0.0).astype(
      jnp.float32)
  flat = jnp.sum(jnp.where(selected[:, None], x, 0.0) * weights[:, None],
                 axis=0)
  return flat, weights


def _multi_krum(name: str, f: int, m: int | None) -> Aggregator:
  """Multi-Krum with m selected (m = 1 is Krum, None is n - f)."""

  def aggregate(updates, mask, state, key):
    """updates: leaves [C, ...]; mask: bool[C] -> one client's tree."""
    del key
    x, like, mask, finite, valid = _prepare(name, updates, mask, f)
    c = x.shape[0]
    if m is not None and m > c:
      raise setting(name, 'm', f'{m} exceeds the C={c} client slots of a '
                    'round')
    n = jnp.sum(mask)
    score, tie = krum_scores(pairwise_sq_dists(x, valid), valid, n, f)
    order = krum_order(score, tie, mask, finite)
    m_eff = jnp.clip(n - f if m is None else m, 1, n)
    top = jnp.arange(c) < m_eff
    selected = jnp.zeros((c,), bool).at[order].set(top) & valid
    flat, weights = _select_mean(x, selected)
    info = {'weights': weights, 'selected': selected.astype(jnp.float32)}
    return unflatten(zeros_if_empty(n, flat), like), state, info

  return Aggregator(stateless_init, aggregate)


def krum(*, num_byzantine: int) -> Aggregator:
  """Krum: the update with the lowest score s(i) (Blanchard et al. 2017).

  Args:
    num_byzantine: f; the scores sum over the n - f - 2 nearest updates.

  Returns:
    An Aggregator; info as in the module docstring.
  """
  f = check_num_byzantine('krum', num_byzantine)
  return _multi_krum('krum', f, 1)


def multi_krum(*, num_byzantine: int, m: int | None = None) -> Aggregator:
  """Multi-Krum: the mean of the m lowest-scoring updates.

  Args:
    num_byzantine: f.
    m: how many updates to average; None uses n - f (traced n). Clipped to
      [1, n] at run time.

  Returns:
    An Aggregator; info as in the module docstring.
  """
  f = check_num_byzantine('multi_krum', num_byzantine)
  if m is not None and (isinstance(m, bool) or not isinstance(m, int) or
                        m < 1):
    raise setting('multi_krum', 'm', f'must be a positive int or unset, got '
                  f'{m!r}')
  return _multi_krum('multi_krum', f, m)


def bulyan(*, num_byzantine: int) -> Aggregator:
  """Bulyan over iterated Krum (El Mhamdi et al. 2018).

  theta = n - 2f clients are selected by iterated Krum; per coordinate the
  output is the mean of the beta = theta - 2f selected values closest to the
  selection's coordinate-wise median (ties by value, then slot). At run time
  theta and beta are clipped to at least 1.

  Args:
    num_byzantine: f.

  Returns:
    An Aggregator; info as in the module docstring.
  """
  f = check_num_byzantine('bulyan', num_byzantine)

  def aggregate(updates, mask, state, key):
    """updates: leaves [C, ...]; mask: bool[C] -> one client's tree."""
    del key
    x, like, mask, finite, valid = _prepare('bulyan', updates, mask, f)
    c = x.shape[0]
    n = jnp.sum(mask)
    d2 = pairwise_sq_dists(x, valid)
    theta = jnp.clip(n - 2 * f, 1, n)

    def pick(t, selected):
      remaining = mask & ~selected
      score, tie = krum_scores(d2, remaining & finite, n - t, f)
      winner = krum_order(score, tie, remaining, finite)[0]
      chosen = (t < theta) & remaining[winner]
      return selected.at[winner].set(selected[winner] | chosen)

    selected = lax.fori_loop(0, c - 2 * f, pick, jnp.zeros((c,), bool))

    # Coordinate-wise: the beta selected values closest to the median.
    num_sel = jnp.sum(selected)
    beta = jnp.clip(num_sel - 2 * f, 1, num_sel)
    med = coordinate_median(x, selected)
    values = jnp.where(jnp.isnan(x), jnp.inf, x)
    values = jnp.where(selected[:, None], values, 0.0)
    dist = jnp.abs(values - med[None, :])
    dist = jnp.where(jnp.isnan(dist) | ~selected[:, None], jnp.inf, dist)
    absent = jnp.broadcast_to((~selected)[:, None], x.shape).astype(jnp.int32)
    iota = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    _, _, ordered, order = lax.sort((absent, dist, values, iota), dimension=0,
                                    num_keys=3)
    keep = jnp.arange(c)[:, None] < beta                   # [C, 1]
    flat = jnp.sum(jnp.where(keep, ordered, 0.0), axis=0) / jnp.maximum(
        beta, 1)
    flat = zeros_if_empty(num_sel, flat)
    pos_w = jnp.where(keep, 1.0 / jnp.maximum(beta, 1), 0.0)
    weights = jnp.where(selected, client_weights(pos_w, order), 0.0)
    info = {'weights': weights, 'selected': selected.astype(jnp.float32)}
    return unflatten(flat, like), state, info

  return Aggregator(stateless_init, aggregate)
