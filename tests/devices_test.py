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

  def test_auto_divides_the_strata_of_sharded_data(self):
    # Sharded client data needs the device count to divide the strata:
    # 10 devices for C = 20 on 16 cores would be refused with 4 strata.
    self.assertEqual(devices.auto_cpu_devices(20, cores=16, strata=4), 4)
    self.assertEqual(devices.auto_cpu_devices(12, cores=16, strata=6), 6)
    self.assertEqual(devices.auto_cpu_devices(8, cores=2, strata=4), 2)
    self.assertEqual(devices.auto_cpu_devices(9, cores=2, strata=3), 1)
    self.assertEqual(devices.auto_cpu_devices(20, cores=16, strata=1), 10)

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

  def test_collective_timeout_is_raised_once_and_never_overridden(self):
    flag = devices._TIMEOUT_FLAG
    with mock.patch.dict(os.environ, {'XLA_FLAGS': '--xla_foo=1'}):
      self.assertTrue(devices.relax_collective_timeout(77, '0.10.2', False))
      self.assertEqual(os.environ['XLA_FLAGS'], f'--xla_foo=1 {flag}=77')
      # Already set (by us or by the user): left as it is.
      self.assertFalse(devices.relax_collective_timeout(5, '0.10.2', False))
      self.assertEqual(os.environ['XLA_FLAGS'], f'--xla_foo=1 {flag}=77')
    with mock.patch.dict(os.environ, {'XLA_FLAGS': ''}):
      # A jaxlib older than the flag would abort on it: not added.
      self.assertFalse(devices.relax_collective_timeout(77, '0.4.30', False))
      self.assertEqual(os.environ['XLA_FLAGS'], '')
      # With a GPU or TPU plugin installed: left out.
      self.assertFalse(devices.relax_collective_timeout(77, '0.10.2', True))
      self.assertEqual(os.environ['XLA_FLAGS'], '')
      self.assertTrue(devices.relax_collective_timeout(77, '0.11.0rc1',
                                                       False))
    self.assertEqual(devices._version('0.10.2.dev20260101'), (0, 10, 2))

  def test_this_jaxlib_accepts_the_timeout_and_a_late_thread_survives(self):
    """A fresh process gets the flag from configure_cpu_devices, XLA
    accepts it (an unknown XLA flag aborts at start), and two CPU devices
    meet at an all-gather with one thread a few seconds late."""
    script = textwrap.dedent("""
        import os, sys
        sys.path.insert(0, {repo!r})
        import jax, jax.numpy as jnp
        from experiments import devices
        devices.configure_cpu_devices(2, 2)
        print(os.environ.get('XLA_FLAGS', ''))
        from jax.sharding import Mesh, PartitionSpec as P
        mesh = Mesh(jax.devices(), ('d',))
        def body(x):
          late = jnp.where(jax.lax.axis_index('d') == 0, 200, 1)
          _, x = jax.lax.while_loop(lambda c: c[0] < late,
              lambda c: (c[0] + 1, jnp.tanh(c[1] @ c[1].T)), (0, x))
          return jax.lax.all_gather(x, 'd', tiled=True)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P('d'),
                                  out_specs=P(), check_vma=False))
        print(f(jnp.full((256, 128), 0.01)).shape)
        """).format(repo=_REPO)
    env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
    env['JAX_PLATFORMS'] = 'cpu'
    out = subprocess.run([sys.executable, '-c', script], env=env,
                         capture_output=True, text=True, timeout=300)
    self.assertEqual(out.returncode, 0, out.stderr[-2000:])
    lines = out.stdout.strip().splitlines()
    self.assertIn(f'{devices._TIMEOUT_FLAG}={devices.COLLECTIVE_TIMEOUT_S}',
                  lines[0])
    self.assertEqual(lines[-1], '(256, 128)')


if __name__ == '__main__':
  absltest.main()
