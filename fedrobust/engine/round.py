"""One federated round as one pure function, jitted by the caller.

round_step(state, data, server_data) -> (state, metrics) is a pipeline.
For every cohort j (a static Python loop at trace time, so still one
program):

  1. sample (sampling.sample_slots): C_j of the cohort's clients (sorted
     ids, padded to a multiple of the device count with masked slots; or
     C_j / S from each of S strata of ids, as client data sharded over
     devices needs); with client delays, a sampled client still busy with
     an earlier update is masked; a Threat marks the attacking slots (data
     poisoning happens inside their local training);
  2. schedule: the arrival mode picks the clients that train now (the
     sample, or with train_on_arrival the clients whose updates are due);
  3. local training: the method's client_update for every slot
     (engine.execution), from this round's broadcast or, with
     train_on_arrival, from the model of the client's start round;
  4. threat (threat.attack_slots): the model attack on the attackers'
     deltas;
  5. arrive: without delays the trained slots arrive; with delays they
     enter the cohort's in-flight ring (engine.delay) and the entries due
     this round arrive, each with its staleness.

Then the method's server_update sees every cohort's arrivals at once, the
metrics stage (engine.metrics) reports the round, and the round counter
and PRNG key advance. The arrival mode (engine.arrivals: synchronous,
buffered or train_on_arrival) is chosen once from the RoundConfig when the
step is built.

Aggregators report info['weights'] per cohort; the round turns them into
detection metrics (engine.detection).

This module also re-exports the engine names other modules import from it
(RoundConfig, Threat, sample_cohort, detection_counts, ...).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from fedrobust.engine.arrivals import arrival_mode, init_pending
from fedrobust.engine.execution import on_mesh, run_clients
from fedrobust.engine.metrics import round_metrics
from fedrobust.engine.pipeline import (CohortRound, RoundKeys, StepContext,
                                       round_keys)
from fedrobust.engine.sampling import sample_slots
from fedrobust.engine.threat import attack_slots
from fedrobust.engine.training import data_specs, retrainer, skips_masked
# Engine names other modules import from engine.round, re-exported.
from fedrobust.engine.config import (CohortSlots, RoundConfig,
                                     check_mesh_for_data, strata_members,
                                     validate_round_config, validate_strata)
from fedrobust.engine.detection import (detection_counts, masked_mean,
                                        weight_auc, weight_metrics)
from fedrobust.engine.sampling import (client_keys, device_blocked_members,
                                       sample_clients, sample_cohort)
from fedrobust.engine.threat import (Threat, malicious_slots, slot_attackers,
                                     with_an_attacker)
from fedrobust.engine.training import client_output_shapes, client_view
from fedrobust.errors import SettingError
from fedrobust.types import FederatedData, Method, ServerState

Params = Any
PyTree = Any


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



def all_finite(tree: PyTree) -> jax.Array:
  """bool[]: every entry of every leaf is finite."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf))
                            for leaf in jax.tree.leaves(tree)]))


def make_setup_step(method: Method, config: RoundConfig, *,
                    mesh: Mesh | None = None) -> Callable:
  """Builds setup_step(state, data, server_data) -> state.

  The method's one-off step before round 1 (Method.client_setup for every
  member of every cohort, then Method.server_setup), run like a round's
  clients (the execution strategy and the device mesh apply). A client's
  key is fold_in(state key, id), and the state's key does not advance, so a
  run with a setup step and one resumed after it match bitwise.

  Raises:
    SettingError: when the method has no setup step or the settings
      cannot hold.
  """
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


def check_round_step(config: RoundConfig, mesh: Mesh | None,
                     threat: Threat | None) -> None:
  """Checks that a round step can be built for these settings.

  Raises:
    SettingError: naming the setting that cannot hold.
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


def server_stage(ctx: StepContext, state: ServerState,
                 cohorts: list[CohortRound], keys: RoundKeys,
                 data: FederatedData, server_data: PyTree):
  """The server update over every cohort's arrivals.

  A method that provides 'retrain' gets the retrain hook
  (training.retrainer), keyed by the round's sample key folded with 0x4E7A.

  Returns:
    (params, method_state, info) of Method.server_update.
  """
  hooks = {}
  if 'retrain' in ctx.method.provides:
    hooks['retrain'] = retrainer(ctx, state, data, server_data,
                                 jax.random.fold_in(keys.sample, 0x4E7A),
                                 keys.threat, keys.attack)
  return on_mesh(ctx.method.server_update, ctx.mesh)(
      state, tuple(c.arrived.arrivals for c in cohorts), keys.server,
      server_data, **hooks)


def guard_nonfinite(old: ServerState, new: ServerState,
                    skip_nonfinite: bool) -> tuple[ServerState, jax.Array]:
  """The round's new state, checked for non-finite global params.

  With skip_nonfinite, a round whose new global params are not finite
  keeps the old state's params, method state and in-flight updates; only
  the round counter and the key advance.

  Returns:
    (the state, metrics['nonfinite_model']: float32[] 1.0 when the new
    params hold a NaN or Inf).
  """
  finite = all_finite(new.params)
  nonfinite = 1.0 - finite.astype(jnp.float32)
  if not skip_nonfinite:
    return new, nonfinite
  kept = old._replace(round=new.round, key=new.key)
  return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new,
                      kept), nonfinite


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
  check_round_step(config, mesh, threat)
  ctx = StepContext(method, config, mesh, threat, data_specs(config),
                    skips_masked(config))
  mode = arrival_mode(config)

  def round_step(state: ServerState, data: FederatedData,
                 server_data: PyTree = ()):
    keys = round_keys(state)
    now = state.round + 1
    flight = mode.begin(state)
    attack_state = state.attack
    cohorts = []
    for j, slots in enumerate(config.cohort_slots()):
      started, delays, flight = sample_slots(ctx, mode, j, slots, keys, now,
                                             flight)
      job, flight = mode.schedule(ctx, j, state, started, delays, flight,
                                  now)
      outputs = mode.train(ctx, j, state, job, data, server_data)
      attacked, attack_state = attack_slots(ctx, j, job.slots, outputs, keys,
                                            attack_state, state.params[j],
                                            data)
      arrived, flight = mode.arrive(ctx, j, state, job, attacked, flight,
                                    now)
      cohorts.append(CohortRound(attacked, arrived))
    params, method_state, info = server_stage(ctx, state, cohorts, keys,
                                              data, server_data)
    metrics = round_metrics(mode, threat, cohorts, flight, info,
                            attack_state, log_clients)
    new_state = ServerState(
        now, tuple(params), method_state, jax.random.key_data(keys.next),
        mode.pending(state, flight, [c.arrived for c in cohorts]),
        attack_state)
    new_state, metrics['nonfinite_model'] = guard_nonfinite(
        state, new_state, skip_nonfinite)
    return new_state, metrics

  return round_step
