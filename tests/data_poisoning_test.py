"""Tests for fedrobust.attacks.data_poisoning and the round's threat hook."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust import attacks, engine
from fedrobust.attacks import data_poisoning as dp
from fedrobust.engine.round import detection_counts, malicious_slots

SHAPE = (28, 28, 1)


def batch(n=8, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.integers(0, 200, (n, *SHAPE), dtype=np.uint8)),
          jnp.asarray(rng.integers(0, 10, n), jnp.int32),
          jnp.arange(n, dtype=jnp.int32))


def train_one_client(loss, params, x, y, config, poison, malicious):
  """One client's local SGD (lr 0.1, key 1) on all of x, y."""
  from fedrobust import local as local_lib  # pylint: disable=g-import-not-at-top
  data = local_lib.LocalData(x[None], y[None], jnp.int32(0),
                             jnp.int32(len(y)), jnp.bool_(malicious),
                             jnp.int32(0))
  new, _ = local_lib.local_sgd(loss, params, data, jax.random.key(1),
                               optimizer=local_lib.sgd(learning_rate=0.1),
                               config=config._replace(poison=poison))
  return new


class TriggerTest(parameterized.TestCase):

  @parameterized.parameters(
      ('top_left', (0, 0)), ('top_right', (0, 22)), ('bottom_left', (26, 0)),
      ('bottom_right', (26, 22)), ('center', (13, 11)))
  def test_trigger_location(self, location, origin):
    mask = dp.trigger_mask(dp.Trigger(2, 6, location), SHAPE)[..., 0]
    rows, cols = np.nonzero(mask)
    self.assertEqual((rows.min(), cols.min()), origin)
    self.assertEqual(mask.sum(), 12)

  def test_dba_pieces_tile_the_trigger(self):
    trigger = dp.Trigger(2, 6)
    pieces = [dp.trigger_mask(trigger, SHAPE, piece=i, num_pieces=4)
              for i in range(4)]
    np.testing.assert_array_equal(np.sum(pieces, axis=0),
                                  dp.trigger_mask(trigger, SHAPE))

  def test_dba_grid_golden_flpoison(self):
    """Golden: FLPoison's attackers/dba.py setup_trigger_position (the DBA
    paper's MNIST triggers: size 4, gap 2, shift 0): local trigger i is a
    1 x 4 bar at row (i // 2) * (1 + gap), column (i % 2) * (4 + gap); the
    global trigger is their union."""
    full, pieces = dp.dba_masks(dp.Trigger(), SHAPE)
    self.assertEqual(pieces.shape, (4, *SHAPE))
    for i in range(4):
      want = np.zeros(SHAPE[:2], bool)
      row, col = (i // 2) * 3, (i % 2) * 6
      want[row, col:col + 4] = True
      np.testing.assert_array_equal(pieces[i][..., 0], want)
    np.testing.assert_array_equal(full, pieces.any(0))
    self.assertEqual(int(full.sum()), 16)
    # The pieces are disjoint and equal; the split layout's are not.
    self.assertEqual(int(pieces.sum()), 16)
    _, split = dp.dba_masks(dp.Trigger(2, 6), SHAPE, 'split')
    self.assertEqual([int(p.sum()) for p in split], [4, 4, 2, 2])
    # A client of attacker rank r stamps piece r mod 4.
    poison = attacks.DATA_ATTACKS['dba'](image_shape=SHAPE, target_label=2,
                                         poison_fraction=1.0)
    x, y, rows = batch()
    out, _ = poison.apply(x, y, rows, jnp.int32(8), jnp.int32(5))
    changed = np.any(np.asarray(out) != np.asarray(x), axis=0)[..., 0]
    self.assertTrue(np.all(changed <= pieces[1][..., 0]))
    self.assertTrue(np.all(np.asarray(out)[:, pieces[1][..., 0]] == 255))
    with self.assertRaisesRegex(ValueError, 'dba_layout'):
      dp.dba_masks(dp.Trigger(), SHAPE, 'rows')

  def test_edge_case_swaps_in_tail_inputs(self):
    """Wang et al.'s edge-case backdoor: poisoned rows become edge-case
    inputs labelled the target; the triggered set is the held-out edge
    inputs with the target as their only label."""
    rng = np.random.default_rng(4)
    edge = rng.integers(0, 255, (5, *SHAPE), dtype=np.uint8)
    poison = attacks.DATA_ATTACKS['edge_case'](
        image_shape=SHAPE, edge_images=edge, target_label=3,
        poison_fraction=0.5)
    x, y, rows = batch()
    out_x, out_y = poison.apply(x, y, rows, jnp.int32(8), jnp.int32(1))
    out_x, out_y = np.asarray(out_x), np.asarray(out_y)
    for r in range(8):
      if r < 4:                                   # round(0.5 * 8) poisoned
        np.testing.assert_array_equal(out_x[r], edge[(r + 97) % 5])
        self.assertEqual(out_y[r], 3)
      else:
        np.testing.assert_array_equal(out_x[r], np.asarray(x)[r])
        self.assertEqual(out_y[r], int(np.asarray(y)[r]))
    tx, ty, true = dp.triggered_test_set(
        np.zeros((3, *SHAPE), np.uint8), np.zeros(3, np.int32), 'edge_case',
        target_label=3, edge_images=edge, with_sources=True)
    np.testing.assert_array_equal(tx, edge)
    np.testing.assert_array_equal(ty, 3)
    np.testing.assert_array_equal(true, 3)
    with self.assertRaisesRegex(ValueError, 'edge images of shape'):
      attacks.DATA_ATTACKS['edge_case'](image_shape=SHAPE,
                                        edge_images=edge[..., 0])

  def test_neurotoxin_trains_only_rarely_updated_coordinates(self):
    """Zhang et al.: the attacker's gradients are projected off the top
    coordinates of its clean gradient at the start model; a benign client
    with the same poison object trains every coordinate."""
    from fedrobust import local as local_lib, models  # pylint: disable=g-import-not-at-top
    g = {'a': jnp.asarray([[0.1, -5.0], [0.2, 0.01]]),
         'b': jnp.asarray([3.0, -0.05, 0.0, 0.4])}
    mask = dp.neurotoxin_mask(g, 0.25)        # 2 of 8 coordinates masked
    np.testing.assert_array_equal(mask['a'], [[1, 0], [1, 1]])
    np.testing.assert_array_equal(mask['b'], [0, 1, 1, 1])
    model = models.get_model('mlp', num_classes=10, input_shape=SHAPE,
                             hidden=(4,))
    params = model.init(jax.random.key(0))
    poison = attacks.DATA_ATTACKS['neurotoxin'](
        image_shape=SHAPE, target_label=2, poison_fraction=1.0,
        top_ratio=0.3)
    x, y, _ = batch(16, seed=2)
    config = local_lib.LocalConfig(batch_size=8, num_epochs=1,
                                   steps_per_epoch=2)
    loss = local_lib.classification_loss(model.apply)
    moved = {}
    for malicious in (True, False):
      new = train_one_client(loss, params, x, y, config, poison, malicious)
      moved[malicious] = np.concatenate([
          np.asarray(a - b).ravel() != 0 for a, b in zip(
              jax.tree.leaves(new), jax.tree.leaves(params))])
    frozen = 1.0 - np.mean(moved[True])
    self.assertGreaterEqual(frozen, 0.29)     # at least the masked 30%
    self.assertLess(np.mean(~moved[False]), frozen - 0.2)

  def test_alternating_min_boosts_the_malicious_phase(self):
    """Bhagoji et al.: clean steps with a stealth term, then malicious
    steps on triggered batches whose weight change is boosted. With
    rho = 0 the attacker's clean phase equals a benign client's, so
    w(boost) - w_benign = boost * (w(1) - w_benign); a benign client holding
    the same poison object trains exactly as without it."""
    from fedrobust import local as local_lib, models  # pylint: disable=g-import-not-at-top
    model = models.get_model('mlp', num_classes=10, input_shape=SHAPE,
                             hidden=(4,))
    params = model.init(jax.random.key(0))
    x, y, _ = batch(16, seed=3)
    config = local_lib.LocalConfig(batch_size=8, num_epochs=1,
                                   steps_per_epoch=2)
    loss = local_lib.classification_loss(model.apply)
    flat = lambda t: np.concatenate([np.asarray(a, np.float64).ravel()
                                     for a in jax.tree.leaves(t)])

    def train(malicious, **kwargs):
      poison = None if kwargs.get('none') else attacks.DATA_ATTACKS[
          'alternating_min'](image_shape=SHAPE, target_label=2,
                             **{k: v for k, v in kwargs.items()
                                if k != 'none'})
      return flat(train_one_client(loss, params, x, y, config, poison,
                                   malicious))

    plain = train(False, none=True)
    np.testing.assert_array_equal(train(False, rho=0.5, boost=3.0), plain)
    one = train(True, rho=0.0, boost=1.0, malicious_steps=3)
    ten = train(True, rho=0.0, boost=10.0, malicious_steps=3)
    self.assertGreater(np.abs(one - plain).max(), 1e-4)
    np.testing.assert_allclose(ten - plain, 10.0 * (one - plain), rtol=1e-3,
                               atol=1e-6)
    # The stealth term is rho times the gradient of ||w - w_start||_2.
    start = {'a': jnp.asarray([1.0, 2.0]), 'b': jnp.asarray([[0.5]])}
    p = {'a': jnp.asarray([1.5, 1.0]), 'b': jnp.asarray([[2.5]])}
    zero = jax.tree.map(jnp.zeros_like, p)
    want = jax.grad(lambda q: 0.3 * jnp.sqrt(sum(
        jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(q),
                                              jax.tree.leaves(start)))))(p)
    got = local_lib._add_stealth(zero, p, start, 0.3, jnp.bool_(True))
    np.testing.assert_allclose(flat(got), flat(want), rtol=1e-6)
    self.assertEqual(flat(local_lib._add_stealth(
        zero, p, start, 0.3, jnp.bool_(False))).max(), 0.0)
    with self.assertRaisesRegex(ValueError, 'malicious_steps'):
      attacks.DATA_ATTACKS['alternating_min'](image_shape=SHAPE,
                                              malicious_steps=0)

  def test_sdfc_release_trigger_rows(self):
    """The release's trigger: rows 0 and 2, columns 0-2 and 4-6."""
    mask = dp.trigger_mask(dp.Trigger(pattern='sdfc_rows'), SHAPE)[..., 0]
    expected = np.zeros(SHAPE[:2], bool)
    for r in (0, 2):
      for c in (0, 1, 2, 4, 5, 6):
        expected[r, c] = True
    np.testing.assert_array_equal(mask, expected)
    corner = dp.trigger_mask(dp.Trigger(pattern='sdfc_rows',
                                        location='bottom_right'), SHAPE)
    rows, cols = np.nonzero(corner[..., 0])
    self.assertEqual((rows.max(), cols.max()), (27, 27))
    with self.assertRaisesRegex(ValueError, 'trigger_pattern'):
      dp.trigger_mask(dp.Trigger(pattern='sdfc_rows'), SHAPE, piece=0,
                      num_pieces=4)

  def test_backdoor_eval_keeps_or_drops_target_images(self):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (50, 28, 28, 1), dtype=np.uint8)
    y = np.arange(50) % 10
    kept, _ = dp.triggered_test_set(x, y, 'badnets', target_label=2)
    every, labels = dp.triggered_test_set(x, y, 'badnets', target_label=2,
                                          exclude_target=False)
    self.assertLen(kept, 45)
    self.assertLen(every, 50)
    np.testing.assert_array_equal(labels, 2)
    np.testing.assert_array_equal(every[:, 0, :6, 0], 255)

  def test_bad_trigger_flags(self):
    with self.assertRaisesRegex(ValueError, 'trigger_size'):
      dp.parse_trigger_size('2by6')
    with self.assertRaisesRegex(ValueError, 'trigger_size.*30x6'):
      dp.trigger_mask(dp.Trigger(30, 6), SHAPE)
    with self.assertRaisesRegex(ValueError, 'poison_fraction'):
      dp.badnets(image_shape=SHAPE, poison_fraction=0.0)


class PoisonTest(absltest.TestCase):

  def test_badnets_poisons_a_fixed_fraction(self):
    x, y, rows = batch()
    poison = dp.badnets(image_shape=SHAPE, target_label=2,
                        poison_fraction=0.5)
    px, py = jax.jit(poison.apply)(x, y, rows, jnp.int32(8), jnp.int32(0))
    hit = np.arange(8) < 4
    np.testing.assert_array_equal(py[hit], 2)
    np.testing.assert_array_equal(py[~hit], y[~hit])
    np.testing.assert_array_equal(px[~hit], x[~hit])
    np.testing.assert_array_equal(px[hit, :2, :6], 255)
    np.testing.assert_array_equal(px[hit, 2:], x[hit, 2:])

  def test_label_flip(self):
    x, y, rows = batch()
    sym = dp.label_flip(num_classes=10)
    _, fy = sym.apply(x, y, rows, jnp.int32(8), jnp.int32(0))
    np.testing.assert_array_equal(fy, 9 - y)
    pair = dp.label_flip(num_classes=10, source_label=int(y[0]),
                         target_label=7)
    _, py = pair.apply(x, y, rows, jnp.int32(8), jnp.int32(0))
    np.testing.assert_array_equal(py, np.where(y == y[0], 7, y))

  def test_triggered_test_set_excludes_target_class(self):
    x = np.zeros((6, *SHAPE), np.uint8)
    y = np.array([0, 2, 1, 2, 3, 4], np.int32)
    tx, ty = dp.triggered_test_set(x, y, 'badnets', target_label=2)
    self.assertLen(tx, 4)
    np.testing.assert_array_equal(ty, 2)
    self.assertTrue(np.all(tx[:, :2, :6] == 255))

  def test_triggered_test_set_sources(self):
    x = np.arange(6 * np.prod(SHAPE), dtype=np.int64).reshape(
        6, *SHAPE).astype(np.uint8)
    y = np.array([0, 2, 1, 2, 3, 4], np.int32)
    tx, ty, true = dp.triggered_test_set(
        x, y, 'badnets', target_label=2, with_sources=True)
    np.testing.assert_array_equal(true, [0, 1, 3, 4])
    np.testing.assert_array_equal(ty, 2)
    clean = x[[0, 2, 4, 5]]
    self.assertFalse(np.array_equal(tx, clean))   # the trigger is on tx
    np.testing.assert_array_equal(tx[:, 2:], clean[:, 2:])   # only

  def test_registry(self):
    self.assertContainsSubset({'badnets', 'dba', 'blended', 'label_flip',
                               'lie', 'min_max'}, set(attacks.ATTACKS))


class ThreatHookTest(absltest.TestCase):

  def test_malicious_slots_fixed_and_start_round(self):
    threat = engine.Threat(malicious=jnp.array([False, True, False, True]),
                           num_malicious=2, start_round=3)
    ids = jnp.array([1, 2, 3, 0])
    mask = jnp.array([True, True, False, False])
    before, _ = malicious_slots(jax.random.key(0), ids, mask, threat, 4,
                                jnp.int32(2))
    after, rank = malicious_slots(jax.random.key(0), ids, mask, threat, 4,
                                  jnp.int32(3))
    np.testing.assert_array_equal(before, [0, 0, 0, 0])
    np.testing.assert_array_equal(after, [1, 0, 0, 0])  # id 3 is masked
    np.testing.assert_array_equal(rank[:1], [0])

  def test_resampled_set_has_the_right_size(self):
    threat = engine.Threat(malicious=None, num_malicious=3)
    ids = jnp.arange(10)
    is_mal, _ = malicious_slots(jax.random.key(1), ids, jnp.ones(10, bool),
                                threat, 10, jnp.int32(1))
    self.assertEqual(int(is_mal.sum()), 3)

  def test_detection_counts(self):
    counts = detection_counts(jnp.array([0.0, 0.5, 0.0, 0.5, 0.0]),
                              jnp.array([True, True, False, False, False]),
                              jnp.array([True, True, True, True, False]))
    chex.assert_trees_all_equal(
        {k: float(v) for k, v in counts.items()},
        {'det_tp': 1.0, 'det_fp': 1.0, 'det_fn': 1.0, 'det_tn': 1.0})



# ----------------------------------------------------------------------------
# Conformance: the same checks for every DATA_ATTACKS entry.
# ----------------------------------------------------------------------------

FRACTION = 0.5


def _text_batch(n=8, length=16, seed=0):
  """Token ids [n, length]: [CLS] words [SEP] then padding, labels {0, 1}."""
  rng = np.random.default_rng(seed)
  x = np.zeros((n, length), np.int32)
  for i in range(n):
    words = int(rng.integers(3, length - 1))
    x[i, 0] = dp.CLS_ID
    x[i, 1:words + 1] = rng.integers(1000, 2000, words)
    x[i, words + 1] = dp.SEP_ID
  return (jnp.asarray(x), jnp.asarray(rng.integers(0, 2, n), jnp.int32),
          jnp.arange(n, dtype=jnp.int32))


# name -> (builder, num_classes, target (None: no fixed target), text)
_EDGE = np.random.default_rng(5).integers(0, 256, (5, *SHAPE), np.uint8)
CONFORMANCE = {
    'label_flip': (lambda: dp.label_flip(num_classes=10,
                                         poison_fraction=FRACTION), 10,
                   None, False),
    'badnets': (lambda: attacks.DATA_ATTACKS['badnets'](
        image_shape=SHAPE, target_label=2, poison_fraction=FRACTION), 10, 2,
                False),
    'dba': (lambda: attacks.DATA_ATTACKS['dba'](
        image_shape=SHAPE, target_label=2, poison_fraction=FRACTION), 10, 2,
            False),
    'blended': (lambda: dp.blended(image_shape=SHAPE, target_label=2,
                                   poison_fraction=FRACTION), 10, 2, False),
    'edge_case': (lambda: dp.edge_case(image_shape=SHAPE, edge_images=_EDGE,
                                       target_label=2,
                                       poison_fraction=FRACTION), 10, 2,
                  False),
    'neurotoxin': (lambda: dp.neurotoxin(image_shape=SHAPE, target_label=2,
                                         poison_fraction=FRACTION), 10, 2,
                   False),
    'alternating_min': (lambda: dp.alternating_min(
        image_shape=SHAPE, target_label=2, poison_fraction=FRACTION), 10, 2,
                        False),
    'trigger_token': (lambda: dp.trigger_token(target_label=1,
                                               poison_fraction=FRACTION), 2,
                      1, True),
}


class DataAttackConformanceTest(parameterized.TestCase):
  """Every data attack, through the batch transform the client runs:
  shapes and dtypes kept, rows past the poisoned share (and padded rows
  past the client's count) untouched, labels in range, poisoned rows sent
  to the target, deterministic, and one trace for any count / rank."""

  def test_every_registered_data_attack_is_covered(self):
    self.assertEqual(set(CONFORMANCE), set(attacks.DATA_ATTACKS))

  @parameterized.parameters(*sorted(CONFORMANCE))
  def test_batch_transform(self, name):
    build, num_classes, target, text = CONFORMANCE[name]
    poison = build()
    self.assertIsInstance(poison, dp.DataPoison)
    x, y, rows = _text_batch() if text else batch()
    y = y % num_classes
    # alternating_min's usual steps are clean; its malicious phase poisons.
    transforms = [('apply', poison.apply)]
    if poison.alternating is not None:
      transforms.append(('alternating', poison.alternating.apply))
    for label, transform in transforms:
      def call(x, y, rows, count, rank, transform=transform):
        return transform(x, y, rows, count, rank)
      call.__name__ = f'data_attack_{name}_{label}'
      fn = jax.jit(chex.assert_max_traces(call, n=1))
      poisoned_any = False
      for count, rank in ((6, 0), (8, 3), (5, 1)):
        limit = int(round(FRACTION * count))
        out_x, out_y = fn(x, y, rows, jnp.int32(count), jnp.int32(rank))
        again = fn(x, y, rows, jnp.int32(count), jnp.int32(rank))
        chex.assert_trees_all_equal((out_x, out_y), again)
        chex.assert_trees_all_equal_shapes_and_dtypes((out_x, out_y),
                                                      (x, y))
        out_x, out_y = np.asarray(out_x), np.asarray(out_y)
        self.assertTrue(np.all((out_y >= 0) & (out_y < num_classes)))
        clean = np.asarray(rows) >= limit
        np.testing.assert_array_equal(out_x[clean], np.asarray(x)[clean])
        np.testing.assert_array_equal(out_y[clean], np.asarray(y)[clean])
        hit = ~clean
        changed = np.any(out_x[hit] != np.asarray(x)[hit]) or np.any(
            out_y[hit] != np.asarray(y)[hit])
        if label == 'apply' and poison.alternating is not None:
          self.assertFalse(changed, f'{name}: the usual steps are clean')
          continue
        poisoned_any |= bool(changed)
        if target is not None:
          np.testing.assert_array_equal(out_y[hit], target)
        else:                               # symmetric label flip
          np.testing.assert_array_equal(out_y[hit],
                                        num_classes - 1 - np.asarray(y)[hit])
      if not (label == 'apply' and poison.alternating is not None):
        self.assertTrue(poisoned_any, f'{name}/{label} changed nothing')
    if poison.grad_mask is not None:         # Neurotoxin's projection
      grads = {'w': jnp.asarray(np.random.default_rng(1).normal(
          size=(10, 10)), jnp.float32)}
      mask = np.asarray(poison.grad_mask(grads)['w'])
      self.assertTrue(np.all((mask == 0) | (mask == 1)))
      self.assertBetween(float(np.mean(mask == 0)), 0.05, 0.2)
      big = np.abs(np.asarray(grads['w'])) >= np.quantile(
          np.abs(np.asarray(grads['w'])), 0.9)
      np.testing.assert_array_equal(mask[big], 0)

if __name__ == '__main__':
  absltest.main()
