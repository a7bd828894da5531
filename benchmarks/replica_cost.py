r"""S seeds as one `--num_seeds=S` run against S single runs, same flags.

  python benchmarks/replica_cost.py --num_seeds=3 -- \
    --flagfile=experiments/configs/fedavg_fmnist.flags --num_rounds=3 \
    --max_train_examples=12000

Runs experiments/main.py once with --num_seeds=S, then with --seed=s for
each of the S seeds one after another (each its own process, so start-up,
data and compile count as a user pays them), and prints one JSON object:
the wall seconds of each, their ratio, whether each replica's
params_sha256 equals its single run's, and each run's compile and mean
round seconds. Workdirs go under --workdir_root (removed first).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
flags.DEFINE_integer('num_seeds', 3, 'S.', lower_bound=2)
flags.DEFINE_string('workdir_root', '/tmp/replica_cost', 'Parent of the '
                    "runs' workdirs (removed first).")
FLAGS = flags.FLAGS


def _run(args: list[str], workdir: str) -> tuple[float, dict]:
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, os.path.join(ROOT, 'experiments',
                                                      'main.py'), *args,
                         f'--workdir={workdir}'], cwd=ROOT,
                        capture_output=True, text=True)
  seconds = time.perf_counter() - t0
  if proc.returncode:
    raise RuntimeError(f'{args}: exit {proc.returncode}\n{proc.stderr[-2000:]}')
  with open(os.path.join(workdir, 'summary.json')) as f:
    return seconds, json.load(f)


def _parts(summary: dict) -> dict:
  return {k: summary.get(k) for k in ('compile_seconds', 'mean_round_seconds',
                                      'wall_seconds')}


def main(argv):
  flags_for_main = argv[1:]
  s = FLAGS.num_seeds
  shutil.rmtree(FLAGS.workdir_root, ignore_errors=True)
  together, rep = _run(flags_for_main + [f'--num_seeds={s}'],
                       os.path.join(FLAGS.workdir_root, 'replicas'))
  singles = []
  t0 = time.perf_counter()
  for i in range(s):
    singles.append(_run(flags_for_main + [f'--seed={i}'],
                        os.path.join(FLAGS.workdir_root, f'seed{i}'))[1])
  apart = time.perf_counter() - t0
  print(json.dumps({
      'flags': flags_for_main, 'num_seeds': s,
      'one_run_seconds': round(together, 1),
      'separate_runs_seconds': round(apart, 1),
      'ratio': round(together / apart, 3),
      'params_sha256_equal': [r['params_sha256'] == one['params_sha256']
                              for r, one in zip(rep['replicas'], singles)],
      'one_run': _parts(rep), 'separate_runs': [_parts(x) for x in singles],
      'test_accuracy': [rep['final'].get('test_accuracy'),
                        rep['final'].get('test_accuracy_std')]}))


if __name__ == '__main__':
  app.run(main)
