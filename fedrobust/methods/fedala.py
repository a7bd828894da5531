"""FedALA: adaptive local aggregation (Zhang et al., AAAI 2023), over cohorts.

Each client keeps its last local model Theta_i. Before local training it
does not take the global model Theta as is; it mixes, element-wise, on the
top `layers` layers (the classifier with layers=1; lower layers take the
global values):

  Theta^_i = Theta_i + (Theta - Theta_i) * W_i,   W_i in [0, 1]   (Eq. 4)

and learns W_i by SGD on the loss of Theta^_i over a random s% of its
local data, clipping W to [0, 1] after every step (Eq. 5). W_i starts at 1
and persists across rounds. At a client's first participation the paper
trains W until the loss settles; here that is a fixed `first_epochs`
epochs of the s% sample (static shapes), then one epoch per round after.
It trains Theta^_i locally as FedAvg does and sends Theta_i^new - Theta;
the server aggregates those with the aggregator (FedAvg: the weighted
mean) and keeps Theta_i^new as the client's local model.

Evaluation is per client (every client's own local model, as Horus's
Table II evaluates personalised methods). With cohorts, each cohort runs
FedALA on its own architecture and the `share` roles' global parameters
are aggregated across cohorts like FedAvg's; the local mixing is within a
client's own model, so it applies to CNN and LSTM clients alike.

Deviation: the paper stops W's first training at a loss-variance
threshold; we use a fixed epoch count (static shapes in one compiled
round).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedrobust.aggregators.base import Aggregator
from fedrobust.cohort import Cohort, member_positions
from fedrobust.errors import SettingError
from fedrobust.local import (LocalConfig, classification_loss, local_sgd,
                             make_batch_plan)
from fedrobust.methods.base import (MethodSpec, aggregate_and_step,
                                    check_cohorts, cohort_aggregation)
from fedrobust.methods.fedavg import SHARE, parse_share
from fedrobust.settings import Setting
from fedrobust.transforms.base import get_path, set_path
from fedrobust.tree import gather_clients, scatter_clients, tree_sub
from fedrobust.types import ClientOutput, EvalModel, Method


class ALAClientState(NamedTuple):
  local: Any        # Theta_i, the client's last local model
  weights: Any      # W_i over the top layers' parameters
  seen: jax.Array   # bool[]


class FedALAState(NamedTuple):
  clients: tuple    # per cohort: ALAClientState with leaves [K_j, ...]
  agg: Any


def _top(params, paths):
  out = {}
  for path in paths:
    out = set_path(out, path, get_path(params, path))
  return out


def fedala(*, cohorts: tuple[Cohort, ...], local: LocalConfig,
           optimizer: optax.GradientTransformation, aggregator: Aggregator,
           server_lr: float = 1.0, num_clients: int = 0,
           share: str | tuple = 'head', sample_percent: float = 80.0,
           layers: int = 1, eta: float = 1.0, first_epochs: int = 5
           ) -> Method:
  """FedALA over `cohorts` (identity transform).

  Args:
    cohorts, local, optimizer, aggregator, server_lr, num_clients,
      share: as for FedAvg.
    sample_percent: s, the share of local data W is learned on.
    layers: p, how many top layers are mixed (1: the classifier).
    eta: W's learning rate.
    first_epochs: epochs of W training at a client's first participation.
  """
  del num_clients
  check_cohorts('fedala', cohorts, multi=True)
  if any(c.transform.name != 'identity' for c in cohorts):
    raise SettingError('transform', 'fedala mixes full local and global '
                       'models: it takes the identity transform')
  if not 0 < sample_percent <= 100:
    raise SettingError('sample_percent', f'must be in (0, 100], got '
                       f'{sample_percent}', component='method fedala')
  if layers < 1 or first_epochs < 1 or not eta > 0:
    raise SettingError('layers', 'layers and first_epochs must be >= 1 and '
                       f'eta > 0; got {layers}, {first_epochs}, {eta}',
                       component='method fedala')
  share = parse_share(share)
  aggregation = cohort_aggregation(aggregator, cohorts, share)
  # The top `layers` layers: the head and the ones just below it, in the
  # model's width order (zoo models list their layers in that order).
  tops = []
  for c in cohorts:
    order = list(c.model.width_units or {})
    head = c.model.roles['head']
    order = [p for p in order if p != head] + [head]
    tops.append(order[-layers:])
  positions = member_positions(cohorts)

  def mix(global_p, local_p, weights, paths):
    """Eq. 4 on the top layers; the global values elsewhere."""
    out = global_p
    for path in paths:
      g, l, w = (get_path(t, path) for t in (global_p, local_p, weights))
      out = set_path(out, path, jax.tree.map(
          lambda gg, ll, ww: ll + (gg - ll) * ww, g, l, w))
    return out

  def init(params, num_clients, key):
    del num_clients, key
    params = aggregation.consistent(tuple(params))
    clients = []
    for c, p in zip(cohorts, params):
      n = len(c.members)
      stack = lambda t, n=n: jax.tree.map(
          lambda leaf: jnp.broadcast_to(leaf, (n, *leaf.shape)), t)
      clients.append(ALAClientState(
          stack(p), stack(jax.tree.map(jnp.ones_like, _top(p, tops[len(
              clients)]))), jnp.zeros((n,), bool)))
    return params, FedALAState(tuple(clients), aggregation.init(params))

  def broadcast(state, j):
    return state.params[j]

  def client_state(method_state, j, ids):
    return gather_clients(method_state.clients[j], positions[j][ids])

  def client_update(j, global_p, state, data, key, server_data):
    del server_data
    model, paths = cohorts[j].model, tops[j]
    loss = classification_loss(model.apply)
    w_key, plan_key, train_key = jax.random.split(key, 3)
    sample = jnp.maximum(1, jnp.round(data.count * sample_percent / 100.0)
                         ).astype(jnp.int32)

    def learn_w(epochs):
      config = local._replace(num_epochs=epochs)
      plan = make_batch_plan(plan_key, sample, config=config)

      def step(w, batch):
        rows, mask, live = batch
        x, y = data.x[data.row, rows], data.y[data.row, rows]
        grad = jax.grad(lambda ww: loss(mix(global_p, state.local, ww,
                                            paths), x, y, mask,
                                        None)[0])(w)
        new = jax.tree.map(lambda ww, g: jnp.clip(ww - eta * g, 0.0, 1.0),
                           w, grad)
        return jax.tree.map(lambda a, b: jnp.where(live, a, b), new, w), None

      w, _ = jax.lax.scan(step, state.weights, (plan.index, plan.example_mask,
                                                plan.step_mask))
      return w

    weights = jax.lax.cond(state.seen, lambda: learn_w(1),
                           lambda: learn_w(first_epochs))
    # At a first participation the local model is the global one, so the
    # mix is the global model whatever W is.
    start = mix(global_p, state.local, weights, paths)
    new, metrics = local_sgd(loss, start, data, train_key,
                             optimizer=optimizer, config=local)
    del w_key
    return ClientOutput(delta=tree_sub(new, global_p),
                        weight=data.count.astype(jnp.float32),
                        client_state=ALAClientState(new, weights,
                                                    jnp.bool_(True)),
                        metrics=metrics)

  def server_update(state, arrivals, key, server_data):
    del server_data
    params, agg_state, info = aggregate_and_step(
        aggregation, state.params, arrivals, state.method_state.agg, key,
        server_lr)
    clients = tuple(
        scatter_clients(state.method_state.clients[j],
                        positions[j][a.ids], a.outputs.client_state, a.mask)
        for j, a in enumerate(arrivals))
    return params, FedALAState(clients, agg_state), info

  def eval_models(state):
    out = []
    for j, c in enumerate(cohorts):
      cs = state.method_state.clients[j]
      # A client that never trained holds the initial model: show it the
      # current global model instead.
      own = jax.tree.map(
          lambda l, g: jnp.where(cs.seen.reshape((-1,) + (1,) * g.ndim), l,
                                 g[None]), cs.local, state.params[j])
      out.append(EvalModel('' if len(cohorts) == 1 else c.name, j, own,
                           clients=c.members, per_client=True))
    return tuple(out)

  return Method('fedala', init, broadcast, client_state, client_update,
                server_update, eval_models,
                provides=frozenset({'weights', 'ids', 'coverage',
                                    'staleness', 'params'}))


FEDALA = MethodSpec(
    build=fedala,
    summary='FedALA: clients learn element-wise weights to mix the global '
    'model into their local one before training.',
    settings=(
        SHARE,
        Setting('sample_percent', 80.0, 'Share of local data (%) the mixing '
                'weights are learned on (s).'),
        Setting('layers', 1, 'Top layers mixed (p; 1: the classifier).'),
        Setting('eta', 1.0, 'Learning rate of the mixing weights.'),
        Setting('first_epochs', 5, 'Epochs of mixing-weight training at a '
                "client's first participation."),
    ))
