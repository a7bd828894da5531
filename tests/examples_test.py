"""The examples run as a user runs them, on small data: the quickstart's
three federations and the custom rule's check, registration and three
attacks. A run's printed accuracies must be real numbers in [0, 1]."""

import re
import subprocess
import sys

import pytest

from tests import smoke


def run_example(script: str) -> str:
  argv = [sys.executable, script, '--rounds=1',
          f'--examples={smoke.SMALL_TRAIN}']
  done = subprocess.run(argv, cwd=smoke.ROOT, capture_output=True,
                        text=True, env=smoke.environment(), timeout=600,
                        check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def accuracies(out: str) -> dict[str, float]:
  found = re.findall(r'^(.*?)\s+test accuracy ([0-9.]+)$', out, re.M)
  return {name.strip(): float(value) for name, value in found}


@pytest.mark.slow
def test_quickstart_runs_three_federations():
  acc = accuracies(run_example('examples/quickstart.py'))
  assert set(acc) == {'fedavg', 'median', 'median under LIE'}
  assert all(0.0 <= a <= 1.0 for a in acc.values()), acc


@pytest.mark.slow
def test_custom_rule_is_checked_registered_and_attacked():
  acc = accuracies(run_example('examples/custom_rule.py'))
  assert set(acc) == {f'sign_vote under {a}'
                      for a in ('sign_flip', 'lie', 'min_max')}, acc
  assert all(0.0 <= a <= 1.0 for a in acc.values()), acc


def test_a_registered_rule_is_a_choice_of_the_runner(tmp_path):
  """--plugins imports the module before the flags exist, so its rule is
  an --aggregator choice; a bad module is named."""
  plugin = tmp_path / 'my_plugin.py'
  plugin.write_text(
      'import fedrobust\n'
      'from fedrobust.aggregators import coordinatewise\n'
      "fedrobust.register_rule('my_median', coordinatewise.median)\n")
  env = dict(smoke.environment(), PYTHONPATH=f'{tmp_path}:{smoke.ROOT}')
  done = subprocess.run(
      [sys.executable, 'experiments/main.py', '--plugins=my_plugin',
       '--aggregator=my_median', '--helpfull'], cwd=smoke.ROOT,
      capture_output=True, text=True, env=env, timeout=300, check=False)
  assert 'my_median' in done.stdout + done.stderr
  bad = subprocess.run(
      [sys.executable, 'experiments/main.py', '--plugins=no_such_plugin'],
      cwd=smoke.ROOT, capture_output=True, text=True, env=env, timeout=300,
      check=False)
  assert bad.returncode != 0
  assert '--plugins=no_such_plugin' in bad.stderr
