"""The records a round step passes between its stages.

For every cohort j the round step runs

  sample    sampling.sample_slots: the cohort's clients of the round;
  schedule  the arrival mode: the clients that train now;
  train     the arrival mode: their local training (engine.execution);
  threat    threat.attack_slots: the model attack on the attackers' updates;
  arrive    the arrival mode: the updates the server takes this round;

and then the server update and the metrics see every cohort's records at
once. The arrival mode (engine.arrivals) is chosen once from the
RoundConfig when the step is built.

Shapes: C slots of a cohort (C_j padded to the device count), K clients,
P rows of the updates handed to the server; masks are bool[C] or bool[P].
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh

from fedrobust.engine.config import RoundConfig
from fedrobust.types import Arrivals, ClientOutput, Method, PendingBuffer

PyTree = Any


class StepContext(NamedTuple):
  """What a round step is built from; fixed for the life of the step.

  Attributes:
    method: the federated algorithm.
    config: the static round settings.
    mesh: the client mesh, or None.
    threat: the attackers (engine.threat.Threat), or None.
    shared_specs: run_clients' specs for the shared (broadcast, data,
      server_data) (training.data_specs).
    skip_masked: whether a masked slot's training is skipped by lax.cond
      (training.skips_masked).
  """
  method: Method
  config: RoundConfig
  mesh: Mesh | None
  threat: Any
  shared_specs: Any
  skip_masked: bool


class RoundKeys(NamedTuple):
  """The round's keys, split from the state's key.

  Attributes:
    next: the next round's key.
    sample: client sampling (and delays, the every-round attacker and the
      retrain hook's client keys, each folded in).
    client: the clients' training keys (client id folded in).
    server: the server update's key.
    threat: a resampled attacker set's draw.
    attack: the model attack's key.
  """
  next: jax.Array
  sample: jax.Array
  client: jax.Array
  server: jax.Array
  threat: jax.Array
  attack: jax.Array


def round_keys(state: Any) -> RoundKeys:
  """The six keys of the round whose state is `state` (a ServerState)."""
  return RoundKeys(*jax.random.split(jax.random.wrap_key_data(state.key), 6))


def per_cohort(key: jax.Array, j: int) -> jax.Array:
  """Cohort j's copy of a round key.

  Cohort 0 uses the round's key as it is (a one-cohort round is the plain
  synchronous round); later cohorts fold in their index.
  """
  return key if j == 0 else jax.random.fold_in(key, j)


class Slots(NamedTuple):
  """A cohort's clients in slots, leaves [C].

  Attributes:
    ids: int32[C] client ids.
    mask: bool[C] live slots (padding and unavailable clients are False).
    is_mal: bool[C] the slot's client attacks.
    rank: int32[C] the client's rank among the attackers.
    keys: uint32[C, 2] key data of each client's training.
  """
  ids: jax.Array
  mask: jax.Array
  is_mal: jax.Array
  rank: jax.Array
  keys: jax.Array


class Job(NamedTuple):
  """The clients a cohort trains this round.

  Attributes:
    slots: the clients that train.
    delays: int32[C] delays of the clients that started this round, or
      None without client delays.
    tickets: the arrival mode's own record of the job (train_on_arrival:
      arrivals.TicketJob), or None.
  """
  slots: Slots
  delays: jax.Array | None
  tickets: Any = None


class Attacked(NamedTuple):
  """A cohort's trained updates after the threat stage.

  Attributes:
    outputs: ClientOutput, leaves [C, ...], attackers' deltas attacked.
    slots: the trained slots; is_mal also marks a stateful attack's decoys.
    attacking: float32[] attackers among the trained slots (decoys not
      counted).
    decoys: bool[C] benign slots carrying a stateful attack's upload, or
      None without a stateful attack.
  """
  outputs: ClientOutput
  slots: Slots
  attacking: jax.Array
  decoys: jax.Array | None


class Flight(NamedTuple):
  """Round bookkeeping of client delays, threaded through the cohorts.

  Attributes:
    busy_until: int32[K] last round each client is busy, or None without
      client delays.
    deferred: float32[] due updates left for the next round.
    expired: float32[] train_on_arrival tickets dropped as too stale.
  """
  busy_until: jax.Array | None
  deferred: jax.Array
  expired: jax.Array


class CohortArrivals(NamedTuple):
  """What a cohort hands the server this round.

  Attributes:
    arrivals: the updates, rows [P] (mask: arriving now).
    malicious: bool[P] arriving updates of attackers.
    buffer: the cohort's in-flight buffer after the round, or None without
      client delays.
    ring: train_on_arrival's model ring after the round, or None.
  """
  arrivals: Arrivals
  malicious: jax.Array
  buffer: PendingBuffer | None = None
  ring: PyTree | None = None


class CohortRound(NamedTuple):
  """One cohort's records of the round: its training and its arrivals."""
  attacked: Attacked
  arrived: CohortArrivals
