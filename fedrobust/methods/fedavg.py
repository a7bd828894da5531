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
from fedrobust.engine.round import Method
from fedrobust.models import Model
from fedrobust.tree import masked_weighted_mean, tree_sq_norm, tree_sub
from fedrobust.types import ClientOutput


def local_sgd_update(model: Model, *, local: LocalConfig,
                     optimizer: optax.GradientTransformation,
                     proximal_mu: float = 0.0):
  """client_update for methods whose client runs plain (proximal) SGD."""
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
                                      optimizer=optimizer, config=local)
    return ClientOutput(delta=tree_sub(new_params, params),
                        weight=data.count.astype(jnp.float32),
                        client_state=client_state, metrics=metrics)

  return client_update


def no_client_state(method_state, ids):
  del method_state, ids
  return ()


def fedavg(*, model: Model, local: LocalConfig,
           optimizer: optax.GradientTransformation, server_lr: float = 1.0,
           proximal_mu: float = 0.0) -> Method:
  """FedAvg (proximal_mu == 0) or FedProx (proximal_mu > 0).

  Args:
    model: the shared architecture.
    local: static local-training settings.
    optimizer: the client optimizer (fresh state every round).
    server_lr: eta, the server step on the averaged delta.
    proximal_mu: FedProx's mu; 0 gives FedAvg.

  Returns:
    A Method.
  """
  if proximal_mu < 0:
    raise ValueError(f'--fedprox_mu must be >= 0, got {proximal_mu}')

  def init(params, num_clients, key):
    del params, num_clients, key
    return ()

  def server_update(state, ids, outputs, mask, key, server_data):
    del ids, key, server_data
    mean_delta = masked_weighted_mean(outputs.delta, outputs.weight, mask)
    params = jax.tree.map(lambda w, d: w + server_lr * d, state.params,
                          mean_delta)
    return params, state.method_state, {}

  name = 'fedprox' if proximal_mu else 'fedavg'
  return Method(name, init, no_client_state,
                local_sgd_update(model, local=local, optimizer=optimizer,
                                 proximal_mu=proximal_mu),
                server_update)
