"""Every preset in experiments/configs names known flags with values that
parse, and each bare-method preset exists."""

import os

from absl.testing import absltest

from fedrobust.methods import METHODS

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
    presets = {m: s.preset for m, s in METHODS.items() if s.preset}
    self.assertEqual(set(presets), {'sdfc', 'horus', 'fedhan'})
    for method, preset in presets.items():
      values = config_lib.read_flagfile(os.path.join(main.CONFIGS, preset))
      self.assertEqual(values['method'], method)

  def test_every_method_has_a_benchmark_preset(self):
    from benchmarks import method_rounds  # pylint: disable=g-import-not-at-top
    from fedrobust.methods import METHODS  # pylint: disable=g-import-not-at-top
    self.assertEqual(set(method_rounds.PRESETS), set(METHODS))
    for method in METHODS:
      config = method_rounds.method_config(method, 100, 20000)
      self.assertEqual((config['method'], config['clients_per_round'],
                        config['max_train_examples']), (method, 100, 20000))
      own = method_rounds.method_config(method, 0, 20000)
      preset = config_lib.read_flagfile(os.path.join(
          main.CONFIGS, method_rounds.preset_of(method)))
      self.assertEqual(own['num_clients'], preset.get(
          'num_clients', config_lib.defaults()['num_clients']))
    with self.assertRaisesRegex(ValueError, 'no benchmark preset'):
      method_rounds.preset_of('nope')

  def test_interleaved_timing_takes_the_ratio_within_each_pass(self):
    """A slow spell that starts mid-pass skews the ratio of the medians
    (12 / 2 here); the median of the per-pass ratios stays 1.5."""
    from unittest import mock  # pylint: disable=g-import-not-at-top
    from benchmarks import method_rounds  # pylint: disable=g-import-not-at-top
    clock = [0.0]
    slow = iter([1, 1, 1, 4, 4, 4])   # per round run, in order

    def method(cost):
      def one_round():
        clock[0] += cost * next(slow)
        return clock[0]
      report = lambda r, s: {'round_seconds': r, 'server_seconds': s}
      return method_rounds.Prepared(one_round, lambda: 0.5, report)

    with mock.patch.object(method_rounds.time, 'perf_counter',
                           lambda: clock[0]):
      a, b = method_rounds.time_interleaved([method(2.0), method(3.0)], 3)
    # Round times a: 2, 2, 8 and b: 3, 12, 12.
    self.assertEqual((a['round_seconds'], b['round_seconds']), (2.0, 12.0))
    self.assertEqual(a['ratio_to_first'], 1.0)
    self.assertEqual(b['ratio_to_first'], 1.5)
    self.assertEqual(b['server_seconds'], 0.5)
    self.assertEqual(b['interleaved_rounds'], 3)

  def test_unknown_flag_is_named(self):
    path = os.path.join(self.create_tempdir().full_path, 'x.flags')
    with open(path, 'w') as f:
      f.write('--method=fedavg\n# comment\n--num_clientz=3\n')
    with self.assertRaisesRegex(Exception, r'x.flags:3: unknown flag '
                                r'--num_clientz'):
      config_lib.read_flagfile(path)


if __name__ == '__main__':
  absltest.main()
