"""FedHAN's server round as an aggregator (FedHAN Sec. 3.5, Algorithm 1).

The engine already delivers what FedHAN's server receives: with
`--client_delay` the round's arrivals come with their staleness tau, and
with `--transform=width` each upload carries its width mask as the
`coverage` extra. This rule keeps FedHAN's per-client cache (the O(4Np)
state, methods/fedhan/cache.py) in its state, indexed by client id, and
per round:

  1. Eq. 3, 4, 9: writes the arrivals into the cache (their update on
     their mask, the previous imputed update elsewhere; weights beta^tau
     and beta-decay; the imputed global update from the global update of
     the round the client's model came from);
  2. Sec. 3.5.3: suspicion s_i = ||gchk_i - gbar_i|| of each arrival
     whose model was sent after the first global update; DBSCAN on S_j
     (`score_set`: by default the round's arrivals' scores; 'clients':
     every unbanned client's latest score, kept in the state),
     divided by their median, and if it finds several clusters or noise,
     2-means; the arrivals in the higher-mean cluster are flagged and
     excluded from this round; a client flagged in `ban_after` rounds is
     banned from then on (its cache row never enters the history
     selection again; its later uploads are still cached and scored, but
     never aggregated);
  3. Eq. 5-6: the weighted imputed aggregate of the kept arrivals;
  4. Eq. 7-8: adds alpha times the aggregate of the cached updates of
     non-arriving clients (staleness <= tau_max) whose cosine with it is
     >= sim_min;
  5. pushes the result onto the global-update history (Eq. 9's g(w_t));
  6. Sec. 3.5.4, when detection flags someone: rolls back `rollback`
     rounds and replays them without the flagged clients (below).

Recovery (Sec. 3.5.4, Eq. 10). The rule stores, for each of the last m =
`rollback` rounds, the kept arrivals' imputed updates and their Eq. 5
weights (at most `recovery_slots` per round, the O(mKp) storage of
Sec. 4.1), that round's historical aggregate and the update it applied.
With server lr 1 the model moved by exactly those updates, so the rule
knows w_t - w_{j-m} without seeing the model. On detection in round j it
replays rounds t = j-m .. j-1 from w_{j-m}: each round's update becomes
the Eq. 5-6 aggregate of its arrivals that are not banned, plus
alpha gtilde_t, corrected for the model it is now applied to by Eq. 10,
  ghat_t = gbar_t - H (what_t - w_t),
with H v the L-BFGS product (fldetector.lbfgs_hvp) from the exact rounds'
pairs (below; without exact rounds H = 0 and the stored updates are
applied as they are). The round returns (what_j - w_j) + ghat_j, which
moves the model to the replayed trajectory. The correction is scaled so it
never moves the replay away from the recorded model (`safe_step`).
`lbfgs_pairs='trajectory'` takes the pairs from the recorded trajectory
instead (s_t = applied update t, y_t = applied update t minus applied
update t + 1: the change of the descent direction, in the delta
convention), the earlier default; those pairs hold the attackers' part of
the aggregate, and the correction they give pulled a replay back toward
the backdoor it was removing (BUILD_NOTES §3d).

Exact rounds (Sec. 3.5.4 and 4.1's O(T_w + (m - T_w) / T_c) extra client
rounds). With `exact_warmup` = T_w and `exact_every` = T_c, replayed
rounds r = 0 .. T_w - 1 and then every T_c-th one are exact: the engine's
`retrain` extra trains that round's kept clients from the replayed model
what_t (the same clients, their own data, width and poisoning if they are
undetected attackers), their new update replaces the stored one on its
mask (the rest stays the stored imputation, Eq. 3), and the round takes no
L-BFGS correction. Each exact round also stores the paper's buffer pair
(Delta w_t, Delta g_t) = (what_t - w_t, gbar_t(w_t, xi) - gbar_t(what_t,
xi)) over the same kept rows. Eq. 10 takes both updates on the same
batches xi; the stored update's batches are not kept, so the clients also
retrain from w_t with the keys of their retraining from what_t (two
trainings per client and exact round, one where what_t = w_t; with fresh
batches the pair would
also hold the sampling difference of two trainings, BUILD_NOTES §3d).
The L-BFGS product of the estimated rounds uses these pairs
(the paper's Delta W, Delta G), and is 0 before the first exact round.
Without exact rounds (the default, T_w = 0 and T_c = 0) no client computes
anything during the replay, and the rounds after the recovery are the
exact ones.

After a recovery the record before it is dropped: a later recovery
replays only the rounds since, and its L-BFGS pairs too.

A replayed round keeps its recorded historical term alpha gtilde_t (Eq. 8)
only if that term took no cached row of a client banned now: the record
keeps which clients each round's Eq. 7 selection took (m N bools), not
their rows, so a term that took a banned client's row is dropped whole.

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
  * recovery: one L-BFGS approximation shared by all clients (the paper
    writes H_{j,i}; per-client pairs need the same client in consecutive
    rounds, which partial asynchronous participation rarely gives), pairs
    only where s.y > 0, and the replayed rounds keep their recorded
    historical aggregate.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.aggregators.base import Aggregator
from fedrobust.aggregators.federaser import unlearning_request
from fedrobust.aggregators.finetune import first_client, ravel_one
from fedrobust.aggregators.fldetector import lbfgs_hvp
from fedrobust.aggregators.mean import setting
from fedrobust.methods.fedhan import cache as fc
from fedrobust.tree import ravel_clients, unravel_like
from fedrobust.types import LEGACY_CONVERTERS

CACHE_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
LBFGS_PAIRS = ('exact', 'trajectory')
# Which suspicion scores Sec. 3.5.3's S_j clusters: every client's latest
# score s_{j,i} (Eq. 9 keeps gchk_i, and Eq. 3 gbar_i, for every client, so
# s_{j,i} is defined for all i in every round), or the round's arrivals'.
SCORE_SETS = ('clients', 'arrivals')


class RecoveryRecord(NamedTuple):
  """The last m rounds, row t mod m (Sec. 3.5.4's O(mKp) storage)."""
  gbar: jax.Array      # [m, S, D] kept arrivals' imputed updates
  weight: jax.Array    # [m, S, D] their Eq. 5 weights p'
  ids: jax.Array       # int32[m, S]
  kept: jax.Array      # bool[m, S]
  gtilde: jax.Array    # float32[m, D] the round's historical aggregate
  round: jax.Array     # int32[m], the round a row holds (0: none)
  selected: jax.Array  # bool[m, N], whose cached rows gtilde took (Eq. 7)


class FedHANState(NamedTuple):
  cache: fc.FedHANCache      # per-client cache (N rows)
  history: jax.Array         # float32[H, D], update applied in round t at
                             # row t mod H
  banned: jax.Array          # bool[N], detected clients
  strikes: jax.Array         # int32[N], rounds each client was flagged in
  round: jax.Array           # int32[], rounds aggregated so far
  record: RecoveryRecord | None  # recovery storage (None: no recovery;
                                 # zero-size arrays cannot be checkpointed)
  base: jax.Array            # int32[], last round whose model a recovery
                             # cannot roll back past (a recovery, or 0)
  score: jax.Array | None = None  # float32[N], each client's latest
                             # suspicion s_{j,i} (Sec. 3.5.3; -1: never
                             # scored); kept only with score_set 'clients',
                             # so the default's checkpoints keep their
                             # layout


class FedHANStateV1(NamedTuple):
  """FedHANState as checkpointed before the `score` field was added."""
  cache: fc.FedHANCache
  history: jax.Array
  banned: jax.Array
  strikes: jax.Array
  round: jax.Array
  record: RecoveryRecord | None
  base: jax.Array


def legacy_states(like: Any):
  """(template, convert) pairs for Checkpointer.restore_latest(legacy=...):
  a checkpoint whose FedHAN states were written before the `score` field
  (which the default score_set 'arrivals' leaves None) restores into
  `like`. () when `like` holds no such state."""
  old = lambda x: isinstance(x, FedHANState) and x.score is None
  is_state = lambda x: isinstance(x, FedHANState)
  if not any(old(x) for x in jax.tree.leaves(like, is_leaf=is_state)):
    return ()
  template = jax.tree.map(
      lambda x: FedHANStateV1(*x[:7]) if old(x) else x, like,
      is_leaf=is_state)
  is_v1 = lambda x: isinstance(x, FedHANStateV1)
  convert = lambda tree: jax.tree.map(
      lambda x: FedHANState(*x, score=None) if is_v1(x) else x, tree,
      is_leaf=is_v1)
  return ((template, convert),)


LEGACY_CONVERTERS.append(legacy_states)


def recovery_bytes(rollback: int, slots: int, dim: int, num_clients: int,
                   dtype=jnp.float32) -> int:
  """Bytes of the recovery record: 2 m S D values plus m D float32 and
  m N bools."""
  item = fc.storage_dtype(dtype).itemsize
  return rollback * (2 * slots * dim * item + slots * 5 + dim * 4 + 4 +
                     num_clients)


def _empty_record(m: int, s: int, d: int, n: int, dtype) -> RecoveryRecord:
  z = jnp.zeros((m, s, d), fc.storage_dtype(dtype))
  return RecoveryRecord(z, z,
                        jnp.zeros((m, s), jnp.int32), jnp.zeros((m, s), bool),
                        jnp.zeros((m, d), jnp.float32),
                        jnp.zeros((m,), jnp.int32), jnp.zeros((m, n), bool))


def safe_step(delta: jax.Array, hv: jax.Array) -> jax.Array:
  """The Eq. 10 correction H delta, scaled so that it never moves the
  replayed model further from the recorded one: ||delta - c hv|| <=
  ||delta|| iff 2 c delta.hv >= c^2 ||hv||^2, so c = min(1, 2 delta.hv /
  ||hv||^2), and 0 when delta.hv <= 0. Exact dynamics have this property
  (gradient steps from two points of an L-smooth convex loss, lr < 2/L, do
  not move them apart); an L-BFGS estimate from noisy pairs does not, and
  compounded over replayed rounds and repeated recoveries it diverged
  (BUILD_NOTES §3d)."""
  dot = jnp.vdot(delta, hv)
  nn = jnp.vdot(hv, hv)
  c = jnp.where((dot > 0) & (nn > 0),
                jnp.minimum(1.0, 2.0 * dot / jnp.where(nn > 0, nn, 1.0)), 0.0)
  return c * hv


def _compact(keep: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
  """`size` slot indices, the kept slots first, and whether each is kept
  (padded with unkept slot 0 when there are fewer slots than `size`)."""
  order = jnp.argsort(~keep, stable=True)[:size]
  kept = keep[order]
  pad = size - order.shape[0]
  if pad:
    order = jnp.concatenate([order, jnp.zeros((pad,), order.dtype)])
    kept = jnp.concatenate([kept, jnp.zeros((pad,), bool)])
  return order, kept


def _history_info(estimate: jax.Array, extra: jax.Array, selected: jax.Array,
                  sim: jax.Array, age: jax.Array) -> dict[str, jax.Array]:
  """How much Eq. 8's historical term alpha g~ moved a round's step.

  Args:
    estimate: float32[D], gbar(w_j), the K arrivals' aggregate.
    extra: float32[D], alpha g~(w_j) (0 when nothing was selected).
    selected: bool[N], the cached rows of Eq. 7.
    sim: float32[N], their cosines to the estimate.
    age: int32[N], rounds since each row was last received.

  Returns:
    'history_selected' (count), 'history_share' = ||alpha g~|| / ||gbar||,
    'history_cos' = cos(alpha g~, gbar), and over the selected rows the
    mean 'history_sim' (Eq. 7's cosine) and 'history_age' (rounds); each
    0 in a round that selects nothing.
  """
  n_sel = jnp.sum(selected.astype(jnp.float32))
  e_norm = jnp.linalg.norm(estimate)
  x_norm = jnp.linalg.norm(extra)
  safe = lambda v: jnp.where(v > 0, v, 1.0)
  mean_sel = lambda v: jnp.sum(jnp.where(selected, v, 0.0)) / safe(n_sel)
  return {'history_selected': n_sel,
          'history_share': jnp.where(e_norm > 0, x_norm / safe(e_norm), 0.0),
          'history_cos': jnp.where((e_norm > 0) & (x_norm > 0),
                                   jnp.vdot(estimate, extra)
                                   / safe(e_norm) / safe(x_norm), 0.0),
          'history_sim': mean_sel(sim),
          'history_age': mean_sel(age.astype(jnp.float32))}


def fedhan(*, num_byzantine: int = 0, num_clients: int | None = None,
           beta: float = 0.9, alpha: float = 0.2, sim_min: float = 0.5,
           tau_max: int = 10, eps: float = 0.5, min_samples: int = 2,
           detect: bool = True, detect_start: int = 1,
           history: int | None = None,
           rollback: int = 0, recovery_slots: int = 16,
           cache_dtype: str = 'float32', ban_after: int = 1,
           exact_warmup: int = 0, exact_every: int = 0,
           lbfgs_pairs: str = 'exact', forget: Any = None,
           unlearn_round: int = 0, score_set: str = 'arrivals',
           min_flag_score: float = 0.0) -> Aggregator:
  """FedHAN's imputation, historical selection, detection and recovery.

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
    min_flag_score: a member of the high cluster is flagged only if its
      score is at least this multiple of the median of the clustered
      scores (`fc.detect`); 0: off, the rule as the paper writes it.
    score_set: the scores S_j that DBSCAN and 2-means cluster (Sec. 3.5.3:
      "the server maintains a latest imputed global update for each client.
      The suspicious score for each client is evaluated as s_{j,i} ... and
      these scores are collected into the set S_j"). 'clients': the latest
      score of every client scored so far and not banned, kept in the state
      (a client's gbar_i and gchk_i change only when it arrives, so its
      score is the one of its last scored arrival); the arrivals in the
      high cluster are flagged, a non-arriving member of it is not.
      'arrivals' (the default): the round's scored arrivals only, banned
      ones included. On the quick preset under trim neither reading
      reaches DACC 0.9 online without a floor (BUILD_NOTES §3d);
      'arrivals' with min_flag_score 1.35 and a ban at the first
      flag does on the mean of held-out seeds.
    detect: run the detection (off: imputation and history only).
    detect_start: first round whose arrivals may be flagged (the paper's
      detector setting starts at round 50); earlier rounds are scored only.
    history: rounds of applied global updates kept (Eq. 9 reads the one a
      stale model came from; older staleness reads the oldest); None:
      max(16, rollback + 2), the fewest the replay needs.
    rollback: m, rounds the recovery rolls back and replays (0: no
      recovery, the flagged clients are only excluded from then on).
    recovery_slots: S, kept arrivals stored per round for the replay; more
      arrivals in a round are aggregated but not stored (info
      'recovery_overflow').
    cache_dtype: 'float32' or 'bfloat16', the storage type of the cache
      and the recovery record (computation stays float32).
    ban_after: k, the rounds a client must be flagged in before it is
      banned (and a recovery starts). A flagged client is always left out
      of that round's aggregate (the paper's "removed from the current
      round"); 1 bans at the first flag. A client flagged at least once is
      no longer a candidate of the historical selection (its cached row
      may hold the flagged upload).
    exact_warmup: T_w, the first replayed rounds in which the clients
      compute exact updates (needs rollback; the rule then reads the
      'params' and 'retrain' extras).
    exact_every: T_c, after the warm-up every T_c-th replayed round is
      exact (0: none).
    lbfgs_pairs: where Eq. 10's L-BFGS pairs come from. 'exact': the exact
      replayed rounds' (Delta w, Delta g) of the kept clients (the paper's
      buffers Delta W, Delta G); without exact rounds there is none, and
      the estimated rounds apply the stored updates uncorrected.
      'trajectory': pairs of the recorded trajectory (applied update t and
      its change to t + 1), the earlier default; they describe the
      aggregate with the attackers in it, and pulled a replayed model back
      to the backdoor it was removing (BUILD_NOTES §3d).
    forget, unlearn_round: the recovery experiments' told mode (as the
      unlearning baselines FedEraser and Crab are told): in round
      `unlearn_round` (>= 2; 0: off) the clients in `forget`
      (bool[num_clients]) are banned, their uploads of that round dropped,
      and a recovery rolls back `rollback` rounds without them (set
      rollback = unlearn_round - 1 to replay from the initial model).
      Detection runs alongside unless `detect` is off.

  Returns:
    Aggregator reading `ids`, `staleness` and `coverage` (with exact
    rounds also `params` and `retrain`). info: 'weights'
    (1/n per kept arrival, 0 if excluded), 'suspicion', 'flagged',
    'history_selected' (count) with 'history_share', 'history_cos',
    'history_sim' and 'history_age' (`_history_info`), 'detected',
    'recovered', 'replayed'
    (rounds replayed), 'recovery_shift' (||what_j - w_j||),
    'recovery_overflow', 'recovery_exact_rounds',
    'recovery_client_rounds' (client trainings the replay asked for),
    'recovery_lbfgs_error' (over the exact rounds that had an L-BFGS pair
    before them, their count 'recovery_lbfgs_scored': the mean of
    ||Delta g - H Delta w|| / ||Delta g||, how well the pairs predicted the
    exact change; 1 is no better than no correction),
    'recovery_history_dropped' (replayed rounds whose Eq. 8 term took a
    cached row of a client banned now, replayed without it), and per arrival
    'staleness', 'coverage' (share of the model it trained), 'update_norm'
    (||gbar_i||) and
    'global_norm' (||gchk_i||), both 0 if excluded.
  """
  if num_clients is None or num_clients < 1:
    raise setting('fedhan', 'num_clients', f'must be >= 1, got '
                  f'{num_clients}')
  told = unlearn_round != 0
  if told:
    forget = unlearning_request('fedhan', num_byzantine, num_clients,
                                forget, unlearn_round)
  elif forget is not None:
    raise setting('fedhan', 'forget', 'is read only in the told mode: set '
                  'unlearn_round >= 2 too')
  if history is None:
    history = max(16, rollback + 2)
  for name, value, ok in (('beta', beta, 0.0 < beta <= 1.0),
                          ('alpha', alpha, alpha >= 0.0),
                          ('sim_min', sim_min, -1.0 <= sim_min <= 1.0),
                          ('tau_max', tau_max, tau_max >= 0),
                          ('eps', eps, eps > 0.0),
                          ('min_samples', min_samples, min_samples >= 1),
                          ('min_flag_score', min_flag_score,
                           min_flag_score >= 0.0),
                          ('detect_start', detect_start, detect_start >= 1),
                          ('history', history, history >= 1),
                          ('rollback', rollback, rollback >= 0),
                          ('recovery_slots', recovery_slots,
                           recovery_slots >= 1),
                          ('cache_dtype', cache_dtype,
                           cache_dtype in CACHE_DTYPES),
                          ('ban_after', ban_after, ban_after >= 1),
                          ('exact_warmup', exact_warmup, exact_warmup >= 0),
                          ('exact_every', exact_every, exact_every >= 0),
                          ('lbfgs_pairs', lbfgs_pairs,
                           lbfgs_pairs in LBFGS_PAIRS),
                          ('score_set', score_set, score_set in SCORE_SETS)):
    if not ok:
      raise setting('fedhan', name, f'out of range: {value!r}')
  if rollback and history < rollback + 2:
    raise setting('fedhan', 'history', f'must be >= rollback + 2 = '
                  f'{rollback + 2} (the replay reads {rollback + 1} '
                  f'applied updates), got {history}')
  exact = bool(exact_warmup or exact_every)
  if exact and not rollback:
    raise setting('fedhan', 'exact_warmup' if exact_warmup else
                  'exact_every', 'exact replay rounds need a recovery '
                  '(rollback >= 1)')
  dtype = CACHE_DTYPES[cache_dtype]
  m = rollback

  def is_exact(r):
    """Whether replayed round r (0 .. m - 1) is exact."""
    late = r - exact_warmup + 1
    return (r < exact_warmup) | (
        (exact_every > 0) & (late > 0) &
        (jnp.mod(late, max(exact_every, 1)) == 0))

  def init(params):
    d = ravel_one(params).shape[0]
    return FedHANState(fc.init_cache(num_clients, d, dtype),
                       jnp.zeros((history, d), jnp.float32),
                       jnp.zeros((num_clients,), bool),
                       jnp.zeros((num_clients,), jnp.int32),
                       jnp.zeros((), jnp.int32),
                       _empty_record(m, recovery_slots, d, num_clients,
                                     dtype) if m
                       else None, jnp.zeros((), jnp.int32),
                       jnp.full((num_clients,), -1.0, jnp.float32)
                       if score_set == 'clients' else None)

  def applied(state, t):
    """Update applied in round t (0 if t is not in the history)."""
    ok = (t >= 1) & (t > state.round - history)
    return jnp.where(ok, state.history[jnp.mod(t, history)], 0.0), ok

  def replay(state, banned, round_, params=None, retrain=None):
    """Sec. 3.5.4: (what_j - w_j, rounds replayed, the pairs' HVP, client
    trainings, exact rounds, the mean L-BFGS error of the exact rounds that
    had a pair before them, and their count)."""
    rec = state.record
    d = state.history.shape[1]
    ones = jnp.ones(rec.gbar.shape[1:], bool)
    if exact:   # the exact rounds' (Delta w, Delta g) pairs, filled below
      pairs = (jnp.zeros((m, d), jnp.float32), jnp.zeros((m, d), jnp.float32),
               jnp.zeros((m,), bool))
      flat_params = ravel_one(params)
    elif lbfgs_pairs == 'exact':   # no exact round, so no pair
      pairs = (jnp.zeros((1, d), jnp.float32), jnp.zeros((1, d), jnp.float32),
               jnp.zeros((1,), bool))
    else:
      # L-BFGS pairs from the recorded trajectory: rounds t = j-m-1 .. j-2,
      # oldest first (s_t = u_t, y_t = u_t - u_{t+1}).
      ts = round_ - m - 1 + jnp.arange(m)
      u, ok = jax.vmap(lambda t: applied(state, t))(ts)
      u_next, ok_next = jax.vmap(lambda t: applied(state, t))(ts + 1)
      s_pairs, y_pairs = u, u - u_next
      sy = jnp.sum(s_pairs * y_pairs, axis=1)
      present = ok & ok_next & (ts > state.base) & (sy > 0)
      pairs = (s_pairs, y_pairs, present)
    hvp_of = lambda p: (lambda v: safe_step(v, lbfgs_hvp(*p, v)))
    # Replayed round r is round ts_all[r], stored in row rows_all[r], and
    # live if recorded since the last recovery. Rows whose Eq. 8 term took
    # no banned client's cached row, and the replayed rounds that lose it.
    clean = ~jnp.any(rec.selected & banned[None, :], axis=1)
    ts_all = round_ - m + jnp.arange(m)
    rows_all = jnp.mod(ts_all, m)
    live_all = (rec.round[rows_all] == ts_all) & (ts_all > state.base)
    dropped = jnp.sum(live_all & ~clean[rows_all]).astype(jnp.int32)

    def step(r, carry):
      delta, n, carried, behind, clients, exact_n, err_sum, err_n = carry
      pairs_now = carried if exact else pairs
      t, row, live = ts_all[r], rows_all[r], live_all[r]
      keep = rec.kept[row] & ~banned.at[rec.ids[row]].get(
          mode='fill', fill_value=True)
      agg = fc.weighted(rec.gbar[row], rec.weight[row], ones, keep, alpha)
      # The round's Eq. 8 term, unless it took a now-banned client's cached
      # row (the term is one weighted sum; that row is not kept apart).
      gtilde = jnp.where(clean[row], rec.gtilde[row], 0.0)
      u_t, _ = applied(state, t)
      if not exact:   # the pairs (trajectory's or none) are closed over
        ghat = agg + alpha * gtilde - hvp_of(pairs)(delta)
        return (jnp.where(live, delta + ghat - u_t, delta),
                n + live.astype(jnp.int32), (), behind, clients, exact_n,
                err_sum, err_n)

      def exact_update():
        # The kept clients retrain from what_t = w_t + delta, where
        # w_t = w_j - (u_t + ... + u_{j-1}), and from w_t itself with the
        # same keys (the same batches xi): Eq. 10's pair Delta g_t =
        # gbar(what_t, xi) - gbar(w_t, xi) then holds no sampling noise
        # (the stored update's own xi is not kept).
        w_t = flat_params - behind

        def rows_from(flat):
          new, cov = retrain(unravel_like(flat, params), rec.ids[row], keep,
                             t)
          cov = ones if cov is None else ravel_clients(cov) > 0
          rows = jnp.where(cov, ravel_clients(new), fc.decode(rec.gbar[row]))
          return fc.weighted(rows, rec.weight[row], ones, keep, alpha)

        g = rows_from(w_t + delta)
        # At delta = 0 (the first live replayed round starts at the
        # recorded model) the pair is 0: no second training.
        moved = jnp.any(delta != 0)
        y = jax.lax.cond(moved, lambda: rows_from(w_t) - g,
                         lambda: jnp.zeros_like(g))
        # How well the pairs so far predict this change: ||y - H delta|| /
        # ||y|| (1: no better than no correction; only with a pair).
        s_p, y_p, ok_p = pairs_now
        err = jnp.linalg.norm(y - hvp_of(pairs_now)(delta)) / jnp.maximum(
            jnp.linalg.norm(y), 1e-30)
        scored = jnp.any(ok_p)
        # Appended as the newest pair (last row, as lbfgs_hvp needs) when
        # it has positive curvature; otherwise the buffer is unchanged.
        fresh = jnp.vdot(delta, y) > 0
        push = lambda a, v: jnp.where(
            fresh, jnp.concatenate([a[1:], v[None]]), a)
        pairs_ = (push(s_p, delta), push(y_p, y), push(ok_p, fresh))
        trained = (1 + moved.astype(jnp.int32)) * jnp.sum(keep).astype(
            jnp.int32)
        return (g, pairs_, trained, jnp.int32(1),
                jnp.where(scored, err, 0.0), scored.astype(jnp.int32))

      def estimated():
        return (agg - hvp_of(pairs_now)(delta), pairs_now, jnp.int32(0),
                jnp.int32(0), jnp.float32(0.0), jnp.int32(0))

      g, pairs_, trained, once, err, scored = jax.lax.cond(
          live & is_exact(r), exact_update, estimated)
      ghat = g + alpha * gtilde
      return (jnp.where(live, delta + ghat - u_t, delta),
              n + live.astype(jnp.int32), pairs_, behind - u_t,
              clients + trained, exact_n + once, err_sum + err,
              err_n + scored)

    delta0 = jnp.zeros((d,), jnp.float32)
    behind = jnp.zeros((d,), jnp.float32)
    if exact:   # u_{j-m} + ... + u_{j-1}: w_j - w_{j-m}
      behind = jnp.sum(jax.vmap(lambda t: applied(state, t)[0])(
          round_ - m + jnp.arange(m)), axis=0)
    zero = jnp.int32(0)
    delta, n, carried, _, clients, exact_n, err_sum, err_n = (
        jax.lax.fori_loop(0, m, step, (delta0, zero, pairs if exact else (),
                                       behind, zero, zero, jnp.float32(0.0),
                                       zero)))
    err = jnp.where(err_n > 0, err_sum / jnp.maximum(err_n, 1), 0.0)
    return (delta, n, hvp_of(carried if exact else pairs), clients, exact_n,
            err, err_n, dropped)

  def aggregate(updates, mask, state, key, *, ids, staleness,
                coverage=None, params=None, retrain=None):
    del key
    ids = jnp.asarray(ids, jnp.int32)
    mask = jnp.asarray(mask, bool)
    c = ids.shape[0]
    tau = jnp.maximum(jnp.asarray(staleness, jnp.int32), 0)
    round_ = state.round + 1
    before, told_now = state.banned, jnp.bool_(False)
    if told:   # the told clients are banned from round unlearn_round on
      before = state.banned | (forget & (round_ >= unlearn_round))
      told_now = (round_ == unlearn_round) & jnp.any(forget & ~state.banned)
    banned = before.at[ids].get(mode='fill', fill_value=True)
    # Eq. 3, 4, 9, a block of slots at a time (fc.receive_uploads). A
    # banned client's uploads are still cached and scored, but never
    # aggregated; with score_set 'arrivals' they stay in the round's
    # clustering (bans are ours), with 'clients' they leave S_j. A model sent
    # before any global update existed (round 1) has no g(w_{j - tau}): its
    # imputed global update takes its own upload there (suspicion 0 on
    # those coordinates, now and while they stay imputed), and it is not
    # scored.
    cache, finite, share = fc.receive_uploads(
        state.cache, state.history, updates, coverage, ids, mask, tau,
        round_=round_, beta=beta)
    valid = finite & ~banned
    have_global = round_ - 1 - tau >= 1
    scored = finite & have_global
    scores, global_norms = fc.slot_norms(cache, ids, finite)
    scores = jnp.where(scored, scores, 0.0)
    latest = None
    if score_set == 'clients':
      # Each client's latest score. A client's uploads of one round all
      # read its final cache row, so repeated ids write the same value.
      latest = state.score.at[jnp.where(scored, ids, num_clients)].set(
          scores, mode='drop')
    if detect:
      rule = dict(eps=eps, min_samples=min_samples,
                  min_flag_score=min_flag_score)
      if score_set == 'clients':
        flagged, detected = fc.detect_latest(
            latest, (latest >= 0.0) & ~before, ids, scored, **rule)
      else:
        flagged, detected = fc.detect(scores, scored, **rule)
      on = round_ >= detect_start
      flagged, detected = flagged & on, detected & on
    else:
      flagged, detected = jnp.zeros((c,), bool), jnp.bool_(False)
    keep = valid & ~flagged
    # One strike per flagged round, however many of its uploads arrived.
    flagged_now = jnp.zeros((num_clients,), bool).at[
        jnp.where(flagged, ids, num_clients)].set(True, mode='drop')
    strikes = state.strikes + flagged_now.astype(jnp.int32)
    new_banned = before | (strikes >= ban_after)
    # A client banned in this round (a recovery's trigger).
    newly = valid & new_banned.at[ids].get(mode='fill', fill_value=False)
    estimate = fc.aggregate_slots(cache, ids, keep, alpha=alpha)
    gtilde, selected, sim = fc.select_history(
        cache, ids, keep, estimate, round_=round_, sim_min=sim_min,
        tau_max=tau_max, alpha=alpha, beta=beta,
        excluded=new_banned | (strikes > 0))
    g = estimate + alpha * gtilde
    history_info = _history_info(estimate, alpha * gtilde, selected, sim,
                                 round_ - cache.last)
    record, base = state.record, state.base
    hist = state.history
    recovered = jnp.bool_(False)
    shift = jnp.float32(0.0)
    replayed = jnp.int32(0)
    overflow = jnp.float32(0.0)
    clients = exact_n = err_n = dropped = jnp.int32(0)
    lbfgs_err = jnp.float32(0.0)
    if m:
      recovered = jnp.any(newly) | told_now

      def recover():
        delta, n, hvp, clients, exact_n, err, err_n, dropped = replay(
            state, new_banned, round_, params, retrain)
        ghat = g - hvp(delta)
        return (delta + ghat, n, jnp.linalg.norm(delta),
                hist.at[jnp.mod(round_, history)].set(ghat), clients,
                exact_n, err, err_n, dropped)

      (out, replayed, shift, hist, clients, exact_n, lbfgs_err,
       err_n, dropped) = jax.lax.cond(
           recovered, recover,
           lambda: (g, jnp.int32(0), jnp.float32(0.0),
                    hist.at[jnp.mod(round_, history)].set(g), jnp.int32(0),
                    jnp.int32(0), jnp.float32(0.0), jnp.int32(0),
                    jnp.int32(0)))
      order, kept = _compact(keep, recovery_slots)
      row = jnp.mod(round_, m)
      # The first S kept arrivals' rows, read back from the cache; rows
      # past the kept arrivals are zero (a masked slot changes nothing,
      # not even the record).
      ids_s = ids[order]
      gbar_s, weight_s, mask_s = fc.arrival_rows(cache, ids_s, kept)
      put = lambda a, v: a.at[row].set(fc.encode(v, a.dtype))
      record = RecoveryRecord(
          gbar=put(record.gbar, gbar_s),
          weight=put(record.weight, weight_s * jnp.where(mask_s, 1.0, alpha)),
          ids=put(record.ids, jnp.where(kept, ids_s, 0)),
          kept=put(record.kept, kept),
          gtilde=put(record.gtilde, gtilde),
          round=record.round.at[row].set(round_),
          selected=record.selected.at[row].set(selected))
      # After a recovery this round's model is the new base: a later
      # recovery replays, and takes L-BFGS pairs from, only the rounds
      # after it (`t > base` in `replay`; letting it replay through earlier
      # replays diverged, BUILD_NOTES §3d).
      base = jnp.where(recovered, round_, base)
      overflow = jnp.maximum(jnp.sum(keep) - recovery_slots,
                             0).astype(jnp.float32)
    else:
      out = g
      hist = hist.at[jnp.mod(round_, history)].set(g)
    new_state = FedHANState(cache=cache, history=hist, banned=new_banned,
                            strikes=strikes, round=round_, record=record,
                            base=base, score=latest)
    n_keep = jnp.maximum(jnp.sum(keep.astype(jnp.float32)), 1.0)
    info = {'weights': jnp.where(keep, 1.0 / n_keep, 0.0).astype(jnp.float32),
            'suspicion': scores.astype(jnp.float32),
            'flagged': flagged & valid,
            **history_info,
            'detected': detected,
            'recovered': jnp.asarray(recovered, jnp.float32),
            'replayed': jnp.asarray(replayed, jnp.float32),
            'recovery_shift': jnp.asarray(shift, jnp.float32),
            'recovery_overflow': overflow,
            'recovery_exact_rounds': jnp.asarray(exact_n, jnp.float32),
            'recovery_client_rounds': jnp.asarray(clients, jnp.float32),
            'recovery_lbfgs_error': jnp.asarray(lbfgs_err, jnp.float32),
            'recovery_lbfgs_scored': jnp.asarray(err_n, jnp.float32),
            'recovery_history_dropped': jnp.asarray(dropped, jnp.float32),
            # Per arrival, for diagnosing the scores.
            'staleness': jnp.where(mask, tau, 0).astype(jnp.float32),
            'coverage': share,
            # ||gbar_i|| is kept by the cache (of the stored values).
            'update_norm': jnp.where(
                keep, cache.norm.at[ids].get(mode='fill', fill_value=0.0),
                0.0),
            'global_norm': jnp.where(keep, global_norms, 0.0)}
    return unravel_like(out, first_client(updates)), new_state, info

  reads = ('ids', 'staleness', 'coverage')
  return Aggregator(init, aggregate, reads=reads + (('params', 'retrain')
                                                     if exact else ()))
