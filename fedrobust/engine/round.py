"""One federated round as one pure function, jitted by the caller.

round_step(state, data, server_data) -> (state, metrics):
  1. sample C of the K clients (sorted ids, padded to a multiple of the
     device count with masked slots);
  2. run the method's client_update for every slot (engine.execution);
  3. hand the stacked outputs and the mask to the method's server_update;
  4. advance the round counter and the PRNG key.

With a Threat, the round also marks this round's attacking slots (data
poisoning happens inside their local training) and applies the model
attack to the stacked deltas between 2 and 3. Aggregators report
info['weights'] [C]; the round turns them into detection counts.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from fedrobust.engine.execution import run_clients, validate_strategy
from fedrobust.tree import ravel_clients, unravel_like
from fedrobust.types import ClientOutput, FederatedData, LocalData, ServerState

Params = Any
PyTree = Any


class Method(NamedTuple):
  """A federated algorithm as pure functions (see STYLE.md).

  init(params, num_clients, key) -> method_state
      Server-side state; per-client arrays are leaves [K, ...].
  client_state(method_state, ids int32[C]) -> per-client slices [C, ...]
  client_update(params, client_state, local: LocalData, key, server_data)
      -> ClientOutput, for ONE client.
  server_update(state: ServerState, ids, outputs, mask, key, server_data)
      -> (params, method_state, info dict of arrays)
      outputs: ClientOutput with leaves [C, ...]; mask: bool[C].
  """
  name: str
  init: Callable[..., PyTree]
  client_state: Callable[[PyTree, jax.Array], PyTree]
  client_update: Callable[..., ClientOutput]
  server_update: Callable[..., tuple[Params, PyTree, dict[str, jax.Array]]]


class Threat(NamedTuple):
  """Who attacks, from when, and how updates are poisoned.

  malicious: bool[K] fixed malicious set, or None to draw `num_malicious`
    clients afresh every round from the round key.
  start_round: first (1-based) round in which attackers act; before it
    they behave honestly.
  model_attack: optional apply(updates float[C, D], is_malicious bool[C],
    mask bool[C], key) -> float[C, D] on the raveled client deltas.
  Data poisoning is the method's business: client_update sees
  LocalData.is_malicious and LocalData.attacker_rank.
  """
  malicious: jax.Array | None = None
  num_malicious: int = 0
  start_round: int = 1
  model_attack: Callable | None = None


class RoundConfig(NamedTuple):
  """Static settings of the round program."""
  num_clients: int          # K
  clients_per_round: int    # C
  strategy: str             # engine.execution.STRATEGIES
  chunk_size: int = 0
  num_devices: int = 1      # slots are padded to a multiple of this

  @property
  def num_slots(self) -> int:
    d = self.num_devices
    return -(-self.clients_per_round // d) * d


def validate_round_config(config: RoundConfig) -> None:
  if config.num_clients < 1:
    raise ValueError(f'--num_clients must be >= 1, got {config.num_clients}')
  if not 1 <= config.clients_per_round <= config.num_clients:
    raise ValueError(
        f'--clients_per_round={config.clients_per_round} must be in '
        f'[1, --num_clients={config.num_clients}]')
  validate_strategy(config.strategy, config.chunk_size)


def sample_clients(key: jax.Array, config: RoundConfig
                   ) -> tuple[jax.Array, jax.Array]:
  """Uniform sample of C distinct clients, sorted, padded to the slots.

  Returns:
    ids int32[slots] and mask bool[slots]; padded slots carry id 0 and
    mask False.
  """
  k, c = config.num_clients, config.clients_per_round
  if c == k:
    ids = jnp.arange(k, dtype=jnp.int32)
  else:
    ids = jnp.sort(jax.random.permutation(key, k)[:c]).astype(jnp.int32)
  pad = config.num_slots - c
  mask = jnp.concatenate([jnp.ones(c, bool), jnp.zeros(pad, bool)])
  return jnp.concatenate([ids, jnp.zeros(pad, jnp.int32)]), mask


def init_server_state(method: Method, params: Params, num_clients: int,
                      seed: int) -> ServerState:
  key = jax.random.key(seed)
  key, init_key = jax.random.split(key)
  # A method state may hold the params themselves (rules that track the
  # global model); copy it so no buffer appears twice when the state is
  # donated to the round.
  method_state = jax.tree.map(jnp.copy,
                              method.init(params, num_clients, init_key))
  return ServerState(round=jnp.zeros((), jnp.int32), params=params,
                     method_state=method_state,
                     key=jax.random.key_data(key))


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


def detection_counts(weights: jax.Array, is_mal: jax.Array,
                     mask: jax.Array) -> dict[str, jax.Array]:
  """Confusion counts of 'excluded' (weight 0) against 'malicious'."""
  flagged = (weights <= 0) & mask
  f32 = lambda b: jnp.sum(b).astype(jnp.float32)
  return {'det_tp': f32(flagged & is_mal), 'det_fp': f32(flagged & ~is_mal &
                                                          mask),
          'det_fn': f32(~flagged & is_mal), 'det_tn': f32(~flagged & ~is_mal
                                                          & mask)}


def make_round_step(method: Method, config: RoundConfig, *,
                    mesh: Mesh | None = None,
                    threat: Threat | None = None) -> Callable:
  """Builds round_step(state, data, server_data) -> (state, metrics).

  Args:
    method: the federated algorithm.
    config: static round settings.
    mesh: optional mesh with a 'clients' axis; config.num_devices must be
      its size.
    threat: optional attackers (see Threat).

  Returns:
    A pure function; jit it with donate_argnums=0.
  """
  validate_round_config(config)
  if mesh is not None and mesh.size != config.num_devices:
    raise ValueError(f'mesh has {mesh.size} devices, config says '
                     f'{config.num_devices}')

  def one_client(per_client, shared):
    client_id, key_data, client_state, is_mal, rank = per_client
    params, data, server_data = shared
    local = LocalData(data.x, data.y, client_id, data.count[client_id],
                      is_mal, rank)
    key = jax.random.wrap_key_data(key_data)
    return method.client_update(params, client_state, local, key, server_data)

  def round_step(state: ServerState, data: FederatedData,
                 server_data: PyTree = ()):
    key = jax.random.wrap_key_data(state.key)
    (key, sample_key, client_key, server_key, threat_key,
     attack_key) = jax.random.split(key, 6)
    ids, mask = sample_clients(sample_key, config)
    if threat is None:
      is_mal = jnp.zeros(ids.shape, bool)
      rank = jnp.zeros(ids.shape, jnp.int32)
    else:
      is_mal, rank = malicious_slots(threat_key, ids, mask, threat,
                                     config.num_clients, state.round + 1)
    # A client's key depends on its id and the round, never on its slot.
    keys = jax.vmap(lambda i: jax.random.key_data(
        jax.random.fold_in(client_key, i)))(ids)
    client_state = method.client_state(state.method_state, ids)
    outputs = run_clients(one_client, (ids, keys, client_state, is_mal, rank),
                          (state.params, data, server_data),
                          strategy=config.strategy,
                          chunk_size=config.chunk_size, mesh=mesh)
    if threat is not None and threat.model_attack is not None:
      flat = ravel_clients(outputs.delta)
      attacked = threat.model_attack(flat, is_mal, mask, attack_key)
      like = jax.tree.map(lambda leaf: leaf[0], outputs.delta)
      outputs = outputs._replace(delta=jax.vmap(
          lambda row: unravel_like(row, like))(attacked))
    params, method_state, info = method.server_update(
        state, ids, outputs, mask, server_key, server_data)
    metrics = {name: masked_mean(v, mask)
               for name, v in outputs.metrics.items()}
    metrics['examples'] = jnp.sum(jnp.where(mask, outputs.weight, 0.0))
    metrics['num_attacking'] = jnp.sum(is_mal).astype(jnp.float32)
    info = dict(info)
    weights = info.pop('weights', None)
    if weights is not None:
      metrics.update(detection_counts(weights, is_mal, mask))
      # Mean share of the round's aggregation weight (shares sum to 1 over
      # the real clients; FedAvg's raw weights are example counts).
      total = jnp.sum(jnp.where(mask, weights, 0.0))
      share = weights / jnp.where(total > 0, total, 1.0)
      metrics['weight_malicious'] = masked_mean(share, is_mal)
      metrics['weight_benign'] = masked_mean(share, mask & ~is_mal)
    metrics.update({k: v for k, v in info.items() if jnp.ndim(v) == 0})
    new_state = ServerState(state.round + 1, params, method_state,
                            jax.random.key_data(key))
    return new_state, metrics

  return round_step
