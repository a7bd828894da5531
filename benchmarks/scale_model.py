r"""The inputs of BUILD_NOTES' scale model: params, FLOPs, program sizes.

  python benchmarks/scale_model.py

Prints each model's parameter count and training FLOPs per example (XLA's
cost analysis of one SGD step, divided by the batch), then the simple-CNN
FedAvg round program's size (arguments + outputs + temporaries - aliased,
from compiled.memory_analysis()) at two C under vmap and under the
sequential strategy; the difference per client is what a vmapped or a
sequential client costs.
"""

from __future__ import annotations

import os
import sys

from absl import app

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax

from benchmarks import round_throughput
from fedrobust.models import get_model


def main(argv):
  del argv
  jax.config.update('jax_num_cpu_devices', 1)
  for name in ('simple_cnn', 'cnn'):
    model = get_model(name, num_classes=10, input_shape=(28, 28, 1))
    d = sum(x.size for x in jax.tree.leaves(model.init(jax.random.key(0))))
    flops = round_throughput.step_cost(model, 64)['flops'] / 64
    print(f'{name}: D = {d:,}, {d * 4 / 2**20:.2f} MiB f32, '
          f'{flops / 1e6:.2f} MFLOP per training example', flush=True)
  for strategy, (c1, c2) in (('vmap', (4, 8)), ('sequential', (8, 32))):
    sizes = []
    for c in (c1, c2):
      _, info = round_throughput.build_round(
          strategy, model_name='simple_cnn', clients=c, local_steps=2,
          batch_size=64, chunk_size=0, scan_unroll=1, conv_impl='xla')
      sizes.append(info['program_mb'])
    print(f'simple_cnn FedAvg round, {strategy}: {sizes[0]:.1f} MiB at '
          f'C = {c1}, {sizes[1]:.1f} MiB at C = {c2}: '
          f'{(sizes[1] - sizes[0]) / (c2 - c1):.2f} MiB per client',
          flush=True)


if __name__ == '__main__':
  app.run(main)
