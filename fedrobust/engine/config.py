"""Static settings of the round program and their validation.

RoundConfig fixes everything the traced round depends on: the client count
K, the per-round sample C, cohorts, client delays and how their updates
arrive, the sampling strata and the layout of the client data over the
devices. The checks here raise SettingError naming the offending argument.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from jax.sharding import Mesh

from fedrobust.engine import delay as delay_lib
from fedrobust.engine.execution import CLIENT_DATA, validate_strategy
from fedrobust.errors import SettingError


class CohortSlots(NamedTuple):
  """Static membership of one cohort.

  Attributes:
    members: the cohort's client ids.
    clients_per_round: C_j, the clients it samples a round.
  """
  members: tuple[int, ...]
  clients_per_round: int


class RoundConfig(NamedTuple):
  """Static settings of the round program.

  Attributes:
    num_clients: K, the clients of the federation.
    clients_per_round: C, the clients sampled a round over all cohorts.
    strategy: how the clients run, one of engine.execution.STRATEGIES.
    chunk_size: clients per vmapped chunk of the 'chunked' strategy.
    num_devices: devices of the client mesh; each cohort's slots are padded
      to a multiple of it.
    cohorts: () for one cohort of every client (C = clients_per_round);
      otherwise one CohortSlots per cohort, members partitioning range(K)
      and clients_per_round summing to C.
    delay: engine.delay.DelayModel for semi-asynchronous rounds, or None.
    max_arrivals: with a delay, the server takes at most this many of the
      updates due in a round per cohort, oldest first, and the aggregator
      sees only those rows (0: every due update, all the buffer's rows).
    train_on_arrival: with a delay (and max_arrivals), a client's training
      runs in the round its update is taken, from the global model of the
      round it started in, instead of in its start round with the update
      held in flight. The math is the same (training is a function of that
      model, the data and the client's start-round key); the state holds a
      ticket per client (one update in flight at most) and a ring of the
      last max_staleness + 1 global models instead of (max_delay + 1) * C_j
      updates. So every client can be in flight at once (clients_per_round
      = num_clients: all free clients start every round) with the server
      taking max_arrivals a round: FedHAN's N/K staleness. A ticket whose
      model has left the ring (staleness > max_staleness) is dropped when
      due (`arrivals_expired`) and its client is free again.
      Model-poisoning attackers craft among the updates of the round they
      arrive in, and the broadcast is rebuilt from the stored trainable
      tree with the current method state.
    max_staleness: with train_on_arrival, the model ring's depth minus one
      (0: the delay cap).
    sample_strata: S > 1 splits the client ids into S equal contiguous
      blocks (strata) and every cohort draws C_j / S of its members from
      each stratum, uniformly within it (sample_cohort); 1 is the plain
      uniform draw over the cohort. A different distribution, so a setting
      of the run, not of its execution.
    client_data: 'replicated' (every device holds all K clients' data) or
      'sharded' (device d of the mesh holds the K / N clients d K / N ..
      (d + 1) K / N - 1 only, the layout of process-local data on a pod).
      Sharded data needs the strata to follow the devices (sample_strata a
      multiple of num_devices), so every slot a device runs holds one of
      its own clients. Same results as replicated data with the same
      strata.
  """
  num_clients: int
  clients_per_round: int
  strategy: str
  chunk_size: int = 0
  num_devices: int = 1
  cohorts: tuple[CohortSlots, ...] = ()
  delay: delay_lib.DelayModel | None = None
  max_arrivals: int = 0
  train_on_arrival: bool = False
  max_staleness: int = 0
  sample_strata: int = 1
  client_data: str = 'replicated'

  def model_ring(self) -> int:
    """Rows of the train_on_arrival model ring."""
    return 1 + (self.max_staleness or self.delay.max_delay)

  def cohort_slots(self) -> tuple[CohortSlots, ...]:
    """The cohorts, or one cohort of all K clients sampling C."""
    if self.cohorts:
      return self.cohorts
    return (CohortSlots(tuple(range(self.num_clients)),
                        self.clients_per_round),)

  def padded(self, c: int) -> int:
    """c slots rounded up to a multiple of the device count."""
    d = self.num_devices
    return -(-c // d) * d

  @property
  def block(self) -> int:
    """Clients per device block of sharded data (K when replicated)."""
    if self.client_data == 'sharded' and self.num_devices > 1:
      return self.num_clients // self.num_devices
    return self.num_clients

  @property
  def num_slots(self) -> int:
    """Padded slots of a round over all cohorts."""
    return sum(self.padded(s.clients_per_round) for s in self.cohort_slots())


def validate_round_config(config: RoundConfig) -> None:
  """Checks that the settings describe a round the engine can run.

  Raises:
    SettingError: naming the first setting that cannot hold.
  """
  if config.num_clients < 1:
    raise SettingError('num_clients', f'must be >= 1, got '
                       f'{config.num_clients}')
  if not 1 <= config.clients_per_round <= config.num_clients:
    raise SettingError(
        'clients_per_round', f'{config.clients_per_round} must be in '
        f'[1, num_clients={config.num_clients}]')
  validate_strategy(config.strategy, config.chunk_size)
  slots = config.cohort_slots()
  members = np.concatenate([np.asarray(s.members, np.int64) for s in slots])
  if sorted(members.tolist()) != list(range(config.num_clients)):
    raise SettingError('cohorts', 'cohort members must partition the '
                       f'{config.num_clients} clients')
  for j, s in enumerate(slots):
    if not 1 <= s.clients_per_round <= len(s.members):
      raise SettingError('cohorts', f'cohort {j} samples '
                         f'{s.clients_per_round} of its {len(s.members)} '
                         'clients per round; need 1 <= C_j <= members')
  if sum(s.clients_per_round for s in slots) != config.clients_per_round:
    raise SettingError('cohorts', 'per-cohort clients per round must sum '
                       f'to clients_per_round={config.clients_per_round}')
  if config.train_on_arrival and (config.delay is None or
                                  not config.max_arrivals):
    raise SettingError('train_on_arrival', 'trains each client when its '
                       'update is due: it needs client_delay and '
                       'max_arrivals > 0')
  if config.max_staleness < 0:
    raise SettingError('max_staleness', f'must be >= 0, got '
                       f'{config.max_staleness}')
  if config.max_staleness and not config.train_on_arrival:
    raise SettingError('max_staleness', 'sizes the train_on_arrival model '
                       'ring; it needs train_on_arrival')
  validate_strata(config)
  if config.max_arrivals < 0:
    raise SettingError('max_arrivals', f'must be >= 0, got '
                       f'{config.max_arrivals}')
  if config.max_arrivals and not config.train_on_arrival:
    if config.delay is None:
      raise SettingError('max_arrivals', 'caps the updates taken per round '
                         'from the in-flight buffer; it needs client_delay')
    largest = max(s.clients_per_round for s in slots)
    if config.max_arrivals < largest:
      raise SettingError(
          'max_arrivals', f'{config.max_arrivals} is below the '
          f'{largest} clients a cohort samples per round; the server must '
          'take at least that many so no update is overwritten in flight')


def strata_members(slots: CohortSlots, num_clients: int, strata: int
                   ) -> list[tuple[int, ...]]:
  """The cohort's members in each of the `strata` equal blocks of ids."""
  size = num_clients // strata
  return [tuple(m for m in slots.members if m // size == s)
          for s in range(strata)]


def validate_strata(config: RoundConfig) -> None:
  """Checks that the strata and the client data layout can hold the samples.

  Raises:
    SettingError: naming the setting that cannot hold.
  """
  s, k, n = config.sample_strata, config.num_clients, config.num_devices
  if config.client_data not in CLIENT_DATA:
    raise SettingError('client_data', f'got {config.client_data!r}; '
                       f'expected one of {CLIENT_DATA}')
  if s < 1:
    raise SettingError('sample_strata', f'must be >= 1, got {s}')
  if s > 1:
    if k % s:
      raise SettingError('sample_strata', f'{s} strata must split the '
                         f'num_clients={k} clients into equal blocks')
    for j, slots in enumerate(config.cohort_slots()):
      c = slots.clients_per_round
      if c % s:
        raise SettingError('sample_strata', f'{s} strata must split the '
                           f'{c} clients cohort {j} samples a round evenly '
                           '(clients_per_round a multiple of the strata)')
      fewest = min(len(m) for m in strata_members(slots, k, s))
      if fewest < c // s:
        raise SettingError('sample_strata', f'cohort {j} has {fewest} '
                           f'members in a stratum, fewer than the {c // s} '
                           'it draws from each')
  if config.client_data == 'sharded' and n > 1:
    if s % n:
      raise SettingError('client_data', f'sharded client data needs the '
                         f'sampling strata to follow the {n} devices: '
                         f'sample_strata a multiple of {n}, got {s}')
    if config.train_on_arrival:
      raise SettingError('client_data', 'train_on_arrival trains the '
                         'clients in the order their updates are taken, '
                         'not by device; it needs replicated client data')


def check_mesh_for_data(config: RoundConfig, mesh: Mesh | None) -> None:
  """Checks the mesh against the config's devices and data layout.

  The mesh must match the config's device count, and sharded data on
  several devices needs the mesh that splits it: off the mesh, or on a mesh
  of another size, a client's row within its block would index the wrong
  rows.

  Raises:
    SettingError: naming `num_devices` or `client_data`.
  """
  if mesh is not None and mesh.size != config.num_devices:
    raise SettingError('num_devices', f'the mesh has {mesh.size} devices, '
                       f'the config says {config.num_devices}')
  if config.block < config.num_clients and mesh is None:
    raise SettingError('client_data', f'sharded client data over '
                       f'{config.num_devices} devices needs their mesh')

