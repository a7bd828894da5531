"""RFD-LoRA as a method (fedrobust/methods/rfd_lora/__init__.py) on a tiny model.

The conformance suite (methods_test.py) covers masks, retracing and
resume; here: heterogeneous ranks in one round, clients keep their own
adapters, uploads are rank independent, and the server's distillation
moves the student onto the clients' consensus.
"""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust import engine, models
from fedrobust.cohort import single_cohort
from fedrobust.errors import SettingError
from fedrobust.methods import get_method
from fedrobust.methods.rfd_lora import distill as rfd_distill
from fedrobust.methods.rfd_lora import (anchor_logits, client_model,
                                        cohort_specs, label_prior_offset)
from fedrobust.transforms import identity, lora
from fedrobust.types import Arrivals, ClientOutput, LocalData
from tests.engine_test import IMAGE, NUM_CLASSES, toy_data

K = 4
RANKS = (1.0, 2.0, 4.0, 2.0)


def build(**settings):
  model = models.get_model('mlp', num_classes=NUM_CLASSES,
                           input_shape=IMAGE, hidden=(6,))
  transform = lora(model, ranks=(1, 2, 4), targets=('all',))
  cohorts = single_cohort(model, transform, K, K, RANKS)
  local = engine.LocalConfig(batch_size=4, num_epochs=2, steps_per_epoch=2)
  method = get_method('rfd_lora', cohorts=cohorts, local=local,
                      optimizer=engine.sgd(learning_rate=0.2), **settings)
  return model, transform, cohorts, method


def start(**settings):
  """(transform, method, round config, initial state, data, anchors)."""
  model, transform, _, method = build(**settings)
  data = toy_data([8, 8, 8, 8], 8, seed=4)
  anchors = toy_data([6], 6, seed=11).x[0]
  config = engine.RoundConfig(num_clients=K, clients_per_round=K,
                              strategy='vmap')
  state = engine.init_server_state(method, model.init(jax.random.key(0)),
                                   K, seed=1, config=config, data=data,
                                   server_data={'anchors': anchors})
  return transform, method, config, state, data, anchors


class RFDLoRATest(absltest.TestCase):

  def test_needs_one_lora_cohort(self):
    model = models.get_model('mlp', num_classes=NUM_CLASSES,
                             input_shape=IMAGE, hidden=(6,))
    cohorts = single_cohort(model, identity(model), K, K, ())
    with self.assertRaisesRegex(SettingError, 'transform'):
      get_method('rfd_lora', cohorts=cohorts,
                 local=engine.LocalConfig(4, 1, 2),
                 optimizer=engine.sgd(learning_rate=0.1))

  def test_one_round_trains_each_client_within_its_rank(self):
    _, method, config, state, data, anchors = start(distill_lr=0.5,
                                                    distill_steps=3)
    server_data = {'anchors': anchors}
    step = jax.jit(engine.make_round_step(method, config))
    before = jax.tree.map(jnp.array, state.method_state.adapters)
    student = jax.tree.map(jnp.array, state.params[0])
    state, metrics = step(state, data, server_data)
    self.assertTrue(np.isfinite(float(metrics['distill_loss'])))
    b_of = lambda tree: [leaf for path, leaf in
                         jax.tree_util.tree_flatten_with_path(tree)[0]
                         if path[-1].key == 'b']
    # Client c's own adapter moved within its rank r_c and kept zeros past
    # it (its coverage); the student moved by distillation alone.
    for new, old in zip(b_of(state.method_state.adapters), b_of(before)):
      for c, r in enumerate(int(r) for r in RANKS):
        self.assertTrue(np.all(np.asarray(new[c, r:]) == 0.0))
        self.assertFalse(np.allclose(new[c, :r], old[c, :r]))
    self.assertFalse(all(np.allclose(n, o) for n, o in
                         zip(b_of(state.params[0]), b_of(student))))

  def test_uploads_are_rank_independent_logits(self):
    _, method, _, state, data, anchors = start()
    ids = jnp.arange(K, dtype=jnp.int32)
    cs = method.client_state(state.method_state, 0, ids)
    shapes = set()
    for i in range(K):
      out = method.client_update(
          0, method.broadcast(state, 0),
          jax.tree.map(lambda leaf, i=i: leaf[i], cs),
          LocalData(data.x, data.y, ids[i], data.count[i]),
          jax.random.key(i), {'anchors': anchors})
      logits = np.asarray(out.delta['logits'])
      shapes.add(logits.shape)
      self.assertLessEqual(np.abs(logits).max(), 10.0)      # clipped to c
      top = np.bincount(np.argmax(logits, -1), minlength=NUM_CLASSES).max()
      self.assertAlmostEqual(float(out.metrics['anchor_top_share']),
                             top / 6, places=6)
      counts = np.bincount(np.argmax(logits, -1), minlength=NUM_CLASSES)
      self.assertEqual(float(out.metrics['anchor_top_class']),
                       float(np.argmax(counts)))
    self.assertEqual(shapes, {(6, NUM_CLASSES)})

  def test_client_model_rebuilds_the_uploads(self):
    """From the student a client received and the adapter it returned,
    client_model gives the client's upload again: the logits the server
    distilled (experiments/analysis/rfd_lora_teacher.py rebuilds teachers so)."""
    transform, method, _, state, data, anchors = start()
    specs = cohort_specs(build()[2][0])
    np.testing.assert_array_equal(specs, RANKS)
    ids = jnp.arange(K, dtype=jnp.int32)
    cs = method.client_state(state.method_state, 0, ids)
    received = method.broadcast(state, 0)
    base, student, round_number = received
    for i in range(K):
      out = method.client_update(
          0, received, jax.tree.map(lambda leaf, i=i: leaf[i], cs),
          LocalData(data.x, data.y, ids[i], data.count[i]),
          jax.random.key(i), {'anchors': anchors})
      apply, own = client_model(transform, base, student, out.client_state,
                                specs[i], round_number)
      z = np.clip(anchor_logits(apply, own, anchors, 4), -10.0, 10.0)
      np.testing.assert_allclose(z, out.delta['logits'], rtol=1e-5,
                                 atol=1e-5)
      # The client's model is not the student's: its own adapter counts.
      bare = anchor_logits(apply, jax.tree.map(jnp.zeros_like, own),
                           anchors, 4)
      self.assertGreater(np.abs(np.asarray(bare) - z).max(), 1e-3)

  def test_distillation_reaches_the_consensus(self):
    """The server step alone: from logits of 4 clients on 6 anchors, enough
    distillation steps make the student's anchor predictions the
    consensus' classes (mmd='none': plain KD under CAT and DIS)."""
    transform, method, _, state, _, anchors = start(
        distill_lr=1.0, distill_steps=600, mmd='none', groups=2)
    rng = np.random.default_rng(0)
    z = rng.normal(size=(K, 6, NUM_CLASSES)).astype(np.float32) * 3
    z[:, :, 0] += np.arange(6)[None, :] % 2 * 4.0        # a class pattern
    own = method.client_state(state.method_state, 0,
                              jnp.arange(K, dtype=jnp.int32))[1]
    outputs = ClientOutput(delta={'logits': jnp.asarray(z)},
                           weight=jnp.ones(K), client_state=own,
                           metrics={})
    arr = (Arrivals(jnp.arange(K, dtype=jnp.int32), jnp.ones(K, bool),
                    outputs, jnp.zeros(K, jnp.int32)),)
    key = jax.random.key(3)
    params, _, info = jax.jit(method.server_update)(
        state, arr, key, {'anchors': anchors})
    target = rfd_distill.consensus(key, jnp.asarray(z), jnp.ones(K, bool),
                                   groups=2)
    base = state.method_state.base
    got = anchor_logits(lambda p, x: transform.apply(base, p, x),
                        params[0], anchors, 8)
    np.testing.assert_array_equal(np.argmax(got, -1),
                                  np.argmax(target.logits, -1))
    self.assertTrue(np.isfinite(float(info['distill_loss'])))
    # The reported fit is the student's: full agreement, and the loss after
    # the steps is the loss of the returned student, below the one before.
    self.assertEqual(float(info['distill_agreement']), 1.0)
    want = rfd_distill.rfd_loss(got, target, mmd='none')
    np.testing.assert_allclose(float(info['distill_loss_after']),
                               float(want), rtol=1e-4)
    self.assertLess(float(info['distill_loss_after']),
                    float(info['distill_loss']))
    share = np.bincount(np.argmax(got, -1), minlength=NUM_CLASSES).max() / 6
    self.assertAlmostEqual(float(info['student_top_share']), share, places=6)
    self.assertAlmostEqual(float(info['consensus_top_share']), share,
                           places=6)
    top = float(np.argmax(np.bincount(np.argmax(got, -1),
                                      minlength=NUM_CLASSES)))
    self.assertEqual(float(info['student_top_class']), top)
    self.assertEqual(float(info['consensus_top_class']), top)

  def test_label_prior_offset_against_numpy(self):
    # Rows past count are padding (here class 2, which must not count).
    y = jnp.asarray([0, 0, 0, 1, 2, 2, 2, 2], jnp.int32)
    got = np.asarray(label_prior_offset(y, jnp.asarray(4), 3))
    log_p = np.log((np.array([3, 1, 0]) + 1.0) / (4 + 3))
    np.testing.assert_allclose(got, log_p - log_p.mean(), rtol=1e-6,
                               atol=1e-6)
    balanced = label_prior_offset(jnp.asarray([0, 1, 2, 0, 1, 2]),
                                  jnp.asarray(6), 3)
    np.testing.assert_allclose(np.asarray(balanced), 0.0, atol=1e-7)

  def test_prior_correction_shifts_each_clients_anchor_logits(self):
    """With the switch on, a client's upload is its plain logits minus
    its own label_prior_offset (clip wide enough not to bind)."""
    uploads = []
    for on in (False, True):
      _, method, _, state, data, anchors = start(prior_correction=on,
                                                 clip=1e4)
      ids = jnp.arange(K, dtype=jnp.int32)
      cs = method.client_state(state.method_state, 0, ids)
      out = method.client_update(
          0, method.broadcast(state, 0), jax.tree.map(lambda l: l[1], cs),
          LocalData(data.x, data.y, ids[1], data.count[1]),
          jax.random.key(5), {'anchors': anchors})
      uploads.append(np.asarray(out.delta['logits']))
    y = np.asarray(data.y[1, :int(data.count[1])])
    log_p = np.log((np.bincount(y, minlength=NUM_CLASSES) + 1.0) /
                   (len(y) + NUM_CLASSES))
    offset = log_p - log_p.mean()
    self.assertGreater(np.abs(offset).max(), 0.1)     # a skewed client
    np.testing.assert_allclose(uploads[1], uploads[0] - offset[None, :],
                               rtol=1e-5, atol=1e-5)


if __name__ == '__main__':
  absltest.main()
