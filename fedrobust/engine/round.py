"""One federated round as one pure function, jitted by the caller.

round_step(state, data, server_data) -> (state, metrics). For every cohort
j (a static Python loop at trace time, so still one program):
  1. sample C_j of the cohort's clients (sorted ids, padded to a multiple
     of the device count with masked slots; or C_j / S from each of S
     strata of ids, as client data sharded over devices needs); with
     client delays, a sampled client that is still busy with an earlier
     update is masked too;
  2. run the method's client_update for every slot (engine.execution);
  3. with a Threat, mark the attacking slots (data poisoning happens inside
     their local training) and apply the model attack to their deltas;
  4. without delays, the slots are this round's arrivals; with delays they
     enter the cohort's in-flight ring (engine.delay) and the entries due
     this round arrive, each with its staleness.
Then the method's server_update sees every cohort's arrivals at once, and
the round counter and PRNG key advance.

Aggregators report info['weights'] per cohort; the round turns them into
detection counts (zero weight = excluded), the mean weight share of
malicious and benign clients, and the weight AUC (how often a benign client
outweighs a malicious one), which is meaningful for soft-weighting rules
that never exclude anyone.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from fedrobust.engine import delay as delay_lib
from fedrobust.engine.execution import (CLIENT_AXIS, CLIENT_DATA, on_mesh,
                                        run_clients, validate_strategy)
from fedrobust.errors import SettingError
from fedrobust.tree import ravel_clients, unravel_like
from fedrobust.types import (Arrivals, AsyncState, AttackContext,
                             FederatedData, LocalData, Method, ServerState)

Params = Any
PyTree = Any


class Threat(NamedTuple):
  """Who attacks, from when, and how updates are poisoned.

  malicious: bool[K] fixed malicious set, or None to draw `num_malicious`
    clients afresh every round from the round key.
  start_round: first (1-based) round in which attackers act; before it
    they behave honestly.
  model_attack: optional apply(updates float[C, D], is_malicious bool[C],
    mask bool[C], key) -> float[C, D] on the raveled client deltas (per
    cohort: attackers craft within their own architecture).
  absent: the malicious clients never take part (their slots are masked
    every round): the "Retrain" baseline of recovery papers, training
    without the attackers. Needs a fixed `malicious` set.
  every_round: from start_round on, every round's sample holds at least
    one attacker (FedHAN's detector setting, "at least one attacker per
    round"): if the uniform sample has none, a free attacker of the cohort
    takes the slot of a sampled benign client. Needs a fixed set.
  stateful_attack: optional attacks.threedfed.StatefulAttack (3DFed): a
    model attack that keeps state across rounds (ServerState.attack,
    from its init) and sees the global model and the data; synchronous
    rounds with one cohort only.
  Data poisoning is the method's business: client_update sees
  LocalData.is_malicious and LocalData.attacker_rank.
  """
  malicious: jax.Array | None = None
  num_malicious: int = 0
  start_round: int = 1
  model_attack: Callable | None = None
  absent: bool = False
  every_round: bool = False
  stateful_attack: Any = None


class CohortSlots(NamedTuple):
  """Static membership of one cohort: its client ids and C_j."""
  members: tuple[int, ...]
  clients_per_round: int


class RoundConfig(NamedTuple):
  """Static settings of the round program.

  cohorts: () for one cohort of every client (C = clients_per_round);
    otherwise one CohortSlots per cohort, members partitioning range(K) and
    clients_per_round summing to C.
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
    updates. So every client can be in flight at once (clients_per_round =
    num_clients: all free clients start every round) with the server
    taking max_arrivals a round: FedHAN's N/K staleness. A ticket whose
    model has left the ring (staleness > max_staleness) is dropped when
    due (`arrivals_expired`) and its client is free again.
    Model-poisoning attackers craft among the updates of the round they
    arrive in, and the broadcast is rebuilt from the stored trainable tree
    with the current method state.
  max_staleness: with train_on_arrival, the model ring's depth minus one
    (0: the delay cap).
  sample_strata: S > 1 splits the client ids into S equal contiguous
    blocks (strata) and every cohort draws C_j / S of its members from each
    stratum, uniformly within it (sample_cohort); 1 is the plain uniform
    draw over the cohort. A different distribution, so a setting of the
    run, not of its execution.
  client_data: 'replicated' (every device holds all K clients' data) or
    'sharded' (device d of the mesh holds the K / N clients d K / N ..
    (d + 1) K / N - 1 only, the layout of process-local data on a pod).
    Sharded data needs the strata to follow the devices (sample_strata a
    multiple of num_devices), so every slot a device runs holds one of its
    own clients. Same results as replicated data with the same strata.
  """
  num_clients: int          # K
  clients_per_round: int    # C
  strategy: str             # engine.execution.STRATEGIES
  chunk_size: int = 0
  num_devices: int = 1      # each cohort's slots are padded to a multiple
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
    if self.cohorts:
      return self.cohorts
    return (CohortSlots(tuple(range(self.num_clients)),
                        self.clients_per_round),)

  def padded(self, c: int) -> int:
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
    return sum(self.padded(s.clients_per_round) for s in self.cohort_slots())


def validate_round_config(config: RoundConfig) -> None:
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
  """Errors naming the setting when the strata or the sharded data layout
  cannot hold the round's samples."""
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


def sample_cohort(key: jax.Array, slots: CohortSlots, num_slots: int, *,
                  num_clients: int = 0, strata: int = 1
                  ) -> tuple[jax.Array, jax.Array]:
  """Uniform sample of C_j distinct members, sorted, padded to the slots.

  With strata > 1 (RoundConfig.sample_strata; num_clients K needed): C_j /
  strata members of each stratum (ids s K / strata .. (s + 1) K / strata -
  1), uniform within it, sorted; the slots are stratum-major, so under a
  mesh whose devices hold the strata in order every slot is a client of
  its own device. Slots past C_j are padding, as without strata.

  Returns:
    ids int32[num_slots] and mask bool[num_slots]; padded slots carry the
    first member's id and mask False.
  """
  members = jnp.asarray(slots.members, jnp.int32)
  k, c = len(slots.members), slots.clients_per_round
  if strata > 1:
    per = c // strata
    ids = []
    for s, block in enumerate(strata_members(slots, num_clients, strata)):
      block = jnp.asarray(block, jnp.int32)
      pick = jax.random.permutation(jax.random.fold_in(key, s),
                                    block.shape[0])[:per]
      ids.append(jnp.sort(block[pick]))
    ids = jnp.concatenate(ids)
  elif c == k:
    ids = members
  else:
    ids = jnp.sort(members[jax.random.permutation(key, k)[:c]])
  pad = num_slots - c
  mask = jnp.concatenate([jnp.ones(c, bool), jnp.zeros(pad, bool)])
  fill = jnp.full((pad,), slots.members[0], jnp.int32)
  return jnp.concatenate([ids.astype(jnp.int32), fill]), mask


def with_an_attacker(key: jax.Array, slots: CohortSlots, ids: jax.Array,
                     mask: jax.Array, malicious: jax.Array,
                     free: jax.Array | None) -> jax.Array:
  """ids with one attacker swapped in when the live sample holds none.

  A uniformly drawn attacker of the cohort that is free (not busy, not
  sampled) replaces the first live benign slot; without such an attacker
  or benign slot the sample is unchanged.

  Args:
    free: bool[K], clients that may start training (None: all).
  """
  members = jnp.asarray(slots.members, jnp.int32)
  sampled = jnp.zeros(malicious.shape, bool).at[
      jnp.where(mask, ids, malicious.shape[0])].set(True, mode='drop')
  ok = malicious[members] & ~sampled[members]
  if free is not None:
    ok = ok & free[members]
  bad_slot = malicious[ids] & mask
  benign_slot = mask & ~malicious[ids]
  draw = jnp.where(ok, jax.random.uniform(key, members.shape), -1.0)
  pick = members[jnp.argmax(draw)]
  swap = ~jnp.any(bad_slot) & jnp.any(ok) & jnp.any(benign_slot)
  slot = jnp.argmax(benign_slot)
  return jnp.where(swap & (jnp.arange(ids.shape[0]) == slot), pick, ids)


def sample_clients(key: jax.Array, config: RoundConfig
                   ) -> tuple[jax.Array, jax.Array]:
  """The single-cohort sample (see sample_cohort)."""
  slots = config.cohort_slots()
  if len(slots) != 1:
    raise SettingError('cohorts', 'sample_clients is for one cohort; use '
                       'sample_cohort')
  return sample_cohort(key, slots[0], config.num_slots,
                       num_clients=config.num_clients,
                       strata=config.sample_strata)


def device_blocked_members(slots: CohortSlots, config: RoundConfig
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Every member of the cohort once, in slots grouped by the device whose
  block of sharded data holds it, each device's group padded to the
  largest with masked copies of its first member (the setup step's
  "everyone" under client_data='sharded').

  Returns:
    ids int32[N * G] and mask bool[N * G] for N devices of G slots, and
    the slot order that lists the members in the cohort's own order,
    padding last.
  """
  blocks = strata_members(slots, config.num_clients, config.num_devices)
  width = max(len(b) for b in blocks)
  ids = np.concatenate([list(b) + [b[0]] * (width - len(b))
                        for b in blocks]).astype(np.int32)
  mask = np.concatenate([[True] * len(b) + [False] * (width - len(b))
                         for b in blocks])
  slot_of = {int(m): i for i, m in enumerate(ids) if mask[i]}
  order = np.array([slot_of[m] for m in slots.members] +
                   np.flatnonzero(~mask).tolist())
  return ids, mask, order


def _buffer(leaf) -> int | None:
  try:
    return leaf.unsafe_buffer_pointer()
  except Exception:  # pylint: disable=broad-except
    return None


def distinct_buffers(tree: Any, held: Any = ()) -> Any:
  """`tree` with every leaf copied that repeats an earlier leaf's buffer
  or one of `held`'s (arrays the caller keeps, which a donation of the
  result must not delete).

  Only those are copied: copying every leaf held the state twice, and
  FedHAN's 1,000-client state (12.4 GB) peaked at 17.2 GB at start-up.
  A leaf whose buffer cannot be read (several shards, not a jax array)
  is copied to be safe.
  """
  seen = {b for b in map(_buffer, jax.tree.leaves(held)) if b is not None}

  def once(leaf):
    pointer = _buffer(leaf)
    if pointer is None or pointer in seen:
      return jnp.copy(leaf)
    seen.add(pointer)
    return leaf

  return jax.tree.map(once, tree)


def init_server_state(method: Method, params: tuple[Params, ...],
                      num_clients: int, seed: int, *,
                      config: RoundConfig | None = None,
                      data: FederatedData | None = None,
                      server_data: PyTree = ()) -> ServerState:
  """The round-0 state.

  Args:
    method: the federated algorithm.
    params: one freshly initialised full params tree per cohort (a bare
      tree is taken as a single cohort's).
    num_clients: K.
    seed: seeds the round keys and the method's init.
    config, data, server_data: needed only with client delays, to size the
      in-flight buffers from the client outputs' shapes.
  """
  if not isinstance(params, tuple):
    params = (params,)
  key = jax.random.key(seed)
  key, init_key = jax.random.split(key)
  global_params, method_state = method.init(params, num_clients, init_key)
  # A method state may hold the params themselves (rules that track the
  # global model), and cohorts' trees may share a buffer (aligned shared
  # layers); no buffer may appear twice when the state is donated to the
  # round, nor be one of the caller's params, so those are copied.
  global_params, method_state = distinct_buffers(
      (global_params, method_state), held=params)
  state = ServerState(round=jnp.zeros((), jnp.int32),
                      params=tuple(global_params),
                      method_state=method_state,
                      key=jax.random.key_data(key))
  if config is not None and config.delay is not None:
    if data is None:
      raise SettingError('client_delay', 'sizing the in-flight buffers '
                         'needs the federated data')
    state = state._replace(pending=init_pending(method, config, state, data,
                                                server_data))
  return state


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


def init_pending(method: Method, config: RoundConfig, state: ServerState,
                 data: FederatedData, server_data: PyTree) -> AsyncState:
  busy = jnp.zeros((config.num_clients,), jnp.int32)
  if config.train_on_arrival:
    ticket = {'key': jax.ShapeDtypeStruct((2,), jnp.uint32),
              'rank': jax.ShapeDtypeStruct((), jnp.int32)}
    r = config.model_ring()
    buffers = tuple(delay_lib.empty_tickets(ticket, config.num_clients)
                    for _ in config.cohort_slots())
    models = tuple(jax.tree.map(lambda p: jnp.zeros((r, *p.shape), p.dtype),
                                params) for params in state.params)
    return AsyncState(buffers, busy, models)
  buffers = tuple(
      delay_lib.empty_buffer(
          client_output_shapes(method, j, state, data, server_data),
          config.padded(s.clients_per_round), config.delay)
      for j, s in enumerate(config.cohort_slots()))
  return AsyncState(buffers, busy)


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of values[c] over mask[c]; masked NaNs do not leak."""
  m = mask.astype(jnp.float32)
  return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(jnp.sum(m), 1.0)


def malicious_slots(key: jax.Array, ids: jax.Array, mask: jax.Array,
                    threat: Threat, num_clients: int, round_number: jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
  """bool[C] attacking this round, int32[C] rank among the attackers."""
  if threat.malicious is not None:
    is_mal = threat.malicious[ids]
    # Rank by client id, so a client keeps its rank (DBA piece) every round.
    rank = jnp.cumsum(threat.malicious)[ids] - 1
  else:
    chosen = jnp.zeros(num_clients, bool).at[
        jax.random.permutation(key, num_clients)[:threat.num_malicious]
    ].set(True)
    is_mal = chosen[ids]
    rank = jnp.cumsum(is_mal) - 1
  is_mal = is_mal & mask & (round_number >= threat.start_round)
  return is_mal, jnp.maximum(rank, 0).astype(jnp.int32)


def slot_attackers(threat: Threat | None, key: jax.Array, ids: jax.Array,
                   mask: jax.Array, num_clients: int, round_number: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
  """`malicious_slots`, or no attacker without a (present) threat."""
  if threat is None or threat.absent:
    return jnp.zeros(ids.shape, bool), jnp.zeros(ids.shape, jnp.int32)
  return malicious_slots(key, ids, mask, threat, num_clients, round_number)


def client_keys(key: jax.Array, ids: jax.Array) -> jax.Array:
  """Key data per slot: the client id folded into `key`."""
  return jax.vmap(lambda i: jax.random.key_data(
      jax.random.fold_in(key, i)))(ids)


def detection_counts(weights: jax.Array, is_mal: jax.Array,
                     mask: jax.Array) -> dict[str, jax.Array]:
  """Confusion counts of 'excluded' (weight 0) against 'malicious'."""
  flagged = (weights <= 0) & mask
  f32 = lambda b: jnp.sum(b).astype(jnp.float32)
  return {'det_tp': f32(flagged & is_mal), 'det_fp': f32(flagged & ~is_mal &
                                                          mask),
          'det_fn': f32(~flagged & is_mal), 'det_tn': f32(~flagged & ~is_mal
                                                          & mask)}


def weight_auc(weights: jax.Array, is_mal: jax.Array,
               mask: jax.Array) -> jax.Array:
  """P(a benign client's weight > a malicious client's), ties count 1/2.

  1 is perfect down-weighting of attackers, 0.5 chance, 0 inverted; NaN
  when the round has no real benign or no real malicious client.
  """
  benign = mask & ~is_mal
  mal = mask & is_mal
  w = jnp.where(mask, weights, 0.0)
  diff = w[:, None] - w[None, :]
  pair = benign[:, None] & mal[None, :]
  score = jnp.where(diff > 0, 1.0, jnp.where(diff == 0, 0.5, 0.0))
  pairs = jnp.sum(pair).astype(jnp.float32)
  return jnp.where(pairs > 0, jnp.sum(jnp.where(pair, score, 0.0)) /
                   jnp.maximum(pairs, 1.0), jnp.nan)


def weight_metrics(weights: jax.Array, is_mal: jax.Array,
                   mask: jax.Array) -> dict[str, jax.Array]:
  metrics = detection_counts(weights, is_mal, mask)
  # Mean share of the round's aggregation weight (shares sum to 1 over the
  # real clients; FedAvg's raw weights are example counts).
  total = jnp.sum(jnp.where(mask, weights, 0.0))
  share = weights / jnp.where(total > 0, total, 1.0)
  metrics['weight_malicious'] = masked_mean(share, is_mal)
  metrics['weight_benign'] = masked_mean(share, mask & ~is_mal)
  metrics['detection_weight_auc'] = weight_auc(weights, is_mal, mask)
  return metrics


def _with_flat_deltas(outputs, flat):
  """outputs with its deltas replaced by the rows of flat float[C, D]."""
  like = jax.tree.map(lambda leaf: leaf[0], outputs.delta)
  return outputs._replace(delta=jax.vmap(
      lambda row: unravel_like(row, like))(flat))


def _attack(outputs, threat, is_mal, mask, key):
  return _with_flat_deltas(outputs, threat.model_attack(
      ravel_clients(outputs.delta), is_mal, mask, key))


def _stateful_attack(outputs, threat, is_mal, mask, key, attack_state,
                     context):
  attacked, attack_state, decoys = threat.stateful_attack.apply(
      ravel_clients(outputs.delta), is_mal, mask, key, attack_state, context)
  return _with_flat_deltas(outputs, attacked), attack_state, decoys


def client_view(config: RoundConfig, data: FederatedData,
                client_id: jax.Array, is_mal: jax.Array | bool = False,
                rank: jax.Array | int = 0) -> LocalData:
  """ONE client's LocalData inside run_clients: its row is its id within
  the device's block of the data (the id itself when replicated)."""
  row = client_id % config.block
  return LocalData(data.x, data.y, client_id, data.count[row], is_mal,
                   rank, row)


def check_mesh_for_data(config: RoundConfig, mesh: Mesh | None) -> None:
  """The mesh matches the config's device count, and sharded data on
  several devices has the mesh that splits it: off the mesh, or on a mesh
  of another size, a client's row within its block would index the wrong
  rows."""
  if mesh is not None and mesh.size != config.num_devices:
    raise SettingError('num_devices', f'the mesh has {mesh.size} devices, '
                       f'the config says {config.num_devices}')
  if config.block < config.num_clients and mesh is None:
    raise SettingError('client_data', f'sharded client data over '
                       f'{config.num_devices} devices needs their mesh')


def data_specs(config: RoundConfig):
  """run_clients' specs for its shared (broadcast, data, server_data): the
  data split over the clients axis when sharded, else None (replicated)."""
  if config.block == config.num_clients:
    return None
  split = P(CLIENT_AXIS)
  return (P(), FederatedData(split, split, split), P())


def all_finite(tree: PyTree) -> jax.Array:
  """bool[]: every entry of every leaf is finite."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf))
                            for leaf in jax.tree.leaves(tree)]))


def make_setup_step(method: Method, config: RoundConfig, *,
                    mesh: Mesh | None = None) -> Callable:
  """setup_step(state, data, server_data) -> state: the method's one-off
  step before round 1 (Method.client_setup for every member of every
  cohort, then Method.server_setup), run like a round's clients (the
  execution strategy and the device mesh apply). A client's key is
  fold_in(state key, id), and the state's key does not advance, so a run
  with a setup step and one resumed after it match bitwise."""
  if method.client_setup is None:
    raise SettingError('method', f'{method.name!r} has no setup step')
  validate_round_config(config)
  check_mesh_for_data(config, mesh)
  cohorts = config.cohort_slots()
  shared_specs = data_specs(config)

  def client_fn(j):
    def one(per_client, shared):
      client_id, key_data, client_state = per_client
      broadcast, data, server_data = shared
      local = client_view(config, data, client_id)
      return method.client_setup(j, broadcast, client_state, local,
                                 jax.random.wrap_key_data(key_data),
                                 server_data)
    return one

  def setup_step(state: ServerState, data: FederatedData,
                 server_data: PyTree = ()):
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key), 0x5E7)
    results = []
    for j, slots in enumerate(cohorts):
      everyone = CohortSlots(slots.members, len(slots.members))
      order = None
      if config.block < config.num_clients:   # sharded data
        # Run by device; the server setup sees the members in their order.
        ids, mask, order = device_blocked_members(slots, config)
        ids, mask = jnp.asarray(ids), jnp.asarray(mask)
      else:
        ids, mask = sample_cohort(key, everyone, config.padded(
            len(slots.members)))
      keys = jax.vmap(lambda i: jax.random.key_data(
          jax.random.fold_in(key, i)))(ids)
      client_state = method.client_state(state.method_state, j, ids)
      outputs = run_clients(client_fn(j), (ids, keys, client_state),
                            (method.broadcast(state, j), data, server_data),
                            strategy=config.strategy,
                            chunk_size=config.chunk_size, mesh=mesh,
                            shared_specs=shared_specs)
      if order is not None:
        ids, mask, outputs = jax.tree.map(lambda leaf: leaf[order],
                                          (ids, mask, outputs))
      results.append((ids, mask, outputs))
    return state._replace(method_state=on_mesh(method.server_setup, mesh)(
        state, tuple(results)))

  return setup_step


def make_round_step(method: Method, config: RoundConfig, *,
                    mesh: Mesh | None = None,
                    threat: Threat | None = None,
                    skip_nonfinite: bool = False,
                    log_clients: bool = False) -> Callable:
  """Builds round_step(state, data, server_data) -> (state, metrics).

  Every round reports metrics['nonfinite_model'] (1.0 when the new global
  params hold a NaN or Inf, i.e. the model or the aggregated update
  diverged).

  Args:
    method: the federated algorithm.
    config: static round settings.
    mesh: optional mesh with a 'clients' axis; config.num_devices must be
      its size.
    threat: optional attackers (see Threat).
    skip_nonfinite: drop a round whose new global params are not finite:
      the state keeps its params, method state and in-flight updates, and
      only the round counter and the key advance.
    log_clients: also return metrics['clients'], per arrival slot (all
      cohorts, concatenated): 'id', 'mask' (arrived), 'malicious', the
      aggregation 'weight' (when the method reports weights) and every
      per-client metric of the arriving updates (SDFC's T_k is
      'fisher_discrepancy').

  Returns:
    A pure function; jit it with donate_argnums=0.
  """
  validate_round_config(config)
  if threat is not None and threat.stateful_attack is not None and (
      config.delay is not None or len(config.cohort_slots()) != 1):
    raise SettingError('attack', f'{threat.stateful_attack.name} keeps '
                       'state across synchronous rounds of one cohort: it '
                       'runs without client delays and cohorts')
  check_mesh_for_data(config, mesh)
  if (config.block < config.num_clients and threat is not None and
      threat.every_round):
    raise SettingError('client_data', 'the every-round attacker swaps a '
                       "client from any device's block into a slot; it "
                       'needs replicated client data')
  cohorts = config.cohort_slots()
  delay = config.delay
  shared_specs = data_specs(config)
  # Slots can be masked when clients are busy (delays) or pad a cohort to
  # the device count. A masked slot's output is never used, so under
  # lax.map (the sequential strategy) it is skipped by lax.cond; under vmap
  # the cond is a select. Rounds without masked slots keep the plain call.
  skip_masked = delay is not None or any(
      config.padded(s.clients_per_round) != s.clients_per_round
      for s in cohorts)

  def client_fn(j):
    def one_client(per_client, shared):
      client_id, key_data, client_state, is_mal, rank, live = per_client
      broadcast, data, server_data = shared
      local = client_view(config, data, client_id, is_mal, rank)
      key = jax.random.wrap_key_data(key_data)
      train = lambda: method.client_update(j, broadcast, client_state, local,
                                           key, server_data)
      if not skip_masked:
        return train()
      zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                   jax.eval_shape(train))
      return jax.lax.cond(live, train, zeros)
    return one_client

  def take_due(buffer, busy_until, now):
    """The server takes max_arrivals of the due updates (oldest first); the
    clients of the others stay busy a round longer."""
    rows, taken, staleness, late, buffer = delay_lib.take_oldest(
        buffer, now, config.padded(config.max_arrivals))
    busy_until = busy_until.at[jnp.where(late, buffer.ids,
                                         config.num_clients)].set(
        now + 1, mode='drop')
    return (rows, taken, staleness, buffer, busy_until,
            jnp.sum(late).astype(jnp.float32))

  def arrival_fn(j):
    """A client trained in the round its update is due (train_on_arrival):
    its broadcast is rebuilt from the stored model of its start round."""
    def one_client(per_client, shared):
      (client_id, key_data, client_state, is_mal, rank, live, params_row,
       start) = per_client
      state, data, server_data = shared
      params = tuple(params_row if i == j else p
                     for i, p in enumerate(state.params))
      broadcast = method.broadcast(state._replace(params=params,
                                                  round=start - 1), j)
      return client_fn(j)((client_id, key_data, client_state, is_mal, rank,
                           live), (broadcast, data, server_data))
    return one_client

  def retrainer(state, data, server_data, key, threat_key, attack_key):
    """The 'retrain' extra: clients `ids` of the (only) cohort trained from
    `values` in place of its global params, as in round `round_` (a
    replayed one): their data, width spec and window of that round and, for
    attackers of that round, their poisoning and model attack (a stateful
    attack is not rerun; a resampled attacker set is this round's draw).
    Keys: the client id folded into `key` folded with `round_`. The slots
    are padded to the device count."""
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
          client_fn(0),
          (ids, keys, method.client_state(state.method_state, 0, ids),
           is_mal, rank, mask), (broadcast, data, server_data),
          strategy=config.strategy, chunk_size=config.chunk_size, mesh=mesh,
          shared_specs=shared_specs)
      if threat is not None and threat.model_attack is not None:
        outputs = _attack(outputs, threat, is_mal, mask,
                          jax.random.fold_in(attack_key, round_))
      cut = lambda tree: jax.tree.map(lambda leaf: leaf[:size], tree)
      return cut(outputs.delta), cut(outputs.coverage)
    return retrain

  def round_step(state: ServerState, data: FederatedData,
                 server_data: PyTree = ()):
    key = jax.random.wrap_key_data(state.key)
    (key, sample_key, client_key, server_key, threat_key,
     attack_key) = jax.random.split(key, 6)
    now = state.round + 1
    # Cohort 0 uses the round's keys as they are (a one-cohort round is the
    # plain synchronous round); later cohorts fold in their index.
    per_cohort = lambda k, j: k if j == 0 else jax.random.fold_in(k, j)
    pending = state.pending
    busy_until = pending.busy_until if delay is not None else None
    arrivals, arrival_mal, buffers, rings = [], [], [], []
    computed = []    # (outputs, run mask) of this round's computations
    num_attacking = jnp.float32(0.0)
    attack_state = state.attack
    decoys = None
    deferred = jnp.float32(0.0)   # due updates left for the next round
    expired = jnp.float32(0.0)    # train_on_arrival tickets too stale
    for j, slots in enumerate(cohorts):
      ids, mask = sample_cohort(per_cohort(sample_key, j), slots,
                                config.padded(slots.clients_per_round),
                                num_clients=config.num_clients,
                                strata=config.sample_strata)
      if delay is not None:
        mask = mask & (busy_until[ids] < now)   # busy clients are away
      if threat is not None and threat.absent:
        mask = mask & ~threat.malicious[ids]    # attackers never take part
      if threat is not None and threat.every_round and not threat.absent:
        forced = with_an_attacker(
            jax.random.fold_in(per_cohort(sample_key, j), 0xA77), slots,
            ids, mask, threat.malicious,
            None if delay is None else busy_until < now)
        ids = jnp.where(now >= threat.start_round, forced, ids)
      is_mal, rank = slot_attackers(threat, threat_key, ids, mask,
                                    config.num_clients, now)
      # A client's key depends on its id and the round, never on its slot.
      keys = client_keys(client_key, ids)
      if delay is not None:   # the started clients are busy until due
        delays = delay_lib.sample_delays(
            jax.random.fold_in(per_cohort(sample_key, j), 0x5EED), ids,
            delay)
        busy_until = busy_until.at[jnp.where(mask, ids, config.num_clients)
                                   ].set(now + delays, mode='drop')
      if config.train_on_arrival:
        r = config.model_ring()
        ring = jax.tree.map(lambda a, p: a.at[now % r].set(p),
                            pending.models[j], state.params[j])
        buffer = delay_lib.start_tickets(pending.buffers[j], now,
                                         {'key': keys, 'rank': rank}, ids,
                                         is_mal, delays, mask)
        # A due ticket whose start model has left the ring is dropped.
        stale = (buffer.valid & (buffer.arrival_round == now) &
                 (buffer.computed_round <= now - r))
        buffer = buffer._replace(valid=buffer.valid & ~stale)
        busy_until = jnp.where(stale, now, busy_until)
        expired += jnp.sum(stale).astype(jnp.float32)
        rows, taken, staleness, buffer, busy_until, late = take_due(
            buffer, busy_until, now)
        deferred += late
        a_ids = buffer.ids[rows]
        start = buffer.computed_round[rows]
        a_mal = buffer.is_malicious[rows] & taken
        ticket = jax.tree.map(lambda leaf: leaf[rows], buffer.outputs)
        outputs = run_clients(
            arrival_fn(j),
            (a_ids, ticket['key'],
             method.client_state(state.method_state, j, a_ids), a_mal,
             ticket['rank'], taken,
             jax.tree.map(lambda a: a[start % r], ring), start),
            (state._replace(pending=()), data, server_data),
            strategy=config.strategy, chunk_size=config.chunk_size,
            mesh=mesh)
        if threat is not None and threat.model_attack is not None:
          outputs = _attack(outputs, threat, a_mal, taken,
                            per_cohort(attack_key, j))
        num_attacking += jnp.sum(a_mal).astype(jnp.float32)
        computed.append((outputs, taken))
        buffers.append(buffer)
        rings.append(ring)
        arrivals.append(Arrivals(a_ids, taken, outputs, staleness))
        arrival_mal.append(a_mal)
        continue
      num_attacking += jnp.sum(is_mal).astype(jnp.float32)
      client_state = method.client_state(state.method_state, j, ids)
      outputs = run_clients(client_fn(j),
                            (ids, keys, client_state, is_mal, rank, mask),
                            (method.broadcast(state, j), data, server_data),
                            strategy=config.strategy,
                            chunk_size=config.chunk_size, mesh=mesh,
                            shared_specs=shared_specs)
      if threat is not None and threat.model_attack is not None:
        outputs = _attack(outputs, threat, is_mal, mask,
                          per_cohort(attack_key, j))
      if threat is not None and threat.stateful_attack is not None:
        outputs, attack_state, decoys = _stateful_attack(
            outputs, threat, is_mal, mask,
            jax.random.fold_in(attack_key, 0x3DFED), attack_state,
            AttackContext(state.params[j], data, ids, rank))
        # A decoy is the attackers' upload in a benign client's slot.
        is_mal = is_mal | decoys
      computed.append((outputs, mask))
      if delay is None:
        arrivals.append(Arrivals(ids, mask, outputs,
                                 jnp.zeros(ids.shape, jnp.int32)))
        arrival_mal.append(is_mal)
        continue
      buffer = delay_lib.enqueue(pending.buffers[j], now, outputs, ids,
                                 is_mal, delays, mask, delay)
      if config.max_arrivals:
        rows, taken, staleness, buffer, busy_until, late = take_due(
            buffer, busy_until, now)
        deferred += late
        buffers.append(buffer)
        arrivals.append(Arrivals(
            buffer.ids[rows], taken,
            jax.tree.map(lambda leaf: leaf[rows], buffer.outputs),
            staleness))
        arrival_mal.append(buffer.is_malicious[rows] & taken)
        continue
      arriving, staleness, buffer = delay_lib.dequeue(buffer, now)
      buffers.append(buffer)
      arrivals.append(Arrivals(buffer.ids, arriving, buffer.outputs,
                               staleness))
      arrival_mal.append(buffer.is_malicious & arriving)

    hooks = {}
    if 'retrain' in method.provides:
      hooks['retrain'] = retrainer(state, data, server_data,
                                   jax.random.fold_in(sample_key, 0x4E7A),
                                   threat_key, attack_key)
    params, method_state, info = on_mesh(method.server_update, mesh)(
        state, tuple(arrivals), server_key, server_data, **hooks)

    metrics = {}
    names = sorted(set().union(*(o.metrics for o, _ in computed)))
    for name in names:
      values = [(o.metrics[name], m) for o, m in computed
                if name in o.metrics]
      metrics[name] = masked_mean(jnp.concatenate([v for v, _ in values]),
                                  jnp.concatenate([m for _, m in values]))
    metrics['examples'] = sum(jnp.sum(jnp.where(m, o.weight, 0.0))
                              for o, m in computed)
    metrics['num_attacking'] = num_attacking
    if decoys is not None:
      metrics['attack_decoys'] = jnp.sum(decoys).astype(jnp.float32)
      metrics.update({f'attack_{name}': value for name, value in
                      threat.stateful_attack.metrics(attack_state).items()})
    metrics['clients_trained'] = sum(jnp.sum(m).astype(jnp.float32)
                                     for _, m in computed)
    if delay is not None:
      mask_all = jnp.concatenate([a.mask for a in arrivals])
      stale = jnp.concatenate([a.staleness for a in arrivals])
      metrics['arrivals'] = jnp.sum(mask_all).astype(jnp.float32)
      if config.max_arrivals:
        metrics['arrivals_deferred'] = deferred
      if config.train_on_arrival:
        metrics['arrivals_expired'] = expired
      metrics['staleness_mean'] = masked_mean(stale.astype(jnp.float32),
                                              mask_all)
      metrics['staleness_max'] = jnp.max(jnp.where(mask_all, stale, 0)
                                         ).astype(jnp.float32)
    info = dict(info)
    weights = info.pop('weights', None)
    per_client_info = info.pop('per_client', {})
    if weights is not None:
      metrics.update(weight_metrics(
          jnp.concatenate(weights), jnp.concatenate(arrival_mal),
          jnp.concatenate([a.mask for a in arrivals])))
    if log_clients:
      cat = lambda values: jnp.concatenate(list(values))
      per = {'id': cat(a.ids for a in arrivals),
             'mask': cat(a.mask for a in arrivals),
             'malicious': cat(arrival_mal)}
      if weights is not None:
        per['weight'] = cat(weights)
      shared = set.intersection(*(set(a.outputs.metrics) for a in arrivals))
      for name in sorted(shared):
        per[name] = cat(a.outputs.metrics[name] for a in arrivals)
      for name, values in per_client_info.items():
        if values.shape == per['id'].shape:
          per[name] = values
      metrics['clients'] = per
    metrics.update({k: v for k, v in info.items() if jnp.ndim(v) == 0})
    new_pending = (AsyncState(tuple(buffers), busy_until, tuple(rings))
                   if delay is not None else state.pending)
    new_state = ServerState(now, tuple(params), method_state,
                            jax.random.key_data(key), new_pending,
                            attack_state)
    finite = all_finite(new_state.params)
    metrics['nonfinite_model'] = 1.0 - finite.astype(jnp.float32)
    if skip_nonfinite:
      kept = state._replace(round=now, key=new_state.key)
      new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                               new_state, kept)
    return new_state, metrics

  return round_step
