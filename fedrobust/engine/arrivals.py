"""How a cohort's updates reach the server: one strategy per RoundConfig.

  synchronous       no client delays: the round's slots train from its
                    broadcast and arrive at once, staleness 0;
  buffered          client delays: the started clients train now and their
                    updates wait in the cohort's in-flight ring
                    (engine.delay); the entries due this round arrive, all
                    of them or, with max_arrivals, the oldest ones;
  train_on_arrival  client delays: a started client leaves a ticket; when
                    the server takes the ticket the client trains from the
                    global model of its start round (a ring of models).

arrival_mode(config) picks the strategy once, when the step is built. Each
is an ArrivalMode of pure functions the round step calls in order: free and
start (inside the sample stage), schedule, train, arrive, then pending and
metrics once all cohorts are done.

Shapes: C slots of a cohort, K clients, P rows handed to the server.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.engine import delay as delay_lib
from fedrobust.engine.config import RoundConfig
from fedrobust.engine.detection import masked_mean
from fedrobust.engine.pipeline import (Attacked, CohortArrivals, Flight, Job,
                                       Slots, StepContext)
from fedrobust.engine.training import (client_output_shapes,
                                       train_from_broadcast, train_from_start)
from fedrobust.types import (Arrivals, AsyncState, FederatedData, Method,
                             PendingBuffer, ServerState)

PyTree = Any


class ArrivalMode(NamedTuple):
  """One arrival strategy as pure functions (see the module docstring).

  Attributes:
    name: 'synchronous', 'buffered' or 'train_on_arrival'.
    init_pending: (method, config, state, data, server_data) -> the round-0
      ServerState.pending.
    begin: (state) -> the round's Flight before its first cohort.
    free: (flight, now) -> bool[K] clients that may start, or None (all).
    start: (config, key, ids, mask, flight, now) -> (delays int32[C] or
      None, flight): the live sampled clients start (key: the cohort's
      sampling key).
    schedule: (ctx, j, state, started, delays, flight, now) -> (Job,
      flight): the clients that train this round.
    train: (ctx, j, state, job, data, server_data) -> ClientOutput, leaves
      [C, ...].
    arrive: (ctx, j, state, job, attacked, flight, now) -> (CohortArrivals,
      flight): the updates the server takes.
    pending: (state, flight, arrived) -> the new ServerState.pending, from
      every cohort's CohortArrivals.
    metrics: (arrived, flight) -> {name: float32[]}, the mode's metrics.
  """
  name: str
  init_pending: Callable
  begin: Callable
  free: Callable
  start: Callable
  schedule: Callable
  train: Callable
  arrive: Callable
  pending: Callable
  metrics: Callable


class TicketJob(NamedTuple):
  """train_on_arrival's record of the tickets a cohort trains this round.

  Attributes:
    start: int32[A] the round each taken ticket started in.
    staleness: int32[A] rounds since that start (0 where not taken).
    buffer: the cohort's ticket table after the round.
    ring: the cohort's model ring (leaves [R, ...]) after the round.
  """
  start: jax.Array
  staleness: jax.Array
  buffer: PendingBuffer
  ring: PyTree


def arrival_mode(config: RoundConfig) -> ArrivalMode:
  """The arrival strategy of `config` (see the module docstring)."""
  if config.delay is None:
    return synchronous()
  if config.train_on_arrival:
    return train_on_arrival()
  return buffered(config)


def init_pending(method: Method, config: RoundConfig, state: ServerState,
                 data: FederatedData, server_data: PyTree) -> AsyncState:
  """The round-0 in-flight state of a config with client delays."""
  return arrival_mode(config).init_pending(method, config, state, data,
                                           server_data)


# Steps shared by the strategies.


def _begin_synchronous(state: ServerState) -> Flight:
  del state
  return Flight(None, jnp.float32(0.0), jnp.float32(0.0))


def _begin_delayed(state: ServerState) -> Flight:
  return Flight(state.pending.busy_until, jnp.float32(0.0), jnp.float32(0.0))


def _all_free(flight: Flight, now: jax.Array) -> None:
  del flight, now


def _not_busy(flight: Flight, now: jax.Array) -> jax.Array:
  return flight.busy_until < now


def _start_now(config, key, ids, mask, flight, now):
  del config, key, ids, mask, now
  return None, flight


def _start_delayed(config: RoundConfig, key: jax.Array, ids: jax.Array,
                   mask: jax.Array, flight: Flight, now: jax.Array
                   ) -> tuple[jax.Array, Flight]:
  """Delays for the started clients, who are busy until their update is
  due."""
  delays = delay_lib.sample_delays(jax.random.fold_in(key, 0x5EED), ids,
                                   config.delay)
  busy_until = flight.busy_until.at[jnp.where(mask, ids, config.num_clients)
                                    ].set(now + delays, mode='drop')
  return delays, flight._replace(busy_until=busy_until)


def _train_started(ctx, j, state, started, delays, flight, now):
  del ctx, j, state, now
  return Job(started, delays), flight


def _async_pending(state: ServerState, flight: Flight,
                   arrived: list[CohortArrivals]) -> AsyncState:
  del state
  return AsyncState(tuple(a.buffer for a in arrived), flight.busy_until,
                    tuple(a.ring for a in arrived if a.ring is not None))


def take_due(config: RoundConfig, buffer: PendingBuffer, flight: Flight,
             now: jax.Array):
  """The server takes max_arrivals of the due updates, oldest first.

  The clients of the others stay busy a round longer.

  Returns:
    (rows int32[A], taken bool[A], staleness int32[A], the buffer without
    the taken rows, the flight with the deferred ones counted).
  """
  rows, taken, staleness, late, buffer = delay_lib.take_oldest(
      buffer, now, config.padded(config.max_arrivals))
  busy_until = flight.busy_until.at[jnp.where(late, buffer.ids,
                                              config.num_clients)].set(
      now + 1, mode='drop')
  return rows, taken, staleness, buffer, flight._replace(
      busy_until=busy_until,
      deferred=flight.deferred + jnp.sum(late).astype(jnp.float32))


def delay_metrics(arrived: list[CohortArrivals], flight: Flight, *,
                  deferred: bool, expired: bool) -> dict[str, jax.Array]:
  """Arrivals and their staleness; deferred and expired updates if asked."""
  mask_all = jnp.concatenate([a.arrivals.mask for a in arrived])
  stale = jnp.concatenate([a.arrivals.staleness for a in arrived])
  metrics = {'arrivals': jnp.sum(mask_all).astype(jnp.float32)}
  if deferred:
    metrics['arrivals_deferred'] = flight.deferred
  if expired:
    metrics['arrivals_expired'] = flight.expired
  metrics['staleness_mean'] = masked_mean(stale.astype(jnp.float32),
                                          mask_all)
  metrics['staleness_max'] = jnp.max(jnp.where(mask_all, stale, 0)
                                     ).astype(jnp.float32)
  return metrics


# Synchronous rounds.


def _arrive_now(ctx, j, state, job, attacked: Attacked, flight, now):
  del ctx, j, state, job, now
  s = attacked.slots
  return CohortArrivals(Arrivals(s.ids, s.mask, attacked.outputs,
                                 jnp.zeros(s.ids.shape, jnp.int32)),
                        s.is_mal), flight


def _no_pending(method, config, state, data, server_data) -> tuple:
  del method, config, state, data, server_data
  return ()


def _keep_pending(state: ServerState, flight: Flight,
                  arrived: list[CohortArrivals]) -> Any:
  del flight, arrived
  return state.pending


def _no_metrics(arrived: list[CohortArrivals], flight: Flight) -> dict:
  del arrived, flight
  return {}


def synchronous() -> ArrivalMode:
  """Every live slot trains from the broadcast and arrives at once."""
  return ArrivalMode(
      'synchronous', init_pending=_no_pending, begin=_begin_synchronous,
      free=_all_free, start=_start_now, schedule=_train_started,
      train=train_from_broadcast, arrive=_arrive_now, pending=_keep_pending,
      metrics=_no_metrics)


# Buffered client delays.


def _init_buffers(method, config, state, data, server_data) -> AsyncState:
  """Empty in-flight rings of (max_delay + 1) * C_j client outputs."""
  buffers = tuple(
      delay_lib.empty_buffer(
          client_output_shapes(method, j, state, data, server_data),
          config.padded(s.clients_per_round), config.delay)
      for j, s in enumerate(config.cohort_slots()))
  return AsyncState(buffers, jnp.zeros((config.num_clients,), jnp.int32))


def _take_all(config, buffer, flight, now):
  """Every due update arrives; rows [P] are the whole buffer."""
  del config
  arriving, staleness, buffer = delay_lib.dequeue(buffer, now)
  return CohortArrivals(
      Arrivals(buffer.ids, arriving, buffer.outputs, staleness),
      buffer.is_malicious & arriving, buffer), flight


def _take_oldest(config, buffer, flight, now):
  """max_arrivals of the due updates arrive (take_due); rows [A]."""
  rows, taken, staleness, buffer, flight = take_due(config, buffer, flight,
                                                    now)
  return CohortArrivals(
      Arrivals(buffer.ids[rows], taken,
               jax.tree.map(lambda leaf: leaf[rows], buffer.outputs),
               staleness),
      buffer.is_malicious[rows] & taken, buffer), flight


def _arrive_buffered(take: Callable, ctx: StepContext, j: int,
                     state: ServerState, job: Job, attacked: Attacked,
                     flight: Flight, now: jax.Array):
  """The trained updates enter the ring; `take` picks the due ones."""
  s = attacked.slots
  buffer = delay_lib.enqueue(state.pending.buffers[j], now, attacked.outputs,
                             s.ids, s.is_mal, job.delays, s.mask,
                             ctx.config.delay)
  return take(ctx.config, buffer, flight, now)


def buffered(config: RoundConfig) -> ArrivalMode:
  """Updates wait in flight for their delay; the due ones arrive."""
  take = _take_oldest if config.max_arrivals else _take_all
  return ArrivalMode(
      'buffered', init_pending=_init_buffers, begin=_begin_delayed,
      free=_not_busy, start=_start_delayed, schedule=_train_started,
      train=train_from_broadcast,
      arrive=functools.partial(_arrive_buffered, take),
      pending=_async_pending,
      metrics=functools.partial(delay_metrics,
                                deferred=bool(config.max_arrivals),
                                expired=False))


# Training on arrival.


def _init_tickets(method, config, state, data, server_data) -> AsyncState:
  """Empty ticket tables (a row per client) and zero model rings."""
  del method, data, server_data
  ticket = {'key': jax.ShapeDtypeStruct((2,), jnp.uint32),
            'rank': jax.ShapeDtypeStruct((), jnp.int32)}
  r = config.model_ring()
  buffers = tuple(delay_lib.empty_tickets(ticket, config.num_clients)
                  for _ in config.cohort_slots())
  models = tuple(jax.tree.map(lambda p: jnp.zeros((r, *p.shape), p.dtype),
                              params) for params in state.params)
  return AsyncState(buffers, jnp.zeros((config.num_clients,), jnp.int32),
                    models)


def _schedule_tickets(ctx: StepContext, j: int, state: ServerState,
                      started: Slots, delays: jax.Array, flight: Flight,
                      now: jax.Array) -> tuple[Job, Flight]:
  """The started clients leave tickets; the server takes the due ones.

  This round's global model enters the ring; a due ticket whose start model
  has left the ring is dropped (its client is free again).
  """
  config, pending = ctx.config, state.pending
  r = config.model_ring()
  ring = jax.tree.map(lambda a, p: a.at[now % r].set(p),
                      pending.models[j], state.params[j])
  buffer = delay_lib.start_tickets(
      pending.buffers[j], now, {'key': started.keys, 'rank': started.rank},
      started.ids, started.is_mal, delays, started.mask)
  stale = (buffer.valid & (buffer.arrival_round == now) &
           (buffer.computed_round <= now - r))
  buffer = buffer._replace(valid=buffer.valid & ~stale)
  flight = flight._replace(
      busy_until=jnp.where(stale, now, flight.busy_until),
      expired=flight.expired + jnp.sum(stale).astype(jnp.float32))
  rows, taken, staleness, buffer, flight = take_due(config, buffer, flight,
                                                    now)
  ids = buffer.ids[rows]
  start = buffer.computed_round[rows]
  is_mal = buffer.is_malicious[rows] & taken
  ticket = jax.tree.map(lambda leaf: leaf[rows], buffer.outputs)
  slots = Slots(ids, taken, is_mal, ticket['rank'], ticket['key'])
  return Job(slots, delays, TicketJob(start, staleness, buffer, ring)), flight


def _arrive_trained(ctx, j, state, job: Job, attacked: Attacked, flight,
                    now):
  """The taken tickets' fresh updates arrive."""
  del ctx, j, state, now
  s, tickets = attacked.slots, job.tickets
  return CohortArrivals(
      Arrivals(s.ids, s.mask, attacked.outputs, tickets.staleness),
      s.is_mal, tickets.buffer, tickets.ring), flight


def train_on_arrival() -> ArrivalMode:
  """Clients train when the server takes their ticket."""
  return ArrivalMode(
      'train_on_arrival', init_pending=_init_tickets, begin=_begin_delayed,
      free=_not_busy, start=_start_delayed, schedule=_schedule_tickets,
      train=train_from_start, arrive=_arrive_trained, pending=_async_pending,
      metrics=functools.partial(delay_metrics, deferred=True, expired=True))
