"""FoolsGold (Fung, Yoon, Beschastnikh, RAID 2020): sybil-aware weights.

Sybils that pursue the same poisoning goal send similar updates round after
round; honest clients with different data do not. FoolsGold keeps the sum
of each client's past updates H_i = sum_t Delta_i^t and weights clients by
how unlike everyone else their history is (Algorithm 1):

  cs_ij  = cos(H_i, H_j)  (i != j),   v_i = max_j cs_ij
  pardoning: cs_ij <- cs_ij * v_i / v_j   if v_i < v_j
  alpha_i = 1 - max_j cs_ij,  clipped to [0, 1]
  alpha_i <- alpha_i / max_j alpha_j,  alpha_i = 0.99 where it is 1
  alpha_i <- kappa (ln(alpha_i / (1 - alpha_i)) + 0.5),  clipped to [0, 1]
  update = sum_i alpha_i Delta_i / sum_i alpha_i

Slot-indexed history: the aggregate API carries no client ids, so H is
indexed by slot position c in [0, C). This is only meaningful when slot c
holds the same client every round, i.e. full participation with a stable
client order (the SDFC setting: every client takes part every round and the
engine sorts ids). With partial participation the history of a slot mixes
clients and the weights are meaningless.

Robustness notes:
  * A non-finite update (NaN / Inf) gets weight 0 and is not added to its
    slot's history; a masked slot keeps its history unchanged.
  * Cosines are computed from overflow-safe unit vectors.
  * Cannot guarantee: bounded magnitude. A single attacker with a unique
    direction gets weight ~1 (FoolsGold targets sybils, not lone Byzantine
    clients), so a finite 1e30 update passes into the weighted mean.
    Honest clients with very similar data (IID) are also down-weighted,
    and if every history is identical all weights are 0 (zero update).

References:
  C. Fung, C. J. M. Yoon, I. Beschastnikh. "The Limitations of Federated
  Learning in Sybil Settings." RAID 2020, Algorithm 1 (earlier version:
  "Mitigating Sybils in Federated Learning Poisoning", arXiv 1808.04866).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.aggregators.base import Aggregator
from fedrobust.aggregators.mean import setting
from fedrobust.aggregators.finetune import (finite_clients, first_client,
                                            ravel_one, select_rows,
                                            unit_rows)
from fedrobust.tree import ravel_clients, unravel_like


class FoolsGoldState(NamedTuple):
  history: jax.Array   # float32[C, D], sum of each slot's past updates


def foolsgold_weights(history: jax.Array, valid: jax.Array, *,
                      kappa: float) -> jax.Array:
  """alpha float32[C] from histories float[C, D] (Algorithm 1, lines 5-21).

  Only slots where `valid` take part; the others get 0 and never change
  another client's weight.
  """
  c = history.shape[0]
  unit = unit_rows(history)
  cs = jnp.matmul(unit, unit.T, precision='highest')             # [C, C]
  pair = valid[:, None] & valid[None, :] & ~jnp.eye(c, dtype=bool)
  cs = jnp.where(pair, cs, -jnp.inf)
  v = jnp.max(cs, axis=1)                                        # -inf: alone
  # Pardoning: honest clients that merely resemble a sybil are lifted.
  v_i, v_j = v[:, None], v[None, :]
  pardon = pair & (v_i < v_j) & (v_j > 0)
  cs = jnp.where(pardon, cs * v_i / jnp.where(pardon, v_j, 1.0), cs)
  alpha = jnp.clip(1.0 - jnp.max(cs, axis=1), 0.0, 1.0)          # inf -> 1
  alpha = jnp.where(valid, alpha, 0.0)
  top = jnp.max(alpha)
  alpha = jnp.where(top > 0, alpha / jnp.where(top > 0, top, 1.0), 0.0)
  alpha = jnp.where(alpha >= 1.0, 0.99, alpha)
  positive = alpha > 0
  safe = jnp.where(positive, alpha, 0.5)
  logit = kappa * (jnp.log(safe / (1.0 - safe)) + 0.5)
  return jnp.where(positive & valid, jnp.clip(logit, 0.0, 1.0), 0.0)


def foolsgold(*, num_byzantine: int, num_clients: int | None = None,
              kappa: float = 1.0, by_client_id: bool = False) -> Aggregator:
  """FoolsGold aggregation with slot- or client-indexed history.

  With by_client_id (the registry's 'foolsgold_ids') the history has one
  row per client id in [0, num_clients) and the rule reads `ids`: a
  client's row gathers its updates whenever it arrives, so it runs with
  partial participation and client delays (FedHAN's asynchronous
  setting). The weights are Algorithm 1 over the arriving clients'
  histories.

  Args:
    num_byzantine: unused (FoolsGold needs no f).
    num_clients: C, the number of slots the aggregator will see (with
      by_client_id: N, the number of client ids; required). Give it:
      with None the history is created on the first aggregate call, so the
      state changes shape once (one extra trace, and it cannot be carried
      through lax.scan before that first call).
    kappa: confidence of the logit (the paper's kappa = 1).
    by_client_id: index the history by client id (reads `ids`).

  Returns:
    Aggregator with state FoolsGoldState. info: 'weights' float32[C] (the
    normalised alpha), 'alpha' float32[C].
  """
  del num_byzantine
  if num_clients is not None and num_clients < 1:
    raise setting('foolsgold', 'num_clients', f'must be >= 1, got '
                  f'{num_clients}')
  if kappa <= 0:
    raise setting('foolsgold', 'kappa', f'must be > 0, got {kappa}')
  if by_client_id and num_clients is None:
    raise setting('foolsgold_ids', 'num_clients', 'is required (one '
                  'history row per client id)')

  def init(params):
    d = ravel_one(params).shape[0]
    return FoolsGoldState(jnp.zeros((num_clients or 0, d), jnp.float32))

  def by_id(updates, mask, state, key, *, ids):
    del key
    flat = ravel_clients(updates).astype(jnp.float32)
    valid = finite_clients(flat, mask)
    clean = select_rows(flat, valid)
    rows = jnp.where(valid, jnp.asarray(ids, jnp.int32), num_clients)
    history = state.history.at[rows].add(clean, mode='drop')
    mine = history.at[rows].get(mode='fill', fill_value=0.0)
    return combine(updates, clean, valid, mine, FoolsGoldState(history))

  def combine(updates, clean, valid, mine, new_state):
    alpha = foolsgold_weights(mine, valid, kappa=kappa)
    total = jnp.sum(alpha)
    weights = jnp.where(total > 0, alpha / jnp.where(total > 0, total, 1.0),
                        0.0)
    agg = jnp.einsum('c,cd->d', weights, clean, precision='highest')
    update = unravel_like(agg, first_client(updates))
    info = {'weights': weights.astype(jnp.float32),
            'alpha': alpha.astype(jnp.float32)}
    return update, new_state, info

  def aggregate(updates, mask, state, key):
    del key
    flat = ravel_clients(updates).astype(jnp.float32)
    c, d = flat.shape
    history = state.history
    if history.shape[0] == 0:      # num_clients=None: first call sizes it
      history = jnp.zeros((c, d), jnp.float32)
    if history.shape != (c, d):
      raise setting('foolsgold', 'num_clients', f'state holds '
                    f'{history.shape[0]} slots, the round has {c}; pass '
                    f'num_clients={c}')
    valid = finite_clients(flat, mask)
    clean = select_rows(flat, valid)
    history = history + clean        # invalid / masked rows add 0
    return combine(updates, clean, valid, history, FoolsGoldState(history))

  if by_client_id:
    return Aggregator(init, by_id, reads=('ids',))
  return Aggregator(init, aggregate)
