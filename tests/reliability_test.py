"""Reliability: no silent corruption, no silent NaN, no lost work (issue 11).

Each finding of the issue is a test here (or in data_test / sweep_test,
named below) that failed before the fix. The suite's slow cases (kill -9
points, bit flips in every kind of checkpoint file, bad clients under every
aggregator) run a random subset in CI and all of them with

  FEDROBUST_RELIABILITY=full .venv/bin/python -m pytest tests/reliability_test.py

The subset is drawn from FEDROBUST_RELIABILITY_SEED (default: today's
date), which every skipped case names, so a failing subset can be re-run.
"""

import datetime
import functools
import glob
import json
import os
import random
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from experiments import train
from experiments import workdir as workdir_lib
from fedrobust import aggregators, engine, models
from fedrobust.checkpoint import CheckpointError
from fedrobust.cohort import single_cohort
from fedrobust.methods import get_method
from fedrobust.transforms import identity
from tests.engine_test import toy_data
from tests.main_test import (ROOT, IdxDataTestCase, base_config, finish,
                             flags_for, kill_after_checkpoint)

FULL = os.environ.get('FEDROBUST_RELIABILITY') == 'full'
SEED = int(os.environ.get('FEDROBUST_RELIABILITY_SEED',
                          datetime.date.today().strftime('%Y%m%d')))


def sampled(cases, k):
  """All cases with FEDROBUST_RELIABILITY=full, else k of them."""
  cases = list(cases)
  return cases if FULL else random.Random(SEED).sample(cases, min(k, len(
      cases)))


def strict_rows(path):
  """metrics.jsonl parsed as strict JSON (NaN/Infinity are errors)."""
  def refuse(token):
    raise ValueError(f'non-strict JSON token {token}')
  with open(path) as f:
    return [json.loads(line, parse_constant=refuse) for line in f]


class _Data(IdxDataTestCase):

  def config(self, workdir=None, **overrides):
    return base_config(self.data_dir, workdir or
                       self.create_tempdir().full_path, **overrides)


# ----------------------------------------------------------------------------
# The ten findings.
# ----------------------------------------------------------------------------


class FindingsTest(_Data, parameterized.TestCase):

  def _run_to(self, workdir, rounds, **kw):
    return train.run(self.config(workdir, num_rounds=rounds,
                                 checkpoint_every=1, **kw))

  # 1. A bit-flipped checkpoint restored silently.
  @parameterized.parameters(0.1, 0.5, 0.9)
  def test_1_bit_flip_in_newest_step_falls_back_exactly(self, where):
    straight = self._run_to(self.create_tempdir().full_path, 6)
    workdir = self.create_tempdir().full_path
    self._run_to(workdir, 4)
    files = [f for f in glob.glob(f'{workdir}/checkpoints/4/**/d/*',
                                  recursive=True) if os.path.isfile(f)]
    target = max(files, key=os.path.getsize)       # the array data
    with open(target, 'r+b') as f:
      data = bytearray(f.read())
      data[int(where * (len(data) - 1))] ^= 0x10
      f.seek(0)
      f.write(data)
    with self.assertLogs(level='WARNING') as logs:
      resumed = self._run_to(workdir, 6)
    self.assertTrue(any('checkpoint step 4' in m and 'bad' in m
                        for m in logs.output), logs.output)
    self.assertTrue(os.path.isdir(f'{workdir}/checkpoints/.broken/4'))
    self.assertEqual(resumed['params_sha256'], straight['params_sha256'])
    self.assertEqual([r['round'] for r in strict_rows(
        f'{workdir}/metrics.jsonl')], [1, 2, 3, 4, 5, 6])

  # 2. A destroyed model ended with exit code 0.
  def test_2_huge_scaling_attack_stops_naming_the_round(self):
    workdir = self.create_tempdir().full_path
    attack = dict(attack='scaling', attack_kwargs='{"factor": 1e38}',
                  malicious_fraction=0.25, clients_per_round=0,
                  aggregator='weighted_mean', num_rounds=3)
    with self.assertRaisesRegex(train.DivergenceError,
                                r'not finite.*after round (\d+)') as ctx:
      train.run(self.config(workdir, **attack))
    with open(f'{workdir}/summary.json') as f:
      summary = json.load(f)
    self.assertEqual(summary['status'], 'diverged')
    self.assertIn(f"round {summary['diverged_round']}", str(ctx.exception))
    rows = strict_rows(f'{workdir}/metrics.jsonl')     # strict JSON
    self.assertEqual(rows[-1]['nonfinite_model'], 1.0)
    self.assertIn('train_loss', rows[-1]['nonfinite'])
    self.assertIsNone(rows[-1]['train_loss'])
    self.assertFalse(os.path.isdir(
        f"{workdir}/checkpoints/{summary['diverged_round']}"))

    skipped = train.run(self.config(on_divergence='skip_round', **attack))
    self.assertEqual(skipped['status'], 'completed')
    self.assertNotEmpty(skipped['skipped_rounds'])
    self.assertTrue(np.isfinite(skipped['final']['test_accuracy']))

  def test_2_cli_exit_code_is_nonzero(self):
    config = self.config(attack='scaling', attack_kwargs='{"factor": 1e39}',
                         malicious_fraction=0.25, clients_per_round=0,
                         num_rounds=1)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, 'experiments', 'main.py')] +
        flags_for(config), capture_output=True, text=True, timeout=300,
        cwd=ROOT)
    self.assertEqual(proc.returncode, 3, proc.stderr[-2000:])
    self.assertIn('not finite', proc.stderr)
    self.assertIn('run diverged', proc.stdout)

  def test_2_nonfinite_learning_rates_are_refused(self):
    for key in ('local_lr', 'server_lr', 'weight_decay', 'momentum',
                'dirichlet_alpha'):
      for value in (float('nan'), float('inf')):
        workdir = self.create_tempdir().full_path
        with self.assertRaisesRegex(ValueError, f'--{key}'):
          train.run(self.config(workdir, **{key: value}))
        self.assertEqual(os.listdir(workdir), [])

  # 3. --overwrite deleted any directory holding a config.json.
  def test_3_overwrite_removes_only_runner_files(self):
    workdir = self.create_tempdir().full_path
    self._run_to(workdir, 1)
    notes = os.path.join(workdir, 'notes.txt')
    with open(notes, 'w') as f:
      f.write('mine')
    with self.assertRaisesRegex(train.WorkdirError,
                                "notes.txt.*--force_overwrite"):
      self._run_to(workdir, 1, local_lr=0.1, overwrite=True)
    self.assertTrue(os.path.isdir(f'{workdir}/checkpoints/1'))
    summary = self._run_to(workdir, 1, local_lr=0.1, overwrite=True,
                           force_overwrite=True)
    self.assertEqual(summary['config']['local_lr'], 0.1)
    with open(notes) as f:
      self.assertEqual(f.read(), 'mine')

  # 4. No lock on the workdir.
  def test_4_a_second_run_on_a_locked_workdir_is_refused(self):
    workdir = self.create_tempdir().full_path
    with workdir_lib.Lock(workdir):
      with self.assertRaisesRegex(train.WorkdirError, 'in use by another '
                                  f'run \\(pid {os.getpid()}'):
        self._run_to(workdir, 1)
    self._run_to(workdir, 1)         # free again

  # 5. When no checkpoint restored, all were deleted and the run restarted.
  def test_5_nothing_restores_is_an_error_and_nothing_is_deleted(self):
    workdir = self.create_tempdir().full_path
    self._run_to(workdir, 2)
    for path in glob.glob(f'{workdir}/checkpoints/.integrity/*'):
      with open(path, 'w') as f:
        f.write('0' * 64)
    with self.assertRaisesRegex(CheckpointError, 'no checkpoint.*good'):
      self._run_to(workdir, 3)
    self.assertEqual(sorted(os.listdir(f'{workdir}/checkpoints/.broken')),
                     ['1', '1.files.json', '1.ledger.json', '1.sha256',
                      '2', '2.files.json', '2.ledger.json', '2.sha256'])
    self.assertEqual(len(strict_rows(f'{workdir}/metrics.jsonl')), 2)
    summary = self._run_to(workdir, 2, overwrite=True)   # explicit restart
    self.assertEqual(summary['rounds_completed'], 2)
    self.assertTrue(os.path.isdir(f'{workdir}/checkpoints/.broken/2'))

  # 6. Out-of-range labels: data_test.IdxTest.test_out_of_range_labels...

  # 7. A refused config poisoned the workdir.
  def test_7_refused_config_writes_nothing(self):
    workdir = self.create_tempdir().full_path
    for bad, pattern in ((dict(attack='badnets'), '--malicious_fraction'),
                         (dict(aggregator='krum', num_byzantine=1),
                          '2f\\+3')):
      with self.assertRaisesRegex(ValueError, pattern):
        self._run_to(workdir, 1, **bad)
      self.assertEqual(os.listdir(workdir), [])
    self._run_to(workdir, 1)           # the corrected command runs

  # 8. Tracebacks instead of messages.
  def test_8_clear_errors(self):
    for kwargs, pattern in (('{"bogus": 1}', '--aggregator_kwargs.*bogus'),
                            ('{"iters": "3"}', '--aggregator_kwargs iters'),
                            ('[1, 2]', '--aggregator_kwargs: must be a JSON '
                             'object')):
      with self.assertRaisesRegex(ValueError, pattern):
        self._run_to(None, 1, aggregator='geometric_median',
                     aggregator_kwargs=kwargs)
    workdir = self.create_tempdir().full_path
    self._run_to(workdir, 2)
    metrics = f'{workdir}/metrics.jsonl'
    with open(metrics) as f:
      lines = f.readlines()
    with open(metrics, 'w') as f:
      f.write(lines[0] + '[1, 2]\n' + lines[1])
    with self.assertRaisesRegex(train.WorkdirError,
                                f'{metrics}:2 is not a metrics row'):
      self._run_to(workdir, 3)
    with open(f'{workdir}/config.json', 'w') as f:
      f.write('[1, 2, 3]')
    with self.assertRaisesRegex(train.WorkdirError,
                                'config.json holds a list, not a JSON '
                                'object'):
      self._run_to(workdir, 3)
    # A corrupt .gz: data_test.IdxTest.test_truncated_gzip_names_the_file.

  # 9. Symlinks were followed when writing *.tmp files (sweep names:
  #    sweep_test.test_sweep_names_are_safe_file_names).
  def test_9_planted_symlinks_are_not_followed(self):
    workdir = self.create_tempdir().full_path
    outside = self.create_tempdir().full_path
    self._run_to(workdir, 1)
    for name in ('summary.json', 'config.json', 'metrics.jsonl'):
      target = os.path.join(outside, name)
      with open(target, 'w') as f:
        f.write('untouched')
      os.symlink(target, os.path.join(workdir, name + '.tmp'))
    self._run_to(workdir, 2)
    for name in ('summary.json', 'config.json', 'metrics.jsonl'):
      with open(os.path.join(outside, name)) as f:
        self.assertEqual(f.read(), 'untouched')
      self.assertFalse(os.path.islink(os.path.join(workdir, name)))
    self.assertEqual(len(strict_rows(f'{workdir}/metrics.jsonl')), 2)

  # 10. Smaller findings.
  def test_10_deleted_metrics_are_noticed(self):
    workdir = self.create_tempdir().full_path
    self._run_to(workdir, 2)
    os.remove(f'{workdir}/metrics.jsonl')
    with self.assertLogs(level='WARNING') as logs:
      summary = self._run_to(workdir, 3)
    self.assertTrue(any('metrics.jsonl is missing' in m
                        for m in logs.output))
    self.assertEqual(summary['metrics_missing_before_round'], 3)

  def _prepare_in_tempdir(self):
    """(the config defaults in a fresh workdir, workdir.prepare bound to
    the runner's key sets)."""
    workdir = self.create_tempdir().full_path
    defaults = dict(train.config_lib.defaults(), workdir=workdir)
    return defaults, functools.partial(
        workdir_lib.prepare, defaults=defaults,
        resumable=train.RESUMABLE_KEYS, execution=train.EXECUTION_KEYS,
        normalize=train.normalize)

  def test_10_explicit_default_data_dir_is_the_same_config(self):
    from fedrobust.data import DEFAULT_FASHION_MNIST_DIR  # pylint: disable=g-import-not-at-top
    defaults, prepare = self._prepare_in_tempdir()
    prepare(dict(defaults, data_dir=None))
    prepare(dict(defaults, data_dir=DEFAULT_FASHION_MNIST_DIR))  # no error
    with self.assertRaises(train.ConfigMismatchError):
      prepare(dict(defaults, data_dir='/elsewhere'))

  def test_10_execution_settings_may_change_on_resume(self):
    """A method setting declared execution=True (how, not what) may change
    on resume, e.g. runs saved with --horus_sv_method=svd before 'auto'
    became the default; a result-changing setting may not."""
    self.assertIn('horus_sv_method', train.EXECUTION_KEYS)
    self.assertIn('sdfc_fisher_impl', train.EXECUTION_KEYS)
    self.assertNotIn('horus_percentile', train.EXECUTION_KEYS)
    defaults, prepare = self._prepare_in_tempdir()
    prepare(dict(defaults, method='horus', horus_sv_method='svd'))
    with self.assertLogs(level='WARNING') as logs:
      prepare(dict(defaults, method='horus', horus_sv_method='auto'))
    self.assertTrue(any('horus_sv_method' in m for m in logs.output))
    with self.assertRaisesRegex(train.ConfigMismatchError,
                                'horus_percentile'):
      prepare(dict(defaults, method='horus', horus_sv_method='auto',
                   horus_percentile=90.0))

  def test_10_fewer_rounds_on_resume_is_refused(self):
    workdir = self.create_tempdir().full_path
    self._run_to(workdir, 3)
    with self.assertRaisesRegex(train.WorkdirError,
                                '--num_rounds=2 is below round 3'):
      self._run_to(workdir, 2)


# ----------------------------------------------------------------------------
# The reliability suite.
# ----------------------------------------------------------------------------


FILE_KINDS = ('_CHECKPOINT_METADATA', 'commit_success.txt',
              'default/_METADATA', 'default/_sharding',
              'default/manifest.ocdbt', 'default/array_metadatas/process_0',
              'default/ocdbt.process_0/manifest.ocdbt',
              'default/ocdbt.process_0/d', 'default/d', '.integrity')


def kind_files(step_dir, kind):
  if kind == '.integrity':
    step = os.path.basename(step_dir)
    return [os.path.join(os.path.dirname(step_dir), '.integrity',
                         f'{step}.sha256')]
  path = os.path.join(step_dir, kind)
  if os.path.isdir(path):
    return sorted(os.path.join(path, f) for f in os.listdir(path))
  return [path] if os.path.isfile(path) else []


class CheckpointFlipTest(_Data, parameterized.TestCase):
  """A flipped bit in any file of the newest step: the resume either
  restores a state that matches its content hash, or sets the step aside
  and falls back; either way it ends bitwise equal to a straight run."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._ref = tempfile.TemporaryDirectory()
    cls.reference = train.run(base_config(
        cls.data_dir, cls._ref.name, num_rounds=4, checkpoint_every=1))

  @classmethod
  def tearDownClass(cls):
    cls._ref.cleanup()
    super().tearDownClass()

  @parameterized.parameters(*FILE_KINDS)
  def test_flip(self, kind):
    if kind not in sampled(FILE_KINDS, 3):
      self.skipTest(f'not in the CI subset (FEDROBUST_RELIABILITY_SEED='
                    f'{SEED}; FEDROBUST_RELIABILITY=full runs all)')
    workdir = self.create_tempdir().full_path
    train.run(self.config(workdir, num_rounds=3, checkpoint_every=1))
    files = kind_files(f'{workdir}/checkpoints/3', kind)
    self.assertNotEmpty(files, kind)
    rng = np.random.default_rng(len(kind))
    for path in files:
      with open(path, 'r+b') as f:
        data = bytearray(f.read())
        if data:
          data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
          f.seek(0)
          f.write(data)
    resumed = train.run(self.config(workdir, num_rounds=4,
                                    checkpoint_every=1))
    self.assertEqual(resumed['params_sha256'],
                     self.reference['params_sha256'], kind)


class KillTest(_Data):

  def test_random_kill_dash_nine_points_resume_bitwise(self):
    """SIGKILL at random points (mid-round, mid-save, mid-delete), each
    followed by a resume; the run ends bitwise equal to a straight run."""
    kills = 10 if FULL else 2
    config = self.config(num_rounds=40, eval_every=10, checkpoint_every=1,
                         local_epochs=2)
    reference = train.run(dict(config, workdir=self.create_tempdir(
    ).full_path, checkpoint_every=40))
    workdir = self.create_tempdir().full_path
    cmd = [sys.executable, os.path.join(ROOT, 'experiments', 'main.py')]
    cmd += flags_for(dict(config, workdir=workdir))
    rng = random.Random(SEED)
    targets = sorted(rng.sample(range(2, 38), kills))
    ckpt = os.path.join(workdir, 'checkpoints')
    killed = []
    for target in targets:
      proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, cwd=ROOT)
      if kill_after_checkpoint(proc, ckpt, target,
                               pause=rng.uniform(0.0, 0.05)):
        killed.append(target)
    self.assertLen(killed, kills)
    self.assertEqual(finish(cmd, workdir)['params_sha256'],
                     reference['params_sha256'])
    rounds = [r['round'] for r in strict_rows(f'{workdir}/metrics.jsonl')]
    self.assertEqual(rounds, [10, 20, 30, 40])


# fdagg needs SDFC's scores; the server-data rules need a server model
# (their finiteness is tested in aggregators_server_test).
RULES = sorted(name for name in aggregators.AGGREGATORS
               if 'server_data' not in aggregators.needs_of(name).provides
               and name not in ('rfa', 'fdagg'))
BAD = ('nan', 'inf', '1e38')
NON_ROBUST = ('mean', 'weighted_mean', 'twafl', 'sasgd',
              'federaser', 'crab')
C = 7      # Bulyan with f = 1 needs n >= 4f + 3


@functools.lru_cache(maxsize=None)
def bad_client_round(rule):
  """A jitted FedAvg round (7 clients, one attacker) under `rule`; the
  attacker's update is replaced by the value passed in."""
  model = models.get_model('mlp', num_classes=3, input_shape=(2, 2, 1),
                           hidden=(4,))
  local = engine.LocalConfig(batch_size=4, num_epochs=1, steps_per_epoch=1)
  needs = aggregators.needs_of(rule)
  kwargs = {'num_clients': C} if needs.per_client else {}
  if 'forget' in needs.provides:
    kwargs.update(forget=np.arange(C) == 2, unlearn_round=2)
  if rule == 'deepsight':          # runs the models on a few random inputs
    kwargs.update(apply_fn=model.apply, input_shape=model.input_shape,
                  num_seeds=1, num_samples=16, sample_batch=16)
  agg = aggregators.get_aggregator(rule, num_byzantine=1, **kwargs)
  method = get_method('fedavg', cohorts=single_cohort(
      model, identity(model), C, C), local=local,
                      optimizer=engine.sgd(learning_rate=0.1),
                      aggregator=agg)

  def attack(flat, is_mal, mask, key, value):
    del mask, key
    return jnp.where(is_mal[:, None], value, flat)

  def step(state, data, value):
    threat = engine.Threat(
        malicious=jnp.arange(C) == 2,
        num_malicious=1,
        model_attack=functools.partial(attack, value=value))
    return engine.make_round_step(method, engine.RoundConfig(
        num_clients=C, clients_per_round=C, strategy='vmap'),
                                  threat=threat)(state, data, ())

  state = engine.init_server_state(method, model.init(jax.random.key(0)),
                                   C, seed=0)
  return jax.jit(step), state


class LegacyLayoutTest(absltest.TestCase):

  def test_a_checkpoint_without_the_attack_field_restores(self):
    from fedrobust.checkpoint import Checkpointer
    from fedrobust.types import (LegacyServerState, ServerState,
                                 legacy_server_state)
    d = tempfile.mkdtemp()
    old = LegacyServerState(jnp.int32(3), ({'w': jnp.arange(3.0)},),
                            {'m': jnp.ones(2)}, jnp.zeros(2, jnp.uint32))
    ck = Checkpointer(d, keep=2)
    ck.save(3, old)
    ck.close()
    like = ServerState(jnp.int32(0), ({'w': jnp.zeros(3)},),
                       {'m': jnp.zeros(2)}, jnp.zeros(2, jnp.uint32))
    ck = Checkpointer(d, keep=2)
    step, state = ck.restore_latest(like, legacy=legacy_server_state(like))
    ck.close()
    self.assertEqual(step, 3)
    self.assertIsInstance(state, ServerState)
    self.assertEqual(state.attack, ())
    np.testing.assert_array_equal(state.params[0]['w'], [0.0, 1.0, 2.0])
    # A state with an attack has no legacy layout to fall back to.
    self.assertEqual(legacy_server_state(like._replace(
        attack={'k': jnp.int32(0)})), ())


  def test_a_fedhan_state_without_the_score_field_restores(self):
    """A FedHAN rule state checkpointed before FedHANState.score existed
    (2026-12-01) restores, inside a server state, into the default
    layout (score None); a 'clients' state, which needs the scores, has
    no legacy layout to fall back to."""
    from fedrobust.methods.fedhan import rule as fedhan_lib
    from fedrobust.aggregators import get_aggregator
    from fedrobust.checkpoint import Checkpointer
    from fedrobust.types import ServerState
    params = {'w': jnp.zeros(3)}
    agg = get_aggregator('fedhan', num_clients=4, rollback=2)
    new = agg.init(params)
    self.assertIsNone(new.score)
    old = fedhan_lib.FedHANStateV1(*new[:7])._replace(
        strikes=jnp.array([0, 2, 0, 1], jnp.int32))
    wrap = lambda s: ServerState(jnp.int32(5), (params,), {'rule': s},
                                 jnp.zeros(2, jnp.uint32))
    d = tempfile.mkdtemp()
    ck = Checkpointer(d, keep=2)
    ck.save(5, wrap(old))
    ck.close()
    like = jax.eval_shape(lambda: wrap(new))
    ck = Checkpointer(d, keep=2)
    step, state = ck.restore_latest(like,
                                    legacy=fedhan_lib.legacy_states(like))
    ck.close()
    self.assertEqual(step, 5)
    rule = state.method_state['rule']
    self.assertIsInstance(rule, fedhan_lib.FedHANState)
    self.assertIsNone(rule.score)
    np.testing.assert_array_equal(rule.strikes, [0, 2, 0, 1])
    self.assertEqual(jax.tree.structure(rule), jax.tree.structure(new))
    scored = get_aggregator('fedhan', num_clients=4,
                            score_set='clients').init(params)
    self.assertEqual(fedhan_lib.legacy_states(wrap(scored)), ())


class RestoreStepTest(absltest.TestCase):

  def test_a_named_step_restores_and_a_bad_one_stays_in_place(self):
    from fedrobust.checkpoint import CheckpointError, Checkpointer
    d = tempfile.mkdtemp()
    ck = Checkpointer(d, keep=3)
    for step in (1, 2):
      ck.save(step, {'w': jnp.full(3, float(step))})
    np.testing.assert_array_equal(
        ck.restore(1, {'w': jnp.zeros(3)})['w'], [1.0, 1.0, 1.0])
    with self.assertRaisesRegex(CheckpointError, r'no step 5 \(steps: '
                                r'\[1, 2\]\)'):
      ck.restore(5, {'w': jnp.zeros(3)})
    # Another shape is refused (orbax alone would hand back the saved
    # one), so is another tree, and neither step is moved aside (a reader
    # never changes the run).
    with self.assertRaisesRegex(CheckpointError, r"step 2 .* is bad: has "
                                r"\['w'\] of shape \(3,\), expected \(4,\)"):
      ck.restore(2, {'w': jnp.zeros(4)})
    with self.assertRaisesRegex(CheckpointError, 'step 2 .* does not '
                                'restore'):
      ck.restore(2, {'v': jnp.zeros(3)})
    self.assertEqual(ck.steps(), [1, 2])
    np.testing.assert_array_equal(ck.restore_latest({'w': jnp.zeros(3)})[1][
        'w'], [2.0, 2.0, 2.0])
    # A resume, by contrast, sets steps of another shape aside (before the
    # check, the 3-vector came back as the 4-vector's state).
    with self.assertRaisesRegex(CheckpointError, r'no checkpoint .* \(steps '
                                r'\[2, 1\] failed'):
      ck.restore_latest({'w': jnp.zeros(4)})
    ck.close()


class BadClientTest(parameterized.TestCase):
  """One client sends NaN, Inf or 1e38: every rule that claims robustness
  keeps the global model finite (the means claim none)."""

  @parameterized.product(rule=RULES, bad=BAD)
  def test_model_stays_finite(self, rule, bad):
    cases = [(r, b) for r in RULES for b in BAD]
    if (rule, bad) not in sampled(cases, 8):
      self.skipTest(f'not in the CI subset (FEDROBUST_RELIABILITY_SEED='
                    f'{SEED}; FEDROBUST_RELIABILITY=full runs all)')
    step, state = bad_client_round(rule)
    value = {'nan': jnp.nan, 'inf': jnp.inf, '1e38': 1e38}[bad]
    data = toy_data([4] * C, 4, seed=2)
    new_state, metrics = step(state, data, jnp.float32(value))
    finite = all(bool(jnp.all(jnp.isfinite(l)))
                 for l in jax.tree.leaves(new_state.params))
    if rule in NON_ROBUST:
      self.assertFalse(finite and bad != '1e38', 'a mean absorbed it?')
      self.assertEqual(float(metrics['nonfinite_model']), float(not finite))
    else:
      self.assertTrue(finite, f'{rule} let a {bad} client through')
      self.assertEqual(float(metrics['nonfinite_model']), 0.0)


if __name__ == '__main__':
  absltest.main()
