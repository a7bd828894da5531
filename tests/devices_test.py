"""Tests for experiments/devices.py: how the host CPU is split into devices."""

import os
import subprocess
import sys
import textwrap
from unittest import mock

from absl.testing import absltest

from experiments import devices

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CpuDevicesTest(absltest.TestCase):

  def test_auto_is_fewest_devices_for_shortest_round(self):
    self.assertEqual(devices.auto_cpu_devices(10, cores=2), 2)
    self.assertEqual(devices.auto_cpu_devices(10, cores=16), 10)
    self.assertEqual(devices.auto_cpu_devices(1, cores=2), 1)
    self.assertEqual(devices.auto_cpu_devices(0, cores=2), 1)
    self.assertEqual(devices.auto_cpu_devices(3, cores=2), 2)
    # Same busiest-device load (2 clients) as 16 devices, no padded slots.
    self.assertEqual(devices.auto_cpu_devices(20, cores=16), 10)
    self.assertEqual(devices.auto_cpu_devices(100, cores=16), 15)
    self.assertGreaterEqual(devices.available_cores(), 1)

  def test_negative_count_names_the_flag(self):
    with self.assertRaisesRegex(ValueError, '--cpu_devices must be >= 0'):
      devices.configure_cpu_devices(-1, 10)

  def test_an_explicit_xla_flag_wins(self):
    flags = f'{devices._XLA_FLAG}=3 {devices._XLA_FLAG}=4'
    with mock.patch.dict(os.environ, {'XLA_FLAGS': flags}):
      # The last occurrence wins, as in XLA; nothing is changed in JAX.
      self.assertEqual(devices.configure_cpu_devices(2, 10), 4)

  def test_fresh_processes_get_the_requested_split(self):
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, {repo!r})
        import jax
        from experiments import devices
        mode = sys.argv[1]
        if mode == 'late':
          jax.devices()          # the backend starts with its default
          try:
            devices.configure_cpu_devices(3, 10)
          except ValueError as err:
            print('refused:', err)
        else:
          got = devices.configure_cpu_devices(int(mode), 10)
          print(got, jax.device_count())
        """).format(repo=_REPO)
    env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
    env['JAX_PLATFORMS'] = 'cpu'

    def run(mode):
      return subprocess.run([sys.executable, '-c', script, mode], env=env,
                            capture_output=True, text=True, check=True,
                            timeout=120).stdout.strip()

    self.assertEqual(run('3'), '3 3')
    auto = devices.auto_cpu_devices(10)
    self.assertEqual(run('0'), f'{auto} {auto}')
    late = run('late')
    self.assertIn('refused: --cpu_devices=3', late)


if __name__ == '__main__':
  absltest.main()
