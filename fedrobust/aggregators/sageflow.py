"""Sageflow (Park et al., NeurIPS 2021): entropy filter + loss weighting.

The server evaluates every received model w_i = w_t + Delta_i on its small
public set U = {(x_v, y_v)}:

  E_i = (1/V) sum_v H(softmax(f(x_v; w_i)))      average prediction entropy
  l_i = (1/V) sum_v CE(f(x_v; w_i), y_v)         public loss

Entropy-based filtering drops the models with E_i > E_th (poisoned or
diverged models are uncertain on clean data); loss-weighted averaging
combines the rest with weights proportional to 1 / l_i^delta:

  w_{t+1} = sum_{i: E_i <= E_th} beta_i w_i,
  beta_i  = l_i^-delta / sum_j l_j^-delta

so the returned update is sum_i beta_i Delta_i (zero if every model is
filtered out). Sageflow's staleness-aware grouping concerns asynchronous
stragglers and does not apply to one synchronous round; the clients' data
sizes m_i in the paper's weights are taken equal (the API carries none).

Robustness notes:
  * A non-finite update, or a model whose entropy or loss is non-finite,
    is excluded. Losses are floored at 1e-6 before the power.
  * Cannot guarantee: bounded magnitude. A finite 1e30 model is confident
    (low entropy) and passes the filter; its huge loss only shrinks its
    weight (beta ~ 1/l), so it still moves the average by about
    ||Delta|| / l. Backdoored models that stay accurate and confident on
    clean data also pass (SDFC Sec. 3.3 makes this point).

Default E_th = 1.0 nats: about 43% of the maximum entropy ln 10 = 2.30 of a
10-class model (the paper tunes E_th per dataset). It is an absolute value,
so it must be re-chosen for another number of classes (with 3 classes the
maximum is ln 3 = 1.10).

References:
  J. Park, D.-J. Han, M. Choi, J. Moon. "Sageflow: Robust Federated
  Learning against Both Stragglers and Adversaries." NeurIPS 2021, Sec. 3
  (entropy-based filtering, loss-weighted averaging).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedrobust.aggregators.base import Aggregator
from fedrobust.aggregators.finetune import (ApplyFn, check_server_data,
                                            client_models, finite_clients,
                                            select_rows)
from fedrobust.tree import ravel_clients, tree_add, unravel_like

Params = Any


class SageflowState(NamedTuple):
  params: Params   # the current global model w_t (one client's shapes)


def sageflow(*, num_byzantine: int, server_data: Any, apply_fn: ApplyFn,
             entropy_threshold: float = 1.0, delta: float = 1.0
             ) -> Aggregator:
  """Sageflow aggregation (one synchronous group).

  The whole of U is evaluated for every client in one vmapped pass, so
  memory grows with C * V * (activation size); keep U small (it is meant
  to be: the paper uses 2% of the data or less).

  Args:
    num_byzantine: unused (Sageflow needs no f).
    server_data: (x uint8[V, H, W, Ch], y int32[V]), the public set U.
    apply_fn: the model's apply function.
    entropy_threshold: E_th in nats; models with E_i > E_th are dropped.
    delta: exponent of the loss weighting (>= 0; 0 gives a plain mean of
      the models that pass the filter).

  Returns:
    Aggregator with state SageflowState. info: 'weights' float32[C]
    (beta_i, 0 when filtered), 'entropy' and 'loss' float32[C] (0 on
    masked slots).
  """
  del num_byzantine
  x, y = check_server_data(server_data, 'sageflow')
  if apply_fn is None:
    raise ValueError('sageflow: needs apply_fn')
  if entropy_threshold <= 0:
    raise ValueError(f'sageflow: entropy_threshold must be > 0, got '
                     f'{entropy_threshold}')
  if delta < 0:
    raise ValueError(f'sageflow: delta must be >= 0, got {delta}')
  images = x      # Model.apply preprocesses the stored images

  def evaluate(model):
    logp = jax.nn.log_softmax(apply_fn(model, images).astype(jnp.float32))
    entropy = jnp.mean(-jnp.sum(jnp.exp(logp) * logp, axis=-1))
    loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logp, y))
    return entropy, loss

  def init(params):
    return SageflowState(params=params)

  def aggregate(updates, mask, state, key):
    del key
    params = state.params
    flat = ravel_clients(updates).astype(jnp.float32)
    valid = finite_clients(flat, mask)
    models = client_models(params, updates, valid)
    entropy, loss = jax.vmap(evaluate)(models)
    ok = (valid & jnp.isfinite(entropy) & jnp.isfinite(loss) &
          (entropy <= entropy_threshold))
    raw = jnp.where(ok, jnp.maximum(jnp.where(ok, loss, 1.0), 1e-6)
                    ** (-delta), 0.0)
    total = jnp.sum(raw)
    weights = jnp.where(total > 0, raw / jnp.where(total > 0, total, 1.0),
                        0.0)
    agg = jnp.einsum('c,cd->d', weights, select_rows(flat, ok),
                     precision='highest')
    update = unravel_like(agg, params)
    info = {'weights': weights.astype(jnp.float32),
            'entropy': jnp.where(valid, entropy, 0.0).astype(jnp.float32),
            'loss': jnp.where(valid, loss, 0.0).astype(jnp.float32)}
    return update, SageflowState(tree_add(params, update)), info

  return Aggregator(init, aggregate)
