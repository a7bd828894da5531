r"""Measures the two roofline ceilings of the current JAX backend.

  python benchmarks/machine_ceilings.py --json

Peak matmul FLOP/s: a jitted float32 [n, n] x [n, n] matmul (2 n^3 FLOPs),
best of --repeats. Memory bandwidth: a jitted a * 2 + 1 over a float32
array far larger than the caches (reads and writes 8 bytes per element),
best of --repeats. These are what an XLA program on this machine can reach,
the denominators of the roofline fractions in BUILD_NOTES.md.
"""

from __future__ import annotations

import json
import time

from absl import app, flags
import jax
import jax.numpy as jnp

flags.DEFINE_integer('matmul_size', 2048, 'n of the n x n matmul.')
flags.DEFINE_integer('stream_mb', 512, 'Size of the streamed array in MiB.')
flags.DEFINE_integer('repeats', 5, 'Timed calls (best is kept).')
flags.DEFINE_boolean('json', False, 'Print one JSON object.')
FLAGS = flags.FLAGS


def best_seconds(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  best = float('inf')
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t0)
  return best


def main(argv):
  del argv
  n = FLAGS.matmul_size
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  matmul = jax.jit(lambda x, y: jnp.matmul(
      x, y, precision=jax.lax.Precision.HIGHEST))
  t_mm = best_seconds(matmul, a, b, repeats=FLAGS.repeats)
  elems = FLAGS.stream_mb * 2**20 // 4
  v = jnp.ones((elems,), jnp.float32)
  stream = jax.jit(lambda x: x * 2.0 + 1.0)
  t_bw = best_seconds(stream, v, repeats=FLAGS.repeats)
  result = {
      'backend': jax.default_backend(),
      'device_kind': jax.devices()[0].device_kind,
      'matmul_gflops': 2 * n**3 / t_mm / 1e9,
      'stream_gb_per_s': 8 * elems / t_bw / 1e9,
      'matmul_size': n, 'stream_mb': FLAGS.stream_mb,
  }
  if FLAGS.json:
    print(json.dumps(result))
  else:
    print(f"{result['backend']} ({result['device_kind']}): matmul "
          f"{result['matmul_gflops']:.1f} GFLOP/s (f32 {n}^3), stream "
          f"{result['stream_gb_per_s']:.1f} GB/s")


if __name__ == '__main__':
  app.run(main)
