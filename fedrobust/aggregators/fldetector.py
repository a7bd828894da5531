"""FLDetector (Zhang et al., KDD 2022): model-update consistency.

A benign client's update is (approximately) a smooth function of the global
model, so the server can predict it from the client's previous update and a
Hessian estimate; a poisoned update is not consistent with its own history.
With g the gradient-like vector -Delta (Delta = client delta):

  g^_i^t = g_i^{t-1} + H^t (w_t - w_{t-1})         predicted update
  d_i^t  = ||g^_i^t - g_i^t||_2,  d^t <- d^t / ||d^t||_1
  s_i^t  = (1/N) sum_{r=0}^{N-1} d_i^{t-r}         suspicious score

H^t v is the L-BFGS Hessian-vector product (the paper's Algorithm 1, i.e.
the compact representation of Byrd, Nocedal, Schnabel 1994) over the last N
pairs Delta_w^k = w_k - w_{k-1}, Delta_g^k = g_k - g_{k-1}, with g_k the
round's aggregated gradient-like update:

  A = S^T Y,  D = diag(A),  L = strictly lower part of A,
  sigma = y_N^T s_N / s_N^T s_N,
  p = [[-D, L^T], [L, sigma S^T S]]^{-1} [Y^T v; sigma S^T v],
  H v = sigma v - [Y, sigma S] p.

Detection: the gap statistic over k-means with k in {1, 2} on the scores
decides whether there are two groups; if so the group with the larger mean
score is flagged. FLDetector then aggregates the remaining clients with a
robust base rule; here the coordinate-wise median.

Jittable form: fixed window N for both the L-BFGS pairs and the scores,
with masks for the warm-up rounds (absent pairs are replaced by identity
rows of the middle matrix and contribute nothing; with no pair H v = 0).
Nobody is excluded until `warmup` rounds of scores exist. Pairs with
non-positive curvature s^T y <= 1e-10 ||s|| ||y|| are skipped, as in
standard L-BFGS, and a singular solve falls back to H v = 0.

Per-client history: g_i^{t-1} and the score window are indexed by client
id (the `ids` extra; K = num_clients rows), so a client keeps its history
whichever slot it lands in, and the rule runs unchanged on any group of
clients (one cohort, the shared layers of several cohorts, or one cohort's
own layers). A client that was absent, masked or non-finite in the
previous round gets no score this round, so the prediction (which assumes
consecutive rounds) is only used for clients present in both. Called
without `ids`, slot c is client c (num_clients = C slots).

Deviations from the paper: a flagged client is excluded from THIS round's
aggregate (the paper removes detected clients and restarts training); the
gap statistic uses the standard within-cluster sum of squares on min-max
scaled scores, B = `gap_samples` uniform reference sets, and chooses two
groups iff Gap(1) < Gap(2) - s_2 (Tibshirani et al. 2001), needing at
least 3 scored clients; k-means is 1-D, initialised at the min and max and
run for a fixed number of Lloyd iterations. The reference draws are keyed
by a client's rank among the scored clients, so masked slots never change
them.

Robustness notes:
  * Non-finite clients are excluded and get no score; 1e30 clients get a
    finite, large score (overflow-safe norms) and never reach the median
    unless they are a majority.
  * Cannot guarantee: detection before `warmup` rounds, detection of
    attackers that are consistent over time (e.g. a fixed backdoor
    direction), or correct flagging when attackers are a majority or when
    honest clients are very heterogeneous (two honest groups may split).

References:
  Z. Zhang, X. Cao, J. Jia, N. Z. Gong. "FLDetector: Defending Federated
  Learning Against Model Poisoning Attacks via Detecting Malicious
  Clients." KDD 2022, Sec. 4, Algorithms 1-2.
  R. H. Byrd, J. Nocedal, R. B. Schnabel. "Representations of quasi-Newton
  matrices and their use in limited memory methods." Math. Prog. 1994.
  R. Tibshirani, G. Walther, T. Hastie. "Estimating the number of clusters
  in a data set via the gap statistic." JRSS-B 2001.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.aggregators.base import Aggregator
from fedrobust.aggregators.clustering import kmeans2_1d
from fedrobust.aggregators.mean import setting
from fedrobust.aggregators.finetune import (finite_clients, masked_median,
                                            ravel_one, safe_norm,
                                            select_rows)
from fedrobust.tree import ravel_clients, tree_add, unravel_like

Params = Any


class FLDetectorState(NamedTuple):
  params: Params             # w_t, the current global model
  prev_params: jax.Array     # float32[D], w_{t-1}
  prev_global: jax.Array     # float32[D], g_{t-1} (-(update of round t-1))
  prev_updates: jax.Array    # float32[K, D], g_i^{t-1} (0 where invalid)
  prev_valid: jax.Array      # bool[K], client was present and finite at t-1
  delta_w: jax.Array         # float32[N, D], L-BFGS s vectors, oldest first
  delta_g: jax.Array         # float32[N, D], L-BFGS y vectors
  pair_mask: jax.Array       # bool[N], pair present
  scores: jax.Array          # float32[N, K], normalised distances, oldest first
  score_mask: jax.Array      # bool[N, K], distance computed
  round: jax.Array           # int32[], rounds aggregated so far


def lbfgs_hvp(s: jax.Array, y: jax.Array, present: jax.Array,
              v: jax.Array) -> jax.Array:
  """H v for the L-BFGS (compact) Hessian approximation.

  Args:
    s: float[N, D], Delta_w pairs, oldest first; the newest present pair
      must be the last row (pairs are appended at the end).
    y: float[N, D], Delta_g pairs.
    present: bool[N]; absent rows are ignored whatever they hold.
    v: float[D].

  Returns:
    float[D]; 0 when no pair is present or the result is not finite
    (a singular middle matrix).
  """
  n = s.shape[0]
  s = jnp.where(present[:, None], s, 0.0)
  y = jnp.where(present[:, None], y, 0.0)
  hi = 'highest'
  a = jnp.matmul(s, y.T, precision=hi)                           # s_i.y_j
  ss = jnp.matmul(s, s.T, precision=hi)
  sigma = jnp.where(present[-1],
                    a[-1, -1] / jnp.where(ss[-1, -1] > 0, ss[-1, -1], 1.0),
                    0.0)
  lower = jnp.tril(a, -1)
  pad = jnp.where(present, 0.0, 1.0)                  # identity for absent
  top = jnp.concatenate([-jnp.diag(jnp.diag(a)) + jnp.diag(pad), lower.T],
                        axis=1)
  bottom = jnp.concatenate([lower, sigma * ss + jnp.diag(pad)], axis=1)
  middle = jnp.concatenate([top, bottom], axis=0)                # [2N, 2N]
  rhs = jnp.concatenate([jnp.matmul(y, v, precision=hi),
                         sigma * jnp.matmul(s, v, precision=hi)])
  p = jnp.linalg.solve(middle, rhs)
  hv = sigma * v - (jnp.matmul(p[:n], y, precision=hi) +
                    sigma * jnp.matmul(p[n:], s, precision=hi))
  ok = jnp.any(present) & jnp.all(jnp.isfinite(hv))
  return jnp.where(ok, hv, 0.0)


def _w1(x: jax.Array, keep: jax.Array) -> jax.Array:
  n = jnp.maximum(jnp.sum(keep.astype(x.dtype)), 1.0)
  mean = jnp.sum(jnp.where(keep, x, 0.0)) / n
  return jnp.sum(jnp.where(keep, jnp.square(x - mean), 0.0))


def gap_two_groups(scores: jax.Array, keep: jax.Array, key: jax.Array, *,
                   samples: int, iters: int) -> tuple[jax.Array, jax.Array]:
  """Gap statistic with k in {1, 2} on scores[C] where keep.

  Returns:
    (two bool[]: the gap statistic prefers 2 groups,
     high bool[C]: members of the higher-score group).
  """
  n = jnp.sum(keep.astype(jnp.int32))
  lo = jnp.min(jnp.where(keep, scores, jnp.inf))
  hi = jnp.max(jnp.where(keep, scores, -jnp.inf))
  spread = hi - lo
  ok = (n >= 3) & (spread > 0) & jnp.isfinite(spread)
  x = jnp.where(keep & ok, (scores - lo) / jnp.where(ok, spread, 1.0), 0.0)
  high, w2 = kmeans2_1d(x, keep, iters)
  w1 = _w1(x, keep)
  # Reference sets: uniform on [0, 1]. Client i draws its B values from a
  # key folded with its rank among the kept clients, so masked slots never
  # shift anyone's draws.
  rank = jnp.cumsum(keep.astype(jnp.int32)) - 1
  ref = jax.vmap(lambda r: jax.random.uniform(
      jax.random.fold_in(key, r), (samples,)))(rank).T          # [B, C]
  ref_w1 = jax.vmap(lambda u: _w1(u, keep))(ref)
  ref_w2 = jax.vmap(lambda u: kmeans2_1d(u, keep, iters)[1])(ref)
  tiny = 1e-12
  log_ref1, log_ref2 = jnp.log(ref_w1 + tiny), jnp.log(ref_w2 + tiny)
  gap1 = jnp.mean(log_ref1) - jnp.log(w1 + tiny)
  gap2 = jnp.mean(log_ref2) - jnp.log(w2 + tiny)
  s2 = jnp.std(log_ref2) * jnp.sqrt(1.0 + 1.0 / samples)
  two = ok & (gap1 < gap2 - s2)
  return two, high & two


def fldetector(*, num_byzantine: int, num_clients: int | None = None,
               window: int = 10, warmup: int | None = None,
               gap_samples: int = 20, kmeans_iters: int = 10) -> Aggregator:
  """FLDetector with a coordinate-wise median base rule.

  Args:
    num_byzantine: unused (detection needs no f).
    num_clients: K, the clients that can appear (ids in [0, K)); without
      ids, the slots per round. Give it: with None the per-client state is
      created on the first call, sized by the slot count (the state changes
      shape once).
    window: N, the L-BFGS memory and the score-averaging window (the
      paper's N = 10).
    warmup: rounds of scores required before anyone is excluded
      (None -> window, i.e. a full window).
    gap_samples: B, uniform reference sets of the gap statistic.
    kmeans_iters: Lloyd iterations of the 1-D k-means.

  Returns:
    Aggregator with state FLDetectorState. info: 'weights' float32[C]
    (1/n per client that entered the median), 'suspicion' float32[C]
    (s_i; 0 for unscored slots), 'flagged' bool[C], 'detecting' bool[].
  """
  del num_byzantine
  if window < 1:
    raise setting('fldetector', 'window', f'must be >= 1, got {window}')
  warmup = window if warmup is None else warmup
  if warmup < 1:
    raise setting('fldetector', 'warmup', f'must be >= 1, got {warmup}')
  if gap_samples < 2 or kmeans_iters < 1:
    raise setting('fldetector', 'gap_samples', 'gap_samples must be >= 2 '
                  'and kmeans_iters >= 1')
  if num_clients is not None and num_clients < 1:
    raise setting('fldetector', 'num_clients', f'must be >= 1, got '
                  f'{num_clients}')

  def fresh(params, c, d):
    return FLDetectorState(
        params=params,
        prev_params=jnp.zeros((d,), jnp.float32),
        prev_global=jnp.zeros((d,), jnp.float32),
        prev_updates=jnp.zeros((c, d), jnp.float32),
        prev_valid=jnp.zeros((c,), bool),
        delta_w=jnp.zeros((window, d), jnp.float32),
        delta_g=jnp.zeros((window, d), jnp.float32),
        pair_mask=jnp.zeros((window,), bool),
        scores=jnp.zeros((window, c), jnp.float32),
        score_mask=jnp.zeros((window, c), bool),
        round=jnp.zeros((), jnp.int32))

  def init(params):
    return fresh(params, num_clients or 0, ravel_one(params).shape[0])

  def push(buffer, row, when):
    """Appends `row` at the end (dropping the oldest) where `when`."""
    shifted = jnp.concatenate([buffer[1:], row[None]], axis=0)
    return jnp.where(when, shifted, buffer)

  def aggregate(updates, mask, state, key, *, ids=None):
    flat = ravel_clients(updates).astype(jnp.float32)
    c, d = flat.shape
    if state.prev_updates.shape[0] == 0:    # num_clients=None: size it now
      state = fresh(state.params, c, d)._replace(round=state.round)
    k = state.prev_updates.shape[0]
    if ids is None:
      if k != c:
        raise setting('fldetector', 'num_clients', f'state holds {k} '
                      f'clients, the round has {c} slots and no ids; pass '
                      f'num_clients={c}')
      ids = jnp.arange(c, dtype=jnp.int32)
    if state.prev_updates.shape[1] != d:
      raise setting('fldetector', 'num_clients', f'state holds updates of '
                    f'size {state.prev_updates.shape[1]}, the round {d}')
    valid = finite_clients(flat, mask)
    # Masked slots write nowhere (row k is dropped) and read row 0 unused.
    rows = jnp.where(mask, jnp.asarray(ids, jnp.int32), k)
    clean = select_rows(flat, valid)
    grads = -clean                                    # gradient-like g_i^t
    w = ravel_one(state.params)
    have_prev = state.round >= 1

    # Consistency scores: prediction, normalised distance, window mean.
    hv = lbfgs_hvp(state.delta_w, state.delta_g, state.pair_mask,
                   w - state.prev_params)
    prev = state.prev_updates.at[rows].get(mode='fill', fill_value=0.0)
    prev_valid = state.prev_valid.at[rows].get(mode='fill', fill_value=False)
    dist = safe_norm(prev + hv[None, :] - grads, axis=1)
    dist = jnp.where(jnp.isfinite(dist), jnp.minimum(dist, 1e30), 1e30)
    scored = valid & prev_valid & have_prev
    dist = jnp.where(scored, dist, 0.0)
    total = jnp.sum(dist)
    dist = jnp.where(total > 0, dist / jnp.where(total > 0, total, 1.0), 0.0)
    scatter = lambda fill, x: jnp.full((k,), fill, x.dtype).at[rows].set(
        x, mode='drop')
    scores = push(state.scores, scatter(0.0, dist), have_prev)
    score_mask = push(state.score_mask, scatter(False, scored), have_prev)
    count = jnp.sum(score_mask.astype(jnp.float32), axis=0)
    suspicion = jnp.sum(jnp.where(score_mask, scores, 0.0), axis=0) / (
        jnp.maximum(count, 1.0))
    suspicion = suspicion.at[rows].get(mode='fill', fill_value=0.0)
    count = count.at[rows].get(mode='fill', fill_value=0.0)
    candidates = valid & (count > 0)

    # Detection (gap statistic, then exclude the high group).
    detecting = state.round >= warmup
    two, high = gap_two_groups(suspicion, candidates, key,
                               samples=gap_samples, iters=kmeans_iters)
    flagged = high & detecting
    keep = valid & ~flagged
    agg = masked_median(clean, keep)
    update = unravel_like(agg, state.params)

    # L-BFGS pair (w_t - w_{t-1}, g_t - g_{t-1}) for the next rounds.
    g = -agg
    s_vec, y_vec = w - state.prev_params, g - state.prev_global
    curvature = jnp.dot(s_vec, y_vec, precision='highest')
    pair_ok = (have_prev & jnp.all(jnp.isfinite(s_vec)) &
               jnp.all(jnp.isfinite(y_vec)) &
               (curvature > 1e-10 * safe_norm(s_vec) * safe_norm(y_vec)))
    new_state = FLDetectorState(
        params=tree_add(state.params, update),
        prev_params=w,
        prev_global=g,
        prev_updates=state.prev_updates.at[rows].set(grads, mode='drop'),
        prev_valid=scatter(False, valid),
        delta_w=push(state.delta_w, s_vec, pair_ok),
        delta_g=push(state.delta_g, y_vec, pair_ok),
        pair_mask=push(state.pair_mask, pair_ok, pair_ok),
        scores=scores,
        score_mask=score_mask,
        round=state.round + 1)
    n_keep = jnp.maximum(jnp.sum(keep.astype(jnp.float32)), 1.0)
    info = {'weights': jnp.where(keep, 1.0 / n_keep, 0.0).astype(jnp.float32),
            'suspicion': jnp.where(candidates, suspicion, 0.0).astype(
                jnp.float32),
            'flagged': flagged & valid,
            'detecting': detecting & two}
    return update, new_state, info

  return Aggregator(init, aggregate, reads=('ids',))
