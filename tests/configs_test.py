"""Every preset in experiments/configs names known flags with values that
parse, and each bare-method preset exists."""

import os

from absl.testing import absltest

from experiments import config as config_lib
from experiments import main


class PresetTest(absltest.TestCase):

  def test_every_preset_parses(self):
    names = sorted(f for f in os.listdir(main.CONFIGS)
                   if f.endswith('.flags'))
    self.assertGreater(len(names), 5)
    for name in names:
      values = config_lib.read_flagfile(os.path.join(main.CONFIGS, name))
      self.assertIn('method', values, name)
      self.assertIn(values['method'], main.FLAGS['method'].parser.enum_values, name)

  def test_bare_method_presets_are_that_method(self):
    for method, preset in main.BARE_METHOD_PRESETS.items():
      values = config_lib.read_flagfile(os.path.join(main.CONFIGS, preset))
      self.assertEqual(values['method'], method)

  def test_unknown_flag_is_named(self):
    path = os.path.join(self.create_tempdir().full_path, 'x.flags')
    with open(path, 'w') as f:
      f.write('--method=fedavg\n# comment\n--num_clientz=3\n')
    with self.assertRaisesRegex(Exception, r'x.flags:3: unknown flag '
                                r'--num_clientz'):
      config_lib.read_flagfile(path)


if __name__ == '__main__':
  absltest.main()
