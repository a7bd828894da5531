r"""Times the server-side statistics at C clients per round.

  python benchmarks/aggregation_cost.py --clients=10,100,1000 --json

For each C: the aggregation rules (median, Krum and Multi-Krum with the
centred-Gram and the exact pairwise distances, trimmed mean), the HOPS
spectral score of [C, r, d] LoRA-A-shaped matrices (Gram eigenvalues vs
SVD), and the per-example Fisher diagonal of every client on
--fisher_examples examples (SDFC's M_k(U)). Updates have the simple CNN's
parameter tree, so D is the real model size. Each entry is compiled once
and timed as the median of --repeats warm calls.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from fedrobust.aggregators import get_aggregator, spectral
from fedrobust.aggregators import krum as krum_lib
from fedrobust.methods.sdfc.fisher import fisher_diagonal
from fedrobust.models import MODELS, default_conv_impl, get_model

flags.DEFINE_string('clients', '10,100,1000', 'Comma-separated C values.')
flags.DEFINE_enum('model', 'simple_cnn', sorted(MODELS), 'Update shapes.')
flags.DEFINE_integer('lora_rank', 8, 'r of the [C, r, d] HOPS matrices.')
flags.DEFINE_integer('lora_width', 256, 'd of the [C, r, d] HOPS matrices.')
flags.DEFINE_integer('fisher_examples', 64, 'Examples per client for the '
                     'per-example Fisher.')
flags.DEFINE_string('only', '', 'Comma-separated entry names to run.')
flags.DEFINE_integer('repeats', 3, 'Warm calls timed (median).')
flags.DEFINE_boolean('json', False, 'One JSON object per line.')
FLAGS = flags.FLAGS


def timed(fn, *args, repeats: int) -> tuple[float, float]:
  """(compile seconds, median warm seconds) of jit(fn)(*args)."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return compile_s, statistics.median(times)


def entries(c: int, model, params):
  """name -> (fn, args) for C = c."""
  rng = np.random.default_rng(c)
  updates = jax.tree.map(
      lambda p: jnp.asarray(rng.normal(size=(c,) + p.shape), jnp.float32),
      params)
  mask = jnp.ones((c,), bool)
  key = jax.random.key(0)
  f = max(1, (c - 3) // 5)

  def rule(name, **kw):
    agg = get_aggregator(name, num_byzantine=f, **kw)
    state = agg.init(params)
    return (lambda u, m: agg.aggregate(u, m, state, key)[0]), (updates, mask)

  def distances(method):
    flat = jnp.concatenate([l.reshape(c, -1) for l in
                            jax.tree.leaves(updates)], axis=1)
    return (functools.partial(krum_lib.pairwise_sq_dists, method=method),
            (flat, mask))

  mats = jnp.asarray(rng.normal(size=(c, FLAGS.lora_rank, FLAGS.lora_width)),
                     jnp.float32)

  def hops(method):
    return (lambda m, msk: spectral.hops_scores(
        spectral.singular_values(m, method), msk, k=1, lam=0.5),
            (mats, mask))

  n = FLAGS.fisher_examples
  x = jnp.asarray(rng.integers(0, 256, (c, 1, n, 28, 28, 1)), jnp.uint8)
  y = jnp.asarray(rng.integers(0, 10, (c, 1, n)), jnp.int32)
  ex_mask = jnp.ones((c, 1, n), bool)

  def fisher(xs, ys, ms):
    return lax.map(lambda a: fisher_diagonal(model.apply, params, *a),
                   (xs, ys, ms))

  return {
      'median': rule('median'),
      'trimmed_mean': rule('trimmed_mean'),
      'krum': rule('krum'),
      'multi_krum': rule('multi_krum'),
      'pairwise_gram': distances('gram'),
      'pairwise_exact': distances('exact'),
      'hops_gram': hops('gram'),
      'hops_svd': hops('svd'),
      'fisher_per_example': (fisher, (x, y, ex_mask)),
  }


def main(argv):
  del argv
  model = get_model(FLAGS.model, num_classes=10, input_shape=(28, 28, 1),
                    conv_impl=default_conv_impl())
  params = model.init(jax.random.key(0))
  d = sum(p.size for p in jax.tree.leaves(params))
  only = {s for s in FLAGS.only.split(',') if s}
  rows = []
  for c in (int(v) for v in FLAGS.clients.split(',')):
    for name, (fn, args) in entries(c, model, params).items():
      if only and name not in only:
        continue
      compile_s, seconds = timed(fn, *args, repeats=FLAGS.repeats)
      row = {'name': name, 'clients': c, 'dim': d, 'seconds': seconds,
             'compile_seconds': compile_s, 'backend': jax.default_backend()}
      rows.append(row)
      if FLAGS.json:
        print(json.dumps(row), flush=True)
      else:
        print(f'C={c:<5} {name:<20} {1e3 * seconds:10.1f} ms '
              f'(compile {compile_s:.1f} s)', flush=True)


if __name__ == '__main__':
  app.run(main)
