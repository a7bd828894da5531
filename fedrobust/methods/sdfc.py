"""SDFC: Self-Driven Fisher Calibration (the SDFC paper, Sec. 3.2).

After local training a client k with model w_k takes the diagonal Fisher on
its own data D_k and on the server's clean validation sample U (Eq. 7a/7b):

  H_k = |M_k(D_k) - M_k(U)|                                   (Eq. 8b)

FDReg (Eq. 9): the next time k trains, its loss is
  CE + lambda * sum_v H_{k,v} (w_v - w^{t-1}_{k,v})^2
with H_k from its previous participation and w^{t-1}_k its previous local
model, as in the paper and its reference code. A client that has not
participated before has no H_k yet: its penalty is zero (plain CE), so its
anchor does not matter; we anchor it on the global model it starts from.

FDAgg (Eq. 10): T_k = sum_v H_{k,v}; min-max normalised over the round's
real clients; alpha_k = sigmoid(-T^_k) / sum sigmoid(-T^). The server takes
w <- w + server_lr * sum_k alpha_k (w_k - w).

Per-client state (w^{t-1}_k, H_k, seen_k) lives in the method state as
leaves [K, ...] indexed by client id, so it is checkpointed with the
server state and survives resume.

Ablations: components in {both, fdreg, fdagg} (Table 3; without FDAgg the
weights are FedAvg's data sizes), importance in {fisher, abs_grad}
(Table 2), stiffness in {diff, local, validation} (Table 4: H = |M(D)-M(U)|,
M(D) or M(U)), fisher mode in {per_example, batch_mean_squared} (the
released code squares each batch's mean gradient).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedrobust.engine.local import (LocalConfig, classification_loss,
                                    make_batch_plan, poisoned_batch,
                                    train_steps)
from fedrobust.engine.round import Method
from fedrobust.methods.fisher import (FISHER_MODES, IMPORTANCES,
                                      fisher_diagonal)
from fedrobust.models import Model
from fedrobust.tree import (gather_clients, masked_weighted_mean,
                            scatter_clients, tree_sub)
from fedrobust.types import ClientOutput

COMPONENTS = ('both', 'fdreg', 'fdagg')
STIFFNESS = ('diff', 'local', 'validation')


class SDFCClientState(NamedTuple):
  """One client's memory; stacked as leaves [K, ...] in the method state."""
  prev_params: object   # w^{t-1}_k, the client's last local model
  stiffness: object     # H_k from its last participation
  seen: jax.Array       # bool[], participated before


def fdagg_weights(totals: jax.Array, mask: jax.Array) -> jax.Array:
  """Eq. 10: sigmoid(-minmax(T)) normalised over the real clients.

  Args:
    totals: float[C], T_k = sum_v H_{k,v}.
    mask: bool[C].

  Returns:
    float[C] summing to 1 over the mask (0 on masked slots). If all T_k are
    equal, T^ = 0 for everyone and the weights are uniform.
  """
  finite = mask & jnp.isfinite(totals)
  lo = jnp.min(jnp.where(finite, totals, jnp.inf))
  hi = jnp.max(jnp.where(finite, totals, -jnp.inf))
  span = hi - lo
  normed = jnp.where(span > 0, (totals - lo) / jnp.where(span > 0, span, 1.0),
                     0.0)
  score = jnp.where(finite, jax.nn.sigmoid(-normed), 0.0)
  return score / jnp.maximum(jnp.sum(score), 1e-12)


def sdfc(*, model: Model, local: LocalConfig,
         optimizer: optax.GradientTransformation, server_lr: float = 1.0,
         lam: float = 5.0, components: str = 'both',
         importance: str = 'fisher', stiffness: str = 'diff',
         fisher_mode: str = 'per_example', poison=None, aggregator=None,
         proximal_mu: float = 0.0) -> Method:
  """Builds SDFC. server_data must be the batched validation set U:
  (x uint8[T, B, ...], y int32[T, B], mask bool[T, B]).

  Args:
    model: the architecture.
    local: static local-training settings.
    optimizer: client optimizer (fresh state each round).
    server_lr: server step on the aggregated delta.
    lam: lambda of Eq. 9 (paper 5, released config 1).
    components: 'both', 'fdreg' or 'fdagg'.
    importance: 'fisher' or 'abs_grad'.
    stiffness: 'diff', 'local' or 'validation'.
    fisher_mode: 'per_example' or 'batch_mean_squared'.
    poison: data poison of malicious clients (also used for their Fisher on
      D_k: a malicious client's local data is its poisoned data).
    aggregator: must be None; SDFC aggregates by Eq. 10.
    proximal_mu: must be 0.

  Returns:
    A Method.
  """
  if components not in COMPONENTS:
    raise ValueError(f'--sdfc_components={components!r}; expected one of '
                     f'{COMPONENTS}')
  if stiffness not in STIFFNESS:
    raise ValueError(f'--sdfc_stiffness={stiffness!r}; expected one of '
                     f'{STIFFNESS}')
  if importance not in IMPORTANCES or fisher_mode not in FISHER_MODES:
    raise ValueError(f'--sdfc_importance must be in {IMPORTANCES} and '
                     f'--sdfc_fisher in {FISHER_MODES}')
  if lam < 0:
    raise ValueError(f'--sdfc_lambda must be >= 0, got {lam}')
  if aggregator is not None:
    raise ValueError('--method=sdfc aggregates by Fisher discrepancy '
                     '(Eq. 10); leave --aggregator=weighted_mean')
  if proximal_mu:
    raise ValueError('--fedprox_mu is not used by --method=sdfc')
  use_reg = components in ('both', 'fdreg') and lam > 0
  use_agg = components in ('both', 'fdagg')
  base_loss = classification_loss(model.apply)

  def init(params, num_clients, key):
    del key
    stack = lambda t: jax.tree.map(
        lambda p: jnp.zeros((num_clients, *p.shape), p.dtype), t)
    return SDFCClientState(prev_params=stack(params),
                           stiffness=stack(params),
                           seen=jnp.zeros((num_clients,), bool))

  def client_state(method_state, ids):
    return gather_clients(method_state, ids)

  def client_update(params, state, data, key, server_data):
    val_x, val_y, val_mask = server_data
    anchor = jax.tree.map(lambda a, g: jnp.where(state.seen, a, g),
                          state.prev_params, params)
    reg = jax.tree.map(lambda h: jnp.where(state.seen, h, 0.0),
                       state.stiffness)

    def loss_fn(p, x, y, mask, k):
      loss, aux = base_loss(p, x, y, mask, k)
      if use_reg:
        penalty = sum(jnp.sum(h * jnp.square(w - a)) for h, w, a in zip(
            jax.tree.leaves(reg), jax.tree.leaves(p),
            jax.tree.leaves(anchor)))
        loss = loss + lam * penalty
        aux = dict(aux, fdreg_penalty=penalty)
      return loss, aux

    plan_key, train_key = jax.random.split(key)
    plan = make_batch_plan(plan_key, data.count, config=local)
    new_params, metrics = train_steps(loss_fn, params, data, plan, train_key,
                                      optimizer=optimizer, config=local,
                                      poison=poison)
    # Fisher on the client's (possibly poisoned) data, one pass in order.
    b, p = local.batch_size, local.steps_per_epoch
    rows = jnp.arange(p * b, dtype=jnp.int32).reshape(p, b)
    xs, ys = jax.vmap(lambda r: poisoned_batch(data, r, poison))(rows)
    fisher = lambda x, y, m: fisher_diagonal(
        model.apply, new_params, x, y, m, importance=importance,
        mode=fisher_mode)
    m_local = fisher(xs, ys, rows < data.count)
    m_val = fisher(val_x, val_y, val_mask)
    h = {'diff': lambda: jax.tree.map(lambda a, v: jnp.abs(a - v), m_local,
                                      m_val),
         'local': lambda: m_local, 'validation': lambda: m_val}[stiffness]()
    total = sum(jnp.sum(leaf) for leaf in jax.tree.leaves(h))
    metrics = dict(metrics, fisher_discrepancy=total)
    return ClientOutput(
        delta=tree_sub(new_params, params),
        weight=data.count.astype(jnp.float32),
        client_state=SDFCClientState(new_params, h, jnp.bool_(True)),
        metrics=metrics)

  def server_update(state, ids, outputs, mask, key, server_data):
    del key, server_data
    if use_agg:
      totals = sum(jnp.sum(leaf.reshape(leaf.shape[0], -1), axis=1)
                   for leaf in jax.tree.leaves(outputs.client_state.stiffness))
      weights = fdagg_weights(totals, mask)
    else:
      w = jnp.where(mask, outputs.weight, 0.0)
      weights = w / jnp.maximum(jnp.sum(w), 1e-12)
    update = masked_weighted_mean(outputs.delta, weights, mask)
    params = jax.tree.map(lambda w, d: w + server_lr * d, state.params,
                          update)
    method_state = scatter_clients(state.method_state, ids,
                                   outputs.client_state, mask)
    return params, method_state, {'weights': weights}

  return Method('sdfc', init, client_state, client_update, server_update)
