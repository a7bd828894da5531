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

from tests.main_test import write_idx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, 'tests', 'multiprocess_worker.py')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class MultiProcessTest(absltest.TestCase):

  def _env(self, devices_per_process: int) -> dict[str, str]:
    # Only the device count differs from the suite's own XLA_FLAGS
    # (conftest.py): the single process and the two compile alike.
    kept = [f for f in os.environ.get('XLA_FLAGS', '').split()
            if not f.startswith('--xla_force_host_platform_device_count')]
    env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=' '.join(
        kept + [f'--xla_force_host_platform_device_count='
                f'{devices_per_process}']))
    env.pop('FEDROBUST_MP_OVERRIDES', None)
    return env

  def _result(self, proc, path):
    _, err = proc.communicate(timeout=300)
    self.assertEqual(proc.returncode, 0, err.decode()[-3000:])
    with open(path) as f:
      return json.load(f)

  def test_two_processes_compute_the_single_process_round(self):
    tmp = self.create_tempdir().full_path
    data_dir = os.path.join(tmp, 'data')
    os.makedirs(data_dir)
    write_idx(data_dir)
    coordinator = f'127.0.0.1:{_free_port()}'
    outs = [os.path.join(tmp, f'process{i}.json') for i in range(2)]
    procs = [subprocess.Popen(
        [sys.executable, WORKER, outs[i], data_dir, '2', coordinator, '2',
         str(i)], env=self._env(1), cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE) for i in range(2)]
    try:   # a process that fails leaves its peer waiting: stop both
      parts = [self._result(p, o) for p, o in zip(procs, outs)]
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
    single_out = os.path.join(tmp, 'single.json')
    single = self._result(subprocess.Popen(
        [sys.executable, WORKER, single_out, data_dir, '2'], env=self._env(2),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE), single_out)

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


if __name__ == '__main__':
  absltest.main()
