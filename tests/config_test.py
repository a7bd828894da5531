"""Tests for experiments/config.py and main.py: settings declared once, flags
derived, errors reported under flags, bare-method presets."""

import json
import os
import subprocess
import sys

from absl.testing import absltest

from experiments import config as config_lib
from fedrobust.errors import SettingError
from fedrobust.methods import METHODS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SettingsTest(absltest.TestCase):

  def test_every_method_setting_is_one_flag(self):
    settings = config_lib.all_settings()
    for method, spec in METHODS.items():
      for s in spec.settings:
        flag = config_lib.method_flag(method, s)
        self.assertIn(flag, settings)
        self.assertEqual(settings[flag].default, s.default)
    self.assertIn('sdfc_lambda', settings)
    self.assertIn('fedprox_mu', settings)
    self.assertIn('cohort_share', settings)       # shared by two methods
    self.assertEqual(set(config_lib.defaults()), set(settings))

  def test_settings_of_passes_factory_keywords(self):
    config = dict(config_lib.defaults(), sdfc_lambda=1.0,
                  sdfc_fisher='released')
    self.assertEqual(config_lib.settings_of('sdfc', config),
                     {'lam': 1.0, 'components': 'both',
                      'importance': 'fisher', 'stiffness': 'diff',
                      'fisher_mode': 'released', 'first_round': 'none',
                      'weighting': 'sigmoid', 'diagnostics': False,
                      'fisher_impl': 'factored', 'fisher_batch': 0})

  def test_foreign_setting_is_refused(self):
    config = dict(config_lib.defaults(), method='fedavg', sdfc_lambda=1.0)
    with self.assertRaisesRegex(SettingError,
                                'sdfc_lambda: is a setting of '
                                'method=sdfc, not method=fedavg') as ctx:
      config_lib.check_foreign_settings(config)
    self.assertEqual(
        config_lib.describe_error(ctx.exception, 'fedavg'),
        '--sdfc_lambda: is a setting of --method=sdfc, not --method=fedavg')
    config_lib.check_foreign_settings(dict(config, sdfc_lambda=5.0))

  def test_errors_are_reported_under_flags(self):
    cases = [
        (SettingError('lam', 'must be >= 0, got -1',
                      component='method sdfc'), 'sdfc',
         '--sdfc_lambda (method sdfc): must be >= 0, got -1'),
        (SettingError('fisher_mode', "got 'x'", component='method sdfc'),
         'sdfc', '--sdfc_fisher'),
        (SettingError('iters', 'must be a positive int, got 0',
                      component='aggregator geometric_median'), 'fedavg',
         '--aggregator_kwargs iters (aggregator geometric_median)'),
        (SettingError('clients_per_round', "aggregator 'krum' needs n >= "
                      '2f+3 clients per round; with num_byzantine=1 that '
                      'is n >= 5, got n=4'), 'fedavg',
         "--clients_per_round: aggregator 'krum' needs n >= 2f+3 clients "
         'per round; with --num_byzantine=1 that is n >= 5, got n=4'),
        (SettingError('z', 'must be finite', component='attack lie'),
         'fedavg', '--attack_kwargs z (attack lie)'),
    ]
    for err, method, expected in cases:
      self.assertIn(expected, config_lib.describe_error(err, method))


class MainTest(absltest.TestCase):

  def test_bare_method_gets_its_paper_preset_and_flags_win(self):
    code = (
        'import json, sys\n'
        'from absl import flags\n'
        f'sys.path.insert(0, {ROOT!r})\n'
        'from experiments import main\n'
        "flags.FLAGS(['main', '--method=sdfc', '--num_rounds=3'])\n"
        'print(json.dumps(main.build_config()))\n')
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
    config = json.loads(proc.stdout.strip().splitlines()[-1])
    self.assertEqual(config['num_rounds'], 3)          # explicit flag wins
    self.assertEqual(config['local_epochs'], 10)       # from the preset
    self.assertEqual(config['attack'], 'badnets')
    self.assertEqual(config['validation_size'], 256)
    self.assertEqual(config['aggregator'], 'auto')     # -> fdagg at run time


if __name__ == '__main__':
  absltest.main()
