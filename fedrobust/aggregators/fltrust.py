"""FLTrust (Cao et al., NDSS 2021): trust bootstrapping from root data.

The server holds a small clean root set U and, every round, computes its
own update g_0 from the current global model w_t exactly as a client would
(S SGD steps on U). Each client update g_i is scored and rescaled:

  TS_i = ReLU(cos(g_i, g_0))                 trust score
  g^_i = (||g_0|| / ||g_i||) g_i              magnitude normalisation
  g    = sum_i TS_i g^_i / sum_j TS_j         aggregate

and g is the returned update (zero when every TS_i is 0; the server applies
w_{t+1} = w_t + g, i.e. the paper's global learning rate is 1 here).

Robustness notes:
  * A non-finite client gets TS = 0. Norms and cosines are overflow safe,
    so a 1e30 client is just rescaled to ||g_0||.
  * Whatever a client sends, ||g|| <= ||g_0||: the damage per round is
    bounded by the server's own step.
  * Cannot guarantee: a correct direction when U is unrepresentative of
    the task (non-IID root data) or when attackers craft updates with
    positive cosine to g_0 (adaptive attacks in the paper's Sec. VI);
    backdoor updates that stay close to g_0 in direction pass.

References:
  X. Cao, M. Fang, J. Liu, N. Z. Gong. "FLTrust: Byzantine-robust Federated
  Learning via Trust Bootstrapping." NDSS 2021, Sec. IV, Algorithm 1-2.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.aggregators.base import Aggregator
from fedrobust.aggregators.finetune import (ApplyFn, finite_clients,
                                            make_server_sgd, ravel_one,
                                            safe_norm, select_rows,
                                            unit_rows)
from fedrobust.tree import ravel_clients, tree_add, unravel_like

Params = Any


class FLTrustState(NamedTuple):
  params: Params   # the current global model w_t (one client's shapes)


def fltrust(*, num_byzantine: int, server_data: Any, apply_fn: ApplyFn,
            server_lr: float = 0.01, server_steps: int = 1,
            server_batch_size: int = 32,
            server_momentum: float = 0.0) -> Aggregator:
  """FLTrust aggregation.

  Args:
    num_byzantine: unused (FLTrust needs no f).
    server_data: (x uint8[V, H, W, Ch], y int32[V]), the root set U
      (the paper uses |U| = 100).
    apply_fn: the model's apply function.
    server_lr: SGD step size of the server's update (the clients' lr in
      the paper).
    server_steps: S, local iterations on U (the paper's default R = 1).
    server_batch_size: B.
    server_momentum: SGD momentum of the server's training (0: plain SGD).

  Returns:
    Aggregator with state FLTrustState. info: 'weights' float32[C] (the
    normalised trust scores TS_i / sum TS), 'trust' float32[C] (TS_i).
  """
  del num_byzantine
  train = make_server_sgd(server_data, apply_fn, rule='fltrust',
                          learning_rate=server_lr, steps=server_steps,
                          batch_size=server_batch_size,
                          momentum=server_momentum)

  def init(params):
    return FLTrustState(params=params)

  def aggregate(updates, mask, state, key):
    params = state.params
    g0 = ravel_one(train(params, key)) - ravel_one(params)
    g0 = jnp.where(jnp.all(jnp.isfinite(g0)), g0, 0.0)
    flat = ravel_clients(updates).astype(jnp.float32)
    valid = finite_clients(flat, mask)
    unit = unit_rows(select_rows(flat, valid))                  # [C, D]
    unit0 = unit_rows(g0[None])[0]                               # [D]
    cos = jnp.einsum('cd,d->c', unit, unit0, precision='highest')
    trust = jnp.where(valid, jax.nn.relu(cos), 0.0)
    total = jnp.sum(trust)
    weights = jnp.where(total > 0, trust / jnp.where(total > 0, total, 1.0),
                        0.0)
    # sum_i w_i g^_i with g^_i = ||g0|| * unit_i.
    agg = safe_norm(g0) * jnp.einsum('c,cd->d', weights, unit,
                                     precision='highest')
    update = unravel_like(agg, params)
    info = {'weights': weights.astype(jnp.float32),
            'trust': trust.astype(jnp.float32)}
    return update, FLTrustState(tree_add(params, update)), info

  return Aggregator(init, aggregate)
