"""FedHAN's server round as an aggregator (FedHAN Sec. 3.5, Algorithm 1).

The engine already delivers what FedHAN's server receives: with
`--client_delay` the round's arrivals come with their staleness tau, and
with `--transform=width` each upload carries its width mask as the
`coverage` extra. This rule keeps FedHAN's per-client cache (the O(4Np)
state, aggregators/fedhan_cache.py) in its state, indexed by client id, and
per round:

  1. Eq. 3, 4, 9: writes the arrivals into the cache (their update on
     their mask, the previous imputed update elsewhere; weights beta^tau
     and beta-decay; the imputed global update from the global update of
     the round the client's model came from);
  2. Sec. 3.5.3: suspicion s_i = ||gchk_i - gbar_i|| of each arrival
     whose model was sent after the first global update;
     DBSCAN on the scores (divided by their median), and if it finds
     several clusters or noise, 2-means; the higher-mean cluster is
     flagged, excluded from this round and banned from then on (its cache
     row never enters the history selection again);
  3. Eq. 5-6: the weighted imputed aggregate of the kept arrivals;
  4. Eq. 7-8: adds alpha times the aggregate of the cached updates of
     non-arriving clients (staleness <= tau_max) whose cosine with it is
     >= sim_min;
  5. pushes the result onto the global-update history (Eq. 9's g(w_t)).

The update returned is in the engine's delta convention (client - server,
so FedHAN's "w - eta g" is "w + server_lr * update").

Assumptions where the paper is silent (BUILD_NOTES §3d):
  * g(w_{j - tau}) of Eq. 9 is the global update applied tau rounds before
    this one (tau = 0: the previous round's), since the update "at" the
    current model is not known yet; the history holds `history` rounds and
    older staleness reads the oldest;
  * the engine aggregates every update that arrives in the round, not a
    fixed K;
  * eps of DBSCAN is relative to the median score (the paper gives none);
  * Sec. 3.5.4's recovery (rollback m rounds and L-BFGS replay) is not
    part of this rule: detection removes the flagged clients going forward.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.aggregators.base import Aggregator
from fedrobust.aggregators.finetune import (finite_clients, first_client,
                                            ravel_one)
from fedrobust.aggregators.mean import setting
from fedrobust.aggregators import fedhan_cache as fc
from fedrobust.tree import ravel_clients, unravel_like


class FedHANState(NamedTuple):
  cache: fc.FedHANCache      # per-client cache (N rows)
  history: jax.Array         # float32[H, D], global updates, newest last
  banned: jax.Array          # bool[N], detected clients
  round: jax.Array           # int32[], rounds aggregated so far


def fedhan(*, num_byzantine: int = 0, num_clients: int | None = None,
           beta: float = 0.9, alpha: float = 0.2, sim_min: float = 0.5,
           tau_max: int = 10, eps: float = 0.5, min_samples: int = 2,
           detect: bool = True, history: int = 16) -> Aggregator:
  """FedHAN's imputation, historical selection and detection.

  Args:
    num_byzantine: unused (detection needs no f).
    num_clients: N, the clients that can appear (ids in [0, N)); required.
    beta: staleness decay of the weight matrix (Eq. 4; the paper's 0.9).
    alpha: weight of unupdated parts and of the historical aggregate
      (Eq. 5 and 8; the paper's 0.2).
    sim_min: cosine threshold of the historical selection (Eq. 7).
    tau_max: staleness limit of historical candidates.
    eps, min_samples: DBSCAN's radius (relative to the median score) and
      core size.
    detect: run the detection (off: imputation and history only).
    history: rounds of global updates kept for Eq. 9.

  Returns:
    Aggregator reading `ids`, `staleness` and `coverage`. info: 'weights'
    (1/n per kept arrival, 0 if excluded), 'suspicion', 'flagged',
    'history_selected' (count), 'detected'.
  """
  del num_byzantine
  if num_clients is None or num_clients < 1:
    raise setting('fedhan', 'num_clients', f'must be >= 1, got '
                  f'{num_clients}')
  for name, value, ok in (('beta', beta, 0.0 < beta <= 1.0),
                          ('alpha', alpha, alpha >= 0.0),
                          ('sim_min', sim_min, -1.0 <= sim_min <= 1.0),
                          ('tau_max', tau_max, tau_max >= 0),
                          ('eps', eps, eps > 0.0),
                          ('min_samples', min_samples, min_samples >= 1),
                          ('history', history, history >= 1)):
    if not ok:
      raise setting('fedhan', name, f'out of range: {value!r}')

  def init(params):
    d = ravel_one(params).shape[0]
    return FedHANState(fc.init_cache(num_clients, d),
                       jnp.zeros((history, d), jnp.float32),
                       jnp.zeros((num_clients,), bool),
                       jnp.zeros((), jnp.int32))

  def aggregate(updates, mask, state, key, *, ids, staleness,
                coverage=None):
    del key
    flat = ravel_clients(updates).astype(jnp.float32)
    c, d = flat.shape
    ids = jnp.asarray(ids, jnp.int32)
    mask = jnp.asarray(mask, bool)
    banned = state.banned.at[ids].get(mode='fill', fill_value=True)
    valid = finite_clients(flat, mask) & ~banned
    cov = (jnp.ones((c, d), bool) if coverage is None else
           ravel_clients(coverage) > 0)
    tau = jnp.maximum(jnp.asarray(staleness, jnp.int32), 0)
    round_ = state.round + 1
    clean = jnp.where(valid[:, None] & cov, flat, 0.0)
    # g(w_{j - tau}): the global update applied tau rounds before this one.
    # A model sent before any global update existed (round 1) has none: its
    # imputed global update takes its own upload there (suspicion 0 on those
    # coordinates, now and while they stay imputed), and it is not scored.
    have_global = round_ - tau > 1
    then = state.history[jnp.clip(history - 1 - tau, 0, history - 1)]
    then = jnp.where(have_global[:, None], then, clean)
    cache = fc.receive(state.cache, ids, valid, clean, cov, tau, then,
                       round_=round_, beta=beta)
    scored = valid & have_global
    scores = fc.suspicion(cache, ids, scored)
    if detect:
      flagged, detected = fc.detect(scores, scored, eps=eps,
                                    min_samples=min_samples)
    else:
      flagged, detected = jnp.zeros((c,), bool), jnp.bool_(False)
    keep = valid & ~flagged
    new_banned = state.banned.at[jnp.where(flagged, ids, num_clients)].set(
        True, mode='drop')
    estimate = fc.aggregate_arrivals(cache, ids, keep, alpha=alpha)
    gtilde, selected, _ = fc.select_history(
        cache, ids, keep, estimate, round_=round_, sim_min=sim_min,
        tau_max=tau_max, alpha=alpha, excluded=new_banned)
    g = estimate + alpha * gtilde
    new_state = FedHANState(
        cache=cache,
        history=jnp.concatenate([state.history[1:], g[None]], axis=0),
        banned=new_banned, round=round_)
    n_keep = jnp.maximum(jnp.sum(keep.astype(jnp.float32)), 1.0)
    info = {'weights': jnp.where(keep, 1.0 / n_keep, 0.0).astype(jnp.float32),
            'suspicion': scores.astype(jnp.float32),
            'flagged': flagged & valid,
            'history_selected': jnp.sum(selected).astype(jnp.float32),
            'detected': detected}
    return unravel_like(g, first_client(updates)), new_state, info

  return Aggregator(init, aggregate, reads=('ids', 'staleness', 'coverage'))
