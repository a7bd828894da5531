"""Tests for fedrobust.data: sources, server/client splits and partitioners."""

import functools
import gzip
import os
import sys
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from fedrobust.errors import SettingError

from fedrobust import attacks
from fedrobust.data import federated
from fedrobust.data import partition
from fedrobust.data import sources
from fedrobust.data import splits
from fedrobust.engine.evaluate import pad_leading, pad_to_batches, rebatch



def _balanced_labels(num_classes, per_class, seed=0):
  labels = np.repeat(np.arange(num_classes), per_class)
  return np.random.default_rng(seed).permutation(labels)


def _assert_partition(test, parts, n):
  """Asserts `parts` are sorted int64 arrays covering range(n) exactly once."""
  for p in parts:
    test.assertEqual(p.dtype, np.int64)
    test.assertTrue(np.all(np.diff(p) > 0), 'part not sorted/unique')
  np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(n))


def _shares(labels, parts, num_classes):
  hist = partition.class_histograms(labels, parts, num_classes)
  return hist / hist.sum(axis=1, keepdims=True)


# ----------------------------------------------------------------------------
# Partitioners.
# ----------------------------------------------------------------------------


FMNIST_SUPERCLASSES = partition.SUPERCLASSES['fashion_mnist']
# The partitioners that draw at random. 'natural' follows the data's client
# ids, so its client count is theirs and no seed enters it
# (tests/arrays_data_test.py covers it).
SEEDED = sorted(set(partition.PARTITIONERS) - {'natural'})


class PartitionTest(parameterized.TestCase):

  @parameterized.parameters(*SEEDED)
  def test_covers_each_index_once(self, name):
    labels = _balanced_labels(10, 97)
    parts = partition.partition(name, labels, 23, seed=0,
                                groups=_two_groups(labels),
                                superclasses=FMNIST_SUPERCLASSES)
    self.assertLen(parts, 23)
    _assert_partition(self, parts, len(labels))

  @parameterized.parameters(*SEEDED)
  def test_deterministic_in_seed(self, name):
    labels = _balanced_labels(10, 100)
    groups = _two_groups(labels)
    kw = dict(groups=groups, superclasses=FMNIST_SUPERCLASSES)
    a = partition.partition(name, labels, 17, seed=3, **kw)
    b = partition.partition(name, labels, 17, seed=3, **kw)
    c = partition.partition(name, labels, 17, seed=4, **kw)
    for pa, pb in zip(a, b):
      np.testing.assert_array_equal(pa, pb)
    self.assertFalse(all(np.array_equal(pa, pc) for pa, pc in zip(a, c)))

  @parameterized.parameters(*sorted(partition.PARTITIONERS))
  def test_single_client_gets_everything(self, name):
    labels = _balanced_labels(10, 10)
    parts = partition.partition(name, labels, 1, seed=0, classes_per_client=10,
                                groups=np.zeros_like(labels),
                                superclasses=(0,) * 10)
    np.testing.assert_array_equal(parts[0], np.arange(len(labels)))

  def test_label_profiles_binary_severe_non_iid(self):
    """RFD-LoRA App. G: binary clients hold [0.1, 0.9], [0.9, 0.1] and
    [0.5, 0.5] label profiles, round-robin, equal sizes before the
    leftovers."""
    labels = _balanced_labels(2, 500)
    parts = partition.partition('label_profiles', labels, 10, seed=0)
    _assert_partition(self, parts, len(labels))
    shares = _shares(labels, parts, 2)
    want = np.array([[0.1, 0.9], [0.9, 0.1], [0.5, 0.5]])[np.arange(10) % 3]
    np.testing.assert_allclose(shares, want, atol=0.08)
    # The balanced clients get none of the leftovers.
    self.assertEqual(len({len(parts[k]) for k in (2, 5, 8)}), 1)
    three = partition.severe_profiles(3)
    np.testing.assert_allclose(three[1], [0.05, 0.9, 0.05])

  def test_iid_sizes_near_equal(self):
    parts = partition.iid(np.zeros(103, np.int32), 10, seed=0)
    self.assertEqual({len(p) for p in parts}, {10, 11})

  def test_unknown_name(self):
    with self.assertRaisesRegex(ValueError, 'partition.*dirichlet'):
      partition.partition('nope', np.zeros(10, np.int32), 2, seed=0)

  @parameterized.parameters(0, -1, 11)
  def test_bad_num_clients(self, num_clients):
    with self.assertRaisesRegex(ValueError, 'num_clients'):
      partition.partition('iid', np.zeros(10, np.int32), num_clients, seed=0)

  def test_bad_labels(self):
    with self.assertRaisesRegex(ValueError, 'integer'):
      partition.iid(np.zeros((4, 2), np.int32), 2, seed=0)
    with self.assertRaisesRegex(ValueError, 'non-negative'):
      partition.iid(np.array([0, -1, 2]), 2, seed=0)

  def test_class_histograms(self):
    labels = np.array([0, 1, 1, 2, 2, 2])
    parts = [np.array([0, 3]), np.array([1, 2, 4, 5])]
    hist = partition.class_histograms(labels, parts, 4)
    self.assertEqual(hist.dtype, np.int64)
    np.testing.assert_array_equal(hist, [[1, 0, 1, 0], [0, 2, 2, 0]])


def _two_groups(labels):
  return (np.arange(len(labels)) % 2).astype(np.int64)


class GroupDirichletTest(absltest.TestCase):

  def test_each_client_holds_one_group_with_skewed_labels(self):
    labels = _balanced_labels(2, 2000)
    groups = np.repeat(np.arange(4), len(labels) // 4)
    parts = partition.partition('group_dirichlet', labels, 10, seed=0,
                                groups=groups, dirichlet_alpha=0.6)
    _assert_partition(self, parts, len(labels))
    owner = partition.group_of_clients(10, 4)
    np.testing.assert_array_equal(owner, [0, 0, 0, 1, 1, 1, 2, 2, 3, 3])
    for k, part in enumerate(parts):
      self.assertEqual(set(groups[part]), {owner[k]})
    shares = [labels[p].mean() for p in parts]
    self.assertGreater(np.ptp(shares), 0.3)    # label skew within groups

  def test_needs_groups_and_a_client_per_group(self):
    labels = _balanced_labels(2, 40)
    with self.assertRaisesRegex(ValueError, 'vader_domains'):
      partition.partition('group_dirichlet', labels, 4, seed=0)
    with self.assertRaisesRegex(ValueError, 'num_clients=2'):
      partition.partition('group_dirichlet', labels, 2, seed=0,
                          groups=np.arange(len(labels)) % 4)


class SuperclassDirichletTest(absltest.TestCase):

  def test_clients_hold_one_fashion_mnist_superclass(self):
    labels = _balanced_labels(10, 3000)
    table = partition.SUPERCLASSES['fashion_mnist']
    self.assertEqual([c for c in range(10) if table[c] == 0], [0, 2, 4, 6])
    self.assertEqual([c for c in range(10) if table[c] == 1], [5, 7, 9])
    parts = partition.partition('superclass_dirichlet', labels, 9, seed=1,
                                superclasses=table, dirichlet_alpha=0.3)
    _assert_partition(self, parts, len(labels))
    owner = partition.group_of_clients(9, 3)
    for k, part in enumerate(parts):
      self.assertEqual({table[c] for c in labels[part]}, {owner[k]})
    with self.assertRaisesRegex(ValueError, 'superclasses'):
      partition.partition('superclass_dirichlet', labels, 9, seed=1)

  def test_setup_reports_the_superclasses_as_true_clusters(self):
    rng = np.random.default_rng(0)
    y = np.tile(np.arange(10), 60).astype(np.int32)
    x = rng.integers(0, 255, (len(y), 4, 4, 1), dtype=np.uint8)
    ds = sources.Dataset(x, y, x[:20], y[:20], 10, 'fashion_mnist')
    setup = federated.build_federated_setup(
        ds, num_clients=6, partition_name='superclass_dirichlet', seed=0,
        dirichlet_alpha=0.5)
    np.testing.assert_array_equal(setup.client_groups,
                                  partition.group_of_clients(6, 3))


class DirichletTest(parameterized.TestCase):

  def test_small_alpha_concentrates_classes(self):
    labels = _balanced_labels(10, 2000)
    max_share = {}
    for alpha in (0.1, 100.0):
      shares = [
          _shares(labels, partition.dirichlet(labels, 20, alpha=alpha, seed=s),
                  10)
          for s in range(3)
      ]
      max_share[alpha] = np.mean([s.max(axis=1).mean() for s in shares])
      if alpha == 100.0:
        # Near-uniform: every client's class shares are close to 1/10.
        self.assertLess(np.abs(np.stack(shares) - 0.1).max(), 0.05)
    self.assertGreater(max_share[0.1], 0.5)
    self.assertLess(max_share[100.0], 0.15)

  @parameterized.parameters(1.0, 10.0)
  def test_class_split_follows_dirichlet_moments(self, alpha):
    num_clients, num_classes, per_class = 5, 10, 500
    labels = _balanced_labels(num_classes, per_class)
    # fractions[s, k, c]: share of class c that client k got with seed s.
    fractions = np.stack([
        partition.class_histograms(
            labels,
            partition.dirichlet(labels, num_clients, alpha=alpha, seed=s),
            num_classes) / per_class
        for s in range(40)
    ])
    mean = 1.0 / num_clients
    # Every client gets ~1/K of every class on average (over seeds, and over
    # seeds and classes, where the estimate is tighter).
    np.testing.assert_allclose(fractions.mean(axis=0), mean, atol=0.1)
    np.testing.assert_allclose(fractions.mean(axis=(0, 2)), mean, atol=0.03)
    np.testing.assert_allclose(fractions.mean(), mean, atol=1e-3)
    # Var of a Dir(alpha * 1_K) component: m (1 - m) / (alpha K + 1).
    expected_var = mean * (1 - mean) / (alpha * num_clients + 1)
    self.assertBetween(fractions.var() / expected_var, 0.75, 1.33)

  def test_min_size(self):
    labels = _balanced_labels(10, 100)
    parts = partition.dirichlet(labels, 20, alpha=0.3, seed=0, min_size=10)
    self.assertGreaterEqual(min(len(p) for p in parts), 10)
    _assert_partition(self, parts, len(labels))

  def test_unreachable_min_size(self):
    labels = _balanced_labels(10, 10)
    with self.assertRaisesRegex(ValueError, 'dirichlet_alpha'):
      partition.dirichlet(labels, 50, alpha=0.001, seed=0, min_size=2)

  @parameterized.parameters(0.0, -1.0, float('nan'))
  def test_bad_alpha(self, alpha):
    with self.assertRaisesRegex(ValueError, 'dirichlet_alpha'):
      partition.partition('dirichlet', _balanced_labels(10, 10), 5, seed=0,
                          dirichlet_alpha=alpha)


class PathologicalTest(parameterized.TestCase):

  @parameterized.parameters((100, 2), (30, 3), (7, 10), (10, 1))
  def test_each_client_has_exactly_classes_per_client(self, num_clients, cpc):
    labels = _balanced_labels(10, 600)
    parts = partition.pathological(labels, num_clients, classes_per_client=cpc,
                                   seed=0)
    _assert_partition(self, parts, len(labels))
    for p in parts:
      self.assertLen(np.unique(labels[p]), cpc)

  def test_balanced_sizes(self):
    labels = _balanced_labels(10, 600)
    sizes = [len(p) for p in partition.pathological(
        labels, 100, classes_per_client=2, seed=0)]
    self.assertEqual(set(sizes), {60})  # 20 shards of 30 per class.

  def test_unbalanced_labels(self):
    labels = np.random.default_rng(0).choice(
        10, 3000, p=np.linspace(1, 10, 10) / 55)
    parts = partition.pathological(labels, 40, classes_per_client=2, seed=1)
    _assert_partition(self, parts, len(labels))
    self.assertLessEqual(max(len(np.unique(labels[p])) for p in parts), 2)

  def test_class_pairs_are_mixed(self):
    labels = _balanced_labels(10, 100)
    parts = partition.pathological(labels, 50, classes_per_client=2, seed=0)
    pairs = {tuple(np.unique(labels[p])) for p in parts}
    self.assertGreater(len(pairs), 10)

  @parameterized.parameters(0, 11)
  def test_bad_classes_per_client(self, cpc):
    with self.assertRaisesRegex(ValueError, 'classes_per_client'):
      partition.partition('pathological', _balanced_labels(10, 10), 5, seed=0,
                          classes_per_client=cpc)

  def test_too_few_shards_for_classes(self):
    with self.assertRaisesRegex(ValueError, 'classes_per_client'):
      partition.pathological(_balanced_labels(10, 10), 2,
                             classes_per_client=2, seed=0)


class QuantitySkewTest(absltest.TestCase):

  def test_labels_iid_sizes_skewed(self):
    labels = _balanced_labels(10, 2000)
    parts = partition.quantity_skew(labels, 10, alpha=0.5, seed=0)
    _assert_partition(self, parts, len(labels))
    sizes = np.array([len(p) for p in parts])
    self.assertGreater(sizes.max(), 3 * sizes.min())
    big = [p for p in parts if len(p) >= 500]
    self.assertNotEmpty(big)
    shares = _shares(labels, big, 10)
    self.assertLess(np.abs(shares - 0.1).max(), 0.06)

  def test_large_alpha_near_equal_sizes(self):
    parts = partition.quantity_skew(np.zeros(10000, np.int32), 10,
                                    alpha=1e4, seed=0)
    sizes = np.array([len(p) for p in parts])
    self.assertLess(np.abs(sizes - 1000).max(), 100)

  def test_min_size(self):
    parts = partition.quantity_skew(np.zeros(1000, np.int32), 50, alpha=0.05,
                                    seed=0, min_size=10)
    self.assertGreaterEqual(min(len(p) for p in parts), 10)
    _assert_partition(self, parts, 1000)

  def test_bad_alpha(self):
    with self.assertRaisesRegex(ValueError, 'quantity_alpha'):
      partition.partition('quantity_skew', np.zeros(10, np.int32), 2, seed=0,
                          quantity_alpha=0.0)


# ----------------------------------------------------------------------------
# Splits.
# ----------------------------------------------------------------------------


class ServerSplitsTest(absltest.TestCase):

  def _split(self, **kw):
    args = dict(validation_fraction=0.1, validation_size=50, public_size=20,
                seed=0)
    args.update(kw)
    return splits.make_server_splits(np.zeros(1000, np.int32), **args)

  def test_sizes_and_disjointness(self):
    s = self._split()
    self.assertLen(s.validation, 50)
    self.assertLen(s.public, 20)
    # 100 reserved (50 of them unused), 20 public.
    self.assertLen(s.client_pool, 1000 - 100 - 20)
    everything = np.concatenate(s)
    self.assertLen(np.unique(everything), len(everything))
    self.assertTrue(np.all((everything >= 0) & (everything < 1000)))
    for a in s:
      self.assertEqual(a.dtype, np.int64)
      self.assertTrue(np.all(np.diff(a) > 0))

  def test_deterministic(self):
    a, b, c = self._split(), self._split(), self._split(seed=1)
    for x, y in zip(a, b):
      np.testing.assert_array_equal(x, y)
    self.assertFalse(np.array_equal(a.validation, c.validation))
    self.assertFalse(np.array_equal(a.public, c.public))

  def test_validation_independent_of_public_size(self):
    np.testing.assert_array_equal(self._split(public_size=0).validation,
                                  self._split(public_size=300).validation)

  def test_no_reserve(self):
    s = self._split(validation_fraction=0.0, validation_size=0, public_size=0)
    self.assertEmpty(s.validation)
    self.assertEmpty(s.public)
    np.testing.assert_array_equal(s.client_pool, np.arange(1000))
    with self.assertRaisesRegex(ValueError, 'validation_size'):
      self._split(validation_fraction=0.0, validation_size=1)

  def test_validation_size_too_large(self):
    self.assertLen(self._split(validation_size=100).validation, 100)
    with self.assertRaisesRegex(ValueError, 'validation_size'):
      self._split(validation_size=101)

  def test_public_size_too_large(self):
    with self.assertRaisesRegex(ValueError, 'public_size'):
      self._split(public_size=900)
    with self.assertRaisesRegex(ValueError, 'public_size'):
      self._split(public_size=-1)

  def test_bad_fraction(self):
    for fraction in (-0.1, 1.0):
      with self.assertRaisesRegex(ValueError, 'validation_fraction'):
        self._split(validation_fraction=fraction)


class LocalTrainTestSplitTest(absltest.TestCase):

  def test_sizes_and_coverage(self):
    rng = np.random.default_rng(0)
    parts = [np.sort(rng.choice(10_000, n, replace=False))
             for n in (0, 1, 2, 3, 10, 100)]
    train, test = splits.local_train_test_split(parts, test_fraction=0.2,
                                                seed=0)
    self.assertEqual([len(t) for t in test], [0, 0, 1, 1, 2, 20])
    for part, tr, te in zip(parts, train, test):
      self.assertEqual(tr.dtype, np.int64)
      self.assertEmpty(np.intersect1d(tr, te))
      np.testing.assert_array_equal(np.sort(np.concatenate([tr, te])), part)

  def test_deterministic(self):
    parts = [np.arange(50), np.arange(50, 80)]
    a = splits.local_train_test_split(parts, test_fraction=0.2, seed=1)
    b = splits.local_train_test_split(parts, test_fraction=0.2, seed=1)
    c = splits.local_train_test_split(parts, test_fraction=0.2, seed=2)
    for x, y in zip(a[1], b[1]):
      np.testing.assert_array_equal(x, y)
    self.assertFalse(np.array_equal(a[1][0], c[1][0]))

  def test_zero_fraction(self):
    parts = [np.arange(5), np.arange(5, 6)]
    train, test = splits.local_train_test_split(parts, test_fraction=0.0,
                                                seed=0)
    self.assertEqual([len(t) for t in test], [0, 0])
    np.testing.assert_array_equal(train[0], parts[0])

  def test_bad_fraction(self):
    with self.assertRaisesRegex(ValueError, 'test_fraction'):
      splits.local_train_test_split([np.arange(5)], test_fraction=1.0, seed=0)


# ----------------------------------------------------------------------------
# IDX sources.
# ----------------------------------------------------------------------------


def _idx_bytes(array, type_code=0x08):
  array = np.asarray(array)
  header = bytes([0, 0, type_code, array.ndim])
  dims = np.asarray(array.shape, '>u4').tobytes()
  return header + dims + array.astype(array.dtype.newbyteorder('>')).tobytes()


_IDX_NAMES = ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte',
              't10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte')


def _write_idx_dir(directory, *, num_train=5, num_test=3, seed=0,
                   compress=True, dotted=False, skip=()):
  """Writes a tiny IDX dataset; returns the arrays that were written."""
  rng = np.random.default_rng(seed)
  arrays = (
      rng.integers(0, 256, (num_train, 28, 28), dtype=np.uint8),
      rng.integers(0, 10, num_train, dtype=np.uint8),
      rng.integers(0, 256, (num_test, 28, 28), dtype=np.uint8),
      rng.integers(0, 10, num_test, dtype=np.uint8),
  )
  for name, array in zip(_IDX_NAMES, arrays):
    if name in skip:
      continue
    data = _idx_bytes(array)
    if dotted:
      name = name.replace('-idx', '.idx')
    if compress:
      data, name = gzip.compress(data), name + '.gz'
    with open(os.path.join(directory, name), 'wb') as f:
      f.write(data)
  return arrays


class RecordingSource:
  """An example array that records which rows were read from it."""

  def __init__(self, array):
    self.array = array
    self.shape, self.dtype = array.shape, array.dtype
    self.read = set()

  def __getitem__(self, rows):
    self.read.update(np.asarray(rows).ravel().tolist())
    return self.array[rows]


class ClientRowsTest(absltest.TestCase):
  """stack_clients' lazy x: the padded stack, built one block at a time."""

  def setUp(self):
    super().setUp()
    rng = np.random.default_rng(0)
    self.x = rng.integers(1, 256, (30, 4, 4, 1)).astype(np.uint8)
    self.y = rng.integers(0, 10, 30)
    self.parts = [np.array([3, 7, 8]), np.array([], np.int64),
                  np.array([0, 1, 2, 4, 5]), np.array([29]),
                  np.array([10, 11, 12, 13]), np.array([20, 21])]
    # The padded stack written out by hand.
    self.full = np.zeros((6, 5, 4, 4, 1), np.uint8)
    for k, p in enumerate(self.parts):
      self.full[k, :len(p)] = self.x[p]

  def test_is_the_zero_padded_stack(self):
    data = federated.stack_clients(self.x, self.y, self.parts)
    self.assertIsInstance(data.x, federated.ClientRows)
    self.assertEqual(data.x.shape, (6, 5, 4, 4, 1))
    self.assertEqual(data.x.dtype, np.uint8)
    np.testing.assert_array_equal(np.asarray(data.x), self.full)
    np.testing.assert_array_equal(data.count, [3, 0, 5, 1, 4, 2])
    np.testing.assert_array_equal(data.y[2], self.y[[0, 1, 2, 4, 5]])
    self.assertEqual(data.y[1].sum(), 0)
    # Indexing behaves as on the full array.
    np.testing.assert_array_equal(data.x[2, :3], self.full[2, :3])
    np.testing.assert_array_equal(data.x[-1], self.full[-1])
    np.testing.assert_array_equal(data.x[1:4], self.full[1:4])
    np.testing.assert_array_equal(data.x[::2], self.full[::2])
    sub = data.x[np.array([4, 0])]
    self.assertIsInstance(sub, federated.ClientRows)
    np.testing.assert_array_equal(np.asarray(sub), self.full[[4, 0]])

  def test_a_block_reads_only_its_clients_rows(self):
    source = RecordingSource(self.x)
    rows = federated.ClientRows(source, self.parts, 5)
    np.testing.assert_array_equal(rows.block(2, 4), self.full[2:4])
    self.assertEqual(source.read, {0, 1, 2, 4, 5, 29})
    source.read.clear()
    rows[np.array([1, 5])].block(0, 2)
    self.assertEqual(source.read, {20, 21})
    with self.assertRaisesRegex(IndexError, r'\[4, 7\)'):
      rows.block(4, 7)


class RowTableTest(parameterized.TestCase):
  """Evaluation sets stay lazy (RowTable) through the host-side re-cuts,
  equal to the same re-cuts of the built array, and a block reads only
  its own rows."""

  def setUp(self):
    super().setUp()
    # Row i holds the value i + 1 everywhere, so a built block names the
    # rows it came from (0 is padding).
    self.x = np.broadcast_to(
        np.arange(1, 14, dtype=np.uint8)[:, None, None, None],
        (13, 8, 8, 1)).copy()
    self.y = np.arange(13, dtype=np.int32) % 4
    self.source = RecordingSource(self.x)
    self.lazy = federated.RowTable(self.source, np.arange(13))

  def assert_lazy_equal(self, lazy, eager):
    self.assertIsInstance(lazy, federated.RowTable)
    self.assertEqual(lazy.shape, eager.shape)
    np.testing.assert_array_equal(np.asarray(lazy), eager)

  def test_recuts_equal_the_built_arrays(self):
    bx, by, bm = pad_to_batches(self.lazy, self.y, 4)
    ex, ey, em = pad_to_batches(self.x, self.y, 4)
    self.assertEqual(self.source.read, set())   # nothing built yet
    self.assert_lazy_equal(bx, ex)
    self.assertEqual(ex.shape, (4, 4, 8, 8, 1))
    np.testing.assert_array_equal(by, ey)
    np.testing.assert_array_equal(bm, em)
    self.assertEqual(int(em.sum()), 13)
    # 4 batches for 3 devices: re-cut into 6 batches of 3.
    rx, ry, rm = rebatch(bx, by, bm, 3)
    sx, sy, sm = rebatch(ex, ey, em, 3)
    self.assert_lazy_equal(rx, sx)
    self.assertEqual(sx.shape, (6, 3, 8, 8, 1))
    np.testing.assert_array_equal(ry, sy)
    np.testing.assert_array_equal(rm, sm)
    # The unmasked examples keep their order.
    np.testing.assert_array_equal(sx[..., 0, 0, 0][sm], np.arange(1, 14))
    px = pad_leading(rx, 4)
    self.assert_lazy_equal(px, pad_leading(sx, 4))
    self.assertEqual(px.shape[0], 8)
    # A block builds its own rows only.
    self.source.read.clear()
    block = px.block(2, 4)
    np.testing.assert_array_equal(block, sx[2:4])
    self.assertEqual(self.source.read, {int(v) - 1 for v in
                                        np.unique(sx[2:4]) if v})
    self.source.read.clear()
    self.assertEqual(px.block(6, 8).sum(), 0)   # padding: nothing read
    self.assertEqual(self.source.read, set())
    with self.assertRaisesRegex(ValueError, r'lead must be in \[1, 2\]'):
      px.regroup(np.arange(3), 3)

  def test_per_client_sets_are_lazy(self):
    parts = [np.array([3, 7]), np.array([], np.int64), np.array([0, 1, 2])]
    sets = federated.stack_eval_sets(self.x, self.y, parts, 2)
    self.assertIsInstance(sets.x, federated.RowTable)
    self.assertEqual(sets.x.shape, (3, 2, 2, 8, 8, 1))
    built = np.asarray(sets.x)
    for k, p in enumerate(parts):
      np.testing.assert_array_equal(built[k][sets.mask[k]], self.x[p])
      np.testing.assert_array_equal(sets.y[k][sets.mask[k]], self.y[p])
      self.assertEqual(built[k][~sets.mask[k]].sum(), 0)
    picked = sets.x[np.array([2, 0])]
    self.assert_lazy_equal(picked, built[[2, 0]])

  @parameterized.parameters('badnets', 'blended')
  def test_a_lazy_triggered_set_stamps_the_rows_it_builds(self, poison):
    eager = attacks.triggered_test_set(self.x, self.y, poison,
                                       target_label=1, with_sources=True)
    lazy = attacks.triggered_test_set(self.lazy, self.y, poison,
                                      target_label=1, with_sources=True)
    self.assertEqual(self.source.read, set())
    self.assert_lazy_equal(lazy[0], eager[0])
    for a, b in zip(lazy[1:], eager[1:]):
      np.testing.assert_array_equal(a, b)
    self.assertFalse(np.array_equal(eager[0], self.x[self.y != 1]))
    # Batched, a block stamps and reads its rows only.
    bx, _, _ = pad_to_batches(lazy[0], lazy[2], 5)
    self.source.read.clear()
    np.testing.assert_array_equal(bx.block(1, 2)[0], eager[0][5:10])
    self.assertEqual(self.source.read, set(
        np.flatnonzero(self.y != 1)[5:10].tolist()))


class StackEvalSetsTest(parameterized.TestCase):

  @parameterized.parameters(
      # (client sizes, batch_size, expected [T, B])
      ([3, 0, 5, 1], 500, (1, 5)),
      ([600, 10], 500, (2, 300)),
      ([1000, 7], 500, (2, 500)),
      ([0, 0], 500, (1, 1)),
  )
  def test_batches_fit_the_longest_client(self, sizes, batch_size, tb):
    """Every client's examples once, in order, masked; batches no larger
    than the longest client needs (not batch_size each)."""
    x = np.arange(sum(sizes) + 1, dtype=np.int32)[:, None] + 1
    y = np.arange(sum(sizes) + 1) % 10
    bounds = np.cumsum([0, *sizes])
    parts = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    out = federated.stack_eval_sets(x, y, parts, batch_size)
    self.assertEqual(out.x.shape, (len(sizes), *tb, 1))
    self.assertEqual(out.mask.shape, (len(sizes), *tb))
    for k, p in enumerate(parts):
      m = out.mask[k].reshape(-1)
      self.assertEqual(int(m.sum()), len(p))
      self.assertTrue(np.all(m[:len(p)]))   # real examples first
      np.testing.assert_array_equal(out.x[k].reshape(-1)[:len(p)], x[p, 0])
      np.testing.assert_array_equal(out.y[k].reshape(-1)[:len(p)], y[p])
      self.assertEqual(int(np.abs(out.x[k].reshape(-1)[len(p):]).sum()), 0)


class IdxTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('gz', True, False), ('raw', False, False), ('dotted_gz', True, True),
      ('dotted_raw', False, True))
  def test_roundtrip(self, compress, dotted):
    directory = self.create_tempdir().full_path
    tx, ty, vx, vy = _write_idx_dir(directory, compress=compress,
                                    dotted=dotted)
    ds = sources.load_idx(directory, name='tiny')
    self.assertEqual(ds.name, 'tiny')
    self.assertEqual(ds.train_x.dtype, np.uint8)
    self.assertEqual(ds.train_y.dtype, np.int32)
    self.assertEqual(ds.train_x.shape, (5, 28, 28, 1))
    self.assertEqual(ds.test_x.shape, (3, 28, 28, 1))
    np.testing.assert_array_equal(ds.train_x[..., 0], tx)
    np.testing.assert_array_equal(ds.train_y, ty)
    np.testing.assert_array_equal(ds.test_x[..., 0], vx)
    np.testing.assert_array_equal(ds.test_y, vy)
    self.assertEqual(ds.num_classes, 10)      # declared, not inferred

  def test_out_of_range_labels_are_refused(self):
    # Before: a label of 10 or 200 silently made num_classes 11 or 201.
    for bad in (10, 200):
      directory = self.create_tempdir().full_path
      _write_idx_dir(directory)
      with gzip.open(os.path.join(directory,
                                  'train-labels-idx1-ubyte.gz'), 'wb') as f:
        f.write(_idx_bytes(np.array([1, 2, bad, 3, 4], np.uint8)))
      with self.assertRaisesRegex(ValueError,
                                  rf'train labels lie outside \[0, 10\).*'
                                  rf'{bad}'):
        sources.load_idx(directory)

  def test_truncated_gzip_names_the_file(self):
    directory = self.create_tempdir().full_path
    _write_idx_dir(directory)
    path = os.path.join(directory, 't10k-images-idx3-ubyte.gz')
    with open(path, 'rb') as f:
      data = f.read()
    for broken in (data[:len(data) // 2], data[:12] + b'\x00' * 40):
      with open(path, 'wb') as f:
        f.write(broken)
      with self.assertRaisesRegex(ValueError, f'{path}: corrupt or '
                                  'truncated gzip'):
        sources.load_idx(directory)

  def test_parse_idx_multibyte_big_endian(self):
    array = np.arange(-6, 6, dtype=np.int32).reshape(3, 4) * 1000
    parsed = sources.parse_idx(_idx_bytes(array, type_code=0x0C))
    self.assertEqual(parsed.dtype, np.int32)
    self.assertTrue(parsed.dtype.isnative)
    np.testing.assert_array_equal(parsed, array)

  def test_parse_idx_errors(self):
    good = _idx_bytes(np.zeros((2, 3), np.uint8))
    with self.assertRaisesRegex(ValueError, 'magic'):
      sources.parse_idx(b'\x01' + good[1:])
    with self.assertRaisesRegex(ValueError, 'type code'):
      sources.parse_idx(good[:2] + b'\x07' + good[3:])
    with self.assertRaisesRegex(ValueError, 'payload'):
      sources.parse_idx(good[:-1])
    with self.assertRaisesRegex(ValueError, 'header'):
      sources.parse_idx(good[:6])

  def test_missing_file(self):
    directory = self.create_tempdir().full_path
    _write_idx_dir(directory, skip=('t10k-labels-idx1-ubyte',))
    with self.assertRaises(sources.DataNotFoundError) as cm:
      sources.load_idx(directory)
    message = str(cm.exception)
    self.assertIsInstance(cm.exception, FileNotFoundError)
    self.assertIn(directory, message)
    self.assertIn('t10k-labels-idx1-ubyte', message)
    self.assertNotIn('train-images-idx3-ubyte[', message)
    self.assertIn('dataset-fashion-mnist', message)
    self.assertIn('data_dir', message)

  def test_missing_directory(self):
    directory = os.path.join(self.create_tempdir().full_path, 'absent')
    with self.assertRaisesRegex(sources.DataNotFoundError,
                                'does not exist.*dataset-fashion-mnist'):
      sources.load_dataset('idx', directory)

  def test_mismatched_counts(self):
    directory = self.create_tempdir().full_path
    _write_idx_dir(directory, skip=('train-labels-idx1-ubyte',))
    with open(os.path.join(directory, 'train-labels-idx1-ubyte'), 'wb') as f:
      f.write(_idx_bytes(np.zeros(4, np.uint8)))
    with self.assertRaisesRegex(ValueError, '5 images but 4 labels'):
      sources.load_idx(directory)


class InDomainAnchorsTest(absltest.TestCase):
  """RFD-LoRA's anchors from the clients' own dataset come only from the
  training rows that --max_train_examples leaves out."""

  def _config(self, directory, max_train_examples):
    return {'method': 'rfd_lora', 'dataset': 'idx', 'data_dir': directory,
            'max_train_examples': max_train_examples, 'seed': 3}

  def test_rows_are_the_complement_of_the_subsample(self):
    kept = federated.subsample_rows(50, 20, seed=3)
    dropped = federated.unused_rows(50, 20, seed=3)
    self.assertLen(kept, 20)
    np.testing.assert_array_equal(np.sort(np.concatenate([kept, dropped])),
                                  np.arange(50))
    ds = sources.Dataset(np.arange(50)[:, None], np.zeros(50, np.int32),
                         np.zeros((1, 1)), np.zeros(1, np.int32), 2, 't')
    np.testing.assert_array_equal(
        federated.subsample(ds, 20, seed=3).train_x[:, 0], kept)
    self.assertEmpty(federated.unused_rows(50, 0, seed=3))
    self.assertEmpty(federated.unused_rows(50, 50, seed=3))

  def test_anchors_are_disjoint_from_the_clients_data(self):
    from experiments import config as config_lib  # pylint: disable=g-import-not-at-top
    from fedrobust.federation import builder as train  # pylint: disable=g-import-not-at-top
    directory = self.create_tempdir().full_path
    _write_idx_dir(directory, num_train=40, num_test=2)

    def as_flags(err):   # as the runner reports it
      return ValueError(config_lib.describe_error(err, 'rfd_lora'))
    config = self._config(directory, 25)
    anchors = train.anchor_inputs('idx', 0.4, 25, (28, 28, 1), config)
    self.assertEqual(anchors.shape, (10, 28, 28, 1))
    full = sources.load_dataset('idx', directory).train_x
    held = federated.subsample(sources.load_dataset('idx', directory), 25,
                               config['seed']).train_x
    as_rows = lambda a: {r.tobytes() for r in a}
    self.assertEqual(len(as_rows(full)), 40)  # every row is distinct
    self.assertEmpty(as_rows(anchors) & as_rows(held))
    self.assertLen(as_rows(anchors), 10)
    with self.assertRaises(SettingError) as ctx:
      train.anchor_inputs('idx', 0.64, 25, (28, 28, 1), config)
    self.assertRegex(str(as_flags(ctx.exception)),
                     r'--rfd_lora_anchor_dataset: idx has 15 training '
                     r'examples the clients do not hold, fewer than the 16')
    with self.assertRaises(SettingError) as ctx:
      train.anchor_inputs('idx', 0.1, 40, (28, 28, 1),
                          self._config(directory, 0))
    self.assertRegex(str(as_flags(ctx.exception)),
                     r"clients' own dataset.*hold all 40.*"
                     r'--max_train_examples below 40')


class RegistryTest(absltest.TestCase):

  def test_names(self):
    self.assertEqual(
        set(sources.DATASETS),
        {'fashion_mnist', 'idx', 'mnist', 'mnist_5k', 'cifar10', 'cifar100',
         'tfds_fashion_mnist', 'vader_movies', 'vader_tweets',
         'vader_amazon', 'vader_nyt', 'vader_domains', 'npz'})

  def test_unknown_dataset(self):
    with self.assertRaisesRegex(ValueError, 'dataset.*fashion_mnist'):
      sources.load_dataset('imagenet')

  def test_idx_needs_data_dir(self):
    with self.assertRaisesRegex(ValueError, 'data_dir'):
      sources.load_dataset('idx')

  def test_idx_and_fashion_mnist_from_dir(self):
    directory = self.create_tempdir().full_path
    _write_idx_dir(directory)
    self.assertEqual(sources.load_dataset('idx', directory).name, 'idx')
    ds = sources.load_dataset('fashion_mnist', directory)
    self.assertEqual(ds.name, 'fashion_mnist')
    self.assertLen(ds.train_x, 5)


@absltest.skipUnless(os.path.isdir(sources.DEFAULT_FASHION_MNIST_DIR),
                     'Fashion-MNIST IDX files not installed '
                     '(apt-get install -y dataset-fashion-mnist).')
class RealFashionMnistTest(absltest.TestCase):

  def test_loads(self):
    ds = sources.load_dataset('fashion_mnist')
    self.assertEqual(ds.name, 'fashion_mnist')
    self.assertEqual(ds.num_classes, 10)
    self.assertEqual(ds.train_x.shape, (60000, 28, 28, 1))
    self.assertEqual(ds.test_x.shape, (10000, 28, 28, 1))
    self.assertEqual(ds.train_x.dtype, np.uint8)
    self.assertEqual(ds.train_y.dtype, np.int32)
    np.testing.assert_array_equal(np.bincount(ds.train_y), [6000] * 10)
    np.testing.assert_array_equal(np.bincount(ds.test_y), [1000] * 10)


# ----------------------------------------------------------------------------
# TFDS sources (no TensorFlow).
# ----------------------------------------------------------------------------


class _BindGetitems(mock.MagicMock):
  """MagicMock that binds an assigned `__getitems__` to itself.

  `tfds.testing.mock_data` (4.9.10) assigns an unbound
  `functools.partial(_getitems, generator=...)` as `__getitems__` of the mocked
  ArrayRecord source; MagicMock does not bind that (non-standard) dunder, so
  batched reads fail with "missing 1 required positional argument". Binding
  it here makes the mock behave like the real source.
  """

  def __setattr__(self, name, value):
    if name == '__getitems__':
      value = functools.partial(value, self)
    super().__setattr__(name, value)


def _mock_tfds(tfds, num_examples):
  source_mock = tfds.testing.PickableDataSourceMock()
  source_mock.return_value = _BindGetitems()
  return tfds.testing.mock_data(num_examples=num_examples,
                                mock_array_record_data_source=source_mock)


def _prepare_tiny_tfds(tfds, data_dir, num_train, num_test):
  """Prepares a tiny image dataset as array_record files, without TF.

  Example i has a constant image of value i and label i % 10. The builder is
  not registered, so reading it back exercises the read-only path used for a
  prepared directory copied from another machine.
  """
  from PIL import Image  # pylint: disable=g-import-not-at-top

  class FedrobustTinyDigits(tfds.core.GeneratorBasedBuilder,
                            skip_registration=True):
    VERSION = tfds.core.Version('1.0.0')

    def _info(self):
      return tfds.core.DatasetInfo(
          builder=self,
          features=tfds.features.FeaturesDict({
              'image': tfds.features.Image(shape=(28, 28, 1)),
              'label': tfds.features.ClassLabel(num_classes=10),
          }))

    def _split_generators(self, dl_manager):
      del dl_manager
      return {'train': self._generate_examples(num_train),
              'test': self._generate_examples(num_test)}

    def _generate_examples(self, n):
      for i in range(n):
        # PIL images are encoded by PIL; numpy images would need TF to encode.
        image = Image.fromarray(np.full((28, 28), i, np.uint8), mode='L')
        yield i, {'image': image, 'label': i % 10}

  builder = FedrobustTinyDigits(data_dir=data_dir, file_format='array_record')
  builder.download_and_prepare()
  return builder.name


class TfdsTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    try:
      import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    except ImportError:
      self.skipTest('tensorflow_datasets is not installed.')
    self.tfds = tfds
    self.tf_was_imported = 'tensorflow' in sys.modules

  def tearDown(self):
    if not self.tf_was_imported:
      self.assertNotIn('tensorflow', sys.modules)
    super().tearDown()

  @parameterized.parameters(
      ('mnist', 'mnist', (28, 28, 1), 10),
      ('cifar10', 'cifar10', (32, 32, 3), 10),
      ('cifar100', 'cifar100', (32, 32, 3), 100),
      ('tfds_fashion_mnist', 'fashion_mnist', (28, 28, 1), 10),
  )
  def test_mocked(self, dataset, tfds_name, shape, num_classes):
    with _mock_tfds(self.tfds, num_examples=7):
      ds = sources.load_dataset(dataset, self.create_tempdir().full_path)
    self.assertEqual(ds.name, tfds_name)
    self.assertEqual(ds.num_classes, num_classes)
    self.assertEqual(ds.train_x.shape, (7, *shape))
    self.assertEqual(ds.test_x.shape, (7, *shape))
    self.assertEqual(ds.train_x.dtype, np.uint8)
    self.assertEqual(ds.train_y.dtype, np.int32)
    self.assertEqual(ds.test_y.shape, (7,))
    self.assertTrue(np.all((ds.train_y >= 0) & (ds.train_y < num_classes)))

  def test_real_array_record_roundtrip(self):
    data_dir = self.create_tempdir().full_path
    name = _prepare_tiny_tfds(self.tfds, data_dir, num_train=23, num_test=11)
    ds = sources.load_tfds(name, data_dir)
    self.assertEqual(ds.num_classes, 10)
    self.assertIsInstance(ds.train_x, sources.RecordImages)
    for x, y, n in ((ds.train_x, ds.train_y, 23), (ds.test_x, ds.test_y, 11)):
      self.assertEqual(x.shape, (n, 28, 28, 1))
      self.assertEqual(x.dtype, np.uint8)
      self.assertEqual(y.dtype, np.int32)
      ids = x[:, 0, 0, 0].astype(np.int32)
      # Records come back shuffled by TFDS; each image is still intact.
      np.testing.assert_array_equal(np.sort(ids), np.arange(n))
      np.testing.assert_array_equal(x, np.broadcast_to(
          ids[:, None, None, None], x.shape))
      np.testing.assert_array_equal(y, ids % 10)

  def test_training_images_are_read_by_client(self):
    """TFDS training images stay in their files: indexing reads only the
    records asked for, a subsample stays lazy, and a federated setup
    built over them reads a client's examples when its block is built,
    giving the arrays of the images read in full."""
    data_dir = self.create_tempdir().full_path
    name = _prepare_tiny_tfds(self.tfds, data_dir, num_train=40, num_test=3)
    ds = sources.load_tfds(name, data_dir)

    class Records:
      """The split's records, noting which are read (no __getitems__)."""

      def __init__(self, records):
        self.records, self.read = records, set()

      def __len__(self):
        return len(self.records)

      def __getitem__(self, i):
        self.read.add(int(i))
        return self.records[i]

    source = Records(ds.train_x.source)
    images = sources.RecordImages(source, 'train')
    self.assertEqual(images.shape, (40, 28, 28, 1))
    source.read.clear()   # the shape came from record 0
    full, labels = sources._read_split(ds.train_x.source, 'train')
    np.testing.assert_array_equal(labels, ds.train_y)
    np.testing.assert_array_equal(images[np.array([5, 2])], full[[5, 2]])
    self.assertEqual(source.read, {5, 2})
    np.testing.assert_array_equal(images[7], full[7])
    np.testing.assert_array_equal(images[3, 0, :2], full[3, 0, :2])
    sub = federated.subsample(ds._replace(train_x=images), 25, seed=1)
    self.assertIsInstance(sub.train_x, sources.RecordImages)
    self.assertEqual(sub.train_x.shape, (25, 28, 28, 1))
    kept = federated.subsample_rows(40, 25, seed=1)
    np.testing.assert_array_equal(sub.train_x[[0, 24]], full[kept[[0, 24]]])
    source.read.clear()
    setup = federated.build_federated_setup(
        ds._replace(train_x=images), num_clients=4,
        partition_name='iid', seed=0)
    self.assertEqual(source.read, set())   # nothing read for the clients
    first = setup.train.x.block(0, 1)
    self.assertEqual(source.read, set(setup.train.x.parts[0].tolist()))
    eager = federated.build_federated_setup(
        ds._replace(train_x=full), num_clients=4, partition_name='iid',
        seed=0)
    np.testing.assert_array_equal(first, np.asarray(eager.train.x)[:1])
    np.testing.assert_array_equal(np.asarray(setup.train.x),
                                  np.asarray(eager.train.x))

  def test_test_images_are_read_by_batch(self):
    """TFDS test images stay in their files too: only the labels are read
    at load, the global test set is built lazily, and a batch of it reads
    only its own records."""
    data_dir = self.create_tempdir().full_path
    name = _prepare_tiny_tfds(self.tfds, data_dir, num_train=12, num_test=11)
    ds = sources.load_tfds(name, data_dir)
    self.assertIsInstance(ds.test_x, sources.RecordImages)
    full, labels = sources._read_split(ds.test_x.source, 'test')
    np.testing.assert_array_equal(labels, ds.test_y)
    read = set()
    records = ds.test_x.source

    class Records:
      def __len__(self):
        return len(records)

      def __getitem__(self, i):
        read.add(int(i))
        return records[i]

    images = sources.RecordImages(Records(), 'test')
    read.clear()   # the shape came from record 0
    setup = federated.build_federated_setup(
        ds._replace(test_x=images, train_x=np.asarray(ds.train_x)),
        num_clients=2, partition_name='iid', seed=0, eval_batch_size=4)
    self.assertIsInstance(setup.test.x, federated.RowTable)
    self.assertEqual(read, set())
    np.testing.assert_array_equal(setup.test.x.block(1, 2)[0], full[4:8])
    self.assertEqual(read, {4, 5, 6, 7})
    np.testing.assert_array_equal(np.asarray(setup.test.x)[setup.test.mask],
                                  full)

  def test_reads_in_batches_and_without_getitems(self):
    data_dir = self.create_tempdir().full_path
    name = _prepare_tiny_tfds(self.tfds, data_dir, num_train=23, num_test=1)
    source = self.tfds.data_source(name, split='train', data_dir=data_dir)
    batched = sources._read_split(source, 'train', batch_size=5)
    records = [source[i] for i in range(len(source))]  # list: no __getitems__
    unbatched = sources._read_split(records, 'train', batch_size=5)
    for a, b in zip(batched, unbatched):
      np.testing.assert_array_equal(a, b)

  def test_not_prepared(self):
    data_dir = self.create_tempdir().full_path
    with self.assertRaises(sources.DataNotFoundError) as cm:
      sources.load_dataset('mnist', data_dir)
    message = str(cm.exception)
    self.assertIn(data_dir, message)
    self.assertIn(f'tfds build mnist --data_dir={data_dir}', message)


class Mnist5kTest(absltest.TestCase):

  def test_missing_and_corrupt_files_name_setup(self):
    empty = self.create_tempdir().full_path
    with self.assertRaisesRegex(sources.DataNotFoundError, 'setup.sh'):
      sources.load_mnist5k_arrays(empty)
    with open(os.path.join(empty, sources.MNIST5K_FILE), 'wb') as f:
      f.write(gzip.compress(b'1,2,3\n'))
    with self.assertRaisesRegex(sources.DataNotFoundError, 'sha256'):
      sources.load_mnist5k_arrays(empty)

  def test_real_subset(self):
    path = os.path.join(sources.default_mnist5k_dir(), sources.MNIST5K_FILE)
    if not os.path.isfile(path):
      self.skipTest(f'{path} absent (./setup.sh fetches it)')
    data = sources.load_dataset('mnist_5k')
    self.assertEqual(data.train_x.shape, (4000, 28, 28, 1))
    self.assertEqual(data.test_x.shape, (1000, 28, 28, 1))
    np.testing.assert_array_equal(np.bincount(data.test_y), [100] * 10)
    np.testing.assert_array_equal(np.bincount(data.train_y), [400] * 10)
    # Real digits: mostly black background, strokes at full intensity.
    self.assertEqual(int(data.train_x.max()), 255)
    self.assertLess(float(np.mean(data.train_x == 0)), 0.9)
    self.assertGreater(float(np.mean(data.train_x == 0)), 0.6)


if __name__ == '__main__':
  absltest.main()
