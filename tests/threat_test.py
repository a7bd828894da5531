"""Tests for fedrobust/threats.py: how a run's settings wire attacks and rules.

No training: build_threat is called on a tiny MLP federation and its output
is inspected (the aggregator factory is spied on where the wiring is in
the settings it receives). Errors are checked as the runner reports them,
under the flag that sets the named argument.
"""

from unittest import mock

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from experiments import config as config_lib
from fedrobust import threats as threat_lib
from fedrobust.federation import builder
from fedrobust import aggregators
from fedrobust.attacks import data_poisoning as dp
from fedrobust.errors import SettingError

SHAPE = (28, 28, 1)


def make_config(**overrides):
  config = config_lib.defaults()
  config.update(dataset='idx', model='mlp', num_clients=8,
                clients_per_round=8, batch_size=32, local_epochs=2,
                local_lr=0.05, momentum=0.5, aggregator='mean')
  unknown = set(overrides) - set(config)
  assert not unknown, unknown
  config.update(overrides)
  return config


def build(config, client_steps=0, validation_size=40):
  rng = np.random.default_rng(0)
  cohorts, _ = builder.build_cohorts(config, num_classes=10, input_shape=SHAPE,
                                   conv_impl='xla', compute_dtype='float32')
  test_x = rng.integers(0, 256, (30, *SHAPE), np.uint8)
  test_y = rng.integers(0, 10, 30).astype(np.int32)
  validation = (rng.integers(0, 256, (validation_size, *SHAPE), np.uint8),
                rng.integers(0, 10, validation_size).astype(np.int32))
  try:
    return threat_lib.build_threat(
        config, num_classes=10, input_shape=SHAPE, test_x=test_x,
        test_y=test_y, validation=validation, cohorts=cohorts,
        group_sizes=(config['clients_per_round'],),
        client_steps=client_steps)
  except SettingError as err:
    raise ValueError(config_lib.describe_error(err, config['method'])
                     ) from err


class ToldRecoveryTest(absltest.TestCase):
  """FedHAN's told mode gets the run's attackers as `forget`, as the
  unlearning baselines do; without --fedhan_unlearn_round it gets none."""

  def test_fedhan_is_told_the_fixed_malicious_set(self):
    real = aggregators.get_aggregator
    for round_, told in ((5, True), (0, False)):
      seen = {}

      def spy(name, **kwargs):
        seen.update(kwargs)
        return real(name, **kwargs)

      config = make_config(method='fedhan', aggregator='fedhan',
                           attack='label_flip', malicious_fraction=0.25,
                           fedhan_unlearn_round=round_)
      with mock.patch.object(threat_lib.aggregators, 'get_aggregator', spy):
        setup = build(config)
      self.assertEqual(seen['unlearn_round'], round_)
      if told:
        np.testing.assert_array_equal(seen['forget'],
                                      np.asarray(setup.threat.malicious))
        self.assertEqual(int(np.sum(seen['forget'])), 2)
      else:
        self.assertNotIn('forget', seen)
    with self.assertRaisesRegex(ValueError, 'fixed malicious set'):
      build(make_config(method='fedhan', aggregator='fedhan',
                        attack='label_flip', malicious_fraction=0.25,
                        resample_malicious=True, fedhan_unlearn_round=5))


class TypicalClientStepsTest(absltest.TestCase):

  def test_mean_of_the_clients_real_steps(self):
    # ceil(n / 32) = 4, 10, 2 batches; x 2 epochs = 8, 20, 4: mean 10.67.
    self.assertEqual(threat_lib.typical_client_steps([100, 300, 64], 32, 2),
                     11)
    # Clients without data take no part; an empty federation gives 1.
    self.assertEqual(threat_lib.typical_client_steps([100, 0], 32, 1), 4)
    self.assertEqual(threat_lib.typical_client_steps([0, 0], 32, 1), 1)
    # Below the padded maximum (the engine's static count) on skewed data.
    counts = [1971, 2500, 7459, 3000]
    self.assertLess(threat_lib.typical_client_steps(counts, 64, 1),
                    -(-max(counts) // 64))


class ServerTrainedRulesTest(absltest.TestCase):
  """Issue 17, fix 5: FLTrust's Alg. 1 runs ModelUpdate(w, D_0, b, beta,
  R_l) on the server with the clients' R_l, batch size and optimizer."""

  def test_server_runs_the_clients_iterations(self):
    for rule in ('fltrust', 'finetune'):
      seen = {}
      real = aggregators.get_aggregator

      def spy(name, **kwargs):
        seen.update(kwargs)
        return real(name, **kwargs)

      with mock.patch.object(threat_lib.aggregators, 'get_aggregator', spy):
        build(make_config(aggregator=rule), client_steps=27)
      self.assertEqual(seen['server_steps'], 27, rule)
      self.assertEqual(seen['server_batch_size'], 32, rule)
      self.assertEqual(seen['server_lr'], 0.05, rule)
      self.assertEqual(seen['server_momentum'], 0.5, rule)
      # Without a client count: one pass per local epoch over U (40 / 32
      # -> 2 batches, x 2 epochs).
      seen.clear()
      with mock.patch.object(threat_lib.aggregators, 'get_aggregator', spy):
        build(make_config(aggregator=rule))
      self.assertEqual(seen['server_steps'], 4, rule)


class ComposedAttackTest(absltest.TestCase):
  """Issue 17, fix 8: a data attack plus a model-space transform."""

  def test_backdoor_with_scaling_poisons_data_and_boosts_updates(self):
    setup = build(make_config(attack='badnets', malicious_fraction=0.25,
                              model_attack='scaling',
                              model_attack_kwargs='{"factor": 3.0}'))
    self.assertIsInstance(setup.poison, dp.DataPoison)
    self.assertEqual(setup.poison.name, 'badnets')
    self.assertIsNotNone(setup.triggered_test)
    self.assertEqual(setup.num_malicious, 2)
    attack = setup.threat.model_attack
    self.assertIsNotNone(attack)
    updates = jnp.asarray(np.random.default_rng(1).normal(size=(4, 6)),
                          jnp.float32)
    malicious = jnp.asarray([False, True, False, True])
    mask = jnp.asarray([True, True, True, False])
    out = np.asarray(attack(updates, malicious, mask, jax.random.key(0)))
    # The real attacker's update is boosted; benign rows and the masked
    # attacker slot are left as they were.
    np.testing.assert_allclose(out[1], 3.0 * np.asarray(updates[1]),
                               rtol=1e-6)
    np.testing.assert_array_equal(out[[0, 2, 3]],
                                  np.asarray(updates)[[0, 2, 3]])

  def test_data_attack_alone_has_no_model_attack(self):
    setup = build(make_config(attack='badnets', malicious_fraction=0.25))
    self.assertIsNone(setup.threat.model_attack)
    self.assertEqual(setup.poison.name, 'badnets')


class NeurotoxinMaskTest(absltest.TestCase):
  """Issue 17, fix 8: Neurotoxin's masking composes with any data attack."""

  def test_mask_on_top_of_dba(self):
    setup = build(make_config(attack='dba', malicious_fraction=0.25,
                              neurotoxin_mask=0.2))
    self.assertEqual(setup.poison.name, 'dba')
    grads = {'w': jnp.asarray(np.random.default_rng(2).normal(size=(20, 5)),
                              jnp.float32)}
    mask = np.asarray(setup.poison.grad_mask(grads)['w'])
    magnitude = np.abs(np.asarray(grads['w']))
    # The 20% largest clean-gradient coordinates are masked, the rest kept.
    self.assertEqual(int(np.sum(mask == 0)), 20)
    np.testing.assert_array_equal(
        mask == 0, magnitude >= np.sort(magnitude.ravel())[-20])
    self.assertIsNone(build(make_config(
        attack='dba', malicious_fraction=0.25)).poison.grad_mask)

  def test_refusals_name_the_flag(self):
    for overrides, pattern in (
        (dict(attack='lie', malicious_fraction=0.25, neurotoxin_mask=0.1),
         '--neurotoxin_mask: 0.1 masks .* needs --attack='),
        (dict(attack='badnets', malicious_fraction=0.25,
              neurotoxin_mask=1.5), r'--neurotoxin_mask: must be in \[0, 1\)'),
        (dict(attack='neurotoxin', malicious_fraction=0.25,
              neurotoxin_mask=0.1), 'masks its gradients already')):
      with self.assertRaisesRegex(ValueError, pattern):
        build(make_config(**overrides))


class AttackerKnowledgeTest(absltest.TestCase):

  def test_omniscient_is_benign_stats(self):
    for knowledge in ('benign_stats', 'omniscient'):
      setup = build(make_config(attack='lie', malicious_fraction=0.25,
                                attacker_knowledge=knowledge))
      self.assertIsNotNone(setup.threat.model_attack)
    with self.assertRaisesRegex(ValueError, 'does not grant them'):
      build(make_config(attack='lie', malicious_fraction=0.25,
                        attacker_knowledge='own_updates_only'))


if __name__ == '__main__':
  absltest.main()
