r"""Each seed paper's headline cells at the paper's schedule, within a budget.

  python experiments/paper_suite.py --budget_seconds=3600 --out=runs/paper_suite

The cells, their priority and their estimated device time are declared in
experiments/suites/paper_suite.json (a cell is a flag list, like a preset).
Cells run in priority order, each as its own `experiments/main.py` process
with a workdir of its own (a finished cell is read back, not rerun; an
interrupted one resumes), while the estimated time of the next cell fits in
what is left of --budget_seconds; the others are listed as skipped.
`--scale=tiny` appends the suite's `tiny` flags and the cell's own to every
cell (one round on a few hundred examples), which is how the test suite
runs it on a CPU.

Writes <out>/paper_suite.md and .csv: per cell and metric, our value (the
mean of the last `last_k` evaluations), the paper's number beside it, the
schedule, the data (substitutes named) and the device.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time

from absl import app, flags

if __package__ in (None, ''):   # run as a script: make `experiments` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
# pylint: disable=g-import-not-at-top
from experiments import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE = os.path.join(ROOT, 'experiments', 'suites', 'paper_suite.json')

flags.DEFINE_string('suite', SUITE, 'The suite file (JSON).')
flags.DEFINE_float('budget_seconds', 3600.0, 'Device time the suite may '
                   'use; a cell starts only if its estimate fits in what is '
                   'left (at --scale=tiny the measured times count).')
flags.DEFINE_enum('scale', 'paper', ['paper', 'tiny'], 'paper: the cells as '
                  'declared; tiny: with the suite\'s tiny flags appended.')
flags.DEFINE_string('only', '', 'Comma-separated cell names (default: all).')
flags.DEFINE_integer('seeds', 1, 'Seeds per cell, run as replicas of one '
                     'program (main.py --num_seeds); the table gives mean '
                     '± std over them. The budget counts a cell S times.',
                     lower_bound=1)
flags.DEFINE_string('out', os.path.join(ROOT, 'runs', 'paper_suite'),
                    'Where the tables and the cells\' workdirs go.')
flags.DEFINE_integer('timeout_seconds', 0, 'Kill a cell after this long '
                     '(0: no limit); it resumes on the next call.')
FLAGS = flags.FLAGS


def load_suite(path: str, only: str) -> tuple[list[dict], list[str]]:
  """(cells in priority order, the tiny flags)."""
  with open(path) as f:
    suite = json.load(f)
  cells = sorted(suite['cells'], key=lambda c: c['priority'])
  names = [n for n in only.split(',') if n]
  unknown = set(names) - {c['name'] for c in cells}
  if unknown:
    raise app.UsageError(f'--only: no cell {sorted(unknown)} in {path}; '
                         f'cells: {[c["name"] for c in cells]}')
  if names:
    cells = [c for c in cells if c['name'] in names]
  return cells, suite.get('tiny', [])


def run_cell(cell: dict, workdir: str, extra: list[str]) -> dict:
  """Runs (or reads back, or resumes) one cell; its summary and status."""
  path = os.path.join(workdir, 'summary.json')
  if os.path.exists(path):
    with open(path) as f:
      done = json.load(f)
    if done.get('status') == 'completed':
      return {'summary': done, 'status': 'ok', 'seconds': 0.0,
              'note': 'read back'}
  argv = ([sys.executable, os.path.join(ROOT, 'experiments', 'main.py')] +
          cell['flags'] + extra + [f'--workdir={workdir}'])
  start = time.perf_counter()
  try:
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                          timeout=FLAGS.timeout_seconds or None,
                          check=False)
  except subprocess.TimeoutExpired:
    return {'status': 'timeout', 'seconds': time.perf_counter() - start,
            'note': f'killed after {FLAGS.timeout_seconds}s; rerun resumes'}
  seconds = time.perf_counter() - start
  if done.returncode != 0 or not os.path.exists(path):
    tail = (done.stderr.strip().splitlines() or ['no output'])[-1]
    return {'status': 'failed', 'seconds': seconds, 'note': tail[:200]}
  with open(path) as f:
    return {'summary': json.load(f), 'status': 'ok', 'seconds': seconds,
            'note': ''}


def ours(rows_path: str, metric: str, last_k: int
         ) -> tuple[float | None, float | None]:
  """The mean of `metric` over the last `last_k` evaluated rounds, and
  with several seeds (replicas) the std over the seeds of each seed's
  mean (ddof 1); (value, None) for one seed."""
  if not os.path.exists(rows_path):
    return None, None
  with open(rows_path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  seeds = len(rows[-1].get('replicas', ())) if rows else 0
  each = ([[r['replicas'][i] for r in rows] for i in range(seeds)]
          if seeds > 1 else [rows])
  means = []
  for own in each:
    values = [r[metric] for r in own if r.get(metric) is not None]
    if values:
      means.append(sum(values[-last_k:]) / len(values[-last_k:]))
  if len(means) != len(each):
    return None, None
  mean = float(sum(means) / len(means))
  if len(means) == 1:
    return mean, None
  return mean, float((sum((m - mean) ** 2 for m in means) /
                      (len(means) - 1)) ** 0.5)


def table_rows(cell: dict, result: dict, workdir: str) -> list[dict]:
  """One row per metric of a cell."""
  summary = result.get('summary', {})
  config = summary.get('config', {})
  device = summary.get('device', {})
  schedule = (f"{config.get('num_rounds', '?')} rounds x "
              f"{config.get('local_epochs', '?')} local epochs"
              if config else '')
  paper = reference.cell_values(cell)
  out = []
  for metric in cell['metrics']:
    value, spread = (ours(os.path.join(workdir, 'metrics.jsonl'), metric,
                          cell.get('last_k', 1)) if result['status'] == 'ok'
                     else (None, None))
    out.append({'priority': cell['priority'], 'cell': cell['name'],
                'paper': f"{cell['paper']} {cell['table']}",
                'setting': f"{cell['paper_method']}, {cell['paper_setting']}",
                'metric': metric, 'ours': value, 'ours_std': spread,
                'seeds': FLAGS.seeds, 'paper_value':
                paper.get(metric), 'schedule': schedule,
                'data': cell['data'],
                'device': (f"{device['device_kind']} ({device['backend']})"
                           if device else ''),
                'seconds': round(result['seconds'], 1),
                'status': result['status'], 'note': result['note']})
  return out


def _pct(value, spread=None) -> str:
  if value is None:
    return ''
  return f'{100 * value:.2f}' + ('' if spread is None else
                                 f' ± {100 * spread:.2f}')


def write_tables(out: str, rows: list[dict], budget: float,
                 spent: float) -> None:
  """paper_suite.csv (every field) and paper_suite.md (the table)."""
  os.makedirs(out, exist_ok=True)
  fields = list(rows[0]) if rows else ['cell']
  with open(os.path.join(out, 'paper_suite.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
  lines = [f'<!-- generated by experiments/paper_suite.py --scale='
           f'{FLAGS.scale} --seeds={FLAGS.seeds}; percent'
           + ('; ours: mean ± std over the seeds' if FLAGS.seeds > 1
              else '') + f'; budget {budget:.0f} s, used {spent:.0f} s -->',
           '| # | cell | paper | setting | metric | ours | paper | schedule '
           '| data | device | s | status |',
           '|' + '---|' * 12]
  for r in rows:
    status = r['status'] + (f": {r['note']}" if r['note'] else '')
    lines.append(
        f"| {r['priority']} | {r['cell']} | {r['paper']} | {r['setting']} | "
        f"{r['metric']} | {_pct(r['ours'], r['ours_std'])} | "
        f"{_pct(r['paper_value'])} | "
        f"{r['schedule']} | {r['data']} | {r['device']} | {r['seconds']} | "
        f'{status} |')
  with open(os.path.join(out, 'paper_suite.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  cells, tiny = load_suite(FLAGS.suite, FLAGS.only)
  extra = tiny if FLAGS.scale == 'tiny' else []
  if FLAGS.seeds > 1:
    extra = extra + [f'--num_seeds={FLAGS.seeds}']
  spent, rows = 0.0, []
  for cell in cells:
    workdir = os.path.join(FLAGS.out, FLAGS.scale, cell['name'] + (
        f'_seeds{FLAGS.seeds}' if FLAGS.seeds > 1 else ''))
    estimate = (0.0 if FLAGS.scale == 'tiny' else
                cell['device_seconds'] * FLAGS.seeds)
    if spent + estimate > FLAGS.budget_seconds:
      result = {'status': 'skipped', 'seconds': 0.0,
                'note': f'budget: needs about {estimate:.0f} s, '
                        f'{FLAGS.budget_seconds - spent:.0f} s left'}
    else:
      print(f"[{cell['priority']}] {cell['name']} ...", flush=True)
      result = run_cell(cell, workdir, extra + (
          cell.get('tiny', []) if FLAGS.scale == 'tiny' else []))
      spent += result['seconds']
      print(f"    {result['status']} in {result['seconds']:.0f}s "
            f"{result['note']}", flush=True)
    rows += table_rows(cell, result, workdir)
    write_tables(FLAGS.out, rows, FLAGS.budget_seconds, spent)
  print(f"wrote {os.path.join(FLAGS.out, 'paper_suite.md')}")
  if any(r['status'] in ('failed', 'timeout') for r in rows):
    sys.exit(1)


if __name__ == '__main__':
  app.run(main)
