"""Personalised LoRA baselines that keep part of every client's adapter.

Both are the baselines of HiLoRA's tables (seeds/002, Sec. 5.1):

  Local-LoRA  every client trains its own adapter on its own data and
              nothing is aggregated.
  FedSA-LoRA  (Guo et al., ICLR 2025) the A matrices are shared (FedAvg of
              the clients' trained A through the aggregator) and every
              client keeps its own B: A learns what all clients share, B
              what is their own.

Notation: the paper's A ([r, d_in]) is our factor `a` ([d_in, r]) and its
B ([d_out, r]) our `b` ([r, d_out]); LoRA starts with b = 0, so every
client starts from W0.

Client i trains (shared factors from the server, its own factors from
its row of the method state) for the round's local steps and uploads the
delta; the server aggregates the shared factors' deltas and stores each
arrival's trained adapter in its row. Evaluation: every client's own
model W0 + s a_i b_i (`personal`), and as the global model W0 plus the
mean of the clients' products (for FedSA-LoRA that is W0 + s A mean(B_i),
the model with the shared A; Local-LoRA has no trained global model, so
its global row is only a reference). A newcomer (fedrobust.adapt) starts
from that global model under FedSA-LoRA and from W0 under Local-LoRA.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedrobust.local import LocalConfig
from fedrobust.methods.base import (MethodSpec, aggregate_and_step,
                                    cohort_aggregation,
                                    transformed_sgd_update)
from fedrobust.methods.fedlora import _check_lora, add_dense, products
from fedrobust.tree import scatter_clients
from fedrobust.types import EvalModel, Method

Params = Any


# What the server step of a personalised method reads from the arrivals
# (its aggregator may weigh by any of them).
PROVIDES = frozenset({'weights', 'ids', 'coverage', 'staleness', 'params'})


def broadcast_base(state, j):
  """(W0, the global trainable tree, round): what a personalised LoRA
  method's clients receive (method_state.base holds W0)."""
  del j
  return (state.method_state.base, state.params[0], state.round + 1)


def own_rows(method_state, j, ids):
  """The clients' own adapters (method_state.own, leaves [N, ...])."""
  del j
  return jax.tree.map(lambda leaf: leaf[ids], method_state.own)


class PersonalState(NamedTuple):
  base: Any   # W0
  own: Any    # every client's adapter, leaves [N, ...]
  agg: Any    # the aggregator's state (over the shared factors)


def _leaf_name(path) -> str:
  last = path[-1]
  return str(getattr(last, 'key', getattr(last, 'name', last)))


def split_by_factor(shared: tuple[str, ...]):
  """(combine, keep_shared) for a trainable LoRA tree whose factors named
  in `shared` ('a', 'b') come from the server:
    combine(global, own): shared leaves from global, the rest from own;
    keep_shared(tree): tree with the non-shared leaves zeroed."""

  def combine(glob, own):
    return jax.tree_util.tree_map_with_path(
        lambda p, g, o: g if _leaf_name(p) in shared else o, glob, own)

  def keep_shared(tree):
    return jax.tree_util.tree_map_with_path(
        lambda p, t: t if _leaf_name(p) in shared else jnp.zeros_like(t),
        tree)

  return combine, keep_shared


def personal_lora(name: str, shared: tuple[str, ...], *, cohorts,
                  local: LocalConfig,
                  optimizer: optax.GradientTransformation, aggregator=None,
                  server_lr: float = 1.0,
                  num_clients: int = 0) -> Method:
  """A LoRA method whose factors in `shared` are aggregated and whose
  other factors stay with each client (see the module docstring)."""
  _check_lora(name, cohorts, single=True)
  cohort = cohorts[0]
  transform = cohort.transform
  scale = transform.factor_scale(None)
  n = num_clients or 1 + max(cohort.members)
  update = transformed_sgd_update(cohort, local=local, optimizer=optimizer)
  # Local-LoRA aggregates nothing (built without an aggregator).
  aggregation = cohort_aggregation(aggregator, cohorts, ()) if shared else None
  combine, keep_shared = split_by_factor(shared)
  row = lambda tree, ids: jax.tree.map(lambda leaf: leaf[ids], tree)

  def init(params, num_clients, key):
    del num_clients
    base, trainable = transform.init(params[0], jax.random.fold_in(key, 0))
    own = jax.tree.map(lambda l: jnp.broadcast_to(l, (n, *l.shape)),
                       trainable)
    agg = aggregation.init((trainable,)) if shared else ()
    return (trainable,), PersonalState(base, own, agg)

  def client_update(j, broadcast, own, data, key, server_data):
    del j, server_data
    base, glob, round_number = broadcast
    return update((base, combine(glob, own), round_number), (), data, key)

  def server_update(state, arrivals, key, server_data):
    del server_data
    ms = state.method_state
    (arr,) = arrivals
    starts = jax.vmap(combine, in_axes=(None, 0))(state.params[0],
                                                  row(ms.own, arr.ids))
    trained = jax.tree.map(jnp.add, starts, arr.outputs.delta)
    own = scatter_clients(ms.own, arr.ids, trained, arr.mask)
    if not shared:            # Local-LoRA: nothing to aggregate
      return state.params, ms._replace(own=own), {}
    only = arr._replace(outputs=arr.outputs._replace(
        delta=jax.vmap(keep_shared)(arr.outputs.delta)))
    params, agg, info = aggregate_and_step(aggregation, state.params,
                                           (only,), ms.agg, key, server_lr)
    return params, ms._replace(own=own, agg=agg), info

  def own_products(state):
    ms = state.method_state
    members = jnp.asarray(cohort.members)
    mine = jax.vmap(combine, in_axes=(None, 0))(state.params[0],
                                                row(ms.own, members))
    return jax.vmap(lambda t: products(t, scale))(mine)

  def mean_model(base, dense):
    """W0 + the mean of the clients' products."""
    return add_dense(base, {p: jnp.mean(v, axis=0) for p, v in dense.items()})

  def eval_models(state):
    base = state.method_state.base
    dense = own_products(state)
    personal = jax.vmap(lambda d: add_dense(base, d))(dense)
    return (EvalModel('', 0, mean_model(base, dense)),
            EvalModel('personal', 0, personal, clients=cohort.members,
                      per_client=True))

  def newcomer(state, data, key):
    del data, key
    if shared:
      return mean_model(state.method_state.base, own_products(state)), {}
    return state.method_state.base, {}

  return Method(name, init, broadcast_base, own_rows, client_update,
                server_update, eval_models, provides=PROVIDES,
                newcomer=newcomer)


def local_lora(**kwargs) -> Method:
  return personal_lora('local_lora', (), **kwargs)


def fedsa_lora(**kwargs) -> Method:
  return personal_lora('fedsa_lora', ('a',), **kwargs)


LOCAL_LORA = MethodSpec(
    build=local_lora,
    summary='Local-LoRA: every client trains its own LoRA adapter; no '
    'aggregation.', uses_aggregator=False)

FEDSA_LORA = MethodSpec(
    build=fedsa_lora,
    summary='FedSA-LoRA: the A matrices are aggregated, every client keeps '
    'its own B.')
