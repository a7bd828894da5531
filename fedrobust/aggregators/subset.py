"""Rules that pick or weight a subset of clients (ByzFL's MDA, SMEA, MoNNA
and CAF).

  mda:   S* = argmin_{|S| = n - f} max_{i, j in S} ||x_i - x_j||_2,
         output mean(S*) (El Mhamdi et al., PODC 2020).
  smea:  S* = argmin_{|S| = n - f} lambda_max(Cov(x_S)), output mean(S*)
         (Allouah et al., ICML 2023).
  monna: the mean of the n - f nearest neighbours of a pivot
         (Farhadkhani et al., ICML 2023).
  caf:   covariance-bound agnostic filter: down-weight clients along the
         top eigenvector of the weighted covariance until the weights sum
         to n - 2f; output the weighted mean of least top eigenvalue
         (Allouah, Guerraoui, Stephan, ICML 2025; see `caf`).

MDA and SMEA enumerate every subset, as the references do. The subsets are
built at trace time from the static slot count C: every f-subset of slots
is a candidate removal; a candidate is admissible when it removes only
real, finite clients, so a masked (or non-finite) slot is always "kept"
and weighs nothing, and the n - f real members are exactly the remaining
real clients. With C slots that is comb(C, f) candidates, refused above
`max_subsets` (the references have the same exponential cost).

Distances come from krum's centred-Gram `pairwise_sq_dists`; a pair whose
squared distance overflows (1e30 updates) is infinitely far, so a subset
holding it loses. SMEA's covariance of a subset is the double-centred
distance matrix -1/2 H D2 H over its members (the members' centred Gram
matrix, whose nonzero eigenvalues are |S| times the covariance's), and
its top eigenvalue comes from `power_iters` steps of the power method.
ByzFL takes one step from a random vector, which makes the choice random;
here the start is the Gram's diagonal and the method runs to convergence
(a golden test checks it against numpy.linalg.eigvalsh).

info: 'weights' (1 / (n - f) on the chosen clients) and 'score' (the
chosen subset's diameter or top covariance eigenvalue).
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.aggregators.base import Aggregator, stateless_init
from fedrobust.aggregators import krum as krum_lib
from fedrobust.aggregators.clustered import clean_rows, weighted_update
from fedrobust.aggregators.finetune import masked_median, select_rows
from fedrobust.aggregators.mean import check_int, check_num_byzantine, setting

REQUIREMENTS = {
    'mda': ('2f < n', lambda f: 2 * f + 1),
    'smea': ('2f < n', lambda f: 2 * f + 1),
    'monna': ('f < n', lambda f: f + 1),
    'caf': ('2f < n', lambda f: 2 * f + 1),
}

PIVOTS = ('median',)


def removal_sets(num_slots: int, f: int, max_subsets: int, rule: str
                 ) -> np.ndarray:
  """int32[K, f]: every f-subset of range(num_slots), K = comb(C, f)."""
  count = math.comb(num_slots, f)
  if count > max_subsets:
    raise setting(
        rule, 'num_byzantine', f'{rule} enumerates every subset of n - f '
        f'clients: comb({num_slots}, {f}) = {count:,} candidates exceed '
        f'max_subsets={max_subsets:,}; lower num_byzantine or '
        'clients_per_round, or raise max_subsets')
  return np.asarray(list(itertools.combinations(range(num_slots), f)),
                    np.int32).reshape(count, f)


def _subset_rule(name: str, f: int, max_subsets: int, power_iters: int,
                 score_fn) -> Aggregator:
  """MDA / SMEA: the mean of the admissible subset of least score."""

  def aggregate(updates, mask, state, key):
    del key
    x, valid = clean_rows(updates, mask)
    c = x.shape[0]
    removed = jnp.asarray(removal_sets(c, f, max_subsets, name))   # [K, f]
    out = jnp.zeros((removed.shape[0], c), bool).at[
        jnp.arange(removed.shape[0])[:, None], removed].set(True)
    admissible = ~jnp.any(out & ~valid[None, :], axis=1)           # [K]
    members = ~out & valid[None, :]                                # [K, C]
    d2 = krum_lib.pairwise_sq_dists(x, valid)
    score = score_fn(d2, members, power_iters)
    score = jnp.where(admissible & ~jnp.isnan(score), score, jnp.inf)
    best = jnp.argmin(score)
    chosen = members[best]
    k = jnp.maximum(jnp.sum(chosen), 1).astype(jnp.float32)
    weights = jnp.where(chosen, 1.0 / k, 0.0).astype(jnp.float32)
    return (weighted_update(updates, x, weights), state,
            {'weights': weights, 'score': score[best].astype(jnp.float32)})

  return Aggregator(stateless_init, aggregate)


def _diameter(d2, members, power_iters):
  del power_iters
  pair = members[:, :, None] & members[:, None, :]
  return jnp.sqrt(jnp.max(jnp.where(pair, d2[None], 0.0), axis=(1, 2)))


def centred_gram(d2: jax.Array, members: jax.Array) -> jax.Array:
  """float[K, C, C]: -1/2 H D2 H over each subset's members (zero rows and
  columns elsewhere); H centres on the members' mean."""
  pair = members[:, :, None] & members[:, None, :]
  d = jnp.where(pair, d2[None], 0.0)
  k = jnp.maximum(jnp.sum(members, axis=1), 1).astype(d.dtype)   # [K]
  row = jnp.sum(d, axis=2) / k[:, None]                          # [K, C]
  total = jnp.sum(row, axis=1) / k                               # [K]
  g = -0.5 * (d - row[:, :, None] - row[:, None, :] + total[:, None, None])
  return jnp.where(pair, g, 0.0)


def top_eigenvalue(g: jax.Array, power_iters: int) -> jax.Array:
  """float[K]: the largest eigenvalue of each PSD g[K, C, C] by the power
  method from the diagonal (a Rayleigh quotient at the end)."""
  v0 = jnp.diagonal(g, axis1=1, axis2=2) + 1e-30
  v0 = v0 / jnp.maximum(jnp.linalg.norm(v0, axis=1, keepdims=True), 1e-30)

  def step(_, v):
    w = jnp.einsum('kij,kj->ki', g, v, precision='highest')
    return w / jnp.maximum(jnp.linalg.norm(w, axis=1, keepdims=True), 1e-30)

  v = jax.lax.fori_loop(0, power_iters, step, v0)
  return jnp.einsum('ki,kij,kj->k', v, g, v, precision='highest')


def _top_covariance(d2, members, power_iters):
  finite = ~jnp.any(members[:, :, None] & members[:, None, :] &
                    ~jnp.isfinite(d2)[None], axis=(1, 2))
  g = centred_gram(jnp.where(jnp.isfinite(d2), d2, 0.0), members)
  k = jnp.maximum(jnp.sum(members, axis=1), 1).astype(g.dtype)
  lam = top_eigenvalue(g, power_iters) / k
  return jnp.where(finite, lam, jnp.inf)


def mda(*, num_byzantine: int = 0, max_subsets: int = 20000) -> Aggregator:
  """Minimum-diameter averaging (ByzFL's MDA)."""
  f = check_num_byzantine('mda', num_byzantine)
  check_int('mda', 'max_subsets', max_subsets)
  return _subset_rule('mda', f, max_subsets, 1, _diameter)


def smea(*, num_byzantine: int = 0, max_subsets: int = 20000,
         power_iters: int = 100) -> Aggregator:
  """Smallest-maximum-eigenvalue averaging (ByzFL's SMEA)."""
  f = check_num_byzantine('smea', num_byzantine)
  check_int('smea', 'max_subsets', max_subsets)
  check_int('smea', 'power_iters', power_iters)
  return _subset_rule('smea', f, max_subsets, power_iters, _top_covariance)


def monna(*, num_byzantine: int = 0, pivot: str = 'median') -> Aggregator:
  """MoNNA: the mean of the n - f nearest neighbours of a pivot.

  ByzFL's MoNNA is a peer-to-peer rule: the pivot is the honest node's own
  vector. A server has no vector it knows to be honest; pivot='median'
  centres the neighbourhood on the coordinate-wise median of the real
  clients, which keeps the rule symmetric in the clients (the only pivot
  offered; a trusted server update is FLTrust's setting).
  """
  f = check_num_byzantine('monna', num_byzantine)
  if pivot not in PIVOTS:
    raise setting('monna', 'pivot', f'must be one of {PIVOTS}, got '
                  f'{pivot!r}')

  def aggregate(updates, mask, state, key):
    del key
    x, valid = clean_rows(updates, mask)
    n = jnp.sum(valid)
    k = jnp.maximum(n - f, 1)
    centre = masked_median(x, valid)
    d2 = krum_lib.pairwise_sq_dists(jnp.concatenate([centre[None], x]),
                                    jnp.concatenate([jnp.ones(1, bool),
                                                     valid]))[0, 1:]
    d2 = jnp.where(valid, d2, jnp.inf)
    rank = jnp.argsort(jnp.argsort(d2, stable=True), stable=True)
    chosen = valid & (rank < k)
    weights = jnp.where(chosen, 1.0 / k.astype(jnp.float32), 0.0)
    return (weighted_update(updates, x, weights), state,
            {'weights': weights.astype(jnp.float32)})

  return Aggregator(stateless_init, aggregate)


def caf(*, num_byzantine: int = 0, power_iters: int = 100,
        max_steps: int = 200) -> Aggregator:
  """Covariance-bound agnostic filter (ByzFL's CAF).

    c_i = 1 for the n real clients; while sum(c) > n - 2f:
      mu_c = sum c_i x_i / sum c;  Sigma_c = sum c_i (x_i - mu_c)(.)^T / sum c
      (lambda, v) = top eigenpair of Sigma_c
      tau_i = ((x_i - mu_c) . v)^2;  c_i <- c_i (1 - tau_i / max_j tau_j)
    output the mu_c of the smallest lambda seen.

  The step zeroes the weight of the client of largest tau (which may
  already be 0, so the weights can shrink geometrically for many steps): a
  fixed loop of `max_steps` steps with a stop flag; a run that has not
  reached n - 2f by then returns the best mean so far. The eigenpair comes
  from the C x C weighted centred Gram matrix (same nonzero spectrum),
  computed on the rows centred on their coordinate-wise median and divided
  by their largest absolute coordinate: CAF is equivariant to shifts and scale, and this
  keeps 1e30 updates from overflowing. Departures from ByzFL: it takes one
  power step from a random vector (a random eigenpair estimate), here the
  power method runs `power_iters` steps from a fixed start; with f = 0 its
  loop never runs and it returns None, here the mean; it stops early when
  every remaining tau is 0.

  info: 'weights' (c / sum c at the chosen step), 'score' (its lambda, in
  the units of the median-centred, norm-scaled rows).
  """
  f = check_num_byzantine('caf', num_byzantine)
  check_int('caf', 'power_iters', power_iters)
  check_int('caf', 'max_steps', max_steps)

  def aggregate(updates, mask, state, key):
    del key
    x, valid = clean_rows(updates, mask)
    n = jnp.sum(valid).astype(jnp.float32)
    centred = select_rows(x - masked_median(x, valid)[None], valid)
    norms = jnp.where(valid, jnp.max(jnp.abs(centred), axis=1), 0.0)
    scale = jnp.max(norms)
    xs = centred / jnp.where(scale > 0, scale, 1.0)
    gram = jnp.matmul(xs, xs.T, precision='highest')
    mv = lambda a, b: jnp.matmul(a, b, precision='highest')

    def step(_, carry):
      c, best_lam, best_w, go = carry
      total = jnp.sum(c)
      run = go & (total > n - 2 * f)
      w = c / jnp.maximum(total, 1e-30)
      gw = mv(gram, w)
      k = (gram - gw[:, None] - gw[None, :] +
           jnp.dot(w, gw, precision='highest'))          # (x_i-mu).(x_j-mu)
      root = jnp.sqrt(w)
      m = root[:, None] * k * root[None, :]
      # sqrt(w) spans M's null space; start from M's diagonal instead.
      u0 = jnp.diagonal(m) + 1e-30

      def power(_, u):
        z = mv(m, u)
        return z / jnp.maximum(jnp.linalg.norm(z), 1e-30)

      u = jax.lax.fori_loop(0, power_iters, power,
                            u0 / jnp.linalg.norm(u0))
      lam = jnp.dot(u, mv(m, u), precision='highest')
      proj = mv(k, root * u)                             # (x_i-mu).v sqrt(lam)
      tau = jnp.where(valid, jnp.square(proj), 0.0)
      tau_max = jnp.max(tau)
      better = run & (lam < best_lam)
      # Clamped at 0: rounding can leave the largest tau's factor at -1e-8.
      new_c = jnp.where(tau_max > 0, c * jnp.maximum(1.0 - tau / jnp.where(
          tau_max > 0, tau_max, 1.0), 0.0), c)
      return (jnp.where(run, new_c, c), jnp.where(better, lam, best_lam),
              jnp.where(better, w, best_w), run & (tau_max > 0))

    c0 = valid.astype(jnp.float32)
    w0 = c0 / jnp.maximum(n, 1.0)
    _, lam, w, _ = jax.lax.fori_loop(
        0, max_steps, step, (c0, jnp.float32(jnp.inf), w0, jnp.bool_(True)))
    w = jnp.where(valid, w, 0.0).astype(jnp.float32)
    return (weighted_update(updates, x, w), state,
            {'weights': w, 'score': jnp.where(jnp.isfinite(lam), lam,
                                              0.0).astype(jnp.float32)})

  return Aggregator(stateless_init, aggregate)
