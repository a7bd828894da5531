"""experiments/paper_suite.py at tiny scale: cells run in priority order
as separate runs, the table puts the paper's number beside ours, a cell
over the budget is skipped and listed, and a finished cell is read back."""

import csv
import json
import os
import subprocess
import sys

import pytest

from tests import smoke

SUITE = os.path.join(smoke.ROOT, 'experiments', 'suites', 'paper_suite.json')


def run_suite(out, *args):
  done = subprocess.run(
      [sys.executable, 'experiments/paper_suite.py', f'--out={out}', *args],
      cwd=smoke.ROOT, capture_output=True, text=True,
      env=smoke.environment(), timeout=900, check=False)
  with open(os.path.join(out, 'paper_suite.csv')) as f:
    return done, list(csv.DictReader(f))


def test_every_cell_names_its_paper_row_and_data():
  from experiments import reference  # pylint: disable=g-import-not-at-top
  with open(SUITE) as f:
    cells = json.load(f)['cells']
  assert [c['priority'] for c in cells] == sorted(c['priority']
                                                   for c in cells)
  papers = {c['paper'] for c in cells}
  assert papers == {'SDFC', 'Horus', 'FedHAN', 'RFD-LoRA', 'HiLoRA'}
  for cell in cells:
    values = reference.cell_values(cell)      # raises on a missing row
    assert all(v is not None for v in values.values()), cell['name']
    assert cell['data'] and cell['device_seconds'] > 0


@pytest.mark.slow
def test_tiny_suite_runs_within_its_budget(tmp_path):
  out = str(tmp_path / 'suite')
  cells = 'fedhan_t2_trim_fedhan,sdfc_t5_b05_m30_dnc'
  done, rows = run_suite(out, '--scale=tiny', f'--only={cells}')
  assert done.returncode == 0, done.stderr[-2000:]
  # Priority order, one row per metric, the paper's number beside ours.
  assert [r['cell'] for r in rows] == (['sdfc_t5_b05_m30_dnc'] * 3 +
                                       ['fedhan_t2_trim_fedhan'] * 3)
  assert all(r['status'] == 'ok' for r in rows), rows
  assert all(0.0 <= float(r['ours']) <= 1.0 for r in rows)  # fractions
  dnc = {r['metric']: r for r in rows if r['cell'].endswith('dnc')}
  assert float(dnc['backdoor_failure_rate']['paper_value']) == \
      pytest.approx(0.8922)
  assert float(rows[-3]['paper_value']) == pytest.approx(1.0)  # DACC 1.00
  # Read back, not rerun; and a budget too small skips every cell.
  again, rows = run_suite(out, '--scale=tiny', f'--only={cells}')
  assert again.returncode == 0
  assert {r['note'] for r in rows} == {'read back'}
  _, rows = run_suite(str(tmp_path / 'none'), '--budget_seconds=60',
                      f'--only={cells}')
  assert {r['status'] for r in rows} == {'skipped'}
  assert 'budget: needs about' in rows[0]['note']


@pytest.mark.slow
def test_seeds_give_mean_and_std(tmp_path):
  out = str(tmp_path / 'seeded')
  done, rows = run_suite(out, '--scale=tiny', '--only=sdfc_t5_b05_m30_dnc',
                         '--seeds=2')
  assert done.returncode == 0, done.stderr[-2000:]
  assert all(r['status'] == 'ok' and r['seeds'] == '2' for r in rows), rows
  assert all(float(r['ours_std']) >= 0.0 for r in rows)
  with open(os.path.join(out, 'paper_suite.md')) as f:
    assert ' ± ' in f.read()
