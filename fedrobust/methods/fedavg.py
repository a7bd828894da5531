"""FedAvg (McMahan et al. 2017) and FedProx (Li et al. 2020) over cohorts.

Client: S masked SGD steps on its cohort transform's trainable tree (the
full model, LoRA factors, or a width-sliced submodel), starting from the
broadcast; FedProx adds mu/2 ||v - w||^2 to the local loss. Server: the
aggregator (by default the weighted mean w <- w + eta * sum_c n_c delta_c /
sum_c n_c over the round's real clients, n_c the client's example count)
and the server step.

Several cohorts (different architectures): each cohort averages its own
trainable tree; the subtrees of the `share` roles (default: the 'head',
the classifier) are aggregated across all cohorts after zero-padding to a
common shape (see fedrobust.cohort), which is how CNN and LSTM clients
learn together. Settings: FedProx's `mu` and the shared roles
(`cohort_share`, declared shared by both methods).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedrobust.aggregators.base import Aggregator
from fedrobust.cohort import Cohort
from fedrobust.errors import SettingError
from fedrobust.local import LocalConfig
from fedrobust.methods.base import (MethodSpec, cohort_aggregation,
                                    eval_models_of, server_step,
                                    transformed_sgd_update)
from fedrobust.settings import Setting
from fedrobust.types import Method

SHARE = Setting('cohort_share', 'head', 'Roles whose trainable parameters '
                'all cohorts aggregate together (comma-separated: head, '
                'first; "none" shares nothing). Used with several '
                'cohorts.', arg='share', shared=True)


class FedAvgState(NamedTuple):
  base: tuple     # each cohort's frozen base (() for the identity transform)
  agg: Any        # the aggregator's state (per group with several cohorts)


def parse_share(share: str | tuple) -> tuple[str, ...]:
  if isinstance(share, tuple):
    return share
  roles = tuple(r.strip() for r in share.split(',') if r.strip())
  return () if roles == ('none',) else roles


def fedavg(*, cohorts: tuple[Cohort, ...], local: LocalConfig,
           optimizer: optax.GradientTransformation, aggregator: Aggregator,
           server_lr: float = 1.0, poison=None, num_clients: int = 0,
           mu: float = 0.0, share: str | tuple = 'head') -> Method:
  """FedAvg (mu == 0) or FedProx (mu > 0).

  Args:
    cohorts: the federation's cohorts (fedrobust.cohort).
    local: static local-training settings.
    optimizer: the client optimizer (fresh state every round).
    aggregator: the server rule (aggregators.AGGREGATORS; FedAvg's is
      weighted_mean); it gets weights, ids, coverage and staleness.
    server_lr: eta, the server step on the aggregated update.
    poison: optional data poison for malicious clients.
    num_clients: K (unused; uniform factory interface).
    mu: FedProx's proximal weight; 0 gives FedAvg.
    share: roles aggregated across cohorts ('head', 'first', 'none').

  Returns:
    A Method.
  """
  del num_clients
  if not (mu >= 0 and jnp.isfinite(mu)):
    raise SettingError('mu', f'must be >= 0 and finite, got {mu}',
                       component='method fedprox')
  share = parse_share(share)
  aggregation = cohort_aggregation(aggregator, cohorts, share)
  updates = [transformed_sgd_update(c, local=local, optimizer=optimizer,
                                    proximal_mu=mu, poison=poison)
             for c in cohorts]
  specs = [jnp.asarray(c.specs, jnp.float32) if c.transform.spec_name
           else None for c in cohorts]

  def init(params, num_clients, key):
    del num_clients
    split = [c.transform.init(p, jax.random.fold_in(key, j))
             for j, (c, p) in enumerate(zip(cohorts, params))]
    trainables = tuple(t for _, t in split)
    return trainables, FedAvgState(base=tuple(b for b, _ in split),
                                   agg=aggregation.init(trainables))

  def broadcast(state, j):
    return (state.method_state.base[j], state.params[j], state.round + 1)

  def client_state(method_state, j, ids):
    del method_state
    return () if specs[j] is None else specs[j][ids]

  def client_update(j, broadcast, spec, data, key, server_data):
    del server_data
    return updates[j](broadcast, spec, data, key)

  def server_update(state, arrivals, key, server_data):
    del server_data
    update, agg_state, info = aggregation.aggregate(
        state.params, arrivals, state.method_state.agg, key)
    params = tuple(server_step(p, u, server_lr)
                   for p, u in zip(state.params, update))
    return params, state.method_state._replace(agg=agg_state), info

  def eval_models(state):
    return eval_models_of(cohorts, state.method_state.base, state.params)

  name = 'fedprox' if mu else 'fedavg'
  return Method(name, init, broadcast, client_state, client_update,
                server_update, eval_models,
                provides=frozenset({'weights', 'ids', 'coverage',
                                    'staleness'}))


FEDAVG = MethodSpec(
    build=fedavg,
    summary='FedAvg: local SGD, the weighted mean of the updates.',
    settings=(SHARE,))

FEDPROX = MethodSpec(
    build=fedavg,
    summary='FedProx: FedAvg with a proximal term mu/2 ||v - w||^2.',
    settings=(Setting('mu', 0.01, 'FedProx proximal weight mu (> 0).'),
              SHARE))
