"""Pytest configuration shared by all tests.

Four host-platform CPU devices let the sharded-round tests run anywhere;
every other test pins itself to one device. Strict rank promotion catches
silent broadcasting.
"""

import os

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
