"""Your own data: arrays (with client ids) become a Dataset; the natural
partitioner keeps each id as one client; the runner reads an .npz."""

import os

from absl.testing import absltest
import numpy as np

from experiments import config as config_lib
from experiments import train
from fedrobust.data import from_arrays, load_npz, save_npz
from fedrobust.data.partition import partition
from fedrobust.errors import SettingError


def writers_data(num_writers=6, per_writer=40, seed=0):
  """Generated 'handwriting': each writer draws its own classes."""
  rng = np.random.default_rng(seed)
  prototypes = rng.integers(0, 256, (4, 12, 12))
  ids = np.repeat(rng.permutation(1000)[:num_writers] * 7, per_writer)
  y = rng.integers(0, 4, len(ids))
  noise = rng.integers(-30, 30, (len(ids), 12, 12))
  x = np.clip(prototypes[y] + noise, 0, 255).astype(np.uint8)
  return x, y, ids


class FromArraysTest(absltest.TestCase):

  def test_ids_channels_and_held_out_test(self):
    x, y, ids = writers_data()
    data = from_arrays(x, y, client_ids=ids, test_fraction=0.25)
    self.assertEqual(data.train_x.shape[1:], (12, 12, 1))
    self.assertEqual(len(data.train_y) + len(data.test_y), len(y))
    self.assertEqual(data.num_classes, 4)
    # Ids become 0..G-1 in id order, on both splits.
    self.assertEqual(sorted(np.unique(data.train_groups)), list(range(6)))
    self.assertEqual(len(data.test_groups), len(data.test_y))
    # Stratified: every class is in the test split.
    self.assertEqual(sorted(np.unique(data.test_y)), [0, 1, 2, 3])

  def test_float_images_and_bad_input_are_named(self):
    x, y, _ = writers_data()
    data = from_arrays(x / 255.0, y, test_x=x[:5], test_y=y[:5])
    np.testing.assert_array_equal(data.train_x[..., 0], x)
    with self.assertRaisesRegex(SettingError, 'y'):
      from_arrays(x, y[:-1])
    with self.assertRaisesRegex(SettingError, 'client_ids'):
      from_arrays(x, y, client_ids=np.zeros(3))
    with self.assertRaisesRegex(SettingError, r'\[0, 1\]'):
      from_arrays(x * 2.0, y)

  def test_subsample_test_keeps_rows_and_groups_together(self):
    from fedrobust.data import subsample_test  # pylint: disable=g-import-not-at-top
    x, y, ids = writers_data()
    data = from_arrays(x, y, client_ids=ids)
    small = subsample_test(data, 20, seed=0)
    self.assertLen(small.test_y, 20)
    self.assertLen(small.test_groups, 20)
    # Every kept row is a row of the full split, with its label and id.
    for xi, yi, gi in zip(small.test_x, small.test_y, small.test_groups):
      match = np.flatnonzero((data.test_x == xi).all(axis=(1, 2, 3)))
      self.assertIn(yi, data.test_y[match])
      self.assertIn(gi, data.test_groups[match])
    self.assertIs(subsample_test(data, 0, seed=0), data)
    np.testing.assert_array_equal(subsample_test(data, 20, seed=0).test_y,
                                  small.test_y)

  def test_natural_keeps_each_id_as_one_client(self):
    x, y, ids = writers_data()
    data = from_arrays(x, y, client_ids=ids)
    parts = partition('natural', data.train_y, 6, seed=0,
                      groups=data.train_groups)
    self.assertLen(parts, 6)
    for k, part in enumerate(parts):
      self.assertTrue(np.all(data.train_groups[part] == k))
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)),
                                  np.arange(len(data.train_y)))
    with self.assertRaisesRegex(SettingError, 'num_clients=6'):
      partition('natural', data.train_y, 5, seed=0, groups=data.train_groups)
    with self.assertRaisesRegex(SettingError, 'partition'):
      partition('natural', data.train_y, 6, seed=0, groups=None)


class NpzRunTest(absltest.TestCase):

  def test_the_runner_trains_on_an_npz_by_writer(self):
    x, y, ids = writers_data()
    path = os.path.join(self.create_tempdir().full_path, 'writers.npz')
    save_npz(path, x, y, client_id=ids)
    self.assertEqual(load_npz(path).num_classes, 4)
    config = config_lib.defaults()
    config.update(dataset='npz', data_dir=path, partition='natural',
                  num_clients=6, clients_per_round=3, model='mlp',
                  num_rounds=2, batch_size=16, num_devices=1,
                  workdir=self.create_tempdir().full_path)
    summary = train.run(config)
    self.assertEqual(summary['status'], 'completed')
    self.assertGreater(summary['final']['test_accuracy'], 0.25)
    with self.assertRaisesRegex(ValueError, 'num_clients'):
      train.run(dict(config, num_clients=5,
                     workdir=self.create_tempdir().full_path))


if __name__ == '__main__':
  absltest.main()
