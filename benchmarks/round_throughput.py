r"""Times the compiled FedAvg round on Fashion-MNIST-shaped synthetic data.

  python benchmarks/round_throughput.py --model=simple_cnn --clients=10 \
    --local_steps=20 --batch_size=64 --client_execution=all

Every client holds exactly local_steps * batch_size examples, so no step is
padding and samples/s counts real work. Compile time is measured apart
(lower + compile); the round time is the median over warm rounds.

Side by side with the PyTorch reference (benchmarks/torch_reference.py, the
sequential per-client loop; needs `pip install -e .[bench]`):

  python benchmarks/round_throughput.py --model=simple_cnn --clients=10 \
    --local_steps=20 --batch_size=64 --reference=torch --rounds=7

Any registered method, from its quick preset (benchmarks/method_rounds.py),
with the server step's share of the round; 'seeds' runs the six seed
methods, 'all' every METHODS entry:

  python benchmarks/round_throughput.py --method=sdfc --method_clients=10,100

Rounds of the two alternate (jax, torch, jax, torch, ...) so both see the
same machine load; the table gives each one's median and the ratio.
--threads=N pins both to N cores: the process's CPU affinity (which sizes
XLA's CPU thread pool) and torch.set_num_threads(N). On CPU the host is
split into --cpu_devices XLA devices (0: auto, up to one per pinned core,
as experiments/devices.py picks) and the client axis is sharded over them,
as experiments/main.py does; --cpu_devices=1 times the single-device
round.

Seeds as replicas of one program (fedrobust.Replicas, main.py
--num_seeds): --num_seeds=1,2,4,8 times the round of S replicas (each its
own initial model and data) for each S; samples/s counts all replicas'
examples. --replica_batch picks how many run side by side (vmap; 0: auto,
1 on CPU, all on GPU/TPU); the others run in turn inside the program:

  python benchmarks/round_throughput.py --num_seeds=1,2,4,8

On a GPU, benchmarks/gpu_suite.sh runs the whole GPU table of BUILD_NOTES
(§4b) in one command, each step under its own time limit.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import method_rounds
from experiments import config as config_lib
from experiments.devices import configure_cpu_devices
from fedrobust import engine
from fedrobust.aggregators import get_aggregator
from fedrobust.engine.execution import STRATEGIES
from fedrobust.federation.replicas import common_program, stack
from fedrobust.cohort import single_cohort
from fedrobust.methods import get_method
from fedrobust.transforms import identity
from fedrobust.models import (COMPUTE_DTYPES, CONV_IMPLS, MODELS,
                              default_compute_dtype, default_conv_impl,
                              get_model)
from fedrobust.types import FederatedData

flags.DEFINE_enum('model', 'simple_cnn', sorted(MODELS), 'Architecture.')
flags.DEFINE_integer('clients', 10, 'Clients per round (all participate).')
flags.DEFINE_integer('local_steps', 20, 'Local SGD steps per client.')
flags.DEFINE_integer('batch_size', 64, 'Local batch size.')
flags.DEFINE_enum('client_execution', 'auto', ('auto', 'all') + STRATEGIES,
                  "Strategy to time; 'all' times each one.")
flags.DEFINE_integer('chunk_size', 0, 'Chunk size (chunked); 0: min(C, 8).')
flags.DEFINE_integer('scan_unroll', 1, 'Local-step scan unroll (0: full).')
flags.DEFINE_enum('conv_impl', 'auto', ('auto',) + CONV_IMPLS,
                  'Convolution lowering.')
flags.DEFINE_enum('compute_dtype', 'auto', ('auto',) + COMPUTE_DTYPES,
                  'Activation/matmul dtype; auto picks per backend.')
flags.DEFINE_integer('rounds', 5, 'Warm rounds timed.')
flags.DEFINE_string('aggregator', 'weighted_mean', 'Server rule '
                    '(fedrobust.aggregators); the torch reference supports '
                    'weighted_mean (its mean) and median.')
flags.DEFINE_enum('reference', 'none', ['none', 'torch'], 'Also time the '
                  'PyTorch per-client loop, interleaved with ours.')
flags.DEFINE_integer('threads', 0, 'Pin both frameworks to this many cores '
                     '(0: all available).')
flags.DEFINE_float('settle_seconds', 1.0, 'Pause after each timed round '
                   'of the side-by-side run, so that neither framework\'s '
                   'idle worker threads still spin while the other runs.')
flags.DEFINE_integer('cpu_devices', 0, 'XLA CPU devices the client axis is '
                     'sharded over (0: auto, up to one per pinned core).')
flags.DEFINE_string('method', '', "Time this registered method's round "
                    "and server step instead (METHODS names, 'seeds' or "
                    "'all'); --model/--local_steps/--reference do not "
                    'apply. An entry NAME:setting=value:... carries its '
                    'own settings (e.g. sdfc:sdfc_lambda=0).')
flags.DEFINE_list('method_clients', ['10'], 'With --method: the clients per '
                  'round C to time, each its own program (0: the '
                  "preset's own federation, unresized).")
flags.DEFINE_list('overrides', [], 'With --method: run settings that '
                  'replace the preset\'s, as name=value (e.g. '
                  'max_arrivals=10).')
flags.DEFINE_bool('interleave', False, 'With --method: compile every '
                  'named method first, then time their rounds in turn '
                  '(one round each per pass) and report each round time '
                  "over the first method's, the median of the passes "
                  '(ratio_to_first): a ratio that a slow spell of a shared '
                  'machine cannot skew.')
flags.DEFINE_string('preset', '', 'With --method: time every method from '
                    'this experiments/configs flagfile instead of its own '
                    '(e.g. SDFC and FedAvg on the same flags).')
flags.DEFINE_boolean('server_in_place', False, 'With --method: time the '
                     "server step on the round's own state, which each "
                     'call advances, instead of on a fresh copy each call '
                     '(the copy doubles the state in memory).')
flags.DEFINE_integer('total_examples', 20000, 'With --method: real '
                     'training examples split iid over the C clients.')
flags.DEFINE_list('num_seeds', ['1'], 'Replicas of the FedAvg round in one '
                  'program; each value is timed as its own program.')
flags.DEFINE_integer('replica_batch', 0, 'Replicas run side by side '
                     '(vmap); 0: auto (1 on CPU, all elsewhere).')
flags.DEFINE_boolean('json', False, 'Print one JSON object per strategy.')
FLAGS = flags.FLAGS


def synthetic_data(clients: int, examples: int, seed: int = 0
                   ) -> FederatedData:
  rng = np.random.default_rng(seed)
  return FederatedData(
      jnp.asarray(rng.integers(0, 256, (clients, examples, 28, 28, 1),
                               dtype=np.uint8)),
      jnp.asarray(rng.integers(0, 10, (clients, examples), dtype=np.int32)),
      jnp.full((clients,), examples, jnp.int32))


def step_cost(model, batch_size: int) -> dict[str, float]:
  """XLA's FLOPs and bytes accessed of ONE local SGD step (fwd, bwd, update).

  XLA's cost analysis counts a while-loop body once, whatever its trip
  count, so the round program's own figure undercounts scanned steps and
  lax.map'd clients; a round is C * S of these steps.
  """
  loss_fn = engine.classification_loss(model.apply)
  params = model.init(jax.random.key(0))

  def one_step(p, x, y):
    grads, _ = jax.grad(loss_fn, has_aux=True)(
        p, x, y, jnp.ones(y.shape, bool), None)
    return jax.tree.map(lambda a, g: a - 0.01 * g, p, grads)

  x = jnp.zeros((batch_size, 28, 28, 1), jnp.uint8)
  y = jnp.zeros((batch_size,), jnp.int32)
  cost = jax.jit(one_step).lower(params, x, y).compile().cost_analysis()
  cost = (cost[0] if isinstance(cost, list) else cost) or {}
  return {'flops': float(cost.get('flops', float('nan'))),
          'bytes': float(cost.get('bytes accessed', float('nan')))}


def _fedavg_round(seed: int, *, model_name: str, clients: int,
                  local_steps: int, batch_size: int, chunk_size: int,
                  scan_unroll: int, conv_impl: str, aggregator: str,
                  compute_dtype: str, strategy: str, num_devices: int):
  """One FedAvg federation of seed `seed`: (round fn, state, data, model,
  info fields)."""
  model = get_model(model_name, num_classes=10, input_shape=(28, 28, 1),
                    conv_impl=conv_impl,
                    dtype=None if compute_dtype == 'float32' else
                    jnp.dtype(compute_dtype))
  local = engine.LocalConfig(batch_size=batch_size, num_epochs=1,
                             steps_per_epoch=local_steps,
                             unroll=scan_unroll or local_steps)
  method = get_method('fedavg', cohorts=single_cohort(
      model, identity(model), clients, clients), local=local,
                      optimizer=engine.sgd(learning_rate=0.01, momentum=0.9,
                                           weight_decay=1e-5),
                      aggregator=get_aggregator(aggregator, num_byzantine=0))
  if strategy == 'chunked' and not chunk_size:
    chunk_size = min(clients, 8)
  config = engine.RoundConfig(num_clients=clients, clients_per_round=clients,
                              strategy=strategy,
                              chunk_size=chunk_size if strategy == 'chunked'
                              else 0, num_devices=num_devices)
  mesh = engine.client_mesh(num_devices) if num_devices > 1 else None
  data = synthetic_data(clients, local_steps * batch_size, seed)
  state = engine.init_server_state(method, model.init(jax.random.key(seed)),
                                   clients, seed=seed)
  if mesh is not None:
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    data, state = jax.device_put((data, state), replicated)
  return (engine.make_round_step(method, config, mesh=mesh), state, data,
          model, chunk_size)


def build_round(strategy: str, *, model_name: str, clients: int,
                local_steps: int, batch_size: int, chunk_size: int,
                scan_unroll: int, conv_impl: str,
                aggregator: str = 'weighted_mean',
                compute_dtype: str = 'float32', num_devices: int = 1,
                num_seeds: int = 1, replica_batch: int = 0):
  """Compiles one FedAvg round (of num_seeds replicas); returns
  (run_one_round, info dict)."""
  parts = [_fedavg_round(
      seed, model_name=model_name, clients=clients, local_steps=local_steps,
      batch_size=batch_size, chunk_size=chunk_size, scan_unroll=scan_unroll,
      conv_impl=conv_impl, aggregator=aggregator,
      compute_dtype=compute_dtype, strategy=strategy,
      num_devices=num_devices) for seed in range(num_seeds)]
  model, chunk_size = parts[0][3], parts[0][4]
  batch = replica_batch or (1 if jax.default_backend() == 'cpu'
                            else num_seeds)
  t0 = time.perf_counter()
  if num_seeds == 1:
    fn, state, data = parts[0][:3]
    step = jax.jit(fn, donate_argnums=0)
    compiled = step.lower(state, data, ()).compile()
    call = lambda s: compiled(s, data, ())
  else:
    fn, consts = common_program(
        [p[0] for p in parts], [(p[1], p[2], ()) for p in parts],
        what='round', seeds=list(range(num_seeds)), batch=batch)
    state, data = stack([p[1] for p in parts]), stack([p[2] for p in parts])
    compiled = jax.jit(fn, donate_argnums=1).lower(
        consts, state, data, ()).compile()
    call = lambda s: compiled(consts, s, data, ())
  compile_seconds = time.perf_counter() - t0
  state, _ = call(state)                         # first run: allocations
  jax.block_until_ready(state)
  box = [state]

  def run_one() -> float:
    t0 = time.perf_counter()
    box[0], metrics = call(box[0])
    jax.block_until_ready((box[0], metrics))
    return time.perf_counter() - t0

  cost = step_cost(model, batch_size)
  steps = num_seeds * clients * local_steps
  info = {
      'model': model_name, 'clients': clients, 'local_steps': local_steps,
      'batch_size': batch_size, 'client_execution': strategy,
      'chunk_size': chunk_size if strategy == 'chunked' else None,
      'scan_unroll': scan_unroll, 'conv_impl': conv_impl,
      'aggregator': aggregator, 'compute_dtype': compute_dtype,
      'num_devices': num_devices, 'num_seeds': num_seeds,
      'replica_batch': min(batch, num_seeds),
      'compile_seconds': compile_seconds,
      'program_mb': method_rounds.program_memory_mb(compiled),
      'flops_per_round': cost['flops'] * steps,
      'bytes_per_round': cost['bytes'] * steps,
      'backend': jax.default_backend(),
      'device_kind': jax.devices()[0].device_kind,
  }
  return run_one, info


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def device_peak_mb() -> float | None:
  """The accelerator allocator's peak so far (GPU/TPU); None on CPU, whose
  memory is the process's RSS."""
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get('peak_bytes_in_use')
  return None if peak is None else peak / 2**20


def time_round(strategy: str, *, rounds: int, **kwargs) -> dict:
  """Compiles and times one FedAvg round program (median of warm rounds)."""
  run_one, info = build_round(strategy, **kwargs)
  round_seconds = statistics.median(run_one() for _ in range(rounds))
  samples = (info['num_seeds'] * info['clients'] * info['local_steps'] *
             info['batch_size'])
  return dict(info, samples_per_second=samples / round_seconds,
              round_seconds=round_seconds, peak_rss_mb=peak_rss_mb(),
              device_peak_mb=device_peak_mb())


def side_by_side(strategy: str, *, rounds: int, **kwargs) -> dict:
  """Our round and the torch reference's, alternating; medians and ratio."""
  from benchmarks import torch_reference  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  if kwargs['aggregator'] not in ('weighted_mean', 'median'):
    raise ValueError('--reference=torch supports --aggregator=weighted_mean '
                     f"or median, not {kwargs['aggregator']!r}")
  if FLAGS.threads:
    torch.set_num_threads(FLAGS.threads)
  run_one, info = build_round(strategy, **kwargs)
  # Same accelerator as ours: a GPU run compares against torch on CUDA.
  device = ('cuda' if jax.default_backend() == 'gpu' and
            torch.cuda.is_available() else 'cpu')
  reference = torch_reference.Round(
      kwargs['model_name'], kwargs['clients'], kwargs['local_steps'],
      kwargs['batch_size'],
      aggregation='mean' if kwargs['aggregator'] == 'weighted_mean'
      else 'median', device=device)
  reference()                                    # warm-up (allocator)
  ours, theirs = [], []
  for _ in range(rounds):
    ours.append(run_one())
    time.sleep(FLAGS.settle_seconds)
    theirs.append(reference())
    time.sleep(FLAGS.settle_seconds)
  samples = reference.samples
  t_ours, t_torch = statistics.median(ours), statistics.median(theirs)
  return dict(info, samples_per_second=samples / t_ours,
              round_seconds=t_ours, torch_samples_per_second=samples / t_torch,
              torch_round_seconds=t_torch, speedup_vs_torch=t_torch / t_ours,
              torch_version=torch.__version__, torch_device=device,
              torch_threads=torch.get_num_threads(),
              cpu_affinity=len(os.sched_getaffinity(0)),
              peak_rss_mb=peak_rss_mb(), device_peak_mb=device_peak_mb())


def run_methods(num_devices: int) -> None:
  """--method: every named method at every --method_clients C."""
  from fedrobust.methods import METHODS  # pylint: disable=g-import-not-at-top
  entries = {'all': sorted(METHODS),
             'seeds': method_rounds.SEED_METHODS}.get(
                 FLAGS.method, FLAGS.method.split(','))

  def parse(items, flag):
    out = {}
    for item in items:
      name, _, text = item.partition('=')
      try:
        out[name] = config_lib.parse_value(name, text)
      except (KeyError, ValueError) as err:
        raise app.UsageError(f'{flag}={item}: {err}') from err
    return out

  overrides = parse(FLAGS.overrides, '--overrides')
  # NAME or NAME:setting=value:setting=value (this entry's own settings,
  # over --overrides), so one interleaved run can hold variants.
  runs = []
  for entry in entries:
    name, *own = entry.split(':')
    if name not in METHODS:
      raise app.UsageError(f'--method={name}: expected one of '
                           f"{sorted(METHODS)}, 'seeds' or 'all'")
    runs.append((entry, name, dict(overrides, **parse(own, '--method'))))
  header = (f"{'method':<11} {'C':>5} {'samples/s':>10} {'round s':>8} "
            f"{'server s':>9} {'share':>6} {'compile s':>9} {'MB':>7} "
            f"{'server MB':>9}")
  if not FLAGS.json:
    print(header, flush=True)
  def show(r):
    r['peak_rss_mb'] = peak_rss_mb()
    r['device_peak_mb'] = device_peak_mb()
    if FLAGS.json:
      print(json.dumps(r), flush=True)
      return
    mb = lambda v: f'{v:.0f}' if v is not None else '-'
    ratio = (f"  x{r['ratio_to_first']:.3f}" if 'ratio_to_first' in r
             else '')
    print(f"{r['entry']:<11} {r['clients']:>5} "
          f"{r['samples_per_second']:>10,.0f} "
          f"{r['round_seconds']:>8.3f} {r['server_seconds']:>9.4f} "
          f"{r['server_share']:>6.1%} {r['compile_seconds']:>9.1f} "
          f"{mb(r['program_mb']):>7} {mb(r['server_program_mb']):>9}{ratio}",
          flush=True)

  kwargs = dict(total_examples=FLAGS.total_examples, num_devices=num_devices,
                preset=FLAGS.preset or None,
                server_in_place=FLAGS.server_in_place)
  for clients in map(int, FLAGS.method_clients):
    if FLAGS.interleave:
      prepared = [method_rounds.prepare_method(name, clients, extra=extra,
                                               **kwargs)
                  for _, name, extra in runs]
      for (entry, _, _), r in zip(
          runs, method_rounds.time_interleaved(prepared, FLAGS.rounds)):
        show(dict(r, entry=entry))
      continue
    for entry, name, extra in runs:
      show(dict(method_rounds.time_method(name, clients, rounds=FLAGS.rounds,
                                          extra=extra, **kwargs),
                entry=entry))


def main(argv):
  del argv
  if FLAGS.threads:
    cpus = sorted(os.sched_getaffinity(0))
    if FLAGS.threads > len(cpus):
      raise app.UsageError(f'--threads={FLAGS.threads}: only {len(cpus)} '
                           'cores are available')
    os.sched_setaffinity(0, cpus[:FLAGS.threads])   # before XLA's pool
  # Before anything below starts JAX's backends.
  num_devices = configure_cpu_devices(FLAGS.cpu_devices, FLAGS.clients)
  if jax.default_backend() != 'cpu':
    num_devices = jax.local_device_count()
  seeds = [int(v) for v in FLAGS.num_seeds]
  if FLAGS.method:
    if seeds != [1]:
      raise app.UsageError('--num_seeds times the FedAvg round; it does not '
                           'apply with --method')
    run_methods(num_devices)   # the client axis sharded, as main.py does
    return
  if min(seeds) < 1:
    raise app.UsageError(f'--num_seeds={FLAGS.num_seeds}: each value must '
                         'be >= 1')
  if FLAGS.reference == 'torch' and seeds != [1]:
    raise app.UsageError('--reference=torch times one seed: leave '
                         '--num_seeds=1')
  if FLAGS.client_execution == 'all':
    strategies = STRATEGIES
  elif FLAGS.client_execution == 'auto':
    strategies = (engine.default_strategy(),)
  else:
    strategies = (FLAGS.client_execution,)
  conv_impl = (default_conv_impl() if FLAGS.conv_impl == 'auto'
               else FLAGS.conv_impl)
  timer = side_by_side if FLAGS.reference == 'torch' else time_round
  results = []
  for strategy, num_seeds in itertools.product(strategies, seeds):
    extra = ({'num_seeds': num_seeds, 'replica_batch': FLAGS.replica_batch}
             if timer is time_round else {})
    result = timer(strategy, **extra, model_name=FLAGS.model,
                   clients=FLAGS.clients, local_steps=FLAGS.local_steps,
                   batch_size=FLAGS.batch_size, chunk_size=FLAGS.chunk_size,
                   scan_unroll=FLAGS.scan_unroll, conv_impl=conv_impl,
                   aggregator=FLAGS.aggregator, rounds=FLAGS.rounds,
                   num_devices=num_devices,
                   compute_dtype=(default_compute_dtype()
                                  if FLAGS.compute_dtype == 'auto'
                                  else FLAGS.compute_dtype))
    results.append(result)
    if FLAGS.json:
      print(json.dumps(result), flush=True)
  if not FLAGS.json:
    print(f"{'execution':<12} {'conv':<7} {'unroll':>6} {'devices':>7} "
          f"{'seeds':>5} {'samples/s':>10} {'round s':>8} {'compile s':>9} "
          f"{'GFLOP/rnd':>9} {'RSS MB':>7}")
    for r in results:
      print(f"{r['client_execution']:<12} {r['conv_impl']:<7} "
            f"{r['scan_unroll']:>6} {r['num_devices']:>7} "
            f"{r.get('num_seeds', 1):>5} "
            f"{r['samples_per_second']:>10,.0f} "
            f"{r['round_seconds']:>8.3f} {r['compile_seconds']:>9.1f} "
            f"{r['flops_per_round'] / 1e9:>9.2f} {r['peak_rss_mb']:>7.0f}")
    for r in results:
      if 'speedup_vs_torch' in r:
        print(f"torch reference ({r['client_execution']} run): "
              f"{r['torch_samples_per_second']:,.0f} samples/s, "
              f"{r['torch_round_seconds']:.3f} s/round, torch "
              f"{r['torch_version']} on {r['torch_threads']} threads; "
              f"fedrobust/torch = {r['speedup_vs_torch']:.2f}x")
    print(f"backend: {results[0]['backend']} "
          f"({results[0]['device_kind']})")


if __name__ == '__main__':
  app.run(main)
