r"""Times the runner's evaluation split over the devices against replicated.

  python benchmarks/eval_split.py --clients=100,1000 --cpu_devices=2

For each client count: the runner's setup (`train.build` on the default
Fashion-MNIST with the simple CNN, --local_test_fraction at its default),
then one model's global test evaluation plus every client's local test,
by two Evaluators on the same mesh: 'replicated' (every set on every
device, each device evaluating everything: the Evaluator before the
split) and 'split' (train.Evaluator with the mesh: each device its share of
the batches and clients). Passes alternate between the two, so both see
the same machine load; the ratio is of the medians. Counts and
accuracies must agree exactly, else the script fails.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import config as config_lib
from experiments import train
from experiments.devices import configure_cpu_devices

flags.DEFINE_string('clients', '100,1000', 'Comma-separated client counts.')
flags.DEFINE_integer('cpu_devices', 2, 'XLA CPU devices (>= 2).')
flags.DEFINE_integer('passes', 5, 'Timed passes of each (after a warm one).')
FLAGS = flags.FLAGS


def main(argv):
  del argv
  devices = configure_cpu_devices(FLAGS.cpu_devices, 10)
  import jax  # after the device count is set
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  for k in map(int, FLAGS.clients.split(',')):
    config = config_lib.defaults()
    config.update(num_clients=k, clients_per_round=10, workdir='unused',
                  model='simple_cnn', num_devices=devices)
    program = train.build(train.resolve(config))
    mesh = program.mesh
    put = lambda tree: jax.device_put(tree, NamedSharding(mesh, P()))
    evaluators = {
        'replicated': train.Evaluator(program, put, config['eval_batch_size']),
        'split': train.Evaluator(program, put, config['eval_batch_size'],
                                 mesh)}
    params = put(program.cohorts[0].model.init(jax.random.key(0)))
    members = len(program.cohorts[0].members)

    def run(ev):
      fns = ev.for_cohort(0)
      test = jax.device_get(fns['test'](params, *ev.test))
      local = ev.clients(fns, params, ev.local_tests[0], members)
      return test, local

    out = {name: run(ev) for name, ev in evaluators.items()}   # warm
    for key in ('accuracy', 'count'):
      for part in (0, 1):
        a, b = (np.asarray(out[n][part][key]) for n in evaluators)
        if not np.array_equal(a, b):
          raise SystemExit(f'{key} differs between replicated and split')
    times = {name: [] for name in evaluators}
    for _ in range(FLAGS.passes):
      for name, ev in evaluators.items():
        t0 = time.perf_counter()
        jax.block_until_ready(run(ev))
        times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"clients {k}, {devices} devices: replicated {med['replicated']:.3f}"
          f" s, split {med['split']:.3f} s, ratio "
          f"{med['replicated'] / med['split']:.2f}x (test accuracy "
          f"{float(out['split'][0]['accuracy']):.5f})")


if __name__ == '__main__':
  app.run(main)
