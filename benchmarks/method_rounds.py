"""Times any registered method's compiled round, and its server step apart.

Used by `round_throughput.py --method=NAME`. A method runs from its quick
preset (PRESETS; the others from the preset of their family), with the
federation resized: C clients, all sampled every round, and an iid split
of `total_examples` real training examples over them (a round trains on
the same data whatever C is), one local epoch. The
preset's threat (attack, detection) stays, so the round times what a run
of that preset does.

The server step (method.server_update: aggregation, detection, SVDs,
clustering, distillation, caches) is compiled alone and timed on synthetic
arrivals of the exact shapes the round hands it: C (or the in-flight
buffer's) client outputs filled with small positive noise. Its share of
the round is its median time over the round's median time; the round
includes it.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from experiments import config as config_lib
from experiments import train
from fedrobust.engine import execution
from fedrobust.engine import round as round_lib
from fedrobust.types import Arrivals

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), 'experiments', 'configs')
# The preset each method is timed from: the seed methods' quick presets;
# the other methods take their family's (LoRA methods the ViT + LoRA
# label-skew preset, full-model ones FedAvg's).
LORA_PRESET = 'hilora_label_skew_quick.flags'
PLAIN_PRESET = 'fedavg_fmnist.flags'
PRESETS = {
    'fedavg': PLAIN_PRESET,
    'fedala': PLAIN_PRESET,
    'fedprox': PLAIN_PRESET,
    'sdfc': 'sdfc_fmnist_quick.flags',
    'horus': 'horus_fmnist_quick.flags',
    'fedhan': 'fedhan_fmnist_quick.flags',
    'rfd_lora': 'rfd_lora_movies_quick.flags',
    'hilora': LORA_PRESET,
    **{name: LORA_PRESET for name in (
        'fdlora', 'fedalt', 'feddpa_f', 'feddpa_t', 'fedit', 'fedsa_lora',
        'ffa_lora', 'flexlora', 'flora', 'local_lora', 'lora_fair',
        'pf2lora')},
}
SEED_METHODS = ('fedavg', 'sdfc', 'horus', 'fedhan', 'rfd_lora', 'hilora')


def preset_of(method: str) -> str:
  if method not in PRESETS:
    raise ValueError(f'method={method!r} has no benchmark preset; add it '
                     'to benchmarks/method_rounds.PRESETS')
  return PRESETS[method]


def method_config(method: str, clients: int, total_examples: int,
                  *, preset: str | None = None, num_devices: int = 1,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
  """The run config the benchmark builds for `method` at C = clients.

  clients = 0 keeps the preset's federation as it is (its clients, sample,
  split, data and local epochs): the preset's own round.
  """
  values = config_lib.read_flagfile(os.path.join(CONFIGS,
                                                 preset or preset_of(method)))
  values.update(method=method, unseen_clients=0, pretrain_epochs=0,
                num_devices=num_devices, workdir='unused')
  if clients:
    # The public split (pretraining, anchors) keeps at most a tenth.
    public = min(values.get('public_size', 0), total_examples // 10)
    values.update(num_clients=clients, clients_per_round=clients,
                  partition='iid', max_train_examples=total_examples,
                  local_epochs=1, local_test_fraction=0.0,
                  public_size=public)
  values.update(extra or {})
  return train.resolve(values)


def _noise_like(shape_tree: Any, rows: int, key: jax.Array) -> Any:
  """[rows, ...] leaves: floats uniform in [0.005, 0.015], ints 0, bools
  True."""
  leaves, treedef = jax.tree.flatten(shape_tree)
  keys = jax.random.split(key, max(len(leaves), 1))
  out = []
  for k, leaf in zip(keys, leaves):
    shape = (rows, *leaf.shape)
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      out.append(jax.random.uniform(k, shape, leaf.dtype, 0.005, 0.015))
    elif leaf.dtype == jnp.bool_:
      out.append(jnp.ones(shape, bool))
    else:
      out.append(jnp.zeros(shape, leaf.dtype))
  return jax.tree.unflatten(treedef, out)


def arrival_rows(config: round_lib.RoundConfig, state: Any, j: int) -> int:
  """How many rows cohort j's Arrivals hold in the round program."""
  slots = config.cohort_slots()[j]
  if config.delay is None:
    return config.padded(slots.clients_per_round)
  if config.train_on_arrival or config.max_arrivals:
    return config.padded(config.max_arrivals)
  return state.pending.buffers[j].ids.shape[0]


def synthetic_arrivals(method, config, state, data, server_data, key):
  """Arrivals of the round's exact shapes, every row real and fresh."""
  out = []
  for j, slots in enumerate(config.cohort_slots()):
    rows = arrival_rows(config, state, j)
    shapes = round_lib.client_output_shapes(method, j, state, data,
                                            server_data)
    members = jnp.asarray(slots.members, jnp.int32)
    ids = members[jnp.arange(rows) % len(slots.members)]
    out.append(Arrivals(ids, jnp.ones((rows,), bool),
                        _noise_like(shapes, rows, jax.random.fold_in(key, j)),
                        jnp.zeros((rows,), jnp.int32)))
  return tuple(out)


def program_memory_mb(compiled) -> float | None:
  """XLA's own estimate of a program's footprint: arguments, outputs and
  temporaries, less what donation aliases."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if m is None:
    return None
  total = (m.argument_size_in_bytes + m.output_size_in_bytes +
           m.temp_size_in_bytes - m.alias_size_in_bytes)
  return total / 2**20


def _median_seconds(fn, rounds: int) -> float:
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


class Prepared(NamedTuple):
  """One method's compiled round, ready to time."""
  one_round: Callable[[], Any]     # runs a warm round, returns its metrics
  one_server: Callable[[], float]  # seconds of one server step
  report: Callable[[float, float], dict[str, Any]]  # (round s, server s)


def prepare_method(method: str, clients: int, *, total_examples: int,
                   preset: str | None = None, num_devices: int = 1,
                   extra: dict[str, Any] | None = None,
                   server_in_place: bool = False) -> Prepared:
  """Compiles one method's round and server step at C = clients and runs
  a warm-up round; returns the timers and the report built from them.

  The server step is timed on a fresh copy of the state after the rounds
  each call, or, with server_in_place, on the state itself, which each
  call advances (no second copy of the state in memory: FedHAN's cache at
  N = 1000 is 11.8 GB in bfloat16). Call one_server only after the rounds
  are timed."""
  config = method_config(method, clients, total_examples, preset=preset,
                         num_devices=num_devices, extra=extra)
  program = train.build(config)
  mesh = program.mesh
  put = (jax.device_put if mesh is None else
         lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec())))
  data = put(jax.tree.map(jnp.asarray, program.setup.train))
  server_data = put(program.server_data)
  step = round_lib.make_round_step(program.method, program.round_config,
                                   mesh=mesh, threat=program.threat.threat)
  state = put(round_lib.init_server_state(
      program.method, train.initial_params(program.cohorts, config['seed']),
      config['num_clients'], config['seed'] + 1,
      config=program.round_config, data=data, server_data=server_data))

  t0 = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=0).lower(
      state, data, server_data).compile()
  compile_seconds = time.perf_counter() - t0
  arrivals = synthetic_arrivals(program.method, program.round_config, state,
                                data, server_data, jax.random.key(7))
  # Donated like the round's own state, so in-place cache and history
  # updates are not timed as copies.
  # Traced on the round's mesh, as the round traces it (batch hints).
  update = program.method.server_update
  if server_in_place:
    def update(state, arrivals, key, server_data):
      params, method_state, _ = program.method.server_update(
          state, arrivals, key, server_data)
      return state._replace(params=params, method_state=method_state)
  server = jax.jit(execution.on_mesh(update, mesh), donate_argnums=0)
  key = jax.random.key(3)
  t0 = time.perf_counter()
  server_compiled = server.lower(state, arrivals, key, server_data).compile()
  server_compile_seconds = time.perf_counter() - t0

  box = [state, None]
  box[0], box[1] = compiled(box[0], data, server_data)   # warm-up
  jax.block_until_ready(box[0])

  def one_round():
    box[0], box[1] = compiled(box[0], data, server_data)
    return box[1]

  def one_server():
    if server_in_place:
      t0 = time.perf_counter()
      box[0] = jax.block_until_ready(
          server_compiled(box[0], arrivals, key, server_data))
      return time.perf_counter() - t0
    # A fresh copy of the state (it is donated), made before the clock.
    state = jax.block_until_ready(jax.tree.map(jnp.copy, box[0]))
    t0 = time.perf_counter()
    jax.block_until_ready(server_compiled(state, arrivals, key, server_data))
    return time.perf_counter() - t0

  def report(round_seconds: float, server_seconds: float) -> dict[str, Any]:
    metrics = box[1]
    trained = float(metrics['clients_trained'])
    # Real examples trained (padding steps not counted): every client is
    # sampled, so the trained ones hold the mean count.
    samples = (trained * float(np.mean(program.setup.train.count)) *
               config['local_epochs'])
    cohorts = '+'.join(c.name for c in program.cohorts)
    return {
        'method': method, 'clients': config['clients_per_round'],
        'cohorts': cohorts,
        'preset': preset or preset_of(method),
        'aggregator': program.resolved['aggregator'],
        'attack': config['attack'],
        'examples_per_client': int(program.setup.train.count.max()),
        'local_steps': program.local.num_steps,
        'batch_size': config['batch_size'],
        'clients_trained': trained,
        'samples_per_second': samples / round_seconds,
        'round_seconds': round_seconds,
        'server_seconds': server_seconds,
        'server_share': server_seconds / round_seconds,
        'compile_seconds': compile_seconds,
        'server_compile_seconds': server_compile_seconds,
        'program_mb': program_memory_mb(compiled),
        'server_program_mb': program_memory_mb(server_compiled),
        'client_execution': program.resolved['client_execution'],
        'num_devices': program.resolved['num_devices'],
        'backend': jax.default_backend(),
        'finite': float(metrics['nonfinite_model']) == 0.0,
    }

  return Prepared(one_round, one_server, report)


def _server_seconds(prepared: Prepared, rounds: int) -> float:
  """Median seconds of the server step over `rounds`, after a warm-up."""
  prepared.one_server()
  return statistics.median(prepared.one_server() for _ in range(rounds))


def time_method(method: str, clients: int, *, total_examples: int,
                rounds: int, preset: str | None = None,
                num_devices: int = 1,
                extra: dict[str, Any] | None = None,
                server_in_place: bool = False) -> dict[str, Any]:
  """Compiles and times one method's round and server step at C = clients."""
  prepared = prepare_method(method, clients, total_examples=total_examples,
                            preset=preset, num_devices=num_devices,
                            extra=extra, server_in_place=server_in_place)
  round_seconds = _median_seconds(prepared.one_round, rounds)
  return prepared.report(round_seconds, _server_seconds(prepared, rounds))


def time_interleaved(prepared: Sequence[Prepared], rounds: int
                     ) -> list[dict[str, Any]]:
  """Times compiled methods in turn, one round each per pass, so a slow
  spell of a shared machine hits all of them alike. Each report adds
  'ratio_to_first': the median over passes of its round time over the
  first method's in the same pass."""
  times = [[] for _ in prepared]
  for _ in range(rounds):
    for k, p in enumerate(prepared):
      t0 = time.perf_counter()
      jax.block_until_ready(p.one_round())
      times[k].append(time.perf_counter() - t0)
  reports = []
  for k, p in enumerate(prepared):
    r = p.report(statistics.median(times[k]), _server_seconds(p, rounds))
    r['ratio_to_first'] = statistics.median(
        a / b for a, b in zip(times[k], times[0]))
    r['interleaved_rounds'] = rounds
    reports.append(r)
  return reports
