"""Multi-controller JAX: the compiled round under jax.distributed.

Two CPU processes with one device each join a jax.distributed job (gloo
collectives), the way the hosts of a TPU pod slice or a GPU cluster do,
and run the runner's round program on a mesh spanning both processes'
devices. The result must be the one a single process computes on a
two-device mesh: the same metrics and, bit for bit, the same global
parameters, seen identically by both processes.
"""

import json
import os
import socket
import subprocess
import sys

from absl.testing import absltest
import pytest

from tests.main_test import write_idx

# Every test here starts several processes: the full suite runs them.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, 'tests', 'multiprocess_worker.py')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class MultiProcessTest(absltest.TestCase):

  def _env(self, devices_per_process: int, **extra) -> dict[str, str]:
    # Only the device count differs from the suite's own XLA_FLAGS
    # (conftest.py): the single process and the two compile alike.
    kept = [f for f in os.environ.get('XLA_FLAGS', '').split()
            if not f.startswith('--xla_force_host_platform_device_count')]
    env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=' '.join(
        kept + [f'--xla_force_host_platform_device_count='
                f'{devices_per_process}']))
    for key in ('FEDROBUST_MP_OVERRIDES', 'FEDROBUST_MP_WORKDIR'):
      env.pop(key, None)
    env.update(extra)
    return env

  def _result(self, proc, path):
    _, err = proc.communicate(timeout=300)
    self.assertEqual(proc.returncode, 0, err.decode()[-3000:])
    with open(path) as f:
      return json.load(f)

  def _data(self) -> tuple[str, str]:
    tmp = self.create_tempdir().full_path
    data_dir = os.path.join(tmp, 'data')
    os.makedirs(data_dir)
    write_idx(data_dir)
    return tmp, data_dir

  def _start_two(self, tmp, data_dir, tag, **extra):
    """(processes, output paths) of one jax.distributed job of two
    processes with 1 device each, started."""
    coordinator = f'127.0.0.1:{_free_port()}'
    outs = [os.path.join(tmp, f'{tag}{i}.json') for i in range(2)]
    procs = [subprocess.Popen(
        [sys.executable, WORKER, outs[i], data_dir, '2', coordinator, '2',
         str(i)], env=self._env(1, **extra), cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    return procs, outs

  def _two_processes(self, tmp, data_dir, tag, **extra):
    """Both processes' output JSON: one jax.distributed job, 1 device each."""
    procs, outs = self._start_two(tmp, data_dir, tag, **extra)
    try:   # a process that fails leaves its peer waiting: stop both
      return [self._result(p, o) for p, o in zip(procs, outs)]
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()

  def _single_process(self, tmp, data_dir, **extra):
    """The output JSON of one process with 2 devices."""
    out = os.path.join(tmp, 'single.json')
    return self._result(subprocess.Popen(
        [sys.executable, WORKER, out, data_dir, '2'],
        env=self._env(2, **extra), cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE), out)

  def test_two_processes_compute_the_single_process_round(self):
    tmp, data_dir = self._data()
    parts = self._two_processes(tmp, data_dir, 'process')
    single = self._single_process(tmp, data_dir)

    for i, part in enumerate(parts):
      self.assertEqual((part['process_index'], part['process_count'],
                        part['devices'], part['local_devices']), (i, 2, 2, 1))
    self.assertEqual((single['process_count'], single['local_devices']),
                     (1, 2))
    # The round did something: clients trained, the attack was on.
    self.assertEqual(single['rounds'][0]['clients_trained'], 6.0)
    self.assertGreater(sum(r['num_attacking'] for r in single['rounds']), 0)
    self.assertLess(single['rounds'][1]['train_loss'],
                    single['rounds'][0]['train_loss'])
    for part in parts:
      self.assertEqual(part['rounds'], single['rounds'])
      self.assertEqual(part['params_sha256'], single['params_sha256'])

  def test_process_local_client_data(self):
    """client_data='sharded': each process builds and places only its
    block of the clients (rows 0-3 and 4-7): it reads exactly its clients'
    examples from the source, with every other row of its label and count
    arrays garbled, and the two compute the single process's round bit
    for bit; that round also equals the one on replicated data with the
    same strata."""
    tmp, data_dir = self._data()
    sharded = json.dumps({'client_data': 'sharded', 'sample_strata': 2})
    parts = self._two_processes(tmp, data_dir, 'local',
                                FEDROBUST_MP_OVERRIDES=sharded,
                                FEDROBUST_MP_GARBLE='1')
    single = self._single_process(tmp, data_dir,
                                  FEDROBUST_MP_OVERRIDES=sharded)
    replicated = self._single_process(tmp, data_dir, FEDROBUST_MP_OVERRIDES=(
        json.dumps({'sample_strata': 2})))
    self.assertEqual([p['data_rows'] for p in parts], [[0, 4], [4, 8]])
    self.assertEqual(single['data_rows'], [0, 8])
    for part in parts:
      self.assertNotEmpty(part['block_examples'])
      self.assertEqual(part['examples_read'], part['block_examples'])
    self.assertEmpty(set(parts[0]['examples_read']) &
                     set(parts[1]['examples_read']))
    self.assertEqual(single['examples_read'], single['block_examples'])
    self.assertEqual(single['rounds'][0]['clients_trained'], 6.0)
    self.assertEqual(single['rounds'], replicated['rounds'])
    self.assertEqual(single['params_sha256'], replicated['params_sha256'])
    for part in parts:
      self.assertEqual(part['rounds'], single['rounds'])
      self.assertEqual(part['params_sha256'], single['params_sha256'])

  def test_two_processes_run_and_resume_the_runner(self):
    """train.run in both processes on one shared workdir: round 1, then a
    second invocation resumes from the checkpoint both wrote and runs
    round 2. The result is the single process's 2-round run, and process
    0 alone wrote the files (one metrics row per round)."""
    tmp, data_dir = self._data()
    single = self._single_process(
        tmp, data_dir, FEDROBUST_MP_WORKDIR=os.path.join(tmp, 'one'))
    self.assertEqual(single['rounds_completed'], 2)
    shared = os.path.join(tmp, 'shared')
    first = self._two_processes(
        tmp, data_dir, 'first', FEDROBUST_MP_WORKDIR=shared,
        FEDROBUST_MP_OVERRIDES=json.dumps({'num_rounds': 1}))
    self.assertEqual([p['rounds_completed'] for p in first], [1, 1])
    resumed = self._two_processes(tmp, data_dir, 'resumed',
                                  FEDROBUST_MP_WORKDIR=shared)
    self.assertEqual([p['process_index'] for p in resumed], [0, 1])
    for part in resumed:
      self.assertEqual(part['rounds_completed'], 2)
      self.assertEqual(part['params_sha256'], single['params_sha256'])
    with open(os.path.join(shared, 'metrics.jsonl')) as f:
      self.assertEqual([json.loads(line)['round'] for line in f], [1, 2])
    with open(os.path.join(shared, 'summary.json')) as f:
      self.assertEqual(json.load(f)['params_sha256'],
                       single['params_sha256'])
    self.assertEqual(sorted(os.listdir(os.path.join(
        shared, 'checkpoints', '.integrity'))),
                     ['1.files.json', '1.ledger.json', '1.sha256',
                      '2.files.json', '2.ledger.json', '2.sha256'])


  def test_a_signal_to_one_process_stops_both_after_the_same_round(self):
    """SIGTERM to process 1 only: both processes agree at the round
    boundary, stop after the same round with exit code 75, and the same
    command resumes both to the end with every round logged once."""
    import signal  # pylint: disable=g-import-not-at-top
    import time  # pylint: disable=g-import-not-at-top
    from experiments import preemption  # pylint: disable=g-import-not-at-top
    tmp, data_dir = self._data()
    shared = os.path.join(tmp, 'shared')
    extra = dict(FEDROBUST_MP_WORKDIR=shared,
                 FEDROBUST_MP_OVERRIDES=json.dumps({'num_rounds': 60}))
    procs, outs = self._start_two(tmp, data_dir, 'stopped', **extra)
    metrics = os.path.join(shared, 'metrics.jsonl')
    try:
      deadline = time.time() + 240
      while time.time() < deadline and all(p.poll() is None for p in procs):
        if os.path.exists(metrics):
          with open(metrics) as f:
            if len(f.readlines()) >= 2:
              break
        time.sleep(0.01)
      self.assertTrue(all(p.poll() is None for p in procs),
                      'the run ended before the signal')
      procs[1].send_signal(signal.SIGTERM)
      for proc in procs:
        _, err = proc.communicate(timeout=240)
        self.assertEqual(proc.returncode, preemption.EXIT_CODE,
                         err.decode()[-3000:])
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
    stopped = []
    for out in outs:
      with open(out) as f:
        stopped.append(json.load(f))
    self.assertEqual([p['status'] for p in stopped], ['preempted'] * 2)
    self.assertEqual(stopped[0]['rounds_completed'],
                     stopped[1]['rounds_completed'])
    self.assertLess(stopped[0]['rounds_completed'], 60)
    resumed = self._two_processes(tmp, data_dir, 'resumed', **extra)
    self.assertEqual([p['rounds_completed'] for p in resumed], [60, 60])
    self.assertEqual(resumed[0]['params_sha256'], resumed[1]['params_sha256'])
    with open(metrics) as f:
      self.assertEqual([json.loads(line)['round'] for line in f],
                       list(range(1, 61)))

  def test_two_processes_split_the_evaluation(self):
    """With local test splits, the runner's evaluation splits the global
    test set's batches and the clients' local tests over the mesh, which
    here spans two processes: each builds and evaluates its share (half
    the test images, read from the source), and the metrics
    rows (global, local and personal accuracy) are the single process's
    on two devices. Batches of 40 cut the 100 test examples into 3
    batches, so `rebatch` pads them to 4 for the two devices."""
    tmp, data_dir = self._data()
    overrides = json.dumps({'local_test_fraction': 0.25, 'num_rounds': 1,
                            'eval_batch_size': 40})
    single = self._single_process(
        tmp, data_dir, FEDROBUST_MP_OVERRIDES=overrides,
        FEDROBUST_MP_WORKDIR=os.path.join(tmp, 'one'))
    parts = self._two_processes(tmp, data_dir, 'eval',
                                FEDROBUST_MP_OVERRIDES=overrides,
                                FEDROBUST_MP_WORKDIR=os.path.join(tmp, 'two'))
    # Each process built only its own devices' test batches: 2 of the 4
    # batches of 25, disjoint, together the whole set.
    self.assertEqual(single['test_examples_read'], list(range(100)))
    reads = [set(p['test_examples_read']) for p in parts]
    self.assertEqual([len(r) for r in reads], [50, 50])
    self.assertEqual(reads[0] | reads[1], set(range(100)))
    rows = {}
    for name in ('one', 'two'):
      with open(os.path.join(tmp, name, 'metrics.jsonl')) as f:
        rows[name] = [json.loads(line) for line in f]
    self.assertLen(rows['two'], 1)
    one, two = rows['one'][0], rows['two'][0]
    self.assertIsNotNone(one['local_accuracy'])
    for key in ('test_accuracy', 'local_accuracy', 'personal_accuracy',
                'personal_accuracy_p10'):
      self.assertEqual(two[key], one[key], key)
    self.assertAlmostEqual(two['test_loss'], one['test_loss'], places=5)


if __name__ == '__main__':
  absltest.main()
