"""The local-training stage: one cohort's clients run their client_update.

Every client runs inside engine.execution.run_clients, under the round's
execution strategy and device mesh. A client trains either from this
round's broadcast (train_from_broadcast) or, with train_on_arrival, from
the global model of the round it started in (train_from_start). The
retrain hook (retrainer) reruns recorded clients for rules that replay
rounds (FedHAN).

Shapes: C slots of a cohort, K clients.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fedrobust.engine.config import RoundConfig
from fedrobust.engine.execution import CLIENT_AXIS, run_clients
from fedrobust.engine.pipeline import Job, StepContext
from fedrobust.engine.sampling import client_keys
from fedrobust.engine.threat import apply_model_attack, slot_attackers
from fedrobust.errors import SettingError
from fedrobust.types import (ClientOutput, FederatedData, LocalData, Method,
                             ServerState)

PyTree = Any


def client_view(config: RoundConfig, data: FederatedData,
                client_id: jax.Array, is_mal: jax.Array | bool = False,
                rank: jax.Array | int = 0) -> LocalData:
  """ONE client's LocalData inside run_clients.

  Its row is its id within the device's block of the data (the id itself
  when replicated).
  """
  row = client_id % config.block
  return LocalData(data.x, data.y, client_id, data.count[row], is_mal,
                   rank, row)


def data_specs(config: RoundConfig):
  """run_clients' specs for its shared (broadcast, data, server_data).

  Returns:
    The data split over the clients axis when sharded, else None
    (replicated).
  """
  if config.block == config.num_clients:
    return None
  split = P(CLIENT_AXIS)
  return (P(), FederatedData(split, split, split), P())


def skips_masked(config: RoundConfig) -> bool:
  """Whether a round can hold masked slots whose training is skipped.

  Slots can be masked when clients are busy (delays) or pad a cohort to
  the device count. A masked slot's output is never used, so under lax.map
  (the sequential strategy) it is skipped by lax.cond; under vmap the cond
  is a select. Rounds without masked slots keep the plain call.
  """
  return config.delay is not None or any(
      config.padded(s.clients_per_round) != s.clients_per_round
      for s in config.cohort_slots())


def client_output_shapes(method: Method, cohort: int, state: ServerState,
                         data: FederatedData, server_data: PyTree) -> Any:
  """ONE client's ClientOutput of `cohort` as ShapeDtypeStructs."""
  def one(state, data, server_data):
    ids = jnp.zeros((1,), jnp.int32)
    client_state = jax.tree.map(lambda leaf: leaf[0], method.client_state(
        state.method_state, cohort, ids))
    local = LocalData(data.x, data.y, ids[0], data.count[0])
    return method.client_update(cohort, method.broadcast(state, cohort),
                                client_state, local, jax.random.key(0),
                                server_data)
  return jax.eval_shape(one, state, data, server_data)


def client_update_fn(ctx: StepContext, j: int) -> Callable:
  """ONE client of cohort j for run_clients, trained from a broadcast.

  Per client: (id, key data, client state, is_mal, rank, live); shared:
  (broadcast, data, server_data).
  """
  method, config = ctx.method, ctx.config

  def one_client(per_client, shared):
    client_id, key_data, client_state, is_mal, rank, live = per_client
    broadcast, data, server_data = shared
    local = client_view(config, data, client_id, is_mal, rank)
    key = jax.random.wrap_key_data(key_data)
    train = lambda: method.client_update(j, broadcast, client_state, local,
                                         key, server_data)
    if not ctx.skip_masked:
      return train()
    zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                 jax.eval_shape(train))
    return jax.lax.cond(live, train, zeros)
  return one_client


def start_model_update_fn(ctx: StepContext, j: int) -> Callable:
  """ONE client of cohort j for run_clients, trained from its start model.

  The broadcast is rebuilt from the stored trainable tree of the round the
  client started in, with the current method state (train_on_arrival).
  Per client: (id, key data, client state, is_mal, rank, live, params row,
  start round); shared: (state, data, server_data).
  """
  method = ctx.method
  train = client_update_fn(ctx, j)

  def one_client(per_client, shared):
    (client_id, key_data, client_state, is_mal, rank, live, params_row,
     start) = per_client
    state, data, server_data = shared
    params = tuple(params_row if i == j else p
                   for i, p in enumerate(state.params))
    broadcast = method.broadcast(state._replace(params=params,
                                                round=start - 1), j)
    return train((client_id, key_data, client_state, is_mal, rank, live),
                 (broadcast, data, server_data))
  return one_client


def train_from_broadcast(ctx: StepContext, j: int, state: ServerState,
                         job: Job, data: FederatedData, server_data: PyTree
                         ) -> ClientOutput:
  """The job's clients trained from this round's broadcast of cohort j.

  Returns:
    ClientOutput, leaves [C, ...] (zeros in masked slots that skip).
  """
  method, config, s = ctx.method, ctx.config, job.slots
  client_state = method.client_state(state.method_state, j, s.ids)
  return run_clients(client_update_fn(ctx, j),
                     (s.ids, s.keys, client_state, s.is_mal, s.rank, s.mask),
                     (method.broadcast(state, j), data, server_data),
                     strategy=config.strategy, chunk_size=config.chunk_size,
                     mesh=ctx.mesh, shared_specs=ctx.shared_specs)


def train_from_start(ctx: StepContext, j: int, state: ServerState, job: Job,
                     data: FederatedData, server_data: PyTree
                     ) -> ClientOutput:
  """The job's clients trained from the models of their start rounds.

  Args:
    job: its tickets (arrivals.TicketJob) hold each slot's start round and
      the cohort's model ring.

  Returns:
    ClientOutput, leaves [C, ...].
  """
  method, config, s = ctx.method, ctx.config, job.slots
  start, ring = job.tickets.start, job.tickets.ring
  r = config.model_ring()
  return run_clients(
      start_model_update_fn(ctx, j),
      (s.ids, s.keys, method.client_state(state.method_state, j, s.ids),
       s.is_mal, s.rank, s.mask, jax.tree.map(lambda a: a[start % r], ring),
       start),
      (state._replace(pending=()), data, server_data),
      strategy=config.strategy, chunk_size=config.chunk_size, mesh=ctx.mesh)


def retrainer(ctx: StepContext, state: ServerState, data: FederatedData,
              server_data: PyTree, key: jax.Array, threat_key: jax.Array,
              attack_key: jax.Array) -> Callable:
  """The 'retrain' hook of rules that replay rounds (Method.provides).

  retrain(values, ids, mask, round_) trains clients `ids` of the (only)
  cohort from `values` in place of its global params, as in round `round_`
  (a replayed one): their data, width spec and window of that round and,
  for attackers of that round, their poisoning and model attack (a
  stateful attack is not rerun; a resampled attacker set is this round's
  draw). Keys: the client id folded into `key` folded with `round_`. The
  slots are padded to the device count.

  Returns:
    retrain -> (deltas, coverage), leaves [len(ids), ...].
  """
  method, config, threat = ctx.method, ctx.config, ctx.threat
  cohorts = config.cohort_slots()

  def retrain(values, ids, mask, round_):
    if len(cohorts) != 1:
      raise SettingError('aggregator', 'a rule that retrains clients '
                         '(FedHAN exact replay rounds) runs on one cohort; '
                         f'this federation has {len(cohorts)}')
    if config.block < config.num_clients:
      raise SettingError('client_data', 'a rule that retrains recorded '
                         'clients (FedHAN exact replay rounds) needs '
                         'replicated client data')
    size = jnp.shape(ids)[0]
    pad = -size % config.num_devices
    ids = jnp.pad(jnp.asarray(ids, jnp.int32), (0, pad))
    mask = jnp.pad(jnp.asarray(mask, bool), (0, pad))
    is_mal, rank = slot_attackers(threat, threat_key, ids, mask,
                                  config.num_clients, round_)
    keys = client_keys(jax.random.fold_in(key, round_), ids)
    broadcast = method.broadcast(
        state._replace(params=(values,), round=round_ - 1), 0)
    outputs = run_clients(
        client_update_fn(ctx, 0),
        (ids, keys, method.client_state(state.method_state, 0, ids),
         is_mal, rank, mask), (broadcast, data, server_data),
        strategy=config.strategy, chunk_size=config.chunk_size,
        mesh=ctx.mesh, shared_specs=ctx.shared_specs)
    if threat is not None and threat.model_attack is not None:
      outputs = apply_model_attack(outputs, threat, is_mal, mask,
                                   jax.random.fold_in(attack_key, round_))
    cut = lambda tree: jax.tree.map(lambda leaf: leaf[:size], tree)
    return cut(outputs.delta), cut(outputs.coverage)
  return retrain
