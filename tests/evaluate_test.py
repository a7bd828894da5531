"""engine.evaluate's confusion matrix and the backdoor rates built on it."""

from absl.testing import absltest
import jax.numpy as jnp
import numpy as np

from fedrobust.engine.evaluate import (backdoor_rates, evaluate,
                                       pad_to_batches)


def fixed_logits(params, x):
  """A 'model' whose prediction is the input itself (x holds a class)."""
  del params
  return jnp.eye(3)[x[:, 0]] * 5.0


class EvaluateTest(absltest.TestCase):

  def test_confusion_counts_real_rows_only(self):
    pred = np.array([0, 1, 2, 2, 1, 0, 2], np.int32)
    true = np.array([0, 1, 1, 2, 0, 0, 2], np.int32)
    x, y, mask = pad_to_batches(pred[:, None], true, 3)   # 2 padded rows
    out = evaluate(fixed_logits, None, jnp.asarray(x), jnp.asarray(y),
                   jnp.asarray(mask))
    want = np.zeros((3, 3))
    for t, p in zip(true, pred):
      want[t, p] += 1
    np.testing.assert_array_equal(out['confusion'], want)
    self.assertAlmostEqual(float(out['accuracy']), 5 / 7, places=6)
    self.assertEqual(float(out['count']), 7.0)


class BackdoorRatesTest(absltest.TestCase):

  def test_rates_from_hand_counts(self):
    # Clean test set, rows true / columns predicted, target class 2.
    clean = np.array([[8, 1, 1],      # class 0: 1 of 10 predicted target
                      [0, 7, 3],      # class 1: 3 of 10
                      [0, 0, 10]])    # target rows: excluded by default
    # Triggered inputs (true classes 0 and 1) against their true labels.
    triggered = np.array([[2, 0, 8],
                          [0, 5, 5],
                          [0, 0, 0]])
    r = backdoor_rates(clean, triggered, 2)
    self.assertAlmostEqual(float(r['attack_success_rate']), 13 / 20)
    self.assertAlmostEqual(float(r['robust_accuracy']), 7 / 20)
    self.assertAlmostEqual(float(r['clean_target_rate']), 4 / 20)
    # With the target class kept (the SDFC release's R), its rows count.
    r = backdoor_rates(clean, triggered, 2, exclude_target=False)
    self.assertAlmostEqual(float(r['clean_target_rate']), 14 / 30)

  def test_leading_axes_are_rows(self):
    eye = np.eye(2)[None].repeat(3, 0)            # 3 perfect models
    flip = np.array([[0, 4], [4, 0]])[None].repeat(3, 0)
    r = backdoor_rates(eye * 5, flip, 1)
    np.testing.assert_allclose(r['attack_success_rate'], [0.5] * 3)
    np.testing.assert_allclose(r['clean_target_rate'], [0.0] * 3)


if __name__ == '__main__':
  absltest.main()
