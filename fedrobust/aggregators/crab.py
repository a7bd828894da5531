"""Crab (Jiang, Shen, Liu, Tan, Lam; IEEE TIFS 2025, arXiv 2401.08216) as a
server rule: recover from known attackers with selectively stored history
and a rollback to an early model, not to the initial one.

Crab is a recovery baseline of FedHAN's Figs. 6-8. Like FedEraser (which
it extends; federaser.py), it is told at round R (`unlearn_round`) whom to
forget (`forget`, here the run's attackers) and rebuilds the model without
them. What it keeps while training differs:

  * Windows. Rounds are grouped into windows; a window closes at round t
    once the round's training loss has fallen below (1 - alpha) times the
    loss of the window's first round, and at round R - 1. The loss of a
    round is the mean training loss the remaining arrivals report.
  * Rounds (the release's `select_round`). When a window of n rounds
    closes, the floor(n * P) rounds (`select_round_ratio` P; one round
    for n = 1) whose aggregation changed the global model most are kept,
    measured by KL(softmax(w_t) || softmax(w_{t+1})) summed over the
    parameter tensors, softmax along the axis PyTorch stores last.
  * Clients (`select_client_in_round`). In every round the floor(m * X)
    arrivals (`select_client_ratio` X, m arrivals) whose model w_t + u_i
    is closest to the new global model w_{t+1} are kept: cosine
    similarity of each output unit's input weights, averaged over units
    and over the weight tensors (ndim >= 2).
  * What a kept round stores: per parameter tensor l, ||U_sel^{t,l}||, the
    norm of the weighted mean update of its kept clients that will NOT be
    forgotten (the calibration step length; as in federaser.py the
    forget set is known when the rule is built, so the norm is stored in
    place of the clients' models).
  * Rollback (`adaptive_rollback`): to the first kept round r0. Until it
    is known the rule keeps, for each round of the open window,
    w_t + U_sel^t: the model the release rebuilds in its first recovery
    round by averaging the stored models of r0's kept remaining clients.

Recovery, in the rounds of the run (as federaser.py):
  * Round R: the model becomes w_{r0} + U_sel^{r0}; the round's arrivals
    (trained from the poisoned model) are dropped.
  * Rounds R + k, k = 1 .. S - 1 (S kept rounds): the arrivals of
    remaining clients that trained from a post-rollback model (staleness
    <= k - 1) give U_new; the applied update is, per tensor,
    ||U_sel^{r_k,l}|| U_new^l / ||U_new^l|| (federaser.calibrated).
  * Afterwards: FedAvg of the remaining clients' fresh arrivals.

Sources: the selection rules (windows, KL round ranking, cosine client
ranking; P = 0.6, X = 0.7, alpha = 0.1) are the authors' release
(shenjiyuan123/Adaptive_Recovery, `serverCrab.py`). That release has no
rollback and restarts every kept round from its own stored model, so the
recovery follows LaityLu/Federated-Learning's `recover/crab.py`, a
third-party benchmark that runs the same selection and then recovers in
order: rollback to the first kept round, that round rebuilt from its
stored client models, then one calibrated step per later kept round. The
paper's method section was not readable offline. Assumed:
  * the window loss is the remaining arrivals' reported training loss
    (the release evaluates the global model on the remaining clients'
    training data at the start of the round);
  * a window also closes when it reaches `max_window` rounds (static
    shapes);
  * as in federaser.py, a calibration round's fresh remaining arrivals
    stand for the kept clients of the stored round (the release retrains
    exactly those clients; under partial, asynchronous participation they
    are mostly not the ones arriving);
  * with width-sliced clients a client's model is w_t + u_i, with the
    global values outside its submodel;
  * the rollback is to the first kept round (LaityLu's
    `adaptive_rollback`); the paper's abstract describes a rollback chosen
    adaptively, which neither code implements.

Info: weights (0 for forgotten or pre-rollback arrivals from R on),
unlearned (1 in round R), calibrating (1 in a calibration round),
crab_kept_rounds (rounds stored so far), crab_rollback_round (r0, -1 until
known), crab_selected_clients (arrivals kept this round).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.aggregators.base import Aggregator
from fedrobust.aggregators.federaser import (calibrated, leaf_norms,
                                             unlearning_request)
from fedrobust.aggregators.mean import covered_weighted_mean, setting
from fedrobust.tree import leaf_names


class CrabState(NamedTuple):
  round: jax.Array          # int32[], rounds aggregated
  moved: Any                # w_t - w_0 (float32 tree)
  win_len: jax.Array        # int32[], rounds in the open window
  win_loss0: jax.Array      # float32[], its first finite round loss
  win_kl: jax.Array         # float32[W], KL of each of its rounds
  win_norms: jax.Array      # float32[W, L], ||U_sel^{t,l}||
  win_models: Any           # tree, leaves [W, ...]: moved + U_sel, until r0
  norms: jax.Array          # float32[S, L], kept rounds' step lengths
  kept_rounds: jax.Array    # int32[S], their round numbers (-1: empty)
  kept: jax.Array           # int32[], rounds kept so far
  rollback: Any             # tree: w_{r0} + U_sel^{r0} - w_0
  rollback_round: jax.Array  # int32[], r0 (-1 until known)


def _is_kernel(name: str) -> bool:
  """A Dense or Conv kernel (leaf name from `tree.leaf_names`): flax stores
  it (..., in, out), PyTorch (out, in, ...). Every other leaf (bias, norm
  scale, nn.Embed's 'embedding', ViT's 'cls' and 'position') has the same
  layout in both."""
  return name.rsplit('/', 1)[-1] == 'kernel'


def _torch_last_axis(name: str, ndim: int) -> int:
  """The axis PyTorch stores last, in flax's layout: (in, out) kernels
  are (out, in) in PyTorch, (*spatial, in, out) ones (out, in, *spatial);
  other leaves keep their last axis."""
  if not _is_kernel(name):
    return ndim - 1
  if ndim <= 2:
    return 0
  return ndim - 3


def _torch_dim1(name: str, ndim: int) -> int:
  """PyTorch's dim 1 (the input axis of a kernel), in flax's layout."""
  return -2 if _is_kernel(name) else 1 - ndim


def round_kl(before: Any, after: Any) -> jax.Array:
  """sum_l KL(softmax(before_l) || softmax(after_l)), softmax along the
  axis PyTorch stores last (the release's `select_round`)."""
  total = jnp.float32(0.0)
  for name, b, a in zip(leaf_names(before), jax.tree.leaves(before),
                         jax.tree.leaves(after)):
    axis = _torch_last_axis(name, b.ndim)
    b = b.astype(jnp.float32)
    a = a.astype(jnp.float32)
    log_p = jax.nn.log_softmax(b, axis=axis)
    log_q = jax.nn.log_softmax(a, axis=axis)
    total = total + jnp.sum(jnp.exp(log_p) * (log_p - log_q))
  return total


def client_similarity(global_after: Any, client_models: Any) -> jax.Array:
  """float32[C]: the mean over weight tensors (ndim >= 2) of the mean
  cosine similarity, per output unit (and kernel position), between each
  client's model and the new global model along PyTorch's dim 1 (a
  kernel's input axis; the release's `select_client_in_round`)."""
  sims = []
  for name, g, c in zip(leaf_names(global_after),
                         jax.tree.leaves(global_after),
                         jax.tree.leaves(client_models)):
    if g.ndim < 2:
      continue
    axis = _torch_dim1(name, g.ndim)
    g = g.astype(jnp.float32)[None]
    c = c.astype(jnp.float32)
    dot = jnp.sum(g * c, axis=axis)
    norm = jnp.sqrt(jnp.sum(g * g, axis=axis) * jnp.sum(c * c, axis=axis))
    cos = dot / jnp.maximum(norm, 1e-8)
    sims.append(jnp.mean(cos.reshape(cos.shape[0], -1), axis=1))
  if not sims:
    return jnp.zeros(jax.tree.leaves(client_models)[0].shape[0], jnp.float32)
  return jnp.mean(jnp.stack(sims), axis=0)


def _top(values: jax.Array, mask: jax.Array, k: jax.Array) -> jax.Array:
  """bool: the k largest of values[mask] (ties: the lower index first)."""
  order = jnp.argsort(-jnp.where(mask, values, -jnp.inf), stable=True)
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
  return mask & (rank < k)


def crab(*, num_byzantine: int = 0, num_clients: int | None = None,
         forget: Any = None, unlearn_round: int = 0,
         select_round_ratio: float = 0.6, select_client_ratio: float = 0.7,
         alpha: float = 0.1, max_window: int = 10) -> Aggregator:
  """Crab forgetting the clients in `forget` at round `unlearn_round`.

  Args:
    num_byzantine: unused (the rule is told whom to forget).
    num_clients: K, the length of `forget` (client ids index it).
    forget: bool[K], the clients to forget.
    unlearn_round: R >= 2, the round the request arrives.
    select_round_ratio: P in (0, 1], the share of a window's rounds kept.
    select_client_ratio: X in (0, 1], the share of a round's arrivals kept.
    alpha: the relative loss drop in [0, 1) that closes a window.
    max_window: W >= 1, the longest window (static shapes).
  """
  forget = unlearning_request('crab', num_byzantine, num_clients, forget,
                              unlearn_round)
  for name, value in (('select_round_ratio', select_round_ratio),
                      ('select_client_ratio', select_client_ratio)):
    if not 0.0 < float(value) <= 1.0:
      raise setting('crab', name, f'must be in (0, 1], got {value!r}')
  if not 0.0 <= float(alpha) < 1.0:
    raise setting('crab', 'alpha', f'must be in [0, 1), got {alpha!r}')
  if not (isinstance(max_window, (int, np.integer)) and max_window >= 1):
    raise setting('crab', 'max_window', f'must be an int >= 1, got '
                  f'{max_window!r}')
  w_max = int(max_window)
  s_max = unlearn_round - 1          # at most every round t < R is kept
  p_round = float(select_round_ratio)
  x_client = float(select_client_ratio)

  def init(params):
    leaves = jax.tree.leaves(params)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return CrabState(
        round=jnp.int32(0), moved=zeros, win_len=jnp.int32(0),
        win_loss0=jnp.float32(jnp.nan),
        win_kl=jnp.zeros(w_max, jnp.float32),
        win_norms=jnp.zeros((w_max, len(leaves)), jnp.float32),
        win_models=jax.tree.map(
            lambda p: jnp.zeros((w_max,) + p.shape, jnp.float32), params),
        norms=jnp.zeros((s_max, len(leaves)), jnp.float32),
        kept_rounds=jnp.full(s_max, -1, jnp.int32), kept=jnp.int32(0),
        rollback=zeros, rollback_round=jnp.int32(-1))

  def window(state, now, mask, rem, updates, w, coverage, losses, params,
             plain):
    """Rounds t < R: rank this round's clients, add the round to the
    window, and close the window when its loss has dropped."""
    after = jax.tree.map(lambda p, u: p.astype(jnp.float32) +
                         u.astype(jnp.float32), params, plain)
    if coverage is not None:
      updates = jax.tree.map(lambda u, c: jnp.where(c > 0, u, 0.0),
                             updates, coverage)
    clients = jax.tree.map(
        lambda p, u: p.astype(jnp.float32)[None] + jnp.where(
            mask.reshape((-1,) + (1,) * p.ndim), u, 0.0).astype(jnp.float32),
        params, updates)
    sims = client_similarity(after, clients)
    arrived = jnp.sum(mask.astype(jnp.int32))
    chosen = _top(sims, mask, jnp.floor(arrived * x_client).astype(jnp.int32))
    sel = covered_weighted_mean(updates, w, chosen & rem, coverage)
    kl = round_kl(params, after)
    n_rem = jnp.sum(rem.astype(jnp.float32))
    loss = jnp.where(n_rem > 0, jnp.sum(jnp.where(rem, losses, 0.0)) /
                     jnp.maximum(n_rem, 1.0), jnp.nan)
    j = state.win_len
    loss0 = jnp.where(jnp.isfinite(state.win_loss0), state.win_loss0, loss)
    win_kl = state.win_kl.at[j].set(kl)
    win_norms = state.win_norms.at[j].set(leaf_norms(sel))
    need_model = state.rollback_round < 0
    win_models = jax.tree.map(
        lambda rows, m, s: rows.at[j].set(jnp.where(
            need_model, m + s.astype(jnp.float32), rows[j])),
        state.win_models, state.moved, sel)
    n = j + 1
    close = (((n >= 2) & (loss < loss0 * (1.0 - alpha))) |
             (now == unlearn_round - 1) | (n == w_max))
    # The window's kept rounds: floor(n P) of largest KL (all of n = 1).
    k_keep = jnp.where(n == 1, 1, jnp.floor(n * p_round).astype(jnp.int32))
    in_win = jnp.arange(w_max) < n
    keep = close & _top(win_kl, in_win, k_keep)
    slot = state.kept + jnp.cumsum(keep.astype(jnp.int32)) - 1
    slot = jnp.where(keep, slot, s_max)            # dropped
    start = now - j                                # round of window row 0
    norms = state.norms.at[slot].set(win_norms, mode='drop')
    kept_rounds = state.kept_rounds.at[slot].set(
        start + jnp.arange(w_max, dtype=jnp.int32), mode='drop')
    kept = state.kept + jnp.sum(keep.astype(jnp.int32))
    first = jnp.argmax(keep)                       # r0's row if any kept
    found = need_model & jnp.any(keep)
    rollback = jax.tree.map(lambda r, rows: jnp.where(found, rows[first], r),
                            state.rollback, win_models)
    rollback_round = jnp.where(found, start + first.astype(jnp.int32),
                               state.rollback_round)
    return state._replace(
        win_len=jnp.where(close, 0, n),
        win_loss0=jnp.where(close, jnp.float32(jnp.nan), loss0),
        win_kl=win_kl, win_norms=win_norms, win_models=win_models,
        norms=norms, kept_rounds=kept_rounds, kept=kept, rollback=rollback,
        rollback_round=rollback_round), jnp.sum(chosen.astype(jnp.float32))

  def aggregate(updates, mask, state, key, *, weights, ids, staleness,
                coverage=None, losses, params):
    del key
    mask = jnp.asarray(mask, bool)
    ids = jnp.asarray(ids, jnp.int32)
    tau = jnp.maximum(jnp.asarray(staleness, jnp.int32), 0)
    losses = jnp.asarray(losses, jnp.float32)
    now = state.round + 1
    gone = forget.at[ids].get(mode='fill', fill_value=True)
    rem = mask & ~gone
    w = jnp.asarray(weights, jnp.float32)
    k = now - unlearn_round                       # calibration step
    before = now < unlearn_round
    reset = now == unlearn_round
    calibrating = (k >= 1) & (k <= state.kept - 1)
    fresh = tau <= k - 1
    keep = jnp.where(before, mask, rem & fresh & ~reset)
    plain = covered_weighted_mean(updates, w, keep, coverage)
    state, chosen = jax.lax.cond(
        before,
        lambda s: window(s, now, mask, rem, updates, w, coverage, losses,
                         params, plain),
        lambda s: (s, jnp.float32(0.0)), state)
    step = calibrated(plain, state.norms[jnp.clip(k, 0, s_max - 1)])
    update = jax.tree.map(
        lambda p, c, m, r: jnp.where(
            reset, r - m, jnp.where(calibrating, c, p.astype(jnp.float32))),
        plain, step, state.moved, state.rollback)
    update = jax.tree.map(lambda u, p: u.astype(p.dtype), update, plain)
    moved = jax.tree.map(lambda m, u: m + u.astype(jnp.float32),
                         state.moved, update)
    new_state = state._replace(round=now, moved=moved)
    info = {'weights': jnp.where(keep, w, 0.0),
            'unlearned': reset.astype(jnp.float32),
            'calibrating': calibrating.astype(jnp.float32),
            'crab_kept_rounds': state.kept.astype(jnp.float32),
            'crab_rollback_round': state.rollback_round.astype(jnp.float32),
            'crab_selected_clients': chosen}
    return update, new_state, info

  return Aggregator(init, aggregate,
                    reads=('weights', 'ids', 'staleness', 'coverage',
                           'losses', 'params'))
