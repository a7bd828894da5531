"""TensorBoard event files: a run's metrics read back with TensorBoard's
own loader, purged past the resumed checkpoint."""

import json
import os

from absl.testing import absltest

from experiments import train
from experiments.tracking import scalars
from tests.main_test import IdxDataTestCase, base_config


def read_scalars(logdir):
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  acc = event_accumulator.EventAccumulator(
      logdir, size_guidance={event_accumulator.SCALARS: 0})
  acc.Reload()
  return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
          for tag in acc.Tags()['scalars']}


class ScalarsTest(absltest.TestCase):

  def test_flattens_numbers_and_skips_the_rest(self):
    row = {'round': 3, 'test_accuracy': 0.5, 'test_accuracy/w0.5': 0.25,
           'clients': [{'id': 1}], 'clients_auc': {'weight': 0.75},
           'nonfinite': ['x'], 'x': None, 'flag': True, 'inf': float('inf'),
           'restored': 're-evaluated'}
    self.assertEqual(dict(scalars(row)), {
        'test_accuracy': 0.5, 'test_accuracy/w0.5': 0.25,
        'clients_auc/weight': 0.75, 'flag': 1.0})


class TensorBoardRunTest(IdxDataTestCase):

  def test_two_rounds_read_back_with_the_logged_values(self):
    workdir = self.create_tempdir().full_path
    train.run(base_config(self.data_dir, workdir, num_rounds=2,
                          attack='badnets', malicious_fraction=0.25))
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      rows = [json.loads(line) for line in f]
    got = read_scalars(os.path.join(workdir, 'tensorboard'))
    for key in ('test_accuracy', 'train_loss', 'attack_success_rate',
                'detection_accuracy', 'local_accuracy'):
      self.assertIn(key, got)
      self.assertEqual([s for s, _ in got[key]], [1, 2], key)
      for (_, value), row in zip(got[key], rows):
        self.assertAlmostEqual(value, row[key], places=6, msg=key)

  def test_resume_purges_rounds_past_the_checkpoint(self):
    workdir = self.create_tempdir().full_path
    config = base_config(self.data_dir, workdir, num_rounds=3,
                         checkpoint_every=2)
    train.run(config)
    # Round 3 is checkpointed; go back to the step at round 2 as if the
    # run had died before saving round 3.
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.rmtree(os.path.join(workdir, 'checkpoints', '3'))
    for name in os.listdir(os.path.join(workdir, 'checkpoints',
                                        '.integrity')):
      if name.startswith('3.'):
        os.unlink(os.path.join(workdir, 'checkpoints', '.integrity', name))
    train.run(config)
    got = read_scalars(os.path.join(workdir, 'tensorboard'))
    self.assertEqual([s for s, _ in got['test_accuracy']], [1, 2, 3])


if __name__ == '__main__':
  absltest.main()
