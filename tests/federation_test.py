"""The public API: a Federation built from settings, run round by round,
gives the runner's model bit for bit; a user's rule and attack registered
from outside the package run in it; bad settings are named."""

from absl.testing import absltest
import jax
import numpy as np

import fedrobust
from experiments import train
from fedrobust.aggregators import coordinatewise
from fedrobust.attacks import model_poisoning
from tests.main_test import IdxDataTestCase, base_config

SETTINGS = dict(dataset='idx', model='mlp', num_clients=4,
                clients_per_round=3, local_test_fraction=0.2, num_rounds=2,
                batch_size=32, local_lr=0.05, eval_batch_size=50,
                num_devices=1, aggregator='median', attack='sign_flip',
                malicious_fraction=0.25)


class FederationTest(IdxDataTestCase):

  def test_the_api_gives_the_runners_model(self):
    fed = fedrobust.Federation(SETTINGS, data_dir=self.data_dir)
    state, rows = fed.run()
    self.assertEqual([r['round'] for r in rows], [1, 2])
    self.assertEqual(int(state.round), 2)
    for key in ('test_accuracy', 'local_accuracy', 'train_loss'):
      self.assertTrue(np.isfinite(rows[-1][key]), key)
    summary = train.run(base_config(
        self.data_dir, self.create_tempdir().full_path,
        **{k: v for k, v in SETTINGS.items() if k != 'dataset'}))
    self.assertEqual(train.params_sha256(state.params),
                     summary['params_sha256'])
    self.assertAlmostEqual(rows[-1]['test_accuracy'],
                           summary['final']['test_accuracy'])

  def test_step_by_step_equals_run(self):
    fed = fedrobust.Federation(SETTINGS, data_dir=self.data_dir)
    state = fed.init()
    for _ in range(2):
      state, metrics = fed.step(state)
      self.assertIn('train_loss', metrics)
    ran, _ = fedrobust.Federation(SETTINGS, data_dir=self.data_dir).run()
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(
        ran.params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  def test_registered_components_run_by_name(self):
    fedrobust.register_rule('user_median', coordinatewise.median,
                            replace=True)
    fedrobust.register_attack('user_sign_flip', model_poisoning.sign_flip,
                              replace=True)
    with self.assertRaisesRegex(ValueError, 'registered already'):
      fedrobust.register_rule('user_median', coordinatewise.median)
    with self.assertRaisesRegex(ValueError, 'letters, digits and underscores'):
      fedrobust.register_attack('user sign-flip', model_poisoning.sign_flip)
    with self.assertRaisesRegex(ValueError, "provides='model'"):
      fedrobust.register_rule('user_rule', coordinatewise.median,
                              needs=fedrobust.Needs(provides=('model',)))
    fed = fedrobust.Federation(SETTINGS, data_dir=self.data_dir,
                               aggregator='user_median',
                               attack='user_sign_flip')
    state, _ = fed.run()
    reference, _ = fedrobust.Federation(SETTINGS,
                                        data_dir=self.data_dir).run()
    # The same rule and attack under other names: the same model.
    self.assertEqual(train.params_sha256(state.params),
                     train.params_sha256(reference.params))

  def test_bad_settings_are_named(self):
    with self.assertRaisesRegex(fedrobust.SettingError,
                                "agregator: is not a setting.*'aggregator'"):
      fedrobust.Federation(SETTINGS, data_dir=self.data_dir,
                           agregator='median')
    with self.assertRaisesRegex(fedrobust.SettingError, '^aggregator'):
      fedrobust.Federation(SETTINGS, data_dir=self.data_dir,
                           aggregator='no_such_rule')
    with self.assertRaisesRegex(fedrobust.SettingError,
                                'validation_size.*needs server data'):
      fedrobust.Federation(SETTINGS, data_dir=self.data_dir,
                           aggregator='fltrust')


if __name__ == '__main__':
  absltest.main()
