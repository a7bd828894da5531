"""Tests for fedrobust.testing: check_rule on registered rules, and on toy
rules that each break one part of the contract (the check that must name
them is the one asserted)."""

import functools
import re

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp

from fedrobust import aggregators
from fedrobust import testing
from fedrobust.aggregators import Aggregator, stateless_init


def masked_mean(updates, mask):
  """The mean over the real clients, masked slots selected away."""
  mask = jnp.asarray(mask, bool)
  n = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)

  def leaf(x):
    keep = mask.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.sum(jnp.where(keep, x, 0.0), axis=0) / n
  weights = jnp.where(mask, 1.0 / n, 0.0).astype(jnp.float32)
  return jax.tree.map(leaf, updates), weights


# ---- Toy rules, each broken in one way -------------------------------------


def multiplies_masked_by_zero(*, num_byzantine=0):
  """Reads masked slots: weights them by 0 instead of selecting them away,
  so a NaN in a masked slot gives 0 * NaN = NaN."""
  del num_byzantine

  def aggregate(updates, mask, state, key):
    del key
    m = jnp.asarray(mask, jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    update = jax.tree.map(lambda x: jnp.tensordot(m, x, axes=1) / n, updates)
    return update, state, {'weights': m / n}
  return Aggregator(stateless_init, aggregate)


def first_client(*, num_byzantine=0):
  """Depends on client order: the update of the first real slot."""
  del num_byzantine

  def aggregate(updates, mask, state, key):
    del key
    first = jnp.argmax(jnp.asarray(mask, bool))
    weights = (jnp.arange(mask.shape[0]) == first).astype(jnp.float32)
    return jax.tree.map(lambda x: x[first], updates), state, {
        'weights': weights}
  return Aggregator(stateless_init, aggregate)


def plain_mean(*, num_byzantine=0):
  """The masked mean: correct, but NaN as soon as one real client sends
  NaN (it claims to be robust when built with num_byzantine >= 1)."""
  del num_byzantine

  def aggregate(updates, mask, state, key):
    del key
    update, weights = masked_mean(updates, mask)
    return update, state, {'weights': weights}
  return Aggregator(stateless_init, aggregate)


def keeps_client_axis(*, num_byzantine=0):
  """Wrong output shape: every leaf keeps a client axis of 1."""
  del num_byzantine

  def aggregate(updates, mask, state, key):
    del key
    update, weights = masked_mean(updates, mask)
    return jax.tree.map(lambda x: x[None], update), state, {
        'weights': weights}
  return Aggregator(stateless_init, aggregate)


def growing_history(*, num_byzantine=0):
  """Retraces every round: its state appends a row per round, so the
  jitted aggregate sees a new state shape each call."""
  del num_byzantine

  def init(params):
    del params
    return jnp.zeros((0,), jnp.float32)

  def aggregate(updates, mask, state, key):
    del key
    update, weights = masked_mean(updates, mask)
    return update, jnp.concatenate([state, jnp.sum(weights)[None]]), {
        'weights': weights}
  return Aggregator(init, aggregate)


def lowest_id(*, num_byzantine=0):
  """Correct: the update of the real client with the smallest id. It is
  permutation invariant only because ids travel with their clients."""
  del num_byzantine

  def aggregate(updates, mask, state, key, *, ids):
    del key
    mask = jnp.asarray(mask, bool)
    big = jnp.iinfo(jnp.int32).max
    pick = jnp.argmin(jnp.where(mask, ids, big))
    weights = (jnp.arange(mask.shape[0]) == pick).astype(jnp.float32)
    return jax.tree.map(lambda x: x[pick], updates), state, {
        'weights': weights}
  return Aggregator(stateless_init, aggregate, reads=('ids',))


class RegisteredRulesTest(parameterized.TestCase):

  @parameterized.parameters(('median', 1), ('trimmed_mean', 1),
                            ('weighted_mean', 0))
  def test_registered_rule_passes(self, name, f):
    report = testing.check_rule(name, num_byzantine=f)
    self.assertTrue(report.passed, str(report))
    self.assertEqual(report.rule, name)
    self.assertEqual([r.name for r in report.results], list(testing.CHECKS))
    self.assertEqual(report.skipped, () if f else ('finite',))
    self.assertTrue(all(r.passed for r in report.results
                        if r.name not in report.skipped))

  def test_factory_and_aggregator_are_accepted(self):
    factory = functools.partial(aggregators.AGGREGATORS['trimmed_mean'])
    report = testing.check_rule(factory, num_clients=6, num_byzantine=2,
                                raise_on_failure=False)
    self.assertEqual(report.failed, (), str(report))
    self.assertEqual(report.rule, 'trimmed_mean')
    agg = aggregators.get_aggregator('mean', num_byzantine=0)
    report = testing.check_rule(agg, num_byzantine=0, name='my_mean')
    self.assertTrue(report.passed, str(report))
    self.assertEqual(report.rule, 'my_mean')

  def test_extras_travel_with_their_clients(self):
    report = testing.check_rule(lowest_id, num_byzantine=0,
                                raise_on_failure=False)
    self.assertEqual(report.failed, (), str(report))
    self.assertTrue(report['permutation'].passed)


class BrokenRulesTest(parameterized.TestCase):
  """Each toy rule fails, and the failure names the check it breaks and
  what was measured."""

  @parameterized.named_parameters(
      ('reads_masked_slots', multiplies_masked_by_zero, 0,
       {'masked', 'shapes', 'identical'}, 'masked',
       r'the update changed by max \|diff\| inf'),
      ('depends_on_client_order', first_client, 1, {'permutation'},
       'permutation', r'the update changed by max \|diff\| [0-9]'),
      ('nan_from_a_nan_client', plain_mean, 1, {'finite'}, 'finite',
       r'client 4 bad: nan: [0-9]+ of 7 update entries'),
      ('wrong_output_shape', keeps_client_axis, 0, {'shapes'}, 'shapes',
       re.escape("leaf ['bias'] is float32[1, 3], expected float32[3]")),
      ('retraces_every_round', growing_history, 0, {'retrace'}, 'retrace',
       r'traced 2 more time\(s\) in rounds 2\.\.3'),
  )
  def test_broken_rule_fails_the_right_check(self, factory, f, failing,
                                             check, detail):
    report = testing.check_rule(factory, num_byzantine=f,
                                raise_on_failure=False)
    self.assertFalse(report.passed)
    self.assertEqual(set(report.failed), failing, str(report))
    self.assertFalse(report[check].passed)
    self.assertRegex(report[check].detail, detail)
    text = str(report)
    self.assertIn(f"rule '{factory.__name__}' failed", text)
    for name in failing:
      self.assertIn(f'FAIL {name}:', text)

  def test_a_failure_raises_naming_rule_check_and_numbers(self):
    with self.assertRaises(AssertionError) as ctx:
      testing.check_rule(first_client)
    self.assertRegex(str(ctx.exception),
                     r"rule 'first_client' failed conformance check\(s\) "
                     r'permutation\n(.|\n)*FAIL permutation: the update '
                     r'changed by max \|diff\| [0-9]')

  def test_skip_and_permutation_invariant_false(self):
    report = testing.check_rule(first_client, skip=('permutation',))
    self.assertTrue(report.passed, str(report))
    self.assertIsNone(report['permutation'].passed)
    self.assertEqual(report.skipped, ('permutation',))
    report = testing.check_rule(first_client, permutation_invariant=False)
    self.assertTrue(report.passed, str(report))
    self.assertIn('does not claim', report['permutation'].detail)

  def test_bad_arguments(self):
    with self.assertRaisesRegex(ValueError, r"unknown checks \['perm'\]"):
      testing.check_rule('median', skip=('perm',))
    with self.assertRaisesRegex(ValueError, 'num_clients must be >= 3'):
      testing.check_rule('median', num_clients=2)
    needs_retrain = Aggregator(stateless_init, lambda *a, **k: None,
                               reads=('retrain',))
    with self.assertRaisesRegex(ValueError, r"\['retrain'\].*extras"):
      testing.check_rule(needs_retrain)
    with self.assertRaisesRegex(TypeError, 'must be an Aggregator'):
      testing.check_rule(lambda: 3)


class CountTracesTest(absltest.TestCase):

  def test_counts_traces_not_calls(self):
    counted = testing.count_traces(lambda x: x + 1)
    fn = jax.jit(counted)
    for value in (1.0, 2.0, 3.0):
      fn(jnp.float32(value))
    self.assertEqual(counted.traces, 1)
    fn(jnp.zeros(2, jnp.float32))                  # a new shape
    self.assertEqual(counted.traces, 2)


if __name__ == '__main__':
  absltest.main()
