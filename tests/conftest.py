"""Pytest configuration shared by all tests.

Four host-platform CPU devices let the sharded-round tests run anywhere;
every other test pins itself to one device. Strict rank promotion catches
silent broadcasting.
"""

import gc
import os

import pytest

_FLAG = '--xla_force_host_platform_device_count=4'
if _FLAG.split('=')[0] not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' +
                             _FLAG).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
import jax

jax.config.update('jax_numpy_rank_promotion', 'raise')

# absltest's create_tempdir() reads --test_tmpdir; pytest never parses flags.
if not flags.FLAGS.is_parsed():
  flags.FLAGS.mark_as_parsed()


@pytest.fixture(autouse=True, scope='module')
def _release_compiled_programs(request):
  """Frees a test module's compiled programs when the module ends.

  Every XLA:CPU executable holds about six memory maps, and a process may
  hold vm.max_map_count of them (65,530 by default). An xdist worker runs
  many modules, and the tests' lru_caches plus JAX's own caches kept every
  program ever compiled: a worker reached the limit near the end of the
  suite and died with a segfault inside the next compile. Dropping the
  module's cached programs (its lru_caches, then jax.clear_caches) returns
  those maps.
  """
  yield
  for value in list(vars(request.module).values()):
    if callable(getattr(value, 'cache_clear', None)):
      value.cache_clear()
  jax.clear_caches()
  gc.collect()
