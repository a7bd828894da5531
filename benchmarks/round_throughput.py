r"""Times the compiled FedAvg round on Fashion-MNIST-shaped synthetic data.

  python benchmarks/round_throughput.py --model=simple_cnn --clients=10 \
    --local_steps=20 --batch_size=64 --client_execution=all

Every client holds exactly local_steps * batch_size examples, so no step is
padding and samples/s counts real work. Compile time is measured apart
(lower + compile); the round time is the median over warm rounds.
"""

from __future__ import annotations

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

from fedrobust import engine
from fedrobust.engine.execution import STRATEGIES
from fedrobust.methods import get_method
from fedrobust.models import CONV_IMPLS, MODELS, default_conv_impl, get_model
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
flags.DEFINE_integer('rounds', 5, 'Warm rounds timed.')
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


def step_flops(model, batch_size: int) -> float:
  """XLA's FLOP count of ONE local SGD step (forward, backward, update).

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
  cost = cost[0] if isinstance(cost, list) else cost
  return float((cost or {}).get('flops', float('nan')))


def time_round(strategy: str, *, model_name: str, clients: int,
               local_steps: int, batch_size: int, chunk_size: int,
               scan_unroll: int, conv_impl: str, rounds: int) -> dict:
  """Compiles and times one FedAvg round program."""
  model = get_model(model_name, num_classes=10, input_shape=(28, 28, 1),
                    conv_impl=conv_impl)
  local = engine.LocalConfig(batch_size=batch_size, num_epochs=1,
                             steps_per_epoch=local_steps,
                             unroll=scan_unroll or local_steps)
  method = get_method('fedavg', model=model, local=local,
                      optimizer=engine.sgd(learning_rate=0.01, momentum=0.9,
                                           weight_decay=1e-5))
  if strategy == 'chunked' and not chunk_size:
    chunk_size = min(clients, 8)
  config = engine.RoundConfig(num_clients=clients, clients_per_round=clients,
                              strategy=strategy,
                              chunk_size=chunk_size if strategy == 'chunked'
                              else 0)
  step = jax.jit(engine.make_round_step(method, config), donate_argnums=0)
  data = synthetic_data(clients, local_steps * batch_size)
  state = engine.init_server_state(method, model.init(jax.random.key(0)),
                                   clients, seed=0)
  t0 = time.perf_counter()
  compiled = step.lower(state, data, ()).compile()
  compile_seconds = time.perf_counter() - t0
  state, _ = compiled(state, data, ())           # first run: allocations
  jax.block_until_ready(state)
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    state, metrics = compiled(state, data, ())
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - t0)
  round_seconds = statistics.median(times)
  samples = clients * local_steps * batch_size
  return {
      'model': model_name, 'clients': clients, 'local_steps': local_steps,
      'batch_size': batch_size, 'client_execution': strategy,
      'chunk_size': chunk_size if strategy == 'chunked' else None,
      'scan_unroll': scan_unroll, 'conv_impl': conv_impl,
      'samples_per_second': samples / round_seconds,
      'round_seconds': round_seconds, 'compile_seconds': compile_seconds,
      'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                     / 1024,
      'flops_per_round': step_flops(model, batch_size) * clients * local_steps,
      'backend': jax.default_backend(),
      'device_kind': jax.devices()[0].device_kind,
  }


def main(argv):
  del argv
  if FLAGS.client_execution == 'all':
    strategies = STRATEGIES
  elif FLAGS.client_execution == 'auto':
    strategies = (engine.default_strategy(),)
  else:
    strategies = (FLAGS.client_execution,)
  conv_impl = (default_conv_impl() if FLAGS.conv_impl == 'auto'
               else FLAGS.conv_impl)
  results = []
  for strategy in strategies:
    result = time_round(strategy, model_name=FLAGS.model,
                        clients=FLAGS.clients, local_steps=FLAGS.local_steps,
                        batch_size=FLAGS.batch_size,
                        chunk_size=FLAGS.chunk_size,
                        scan_unroll=FLAGS.scan_unroll, conv_impl=conv_impl,
                        rounds=FLAGS.rounds)
    results.append(result)
    if FLAGS.json:
      print(json.dumps(result), flush=True)
  if not FLAGS.json:
    print(f"{'execution':<12} {'conv':<7} {'unroll':>6} {'samples/s':>10} "
          f"{'round s':>8} {'compile s':>9} {'GFLOP/rnd':>9} {'RSS MB':>7}")
    for r in results:
      print(f"{r['client_execution']:<12} {r['conv_impl']:<7} "
            f"{r['scan_unroll']:>6} {r['samples_per_second']:>10,.0f} "
            f"{r['round_seconds']:>8.3f} {r['compile_seconds']:>9.1f} "
            f"{r['flops_per_round'] / 1e9:>9.2f} {r['peak_rss_mb']:>7.0f}")
    print(f"backend: {results[0]['backend']} "
          f"({results[0]['device_kind']})")


if __name__ == '__main__':
  app.run(main)
