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
  update = sum_i alpha_i Delta_i / n

The similarities are taken over the output layer's weights only (the
history keeps just those coordinates), as the authors' deep-fg code and
FLPoison do: a backdoor's sybils agree most where the target class is
decided, and the rest of the update is dominated by local-training noise.
The references apply the unnormalised sum_i alpha_i Delta_i (a FedSGD
step); dividing by the n real clients keeps FedAvg's scale. Both choices,
and this library's earlier ones (the whole update; division by sum_i
alpha_i), are settings: `features`, `normalize` (BUILD_NOTES §3g).

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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.aggregators.base import Aggregator
from fedrobust.aggregators.mean import setting
from fedrobust.aggregators.finetune import (finite_clients, first_client,
                                            ravel_one, select_rows,
                                            unit_rows)
from fedrobust.tree import leaf_names, ravel_clients, unravel_like


Params = Any


class FoolsGoldState(NamedTuple):
  history: jax.Array   # float32[C, D], sum of each slot's past updates


def foolsgold_weights(history: jax.Array, valid: jax.Array, *,
                      kappa: float, epsilon: float = 1e-5) -> jax.Array:
  """alpha float32[C] from histories float[C, D] (Algorithm 1, lines 5-21).

  Only slots where `valid` take part; the others get 0 and never change
  another client's weight. epsilon enters as in the authors' deep-fg code:
  v_i = max_j cs_ij + epsilon in the pardoning, and
  kappa (ln(alpha / (1 - alpha) + epsilon) + 0.5) in the logit.
  """
  c = history.shape[0]
  unit = unit_rows(history)
  cs = jnp.matmul(unit, unit.T, precision='highest')             # [C, C]
  pair = valid[:, None] & valid[None, :] & ~jnp.eye(c, dtype=bool)
  cs = jnp.where(pair, cs, -jnp.inf)
  v = jnp.max(cs, axis=1) + epsilon                              # -inf: alone
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
  logit = kappa * (jnp.log(safe / (1.0 - safe) + epsilon) + 0.5)
  return jnp.where(positive & valid, jnp.clip(logit, 0.0, 1.0), 0.0)


FEATURES = ('output', 'all')
NORMALIZATIONS = ('clients', 'sum', 'none')


def feature_index(tree: Params, output_path: str | None) -> np.ndarray | None:
  """Positions, in ravel order, of the output layer's weights in ONE
  client's tree: every leaf under module `output_path` ('/'-joined) but
  its bias (a LoRA tree: the module's factors). None: the module of the
  last 'kernel' leaf. Returns None when no such leaf exists (then every
  coordinate is a feature)."""
  leaves = jax.tree.leaves(tree)
  names = leaf_names(tree)
  if output_path is None:
    kernels = [n for n in names if n.rsplit('/', 1)[-1] == 'kernel']
    if not kernels:
      return None
    output_path = kernels[-1].rsplit('/', 1)[0]
  out, offset = [], 0
  for name, leaf in zip(names, leaves):
    size = int(np.prod(leaf.shape))
    module, _, last = name.rpartition('/')
    if module == output_path and last != 'bias':
      out.append(np.arange(offset, offset + size))
    offset += size
  return np.concatenate(out) if out else None


def foolsgold(*, num_byzantine: int, num_clients: int | None = None,
              kappa: float = 1.0, by_client_id: bool = False,
              features: str = 'output', output_path: str | None = None,
              normalize: str = 'clients',
              epsilon: float = 1e-5) -> Aggregator:
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
    features: which coordinates the similarities are taken over: 'output'
      (the default: the output layer's weights, as the authors' deep-fg
      code, which passes the last layer's indices as sig_features_idx,
      and FLPoison, which keeps top-k indicative features of that layer)
      or 'all' (the whole flattened update; this library's earlier
      choice).
    output_path: the output layer's module path (the runner passes the
      model's 'head' role); None: the module of the last 'kernel' leaf.
    normalize: how the weighted sum is scaled: 'clients' (the default,
      sum_i alpha_i Delta_i / n over the n real clients: the references'
      unnormalised weights on FedAvg's scale, so a down-weighted client's
      share is dropped, not handed to the others), 'sum' (divided by
      sum_i alpha_i; this library's earlier choice) or 'none' (deep-fg's
      and FLPoison's literal sum_i alpha_i Delta_i, n times a mean step).
    epsilon: the references' epsilon (deep-fg 1e-5, FLPoison 1e-6).

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
  name = 'foolsgold_ids' if by_client_id else 'foolsgold'
  if features not in FEATURES:
    raise setting(name, 'features', f'must be one of {FEATURES}, got '
                  f'{features!r}')
  if normalize not in NORMALIZATIONS:
    raise setting(name, 'normalize', f'must be one of {NORMALIZATIONS}, got '
                  f'{normalize!r}')
  if not 0 <= epsilon < 1:
    raise setting(name, 'epsilon', f'must be in [0, 1), got {epsilon}')

  def picked(one):
    """The feature positions of ONE client's tree (None: all)."""
    return feature_index(one, output_path) if features == 'output' else None

  def feats(flat, one):
    index = picked(one)
    return flat if index is None else flat[:, index]

  def init(params):
    index = picked(params)
    d = ravel_one(params).shape[0] if index is None else len(index)
    return FoolsGoldState(jnp.zeros((num_clients or 0, d), jnp.float32))

  def by_id(updates, mask, state, key, *, ids):
    del key
    flat = ravel_clients(updates).astype(jnp.float32)
    valid = finite_clients(flat, mask)
    clean = select_rows(flat, valid)
    rows = jnp.where(valid, jnp.asarray(ids, jnp.int32), num_clients)
    history = state.history.at[rows].add(feats(clean, first_client(updates)),
                                         mode='drop')
    mine = history.at[rows].get(mode='fill', fill_value=0.0)
    return combine(updates, mask, clean, valid, mine,
                   FoolsGoldState(history))

  def combine(updates, mask, clean, valid, mine, new_state):
    alpha = foolsgold_weights(mine, valid, kappa=kappa, epsilon=epsilon)
    if normalize == 'sum':
      total = jnp.sum(alpha)
    elif normalize == 'clients':
      total = jnp.sum(mask).astype(jnp.float32)
    else:
      total = jnp.float32(1.0)
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
    one = first_client(updates)
    index = picked(one)
    width = d if index is None else len(index)
    if history.shape[0] == 0:      # num_clients=None: first call sizes it
      history = jnp.zeros((c, width), jnp.float32)
    if history.shape != (c, width):
      raise setting('foolsgold', 'num_clients', f'state holds '
                    f'{history.shape[0]} slots, the round has {c}; pass '
                    f'num_clients={c}')
    valid = finite_clients(flat, mask)
    clean = select_rows(flat, valid)
    history = history + feats(clean, one)   # invalid / masked rows add 0
    return combine(updates, mask, clean, valid, history,
                   FoolsGoldState(history))

  if by_client_id:
    return Aggregator(init, by_id, reads=('ids',))
  return Aggregator(init, aggregate)
