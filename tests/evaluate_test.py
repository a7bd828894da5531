"""engine.evaluate's confusion matrix and the backdoor rates built on it."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.engine.evaluate import (backdoor_rates, evaluate, evaluations,
                                       pad_leading, pad_to_batches, rebatch)
from fedrobust.engine.execution import client_mesh, place_clients


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


def linear(params, x):
  return x.reshape(x.shape[0], -1) @ params


class SplitEvaluationsTest(absltest.TestCase):
  """On a 4-device mesh the evaluations split the sets' batches or the
  clients over the devices, and give the numbers of the unsplit ones."""

  def setUp(self):
    super().setUp()
    if jax.device_count() < 4:
      self.skipTest('needs 4 devices (conftest sets 4 CPU devices)')
    self.mesh = client_mesh(4)
    rng = np.random.default_rng(0)
    self.params = jnp.asarray(rng.normal(size=(6, 3)), jnp.float32)
    self.rows = jnp.asarray(rng.normal(size=(5, 6, 3)), jnp.float32)
    # 43 examples in batches of 5: T = 9, not a multiple of 4.
    x = rng.normal(size=(43, 2, 3)).astype(np.float32)
    y = rng.integers(0, 3, 43).astype(np.int32)
    self.test = pad_to_batches(x, y, 5)
    # 6 clients (not a multiple of 4), 0 to 9 examples each, [6, 2, 5].
    sizes = [3, 0, 9, 5, 1, 7]
    sets = [pad_to_batches(rng.normal(size=(n, 2, 3)).astype(np.float32),
                           rng.integers(0, 3, n).astype(np.int32), 5)
            for n in sizes]
    self.local = tuple(
        np.stack([np.concatenate([s[i], np.zeros((2 - len(s[i]),
                                                  *s[i].shape[1:]),
                                                 s[i].dtype)])
                  for s in sets]) for i in range(3))
    self.index = np.array([4, 0, 2, 2, 1, 3], np.int32)

  def test_rebatch_keeps_examples_in_order(self):
    x, y, mask = rebatch(*self.test, 4)
    self.assertEqual(x.shape[0] % 4, 0)
    self.assertEqual(x.shape[0], 12)
    self.assertLessEqual(x.shape[1], 5)
    np.testing.assert_array_equal(x[mask], self.test[0][self.test[2]])
    np.testing.assert_array_equal(y[mask], self.test[1][self.test[2]])
    self.assertEqual(int(mask.sum()), 43)

  def test_split_equals_whole(self):
    whole = evaluations(linear, None)
    split = evaluations(linear, self.mesh)
    test = place_clients(rebatch(*self.test, 4), self.mesh, 'sharded')
    # Each device holds a quarter of the batches, not all of them.
    self.assertEqual(test[0].addressable_shards[0].data.shape[0],
                     test[0].shape[0] // 4)
    local = place_clients(pad_leading(self.local, 4), self.mesh, 'sharded')
    index = place_clients(pad_leading(self.index, 4), self.mesh, 'sharded')
    self.assertEqual(local[0].shape[0], 8)
    self.assertEqual(local[0].addressable_shards[0].data.shape[0], 2)
    got = {
        'test': split['test'](self.params, *test),
        'rows': split['rows'](self.rows, *test),
        'clients': jax.tree.map(lambda a: np.asarray(a)[:6],
                                split['clients'](self.params, *local)),
        'own': jax.tree.map(lambda a: np.asarray(a)[:6],
                            split['own'](self.rows, index, local))}
    t = tuple(map(jnp.asarray, self.test))
    lt = tuple(map(jnp.asarray, self.local))
    want = {'test': whole['test'](self.params, *t),
            'rows': whole['rows'](self.rows, *t),
            'clients': whole['clients'](self.params, *lt),
            'own': whole['own'](self.rows, jnp.asarray(self.index), lt)}
    for name in want:
      for key in want[name]:
        w, g = np.asarray(want[name][key]), np.asarray(got[name][key])
        if key == 'loss':   # another order of float additions
          np.testing.assert_allclose(g, w, rtol=1e-5, err_msg=name)
        else:
          np.testing.assert_array_equal(g, w, err_msg=f'{name} {key}')
    # Client 1 has no test example: count 0 split or whole.
    self.assertEqual(float(got['clients']['count'][1]), 0.0)
    self.assertEqual(float(got['test']['count']), 43.0)


class RecurrentSplitTest(absltest.TestCase):
  """A model that scans over a carry it builds from constants (the
  row-LSTM's zero state) evaluates on a 2-device mesh, the runner's
  default on 2 cores, and gives the unsplit numbers."""

  def test_row_lstm_on_two_devices(self):
    if jax.device_count() < 2:
      self.skipTest('needs 2 devices (conftest sets 4 CPU devices)')
    from fedrobust.models import get_model  # pylint: disable=g-import-not-at-top
    model = get_model('row_lstm', num_classes=3, input_shape=(6, 5, 1),
                      hidden=8)
    params = model.init(jax.random.PRNGKey(0))
    rng = np.random.default_rng(1)
    x = rng.integers(0, 255, (13, 6, 5, 1)).astype(np.uint8)
    y = rng.integers(0, 3, 13).astype(np.int32)
    test = pad_to_batches(x, y, 4)                     # T = 4
    mesh = client_mesh(2)
    whole = evaluations(model.apply, None)
    split = evaluations(model.apply, mesh)
    want = whole['test'](params, *map(jnp.asarray, test))
    got = split['test'](params, *place_clients(rebatch(*test, 2), mesh,
                                               'sharded'))
    self.assertEqual(float(got['count']), 13.0)
    self.assertEqual(float(got['accuracy']), float(want['accuracy']))
    np.testing.assert_allclose(got['loss'], want['loss'], rtol=1e-5)
    # Per-client sets [K, T, B, ...] split over the clients.
    local = tuple(np.stack([a, a]) for a in test)
    got = split['clients'](params, *place_clients(local, mesh, 'sharded'))
    np.testing.assert_array_equal(np.asarray(got['count']), [13.0, 13.0])
    np.testing.assert_allclose(np.asarray(got['accuracy']),
                               [float(want['accuracy'])] * 2)


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
