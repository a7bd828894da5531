"""State, data and component contracts shared by the engine and the methods.

Dimension letters: K all clients of the federation, C clients in a round
(C_j in cohort j), P a cohort's arrival slots (C_j without client delays,
C_j * (max_delay + 1) with them), N examples of the largest client
(padding), S local steps, B batch.

Methods import this module, never the engine: the engine batches, shards
and sequences what a Method declares.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

Params = Any
PyTree = Any
Info = dict[str, jax.Array]


class FederatedData(NamedTuple):
  """Every client's training data, padded to the largest client, on device.

  Images stay uint8 until a batch is gathered inside the compiled round.
  """
  x: jax.Array       # uint8[K, N, H, W, Ch]
  y: jax.Array       # int32[K, N]
  count: jax.Array   # int32[K], real examples of each client (<= N)


class LocalData(NamedTuple):
  """ONE client's view inside the round: the shared arrays plus its id.

  x and y hold every client of the device's block: all K clients when the
  data is replicated, K / N when it is sharded over the mesh's N devices
  (RoundConfig.client_data). A client's own rows are x[data.row] (the
  `row` field, or its id when the field is None); its id stays its global
  identity (key folds, per-client draws).
  """
  x: jax.Array          # uint8[K, N, H, W, Ch] (not batched over clients)
  y: jax.Array          # int32[K, N]
  client_id: jax.Array  # int32[]
  count: jax.Array      # int32[]
  is_malicious: jax.Array | bool = False  # bool[], attacking this round
  attacker_rank: jax.Array | int = 0      # int32[], rank among attackers
  data_row: jax.Array | None = None       # int32[], the client's row of x

  @property
  def row(self) -> jax.Array:
    """The client's index into x and y."""
    return self.client_id if self.data_row is None else self.data_row


class BatchPlan(NamedTuple):
  """ONE client's local-training schedule; leading axis S = epochs * steps."""
  index: jax.Array         # int32[S, B], rows of the client's data
  example_mask: jax.Array  # bool[S, B], False for padding in a partial batch
  step_mask: jax.Array     # bool[S], False for a step past the client's data


class ClientOutput(NamedTuple):
  """What ONE client returns; stacked over a cohort's slots as [C, ...].

  coverage: None when the client's update covers every coordinate of its
  cohort's trainable tree; otherwise a tree shaped like `delta` holding 1.0
  where the client owns the coordinate (a width-sliced submodel, a LoRA
  rank below the cohort's largest) and 0.0 elsewhere. Aggregators that read
  coverage average each coordinate over its owners only.
  """
  delta: Params          # client trainable - broadcast trainable
  weight: jax.Array      # float32[], aggregation weight (examples seen)
  client_state: PyTree   # the method's new per-client state (() if none)
  metrics: dict[str, jax.Array]  # float32[] each
  coverage: Params | None = None


class Arrivals(NamedTuple):
  """The updates a cohort hands the server this round, leaves [P, ...].

  Without client delays these are the round's own C_j slots. With delays
  (engine.delay), they are the cohort's in-flight buffer, and `mask` marks
  the entries that arrive this round. A masked entry never changes a
  result, whatever it holds.
  """
  ids: jax.Array          # int32[P] client ids
  mask: jax.Array         # bool[P] real and arriving now
  outputs: ClientOutput   # leaves [P, ...]
  staleness: jax.Array    # int32[P] rounds since the broadcast it used


class PendingBuffer(NamedTuple):
  """A cohort's updates in flight: a ring of R = max_delay + 1 rounds of C_j
  slots (P = R * C_j entries). Round r writes ring row r mod R; an entry
  written in round r arrives by round r + max_delay, before its row is
  reused."""
  outputs: ClientOutput     # leaves [P, ...]
  ids: jax.Array            # int32[P]
  is_malicious: jax.Array   # bool[P] (for detection metrics only)
  computed_round: jax.Array  # int32[P] round in which it was computed
  arrival_round: jax.Array  # int32[P]
  valid: jax.Array          # bool[P] still waiting to arrive


class AsyncState(NamedTuple):
  """Semi-asynchronous bookkeeping, part of the checkpointed ServerState.

  With train_on_arrival (RoundConfig) a buffer's `outputs` are the start
  tickets {'key': uint32[P, 2], 'rank': int32[P]} instead of updates, and
  `models` holds per cohort the ring of the last R global trainable trees
  (leaves [R, ...]): a client trains when its update is due, from the
  model of the round it started in.
  """
  buffers: tuple[PendingBuffer, ...]   # one per cohort
  busy_until: jax.Array                # int32[K] last round a client is busy
  models: tuple = ()                   # per cohort, with train_on_arrival


class AttackContext(NamedTuple):
  """What a stateful model attack sees of the round besides the updates."""
  params: Any             # theta_t, the global model the clients started from
  data: FederatedData     # every client's training data
  ids: jax.Array          # int32[C], the slots' client ids
  rank: jax.Array         # int32[C], each slot's rank among all attackers


class ServerState(NamedTuple):
  """Everything a round reads and writes; checkpointed as one pytree."""
  round: jax.Array     # int32[], rounds completed
  params: tuple[Params, ...]  # the global trainable tree of each cohort
  method_state: PyTree  # server-side state of the method (per-client arrays
                        # are indexed by client id: leaves [K, ...])
  key: jax.Array       # PRNG key data (uint32[2]); see engine.round
  pending: AsyncState | tuple = ()   # () without client delays
  attack: PyTree = ()  # a stateful attack's state (3DFed); () without one


class LegacyServerState(NamedTuple):
  """ServerState as checkpointed before the `attack` field was added:
  `legacy_server_state` restores such a checkpoint."""
  round: jax.Array
  params: tuple[Params, ...]
  method_state: PyTree
  key: jax.Array
  pending: AsyncState | tuple = ()


# Converters for checkpoints written by older versions: functions like ->
# ((template, convert), ...). Components with such states register theirs.
LEGACY_CONVERTERS: list = []


def legacy_states(like: Any) -> tuple:
  """Every registered (template, convert) pair that applies to `like`, a
  ServerState template, for Checkpointer.restore_latest(legacy=...)."""
  return sum((tuple(fn(like)) for fn in LEGACY_CONVERTERS), ())


def legacy_server_state(like: ServerState):
  """(template, convert) for Checkpointer.restore_latest(legacy=...): a
  checkpoint written before ServerState.attack existed restores into a
  state without a stateful attack."""
  if like.attack != ():
    return ()
  return ((LegacyServerState(*like[:5]),
           lambda old: ServerState(*old, attack=())),)


LEGACY_CONVERTERS.append(legacy_server_state)


class EvalModel(NamedTuple):
  """One model to evaluate: `label` '' is the run's headline model.

  clients: whose local test splits its local accuracy averages over (None:
  every member of its cohort).
  """
  label: str
  cohort: int      # whose architecture (Model) evaluates it
  params: Params   # full params for that cohort's Model.apply
  clients: tuple[int, ...] | None = None
  per_client: bool = False   # params has a leading axis of models, one
                             # per client of `clients` (private backbones)
                             # or, with `index`, one per distinct model
  index: Any = None   # with per_client: int[len(clients)], the row of
                      # params that client k of `clients` uses (width
                      # submodels: clients of one width share a row)
  apply: Any = None   # a method's own forward (params, x, *, train=False,
                      # key=None) -> logits for these params, instead of
                      # the cohort Model's (FedDPA's instance-wise mix)


class Method(NamedTuple):
  """A federated algorithm over one or more cohorts, as pure functions.

  A cohort j is a group of clients that share an architecture and a
  parameter transform; the engine batches each cohort's clients on its own
  and hands the server every cohort's arrivals at once.

  init(params, num_clients, key) -> (global_params, method_state)
      params: tuple over cohorts of freshly initialised full model params.
      global_params: tuple over cohorts of what the server aggregates (the
      full params, or a LoRA/width trainable tree). Per-client server state
      is leaves [K, ...] in method_state.
  broadcast(state, j) -> what every client of cohort j receives (one tree,
      replicated over the client axis).
  client_state(method_state, j, ids int32[C_j]) -> per-client inputs
      [C_j, ...] (() if none).
  client_update(j, broadcast, client_state, local: LocalData, key,
      server_data) -> ClientOutput, for ONE client of cohort j.
  server_update(state, arrivals: tuple[Arrivals], key, server_data)
      -> (global_params tuple, method_state, info). info['weights'], when
      present, is a tuple over cohorts of float32[P_j] aggregation weights
      (0 for an excluded client); the round turns it into detection
      metrics. Scalar info entries are logged. A method whose `provides`
      holds 'retrain' also takes the keyword retrain= (the engine's
      client-retraining hook, aggregators.base) and hands it to its rule.
  eval_models(state) -> tuple[EvalModel, ...] (host side, eager).
  provides: the keyword extras this method can hand an aggregator
      ('weights', 'ids', 'coverage', 'staleness', 'scores', 'params',
      'losses', 'retrain').
  client_setup, server_setup: optional one-off step before round 1
      (engine.round.make_setup_step), e.g. each client's local warm-up
      into a private backbone. client_setup(j, broadcast, client_state,
      local, key, server_data) -> per-client tree, for ONE client of
      cohort j (every member runs it); server_setup(state, results) ->
      method_state, results a tuple over cohorts of (ids [K_j], mask,
      stacked outputs).
  newcomer: optional; what a client that never took part starts from
      (fedrobust.adapt): newcomer(state, local: LocalData, key) ->
      (full params of cohort 0, info dict of scalars), for ONE newcomer,
      which may use its own data (HiLoRA routes it to a cluster). None:
      the headline global model.
  describe: optional; describe(method_state, client_groups) -> dict of
      JSON values for the run's summary (HiLoRA: its clusters, scored
      against the partition's true groups int[K] or None). Host side.
  """
  name: str
  init: Callable[..., tuple[tuple[Params, ...], PyTree]]
  broadcast: Callable[[ServerState, int], PyTree]
  client_state: Callable[[PyTree, int, jax.Array], PyTree]
  client_update: Callable[..., ClientOutput]
  server_update: Callable[..., tuple[tuple[Params, ...], PyTree, Info]]
  eval_models: Callable[[ServerState], tuple[EvalModel, ...]]
  provides: frozenset = frozenset()
  client_setup: Callable[..., PyTree] | None = None
  server_setup: Callable[..., PyTree] | None = None
  newcomer: Callable[..., tuple[Params, dict]] | None = None
  describe: Callable[[PyTree, Any], dict] | None = None
