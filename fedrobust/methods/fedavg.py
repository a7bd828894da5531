"""FedAvg (McMahan et al. 2017) and FedProx (Li et al. 2020).

Client: S masked SGD steps from the global model w (FedProx adds
mu/2 ||v - w||^2 to the local loss). Server: w <- w + eta * sum_c n_c
delta_c / sum_c n_c over the round's real clients, n_c the client's
example count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedrobust.engine.local import (LocalConfig, classification_loss,
                                    make_batch_plan, train_steps)
from fedrobust.aggregators.base import Aggregator
from fedrobust.engine.round import Method
from fedrobust.models import Model
from fedrobust.tree import masked_weighted_mean, tree_sq_norm, tree_sub
from fedrobust.types import ClientOutput


def local_sgd_update(model: Model, *, local: LocalConfig,
                     optimizer: optax.GradientTransformation,
                     proximal_mu: float = 0.0, poison=None):
  """client_update for methods whose client runs plain (proximal) SGD.

  `poison` (attacks.data_poisoning.DataPoison) poisons the batches of
  clients whose LocalData.is_malicious is set.
  """
  base_loss = classification_loss(model.apply)

  def client_update(params, client_state, data, key, server_data):
    del server_data
    plan_key, train_key = jax.random.split(key)
    plan = make_batch_plan(plan_key, data.count, config=local)

    def loss_fn(p, x, y, mask, k):
      loss, aux = base_loss(p, x, y, mask, k)
      if proximal_mu:
        loss = loss + 0.5 * proximal_mu * tree_sq_norm(tree_sub(p, params))
      return loss, aux

    new_params, metrics = train_steps(loss_fn, params, data, plan, train_key,
                                      optimizer=optimizer, config=local,
                                      poison=poison)
    return ClientOutput(delta=tree_sub(new_params, params),
                        weight=data.count.astype(jnp.float32),
                        client_state=client_state, metrics=metrics)

  return client_update


def no_client_state(method_state, ids):
  del method_state, ids
  return ()


def fedavg(*, model: Model, local: LocalConfig,
           optimizer: optax.GradientTransformation, server_lr: float = 1.0,
           proximal_mu: float = 0.0, aggregator: Aggregator | None = None,
           poison=None) -> Method:
  """FedAvg (proximal_mu == 0) or FedProx (proximal_mu > 0).

  With an `aggregator` the server replaces the size-weighted mean by that
  robust rule (unweighted, as the rules are defined); its state is the
  method state.

  Args:
    model: the shared architecture.
    local: static local-training settings.
    optimizer: the client optimizer (fresh state every round).
    server_lr: eta, the server step on the averaged delta.
    proximal_mu: FedProx's mu; 0 gives FedAvg.
    aggregator: optional robust aggregation rule (aggregators.AGGREGATORS).
    poison: optional data poison for malicious clients.

  Returns:
    A Method.
  """
  if proximal_mu < 0:
    raise ValueError(f'--fedprox_mu must be >= 0, got {proximal_mu}')

  def init(params, num_clients, key):
    del num_clients, key
    return aggregator.init(params) if aggregator is not None else ()

  def server_update(state, ids, outputs, mask, key, server_data):
    del ids, server_data
    if aggregator is None:
      update = masked_weighted_mean(outputs.delta, outputs.weight, mask)
      agg_state = state.method_state
      info = {'weights': jnp.where(mask, outputs.weight, 0.0)}
    else:
      update, agg_state, info = aggregator.aggregate(
          outputs.delta, mask, state.method_state, key)
    params = jax.tree.map(lambda w, d: w + server_lr * d, state.params,
                          update)
    return params, agg_state, info

  name = 'fedprox' if proximal_mu else 'fedavg'
  return Method(name, init, no_client_state,
                local_sgd_update(model, local=local, optimizer=optimizer,
                                 proximal_mu=proximal_mu, poison=poison),
                server_update)
