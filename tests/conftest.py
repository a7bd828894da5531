"""Pytest configuration shared by all tests.

Four host-platform CPU devices let the sharded-round tests run anywhere;
every other test pins itself to one device. Strict rank promotion catches
silent broadcasting.
"""

import gc
import os
import tempfile

import pytest

# LLVM at -O0 for the tests' XLA:CPU programs. The suite is compile-bound:
# its models are tiny and run a few steps, and it compiles about 3,800
# programs. The level sets LLVM's code generation only, not XLA's HLO
# passes, and the whole suite passes at both levels. Runs under the same
# flags still agree bit for bit, and the experiments/main.py subprocesses
# the end-to-end tests start inherit XLA_FLAGS, so a test that compares
# them with an in-process run compares like with like. Measured on the
# 2-core box, fresh clone, cold cache, quiet: `.ci/run` took 25 m 53 s at
# the default level and 18 m 46 s at 0 (BUILD_NOTES §2 "CI", session 25).
# An XLA_FLAGS that already sets the level wins.
_XLA_FLAGS = ('--xla_force_host_platform_device_count=4',
              '--xla_backend_optimization_level=0')
for _flag in _XLA_FLAGS:
  if _flag.split('=')[0] not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' +
                               _flag).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

# A persistent compilation cache shared by the xdist workers and by the
# experiments/main.py subprocesses the end-to-end tests start (they
# inherit the environment). The suite compiles the same programs many
# times: a kill-and-resume test compiles its round in the straight run,
# the killed run and the resumed one, and the fixture below drops every
# module's programs when it ends. Every program is cached, however small:
# a FedHAN run compiles about 170, of which the round step takes 13 s and
# the other 169 another 24 s. The key covers the program, the jax/jaxlib
# version, the XLA flags and the devices, so an entry never serves another
# build. The cache has no size bound: with one, JAX scans every entry under
# a lock on each write (0.7 s at the 3,800 entries of a full run: minutes
# of a cold run spent under one lock). Unlocked, a worker may read an
# entry another is still writing; the truncated entry fails to decompress,
# and JAX warns and compiles the program itself.
# FEDROBUST_TEST_COMPILE_CACHE=0 turns it off; a JAX_COMPILATION_CACHE_DIR
# of your own is kept.
if os.environ.get('FEDROBUST_TEST_COMPILE_CACHE', '1') != '0':
  os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(
      tempfile.gettempdir(), f'fedrobust-test-jax-cache-{os.getuid()}'))
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
import jax

from experiments import devices

# Four devices on two cores: a device thread that lags 40 s behind another
# at a collective would abort the xdist worker (experiments/devices.py).
devices.relax_collective_timeout()

jax.config.update('jax_numpy_rank_promotion', 'raise')

# absltest's create_tempdir() reads --test_tmpdir; pytest never parses flags.
if not flags.FLAGS.is_parsed():
  flags.FLAGS.mark_as_parsed()


def _slow_tests() -> frozenset[str]:
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      'slow_tests.txt')
  with open(path) as f:
    return frozenset(line.strip() for line in f
                     if line.strip() and not line.startswith('#'))


# The longest test files, longest first. xdist's loadfile hands files to
# the workers in collection order, so starting these first keeps the two
# workers busy to the end instead of leaving one long file for last.
LONG_POLES = ('tests/smoke_configs_test.py', 'tests/smoke_configs_more_test.py',
              'tests/smoke_docs_test.py', 'tests/examples_test.py',
              'tests/paper_suite_test.py',
              'tests/methods_test.py', 'tests/main_test.py',
              'tests/multiprocess_test.py', 'tests/reliability_test.py')


def pytest_collection_modifyitems(config, items):
  """Marks the tests listed in slow_tests.txt `slow` (the fast tier is
  `pytest -m "not slow"`; CI runs everything), and moves the long-pole
  files to the front."""
  del config
  slow = _slow_tests()
  for item in items:
    if item.nodeid in slow:
      item.add_marker(pytest.mark.slow)

  def rank(item):
    path = item.nodeid.split('::')[0]
    return LONG_POLES.index(path) if path in LONG_POLES else len(LONG_POLES)
  items.sort(key=rank)        # stable: each file keeps its own order


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
