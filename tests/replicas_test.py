"""Seeds as replicas of one program (fedrobust.Replicas, --num_seeds):
replica i is the single run with seed `seed + i` bit for bit, the runner's
rows and summary carry every replica with mean and std, a resumed replica
run ends where an uninterrupted one does, and programs that differ in
more than array values are refused."""

import json
import os

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import fedrobust
from experiments import train
from fedrobust.federation import combine_rows
from fedrobust.federation.replicas import common_program
from tests.main_test import IdxDataTestCase, base_config

# A label-skewed partition, so the seeds' largest clients differ and the
# replicas are padded to one client size; a malicious set per seed.
SETTINGS = dict(dataset='idx', model='mlp', num_clients=4,
                clients_per_round=3, local_test_fraction=0.2, num_rounds=2,
                batch_size=16, local_lr=0.05, eval_batch_size=50,
                num_devices=1, partition='dirichlet', dirichlet_alpha=0.3,
                aggregator='median', attack='sign_flip',
                malicious_fraction=0.25)


class ReplicasTest(IdxDataTestCase):

  def test_each_replica_is_its_single_run(self):
    reps = fedrobust.Replicas(SETTINGS, data_dir=self.data_dir, seed=3,
                              num_seeds=2)
    sizes = [fedrobust.Federation(SETTINGS, data_dir=self.data_dir,
                                  seed=s).program.setup.train.y.shape[1]
             for s in (3, 4)]
    self.assertNotEqual(sizes[0], sizes[1])     # padding is exercised
    state, rows = reps.run()
    self.assertEqual(rows[-1]['seeds'], [3, 4])
    for i, seed in enumerate((3, 4)):
      single, single_rows = fedrobust.Federation(
          SETTINGS, data_dir=self.data_dir, seed=seed).run()
      mine = jax.tree.map(lambda a: np.asarray(a[i]), state.params)
      for a, b in zip(jax.tree.leaves(mine),
                      jax.tree.leaves(single.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
      self.assertEqual(rows[-1]['replicas'][i]['test_accuracy'],
                       single_rows[-1]['test_accuracy'])
    accs = [r['test_accuracy'] for r in rows[-1]['replicas']]
    self.assertAlmostEqual(rows[-1]['test_accuracy'], np.mean(accs))
    self.assertAlmostEqual(rows[-1]['test_accuracy_std'],
                           np.std(accs, ddof=1))

  def test_a_federation_is_one_seed(self):
    with self.assertRaisesRegex(fedrobust.SettingError, '^num_seeds.*'
                                'Replicas'):
      fedrobust.Federation(SETTINGS, data_dir=self.data_dir, num_seeds=2)
    with self.assertRaisesRegex(fedrobust.SettingError, '^num_seeds'):
      fedrobust.Replicas(SETTINGS, data_dir=self.data_dir, num_seeds=0)

  def test_runner_rows_summary_and_exact_resume(self):
    config = lambda workdir, **kw: base_config(
        self.data_dir, workdir, **{**{k: v for k, v in SETTINGS.items()
                                      if k != 'dataset'}, **kw})
    whole = self.create_tempdir().full_path
    summary = train.run(config(whole, num_seeds=2, num_rounds=3))
    self.assertEqual(len(summary['params_sha256']), 2)
    self.assertEqual([r['seed'] for r in summary['replicas']], [0, 1])
    for i, entry in enumerate(summary['replicas']):
      single = train.run(config(self.create_tempdir().full_path, seed=i,
                                num_rounds=3))
      self.assertEqual(entry['params_sha256'], single['params_sha256'])
      self.assertEqual(entry['final']['test_accuracy'],
                       single['final']['test_accuracy'])
    final = summary['final']
    self.assertIn('test_accuracy_std', final)
    self.assertIn('test_accuracy_std', summary['final_mean_last5'])
    with open(os.path.join(whole, 'metrics.jsonl')) as f:
      rows = [json.loads(line) for line in f]
    self.assertEqual([r['round'] for r in rows], [1, 2, 3])
    self.assertEqual(len(rows[0]['replicas']), 2)
    self.assertTrue(os.path.exists(os.path.join(whole, 'curves.png')))
    # Stopped after round 1 (checkpointed), then resumed to 3.
    cut = self.create_tempdir().full_path
    train.run(config(cut, num_seeds=2, num_rounds=1))
    resumed = train.run(config(cut, num_seeds=2, num_rounds=3))
    self.assertEqual(resumed['params_sha256'], summary['params_sha256'])
    with open(os.path.join(cut, 'metrics.jsonl')) as f:
      cut_rows = [json.loads(line) for line in f]
    self.assertEqual([r['test_accuracy'] for r in cut_rows],
                     [r['test_accuracy'] for r in rows])


class CommonProgramTest(absltest.TestCase):

  def test_array_constants_are_stacked_and_shared_ones_kept(self):
    tables = [np.array([1., 2.]), np.array([3., 5.])]
    scale = np.array([2., 2.])
    fns = [lambda x, t=t: x * t + scale for t in tables]
    args = [(jnp.ones(2),), (jnp.ones(2),)]
    fn, consts = common_program(fns, args, what='test', seeds=[0, 1],
                                batch=1)
    self.assertLen(consts, 1)                 # `scale` stays unstacked
    out = jax.jit(fn)(consts, jnp.stack([jnp.ones(2), 2 * jnp.ones(2)]))
    np.testing.assert_allclose(out, [[3., 4.], [8., 12.]])
    fn, consts = common_program(fns, args, what='test', seeds=[0, 1],
                                batch=2)
    np.testing.assert_allclose(jax.jit(fn)(consts, jnp.ones((2, 2))),
                               [[3., 4.], [5., 7.]])

  def test_python_choices_and_host_effects_are_refused(self):
    fns = [lambda x, n=n: jnp.full((2,), n) + x for n in (1, 2)]
    args = [(jnp.ones(2),)] * 2
    with self.assertRaisesRegex(fedrobust.SettingError,
                                '^num_seeds: the round of seed 8 differs'):
      common_program(fns, args, what='round', seeds=[7, 8], batch=1)

    def noisy(x):
      jax.debug.callback(lambda v: None, x)
      return x
    with self.assertRaisesRegex(fedrobust.SettingError, 'host-side'):
      common_program([noisy, noisy], args, what='round', seeds=[0, 1],
                     batch=1)

  def test_combined_rows(self):
    rows = [{'round': 2, 'acc': 0.5, 'tag': 'a', 'note': 'x'},
            {'round': 2, 'acc': 0.7, 'tag': 'b', 'note': 'x'}]
    out = combine_rows(rows, [0, 1])
    self.assertAlmostEqual(out['acc'], 0.6)
    self.assertAlmostEqual(out['acc_std'], np.std([0.5, 0.7], ddof=1))
    self.assertEqual(out['note'], 'x')
    self.assertNotIn('tag', out)              # differs: per replica only
    self.assertEqual([r['tag'] for r in out['replicas']], ['a', 'b'])
    self.assertIs(combine_rows(rows[:1], [0]), rows[0])


if __name__ == '__main__':
  absltest.main()
