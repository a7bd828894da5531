"""A preempted run loses nothing: SIGTERM / SIGINT end it after the round
in flight, checkpointed, and the same command resumes it to the
uninterrupted run's parameters; a metrics row cut by a crash comes back on
resume."""

import json
import os
import signal
import subprocess
import sys
import time
from unittest import mock

from absl.testing import absltest
import pytest

from experiments import preemption as preemption_lib
from experiments import train
from tests.main_test import ROOT, IdxDataTestCase, base_config, flags_for


def rows_of(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


class PreemptionHandlerTest(absltest.TestCase):

  def test_first_signal_sets_the_flag_and_a_second_would_kill(self):
    before = signal.getsignal(signal.SIGTERM)
    with preemption_lib.Preemption(agree=lambda flag: flag) as p:
      self.assertFalse(p.requested())
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(0.01)                 # the handler runs between bytecodes
      self.assertEqual(p.received, 'SIGTERM')
      self.assertTrue(p.requested())
      # The default action now: a second signal ends the process at once.
      self.assertIs(signal.getsignal(signal.SIGTERM), signal.SIG_DFL)
      self.assertIs(signal.getsignal(signal.SIGINT), signal.SIG_DFL)
    self.assertIs(signal.getsignal(signal.SIGTERM), before)

  def test_a_signal_on_another_process_stops_this_one(self):
    p = preemption_lib.Preemption(agree=lambda flag: True)
    self.assertIsNone(p.received)
    self.assertTrue(p.requested())


@pytest.mark.slow
class PreemptedRunTest(IdxDataTestCase):

  def config(self, **overrides):
    return base_config(self.data_dir, self.create_tempdir().full_path,
                       **overrides)

  def test_sigterm_mid_run_then_resume_is_exact(self):
    config = self.config(num_rounds=40, checkpoint_every=100)
    reference = train.run(dict(config, workdir=self.create_tempdir(
    ).full_path))
    workdir = config['workdir']
    cmd = [sys.executable, os.path.join(ROOT, 'experiments', 'main.py')]
    cmd += flags_for(config)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    metrics = os.path.join(workdir, 'metrics.jsonl')
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
      if os.path.exists(metrics) and len(rows_of(metrics)) >= 2:
        break
      time.sleep(0.005)
    self.assertIsNone(proc.poll(), 'the run ended before the signal')
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    self.assertEqual(proc.returncode, preemption_lib.EXIT_CODE, err[-3000:])
    self.assertIn('run preempted', out)
    self.assertIn('Run the same command again to resume', err)
    stopped = rows_of(metrics)[-1]['round']
    self.assertLess(stopped, 40)
    steps = [int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints'))
             if s.isdigit()]
    self.assertEqual(max(steps), stopped)   # the round in flight, saved
    with open(os.path.join(workdir, 'summary.json')) as f:
      self.assertEqual(json.load(f)['status'], 'preempted')
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    self.assertEqual(done.returncode, 0, done.stderr[-3000:])
    with open(os.path.join(workdir, 'summary.json')) as f:
      summary = json.load(f)
    self.assertEqual(summary['params_sha256'], reference['params_sha256'])
    self.assertEqual([r['round'] for r in rows_of(metrics)],
                     list(range(1, 41)))

  def test_a_stop_agreed_across_processes_checkpoints_that_round(self):
    """What every process does when any of them got the signal."""
    config = self.config(num_rounds=5, checkpoint_every=100)
    calls = []

    def agree(flag):
      del flag
      calls.append(1)
      return len(calls) >= 2             # another process was signalled

    with mock.patch.object(preemption_lib, '_agreed_any', agree):
      with self.assertRaisesRegex(preemption_lib.Preempted,
                                  'after round 2 of 5'):
        train.run(config)
    steps = os.listdir(os.path.join(config['workdir'], 'checkpoints'))
    self.assertIn('2', steps)
    summary = train.run(config)
    straight = train.run(dict(config, workdir=self.create_tempdir(
    ).full_path))
    self.assertEqual(summary['params_sha256'], straight['params_sha256'])


class TornRowTest(IdxDataTestCase):

  def config(self, workdir, **overrides):
    return base_config(self.data_dir, workdir, **overrides)

  def test_a_cut_last_row_is_restored_on_resume(self):
    workdir = self.create_tempdir().full_path
    train.run(self.config(workdir, num_rounds=2))
    metrics = os.path.join(workdir, 'metrics.jsonl')
    original = rows_of(metrics)
    with open(metrics) as f:
      text = f.read()
    cut = text.rstrip('\n').rfind('\n') + 1
    with open(metrics, 'w') as f:       # round 2's row, cut in half
      f.write(text[:cut + (len(text) - cut) // 2])
    with self.assertLogs(level='WARNING') as logs:
      train.run(self.config(workdir, num_rounds=3))
    rows = rows_of(metrics)
    self.assertEqual([r['round'] for r in rows], [1, 2, 3])
    self.assertEqual(rows[1]['restored'], 're-evaluated from the checkpoint')
    for key in ('test_accuracy', 'test_loss', 'train_loss', 'round_seconds',
                'local_accuracy'):
      self.assertEqual(rows[1][key], original[1][key], key)
    self.assertTrue(any('restored it' in m for m in logs.output))
    # TensorBoard shows the restored round once, like metrics.jsonl.
    from tests.tracking_test import read_scalars  # pylint: disable=g-import-not-at-top
    got = read_scalars(os.path.join(workdir, 'tensorboard'))
    self.assertEqual([s for s, _ in got['test_accuracy']], [1, 2, 3])

  def test_older_lost_rows_come_from_rounds_jsonl(self):
    workdir = self.create_tempdir().full_path
    train.run(self.config(workdir, num_rounds=2))
    metrics = os.path.join(workdir, 'metrics.jsonl')
    original = rows_of(metrics)
    os.remove(metrics)
    train.run(self.config(workdir, num_rounds=3))
    rows = rows_of(metrics)
    self.assertEqual([r['round'] for r in rows], [1, 2, 3])
    self.assertNotIn('test_accuracy', rows[0])      # its model is gone
    self.assertEqual(rows[0]['train_loss'], original[0]['train_loss'])
    self.assertIn('rounds.jsonl', rows[0]['restored'])
    self.assertEqual(rows[1]['test_accuracy'], original[1]['test_accuracy'])

  def test_rows_are_written_in_one_call(self):
    from experiments import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
    path = os.path.join(self.create_tempdir().full_path, 'm.jsonl')
    writes = []
    real = os.write

    def counting(fd, data):
      writes.append(len(data))
      return real(fd, data)

    with mock.patch.object(workdir_lib.os, 'write', counting):
      workdir_lib.append_row(path, {'round': 1, 'x': 'y' * 20000})
    self.assertLen(writes, 1)
    self.assertEqual(rows_of(path)[0]['round'], 1)


@pytest.mark.slow
class QuietFallbackTest(IdxDataTestCase):

  def test_a_truncated_step_falls_back_without_a_traceback(self):
    workdir = self.create_tempdir().full_path
    config = base_config(self.data_dir, workdir, num_rounds=2)
    cmd = [sys.executable, os.path.join(ROOT, 'experiments', 'main.py')]
    done = subprocess.run(cmd + flags_for(config), capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    data = [os.path.join(d, f) for d, _, names in os.walk(
        os.path.join(workdir, 'checkpoints', '2')) for f in names
            if os.sep + 'd' + os.sep in os.path.join(d, f)]
    target = max(data, key=os.path.getsize)
    with open(target, 'r+b') as f:
      f.truncate(os.path.getsize(target) // 2)
    done = subprocess.run(cmd + flags_for(dict(config, num_rounds=3)),
                          capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertIn('checkpoint step 2', done.stderr)
    self.assertIn('cut short', done.stderr)
    self.assertNotIn('Traceback', done.stderr + done.stdout)
    straight = train.run(base_config(self.data_dir, self.create_tempdir(
    ).full_path, num_rounds=3))
    with open(os.path.join(workdir, 'summary.json')) as f:
      self.assertEqual(json.load(f)['params_sha256'],
                       straight['params_sha256'])


if __name__ == '__main__':
  absltest.main()
