"""FedEraser (the recovery baseline of FedHAN's Figs. 6-8) by hand: storage
of the remaining clients' step lengths, the reset to the initial model,
calibrated steps, and FedAvg of fresh remaining clients afterwards."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.aggregators import call_aggregator, get_aggregator
from fedrobust.errors import SettingError

FORGET = np.array([False, False, False, True])   # client 3 is forgotten


class FedEraserTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.agg = get_aggregator('federaser', num_clients=4, forget=FORGET,
                              unlearn_round=4, interval=1)
    self.state = self.agg.init({'a': jnp.zeros(2), 'b': jnp.zeros(1)})
    self.step = jax.jit(lambda u, m, s, ids, tau, w: call_aggregator(
        self.agg, u, m, s, jax.random.key(0), ids=ids, staleness=tau,
        weights=w, coverage=None))

  def round(self, rows, ids, tau, mask=None, w=None):
    rows = np.asarray(rows, np.float32)
    mask = np.ones(len(ids), bool) if mask is None else np.asarray(mask)
    w = np.ones(len(ids), np.float32) if w is None else np.asarray(w)
    out, self.state, info = self.step(
        {'a': jnp.asarray(rows[:, :2]), 'b': jnp.asarray(rows[:, 2:])},
        jnp.asarray(mask), self.state, jnp.asarray(ids, jnp.int32),
        jnp.asarray(tau, jnp.int32), jnp.asarray(w, jnp.float32))
    return np.concatenate([out['a'], out['b']]), info

  def test_reset_then_calibrated_steps_then_fedavg(self):
    applied = []
    old = [[3.0, 4.0, 1.0], [0.0, 6.0, -2.0], [1.0, 0.0, 0.5]]
    for t in range(3):          # rounds 1-3: client 0 and the attacker
      out, info = self.round([old[t], [50.0, 50.0, 50.0], [9, 9, 9]],
                             [0, 3, 1], [0, 0, 0], mask=[1, 1, 0],
                             w=[1.0, 3.0, 1.0])
      want = (np.array(old[t]) + 3 * 50.0) / 4
      np.testing.assert_allclose(out, want, rtol=1e-6)
      np.testing.assert_allclose(info['weights'], [1.0, 3.0, 0.0])
      applied.append(out)
    # Per tensor, the stored step lengths are client 0's alone.
    np.testing.assert_allclose(self.state.norms,
                               [[5.0, 1.0], [6.0, 2.0], [1.0, 0.5]],
                               rtol=1e-6)
    # Round 4 = R: back to the initial model, arrivals dropped.
    out, info = self.round([[1, 1, 1], [2, 2, 2], [3, 3, 3]], [0, 1, 3],
                           [0, 0, 0])
    np.testing.assert_allclose(out, -np.sum(applied, axis=0), rtol=1e-6)
    self.assertEqual(float(info['unlearned']), 1.0)
    np.testing.assert_allclose(info['weights'], [0, 0, 0])
    # Round 5 (k = 1): client 1 trained from the reset model; client 0's
    # update is from round 4's broadcast (pre-reset) and the attacker is
    # forgotten. Step length from stored round 1, direction from client 1.
    out, info = self.round([[0.0, 2.0, -4.0], [7, 7, 7], [8, 8, 8]],
                           [1, 0, 3], [0, 1, 0])
    np.testing.assert_allclose(out, [0.0, 5.0, -1.0], rtol=1e-6)
    np.testing.assert_allclose(info['weights'], [1, 0, 0])
    self.assertEqual(float(info['calibrating']), 1.0)
    # Round 6 (k = 2): client 0 one round late (from round 5's broadcast,
    # post-reset) counts; mean direction (1, 0 | 2) scaled to (6 | 2).
    out, _ = self.round([[2.0, 0.0, 2.0], [0.0, 0.0, 2.0]], [0, 2], [1, 0])
    np.testing.assert_allclose(out, [6.0, 0.0, 2.0], rtol=1e-6)
    # Round 7 (k = 3): no fresh remaining arrival: nothing applied.
    out, _ = self.round([[1, 2, 3], [4, 5, 6]], [3, 2], [0, 5])
    np.testing.assert_allclose(out, [0, 0, 0])
    # Round 8: calibration over (3 stored rounds); FedAvg of the fresh
    # remaining arrivals.
    out, info = self.round([[1, 2, 3], [3, 4, 5], [9, 9, 9]], [0, 1, 3],
                           [0, 2, 0])
    np.testing.assert_allclose(out, [2, 3, 4], rtol=1e-6)
    self.assertEqual(float(info['calibrating']), 0.0)

  def test_masked_slots_change_nothing(self):
    a, _ = self.round([[1, 2, 3], [4, 5, 6]], [0, 1], [0, 0])
    self.setUp()
    b, _ = self.round([[1, 2, 3], [4, 5, 6], [np.nan, 1e30, -np.inf]],
                      [0, 1, 3], [0, 0, 7], mask=[1, 1, 0])
    np.testing.assert_array_equal(a, b)

  def test_settings_are_checked(self):
    for kwargs, arg in (({'unlearn_round': 1}, 'unlearn_round'),
                        ({'interval': 0}, 'interval'),
                        ({'forget': np.zeros(3, bool)}, 'forget'),
                        ({'forget': None}, 'forget')):
      with self.assertRaises(SettingError) as ctx:
        get_aggregator('federaser', **{'num_clients': 4, 'forget': FORGET,
                                       'unlearn_round': 4, **kwargs})
      self.assertEqual(ctx.exception.argument, arg, kwargs)


if __name__ == '__main__':
  absltest.main()
