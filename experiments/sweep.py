r"""Runs a grid of experiments/main.py invocations and tabulates them.

  python experiments/sweep.py --name=backdoor_fmnist \
    --base_flagfile=experiments/configs/threat_backdoor.flags \
    --grid='aggregator=weighted_mean,median,krum' \
    --metrics=test_accuracy,attack_success_rate

Grid syntax: 'flag=v1,v2;flag2=v3,v4' (cartesian product); products
joined by '|' are run as their union. An axis named
in the --axes JSON file is a named axis: each of its values stands for a
list of flags, so one axis can mix methods and aggregators, e.g.
{"defense": {"SDFC": {"flags": ["--method=sdfc"], "paper": "SDFC"},
             "Median": {"flags": ["--aggregator=median"]}}}
("paper" is the method's name in the reference file). Each cell runs
in its own subprocess and workdir (runs/sweeps/<name>/<cell>); a finished
cell is skipped and an interrupted one resumes, so re-running the same
command only does the missing work. A cell whose flags are refused (e.g.
Krum with n < 2f+3) is recorded with the error instead of a number.

Outputs in --out: <name>.csv, <name>.md and <name>.png (bar plot of the
first metric). Final values are means over the last --last_k evaluated
rounds (SDFC reports the mean of the last five). With --num_seeds=S each
cell runs S seeds as replicas of one program (main.py --num_seeds); a
value is then the mean over the seeds of each seed's final value, its
sample std (ddof 1) beside it: tables print `84.50 ± 0.70`, the CSV has a
`<metric>_std` column and the bars carry error bars. With --reference=PAPER:TABLE
the table and CSV put the paper's number beside each of ours (see
experiments/reference.py); the setting is read from each run's config.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
import subprocess
import sys
import time

from absl import app, flags

if __package__ in (None, ''):   # run as a script: make `experiments` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
# pylint: disable=g-import-not-at-top
from experiments import plugins
# Components registered by --plugins (in --base_flags) are valid cell values.
plugins.load(sys.argv)
from experiments import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

flags.DEFINE_string('name', None, 'Sweep name (file and directory names).')
flags.DEFINE_string('base_flagfile', None, 'Flagfile shared by every cell.')
flags.DEFINE_string('base_flags', '', 'Extra flags shared by every cell, '
                    'space separated.')
flags.DEFINE_string('grid', '', "'flag=v1,v2;flag2=v3'.")
flags.DEFINE_string('metrics', 'test_accuracy', 'Comma-separated metrics '
                    '(metrics.jsonl keys, or upload_bytes: bytes a client '
                    'uploads per round, from summary.json).')
flags.DEFINE_integer('last_k', 1, 'Average the metrics over the last k '
                     'evaluated rounds.')
flags.DEFINE_string('out', os.path.join(ROOT, 'experiments', 'results'),
                    'Directory for the table, CSV and plot.')
flags.DEFINE_string('runs_dir', os.path.join(ROOT, 'runs', 'sweeps'),
                    'Parent of the cell workdirs.')
flags.DEFINE_string('runs_name', None, 'Subdirectory of --runs_dir for the '
                    'cells (default --name); sweeps that share it share '
                    'their identical cells.')
flags.DEFINE_string('pivot', '', "'row_flag,col_flag': also write "
                    '<name>_pivot.md with the first metric in a grid.')
flags.DEFINE_string('axes', None, 'JSON file of named axes: {axis: {value: '
                    '{"flags": [...], "paper": name}}}.')
flags.DEFINE_string('reference', None, "'PAPER:TABLE' of "
                    'experiments/reference/paper_results.csv to print beside '
                    'our numbers.')
flags.DEFINE_string('title', '', 'A line written above the table: the '
                    'setting, e.g. "Fashion-MNIST, self-pretrained ViT".')
flags.DEFINE_string('merge', '', 'Comma-separated CSVs written by earlier '
                    'sweeps: tabulate their rows together as --name, runs '
                    'nothing (key columns: neither a --metrics column nor '
                    'status/note; a "source" column names each row\'s CSV; '
                    'a cell in several CSVs is kept once, from the first). '
                    "An entry 'PATH#flag=v;flag2=v2' gives the key values "
                    'its CSV lacks (e.g. #attack=3dfed for a sweep that set '
                    'the attack in --base_flags).')
flags.DEFINE_string('merge_defaults', '', "With --merge: 'flag=v;flag2=v2', "
                    'the value of a key column for the rows of a CSV that '
                    'lacks it (e.g. attack=badnets for a sweep that varied '
                    'only the rule); otherwise "-".')
flags.DEFINE_string('marks', None, 'JSON file {"flag=v;flag2=v2": "why"}: '
                    'cells marked implausible against the literature; the '
                    'table marks them and lists the reasons below it (a '
                    'key may name a subset of the columns).')
if 'num_seeds' not in flags.FLAGS:   # main.py's own, where both are imported
  flags.DEFINE_integer('num_seeds', 1, 'Seeds per cell, run as replicas of '
                       'one program (main.py --num_seeds); values are mean '
                       '± std over them.', lower_bound=1)
flags.DEFINE_boolean('dry_run', False, 'Print the cells and exit.')
flags.DEFINE_integer('max_cells', 0, 'Run only the first N cells of the '
                     'grid (0: all); the tables hold those. A quick check '
                     'of a sweep before the whole grid runs.', lower_bound=0)
flags.mark_flags_as_required(['name'])
FLAGS = flags.FLAGS


def parse_grid(text: str) -> list[dict[str, str]]:
  """'a=1,2;b=x' -> [{'a': '1', 'b': 'x'}, {'a': '2', 'b': 'x'}].

  Products joined by '|' form a union, e.g. 'a=1,2;b=x | a=1;b=y' runs
  three cells. Every product must name the same flags in the same order.
  """
  cells = []
  first_keys = None
  for term in text.split('|'):
    axes = []
    for part in filter(None, (p.strip() for p in term.split(';'))):
      if '=' not in part:
        raise ValueError(f'--grid part {part!r} is not flag=v1,v2')
      key, values = part.split('=', 1)
      axes.append((key.strip().lstrip('-'),
                   [v.strip() for v in values.split(',')]))
    keys = [k for k, _ in axes]
    if first_keys is None:
      first_keys = keys
    elif keys != first_keys:
      raise ValueError(f'--grid: every |-joined product must name the flags '
                       f'{first_keys} in that order, got {keys}')
    for combo in itertools.product(*(v for _, v in axes)):
      cell = dict(zip(keys, combo))
      if cell not in cells:
        cells.append(cell)
  return cells


def load_axes(path: str | None) -> dict[str, dict[str, dict]]:
  if not path:
    return {}
  with open(path) as f:
    axes = json.load(f)
  for axis, values in axes.items():
    for value, spec in values.items():
      if not isinstance(spec, dict) or not isinstance(spec.get('flags'),
                                                      list):
        raise ValueError(f'--axes {path}: {axis}={value} needs '
                         '{"flags": [...]}')
      bad = [c for c in ',;|' if c in value]
      if bad or value != value.strip():
        raise ValueError(f'--axes {path}: the value name {value!r} of axis '
                         f'{axis!r} cannot be named in --grid (it has '
                         f"{' '.join(map(repr, bad)) or 'edge spaces'}); "
                         'rename it')
  return axes


def cell_flags(cell: dict[str, str], axes: dict[str, dict[str, dict]]
               ) -> list[str]:
  """The main.py flags of one cell; named-axis values expand to theirs."""
  out = []
  for key, value in cell.items():
    if key in axes:
      if value not in axes[key]:
        raise ValueError(f'--grid: {key}={value} is not in --axes; known: '
                         f'{sorted(axes[key])}')
      out += axes[key][value]['flags']
    else:
      out.append(f'--{key}={value}')
  if FLAGS.num_seeds > 1:
    out.append(f'--num_seeds={FLAGS.num_seeds}')
  return out


def paper_name(cell: dict[str, str], axes: dict[str, dict[str, dict]]
               ) -> str | None:
  """The paper's name for a cell: that of its last named axis that has one
  (a variant axis after a method axis names the variant)."""
  name = None
  for key, value in cell.items():
    if key in axes and 'paper' in axes[key].get(value, {}):
      name = axes[key][value]['paper']
  return name


def cell_workdir(cell: dict[str, str]) -> str:
  # A cell of several seeds is another run than its one-seed cell.
  seeds = f'_seeds{FLAGS.num_seeds}' if FLAGS.num_seeds > 1 else ''
  return os.path.join(FLAGS.runs_dir, FLAGS.runs_name or FLAGS.name,
                      cell_name(cell) + seeds)


def cell_name(cell: dict[str, str]) -> str:
  text = '_'.join(f'{k}-{v}' for k, v in cell.items()) or 'base'
  return ''.join(ch if ch.isalnum() or ch in '-_.' else '_' for ch in text)


def _summary(workdir: str) -> dict | None:
  path = os.path.join(workdir, 'summary.json')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def upload_bytes(workdir: str) -> int | None:
  """Bytes one client uploads per round, averaged over the run's clients:
  the method's own count for the federated-LoRA methods (summary.json
  'communication'), else the coordinates it owns (a cohort's specs, e.g.
  width ratios or LoRA ranks, count alike)."""
  return _per_client_bytes(workdir, 'upload')


def download_bytes(workdir: str) -> int | None:
  """Bytes one client downloads per round: the method's own count for the
  federated-LoRA methods, else the coordinates it trains (the slice of
  the global model it is sent, the same bytes it uploads). Extra
  server-to-client payloads of other methods are not counted."""
  return _per_client_bytes(workdir, 'download')


def _per_client_bytes(workdir: str, direction: str) -> int | None:
  summary = _summary(workdir)
  if summary is None:
    return None
  cohorts = summary.get('cohorts', {})
  comm = summary.get('communication') or {}
  total = count = 0
  for name, c in cohorts.items():
    if comm.get(name):
      value = comm[name]['mean'][direction]
    else:
      per_spec = list(c['upload_bytes_per_client'].values())
      value = sum(per_spec) / len(per_spec)
    total += c['clients'] * value
    count += c['clients']
  return round(total / count) if count else None


# Columns shown as they are in the tables (counts, indices), not percent.
RAW_METRICS = frozenset({'num_clusters', 'true_clusters', 'cluster_ari'})

# Columns read from summary.json rather than metrics.jsonl.
SUMMARY_METRICS = {'upload_bytes': upload_bytes,
                   'download_bytes': download_bytes}


def read_final(workdir: str, metrics: list[str], last_k: int
               ) -> dict[str, float | int | None]:
  """Each metric's mean over the last `last_k` evaluated rounds. A run of
  several seeds (replicas) gives the mean over the seeds of each seed's
  value, with its sample std (ddof 1) as '<metric>_std'."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  summary = _summary(workdir) or {}
  replicas = summary.get('replicas')
  # Without a summary (a cell read before it ended) the rows say.
  seeds = (len(replicas) if replicas else
           len(rows[-1].get('replicas', ())) if rows else 0) or 1
  if seeds > 1 and not replicas:
    replicas = [{}] * seeds
  if seeds > 1:
    each_rows = [[r['replicas'][i] for r in rows if 'replicas' in r]
                 for i in range(seeds)]
  else:
    each_rows, replicas = [rows], [summary]
  out = {}
  for m in metrics:
    if m in SUMMARY_METRICS:
      out[m] = SUMMARY_METRICS[m](workdir)
      continue
    each = []
    for own, own_summary in zip(each_rows, replicas):
      values = [r[m] for r in own[-last_k:] if r.get(m) is not None]
      # Run-level figures (cluster_ari, unseen_accuracy) live in
      # summary.json.
      if not values and isinstance(own_summary.get(m), (int, float)):
        values = [own_summary[m]]
      if values:
        each.append(sum(values) / len(values))
    out[m] = sum(each) / len(each) if len(each) == seeds else None
    if seeds > 1 and out[m] is not None:
      mean = out[m]
      out[f'{m}_std'] = (sum((v - mean) ** 2 for v in each) /
                         (seeds - 1)) ** 0.5
  if seeds > 1:
    out['seeds'] = seeds
  return out


def finished(workdir: str) -> tuple[str, str] | None:
  """(status, note) of a cell whose run has ended; None if it must (re)run.

  A diverged run (non-finite model) is a failure whatever round it reached:
  its last evaluation would otherwise be read as the cell's result.
  """
  path = os.path.join(workdir, 'summary.json')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    summary = json.load(f)
  if summary.get('status') == 'diverged':
    return 'failed', ('the global model is not finite (NaN or Inf) after '
                      f"round {summary.get('diverged_round')}")
  if summary['rounds_completed'] >= summary['config']['num_rounds']:
    return 'ok', ''
  return None


CELL_RECORD = 'sweep_cell.json'


def cell_flags_record(cell_args: list[str]) -> dict:
  """What a cell runs with: its main.py arguments and the text of the base
  flagfile (a changed file changes the run as much as a changed flag)."""
  args = FLAGS.base_flags.split() + list(cell_args)
  text = None
  if FLAGS.base_flagfile:
    # main.py runs in ROOT; an absolute path stays as it is.
    with open(os.path.join(ROOT, FLAGS.base_flagfile)) as f:
      text = f.read()
  return {'base_flagfile': FLAGS.base_flagfile or None,
          'base_flagfile_text': text, 'args': args}


def changed_flags(workdir: str, record: dict) -> str | None:
  """How a finished cell's recorded flags differ from `record`; None when
  they agree or the cell predates the record."""
  path = os.path.join(workdir, CELL_RECORD)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    old = json.load(f)
  if old == record:
    return None
  if old.get('base_flagfile_text') != record['base_flagfile_text']:
    return (f"--base_flagfile {record['base_flagfile']!r} is not the file "
            f"it ran with ({old.get('base_flagfile')!r})")
  before, now = old.get('args', []), record['args']
  gone = [a for a in before if a not in now]
  new = [a for a in now if a not in before]
  return f'it ran with {gone or "[]"}, this sweep asks for {new or "[]"}'


def run_cell(cell_args: list[str], workdir: str) -> tuple[str, str]:
  """Runs (or resumes) one cell; returns (status, message)."""
  cmd = [sys.executable, os.path.join(ROOT, 'experiments', 'main.py')]
  if FLAGS.base_flagfile:
    cmd.append(f'--flagfile={FLAGS.base_flagfile}')
  cmd += FLAGS.base_flags.split()
  cmd += cell_args
  cmd.append(f'--workdir={workdir}')
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, CELL_RECORD), 'w') as f:
    json.dump(cell_flags_record(cell_args), f)
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
  if proc.returncode == 0:
    return 'ok', ''
  # The whole stderr stays beside the cell's outputs; the table gets one
  # line of it.
  with open(os.path.join(workdir, CELL_STDERR), 'w') as f:
    f.write(proc.stderr)
  return failure(proc.returncode, proc.stderr)


CELL_STDERR = 'stderr.log'


def failure(returncode: int, stderr: str) -> tuple[str, str]:
  """(status, one-line message) of a cell that exited with `returncode`.

  A refusal's or error's 'error:' line; else, for a crash, the line that
  names it: Python's 'Fatal Python error: ...' (an abort, whose last lines
  only list extension modules) or the traceback's last line.
  """
  lines = stderr.splitlines()
  errors = [l for l in lines if l.startswith('error:')]
  fatal = [l for l in lines if l.startswith('Fatal Python error')]
  # XLA's own fatal check ('F1127 10:44:57.65 8658 file.cc:161] why')
  # names the cause of an abort, e.g. a collective's rendezvous timeout.
  checks = [l.split('] ', 1)[1] for l in lines
            if re.match(r'F\d{4} \d', l) and '] ' in l]
  if errors:
    message = errors[-1][len('error: '):]
  elif fatal:
    message = fatal[-1] + (f' after XLA: {checks[-1]}' if checks else '')
  else:   # a crash: its last line names the exception
    tail = [l for l in lines if l.strip()]
    message = tail[-1] if tail else f'exit {returncode}'
  if returncode < 0:
    message = f'signal {-returncode}: {message}'
  message = message.replace('|', '/')[:300]
  if not errors:
    message += f' (whole stderr: {CELL_STDERR} in the cell\'s workdir)'
  return ('refused' if returncode == 2 else 'failed'), message


def load_marks(path: str | None) -> list[tuple[dict[str, str], str]]:
  """[(cell selector, reason)] from a --marks JSON file."""
  if not path:
    return []
  with open(path) as f:
    raw = json.load(f)
  out = []
  for key, why in raw.items():
    selector = {}
    for part in key.split(';'):
      flag, sep, value = part.partition('=')
      if not sep or not flag.strip():
        raise ValueError(f'--marks: {key!r} is not "flag=v;flag2=v2"')
      selector[flag.strip()] = value.strip()
    out.append((selector, str(why)))
  return out


def mark_of(row: dict, marks: list[tuple[dict[str, str], str]]) -> int:
  """1-based index of the first mark whose selector the row matches; 0."""
  for i, (selector, _) in enumerate(marks):
    if all(str(row.get(k)) == v for k, v in selector.items()):
      return i + 1
  return 0


def parse_assignments(text: str, what: str) -> dict[str, str]:
  """'flag=v;flag2=v2' -> {flag: v}."""
  out = {}
  for part in filter(None, text.split(';')):
    key, sep, value = part.partition('=')
    if not sep or not key.strip():
      raise ValueError(f'{what}: {part!r} is not flag=v')
    out[key.strip()] = value.strip()
  return out


def merged_rows(sources: list, metrics: list[str],
                defaults: dict[str, str] | None = None
                ) -> tuple[list[dict], list[str]]:
  """(rows, key columns) of several sweep CSVs, each row once.

  sources: CSV paths, or (path, {key: value}) with the key values that
  CSV lacks. A key a CSV lacks takes its own value, else defaults[key],
  else '-'. The paper's columns (paper_<metric>, paper_method,
  paper_setting) are kept where a CSV has them, blank where it has not.
  Integer cells (bytes, counts) stay integers. A row of an earlier merge
  keeps its `source`.
  """
  def number(v):
    if v in (None, ''):
      return None
    try:
      return int(v)
    except ValueError:
      return float(v)

  defaults = defaults or {}
  rows, keys, seen = [], [], {}
  for source in sources:
    path, own = (source, {}) if isinstance(source, str) else source
    with open(path, newline='') as f:
      reader = csv.DictReader(f)
      cols = [c for c in reader.fieldnames or ()
              if c not in metrics and c not in ('status', 'note', 'source',
                                                'seeds')
              and not c.startswith('paper_') and not c.endswith('_std')]
      keys += [c for c in list(cols) + list(own) if c not in keys]
      for raw in reader:
        row = {c: raw[c] for c in cols}
        row['status'] = raw.get('status') or 'ok'
        row['note'] = raw.get('note') or ''
        for m in metrics:
          row[m] = number(raw.get(m))
          if raw.get(f'{m}_std'):
            row[f'{m}_std'] = number(raw[f'{m}_std'])
          if f'paper_{m}' in raw:
            row[f'paper_{m}'] = number(raw[f'paper_{m}'])
        for c in ('paper_method', 'paper_setting'):
          if c in raw:
            row[c] = raw[c]
        # A merged CSV keeps each row's own source.
        row['source'] = (raw.get('source') or
                         os.path.splitext(os.path.basename(path))[0])
        for k, v in own.items():
          row.setdefault(k, v)
        rows.append(row)
  out = []
  for row in rows:
    for k in keys:
      row.setdefault(k, defaults.get(k, '-'))
    ident = tuple(row[k] for k in keys)
    if ident in seen:
      first = seen[ident]
      if first.get(metrics[0]) != row.get(metrics[0]):
        print(f'merge: {ident} differs between {first["source"]} and '
              f'{row["source"]}; keeping {first["source"]}', flush=True)
      continue
    seen[ident] = row
    out.append(row)
  return out, keys + ['source']


def _format(v, column: str = '') -> str:
  """A table cell: percent for rates, as-is for counts and indices."""
  metric = column.removeprefix('paper_')
  if v is None:
    return ''
  if metric in RAW_METRICS:           # counts and indices, not percent
    return f'{v:.3g}' if isinstance(v, float) else str(v)
  return f'{100 * v:.2f}' if isinstance(v, float) else str(v)


def _cell(r: dict, column: str) -> str:
  """A result's table cell: the value, '± std' where seeds give one."""
  out = _format(r.get(column), column)
  std = r.get(f'{column}_std')
  if out and std is not None:
    out += f' ± {_format(std, column)}'
  return out


def _write_csv(name: str, results: list[dict], keys: list[str],
               columns: list[str], extra: list[str], marks) -> None:
  with open(os.path.join(FLAGS.out, f'{name}.csv'), 'w', newline='') as f:
    spread = [f'{c}_std' for c in columns
              if any(r.get(f'{c}_std') is not None for r in results)]
    fields = keys + columns + spread + ['status', 'note'] + extra + (
        ['seeds'] if any(r.get('seeds') for r in results) else [])
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    for r in results:
      row = {k: r.get(k) for k in fields}
      if mark_of(r, marks) and r['status'] == 'ok':
        row['note'] = 'implausible: ' + marks[mark_of(r, marks) - 1][1]
      writer.writerow(row)


def _table_lines(results: list[dict], keys: list[str], columns: list[str],
                 marks, with_paper: bool) -> tuple[list[str], list[int]]:
  """The markdown table's lines and the implausibility marks used."""
  lines = ['| ' + ' | '.join(keys + columns) + ' |',
           '|' + '---|' * (len(keys) + len(columns))]
  used = []
  for r in results:
    cells = [str(r[k]) for k in keys]
    if r['status'] == 'ok':
      cells += [_cell(r, c) for c in columns]
      mark = mark_of(r, marks)
      if mark:
        cells[len(keys)] += f' (!{mark})'
        used.append(mark)
    else:
      note = f"{r['status']}: {r['note']}"
      if with_paper:
        cells += [note if c == columns[0] else _format(r.get(c), c)
                  for c in columns]
      else:
        cells += [note] + [''] * (len(columns) - 1)
    lines.append('| ' + ' | '.join(cells) + ' |')
  return lines, used


def _write_markdown(name: str, lines: list[str], used: list[int], marks,
                    metrics: list[str], with_paper: bool) -> None:
  with open(os.path.join(FLAGS.out, f'{name}.md'), 'w') as f:
    f.write(f'<!-- generated by experiments/sweep.py --name={name}; '
            'metrics in percent'
            + (' (' + ', '.join(sorted(RAW_METRICS & set(metrics)))
               + ' as they are)' if RAW_METRICS & set(metrics) else '')
            + (', bytes per client per round' if set(metrics) & set(
                SUMMARY_METRICS) else '')
            + ('; paper_* columns: ' + (
                f'{FLAGS.reference} of ' + os.path.relpath(
                    reference.path_of(FLAGS.reference.partition(':')[0]),
                    ROOT) if FLAGS.reference else 'from each source sweep')
               if with_paper else '') + ' -->\n')
    if FLAGS.title:
      f.write(f'\n**{FLAGS.title}**\n\n')
    f.write('\n'.join(lines) + '\n')
    if used:
      f.write('\nCells marked (!N) are implausible against the literature '
              '(BUILD_NOTES explains each):\n\n')
      for i in sorted(set(used)):
        selector, why = marks[i - 1]
        f.write(f'{i}. ' + ', '.join(f'{k}={v}' for k, v in selector.items())
                + f': {why}\n')


def _plot_bars(name: str, results: list[dict], keys: list[str],
               metrics: list[str]) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  ok = [r for r in results if r['status'] == 'ok']
  if not ok:
    return
  # Bars in percent; counts and indices (RAW_METRICS) and bytes are on
  # other scales and stay in the table, unless nothing else is there.
  shown = [m for m in metrics
           if m not in SUMMARY_METRICS and m not in RAW_METRICS]
  metrics = shown or [m for m in metrics if m not in SUMMARY_METRICS] or (
      metrics)
  labels = ['/'.join(r[k] for k in keys) for r in ok]
  # Taller for long cell labels, so the rotated labels leave the axes room.
  fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(ok)), 3 + min(
      9, 0.065 * max(len(label) for label in labels))))
  width = 0.8 / len(metrics)
  for i, m in enumerate(metrics):
    scale = 1 if m in RAW_METRICS else 100
    spread = [r.get(f'{m}_std') for r in ok]
    ax.bar([j + i * width for j in range(len(ok))],
           [scale * (r.get(m) or 0) for r in ok], width, label=m,
           # Seeds (--num_seeds): one std either side.
           yerr=([scale * (v or 0) for v in spread]
                 if any(v is not None for v in spread) else None),
           capsize=2)
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ok))])
  ax.set_xticklabels(labels, rotation=60, ha='right', fontsize=8)
  ax.set_ylabel('%' if shown else ', '.join(metrics))
  # Beside the axes, not over the bars (a full-height bar sits under any
  # corner inside them).
  ax.legend(loc='upper left', bbox_to_anchor=(1.0, 1.0), fontsize=8)
  ax.set_title(name)
  fig.tight_layout()
  fig.savefig(os.path.join(FLAGS.out, f'{name}.png'), dpi=100)
  plt.close(fig)


def write_outputs(name: str, results: list[dict], keys: list[str],
                  metrics: list[str], with_paper: bool = False) -> None:
  """<name>.csv, <name>.md and <name>.png; with_paper adds 'paper_<metric>'
  columns."""
  os.makedirs(FLAGS.out, exist_ok=True)
  marks = load_marks(FLAGS.marks)
  columns = []
  for m in metrics:
    columns += [m, f'paper_{m}'] if with_paper else [m]
  extra = ['paper_method', 'paper_setting'] if with_paper else []
  _write_csv(name, results, keys, columns, extra, marks)
  lines, used = _table_lines(results, keys, columns, marks, with_paper)
  _write_markdown(name, lines, used, marks, metrics, with_paper)
  _plot_bars(name, results, keys, metrics)


def write_pivot(name: str, results: list[dict], row_key: str, col_key: str,
                metric: str) -> None:
  """A row_key x col_key grid of `metric` (percent) as markdown."""
  rows = list(dict.fromkeys(r[row_key] for r in results))
  cols = list(dict.fromkeys(r[col_key] for r in results))
  value = {(r[row_key], r[col_key]): r for r in results}
  lines = [f'| {row_key} \\ {col_key} | ' + ' | '.join(cols) + ' |',
           '|' + '---|' * (len(cols) + 1)]
  for row in rows:
    cells = []
    for col in cols:
      r = value.get((row, col))
      if r is None:
        cells.append('')
      elif r['status'] != 'ok':
        cells.append(r['status'])
      else:
        cells.append(_cell(r, metric))
    lines.append(f'| {row} | ' + ' | '.join(cells) + ' |')
  with open(os.path.join(FLAGS.out, f'{name}_pivot.md'), 'w') as f:
    f.write(f'<!-- generated by experiments/sweep.py --name={name}: '
            f'{metric} (%) -->\n' + '\n'.join(lines) + '\n')


def paper_columns(cell: dict[str, str], workdir: str,
                  axes: dict[str, dict[str, dict]], paper: str,
                  paper_rows: dict, metrics: list[str]) -> dict:
  """paper_<metric> values for one cell (None where the paper has none)."""
  method = paper_name(cell, axes)
  config_path = os.path.join(workdir, 'config.json')
  if method is None or not os.path.exists(config_path):
    return {'paper_method': method}
  with open(config_path) as f:
    setting = reference.setting_of(paper, json.load(f))
  values = paper_rows.get((method, setting), {})
  out = {'paper_method': method, 'paper_setting': setting}
  out.update({f'paper_{m}': values.get(m) for m in metrics})
  return out


SAFE_NAME = re.compile(r'[A-Za-z0-9_][A-Za-z0-9_.-]*')


def check_name(flag: str, value: str | None) -> None:
  """Sweep names become file and directory names: letters, digits, '_',
  '-' and '.', not starting with '.' (no path separators, no '..')."""
  if value is not None and not SAFE_NAME.fullmatch(value):
    raise app.UsageError(f'--{flag}={value!r}: use letters, digits, _, - '
                         "and . only, not starting with '.' (it names files "
                         'and directories)')


def main(argv):
  del argv
  check_name('name', FLAGS.name)
  check_name('runs_name', FLAGS.runs_name)
  if FLAGS.merge:
    if FLAGS.grid or FLAGS.reference:
      raise app.UsageError('--merge tabulates earlier CSVs: give no --grid '
                           'or --reference')
    metrics = [m.strip() for m in FLAGS.metrics.split(',') if m.strip()]
    defaults = parse_assignments(FLAGS.merge_defaults, '--merge_defaults')
    sources = []
    for entry in filter(None, (e.strip() for e in FLAGS.merge.split(','))):
      path, _, own = entry.partition('#')
      sources.append((path, parse_assignments(own, '--merge')))
    results, keys = merged_rows(sources, metrics, defaults)
    write_outputs(FLAGS.name, results, keys, metrics,
                  with_paper=any('paper_method' in r for r in results))
    if FLAGS.pivot:
      row_key, col_key = FLAGS.pivot.split(',')
      write_pivot(FLAGS.name, results, row_key, col_key, metrics[0])
    print(f'{FLAGS.name}: {len(results)} cells from '
          f'{len(FLAGS.merge.split(","))} CSVs', flush=True)
    return
  cells = parse_grid(FLAGS.grid)
  if FLAGS.max_cells:
    cells = cells[:FLAGS.max_cells]
  keys = list(cells[0]) if cells and cells[0] else []
  metrics = [m.strip() for m in FLAGS.metrics.split(',') if m.strip()]
  axes = load_axes(FLAGS.axes)
  paper_rows = {}
  if FLAGS.reference:
    paper, _, table = FLAGS.reference.partition(':')
    paper_rows = reference.load(paper, table)
  results = []
  # A finished cell is reused only with the flags it ran with: the same
  # --runs_name with other --base_flags (or an edited flagfile) would
  # otherwise read old runs as new results.
  stale = []
  for cell in cells:
    workdir = cell_workdir(cell)
    why = finished(workdir) and changed_flags(
        workdir, cell_flags_record(cell_flags(cell, axes)))
    if why:
      stale.append(f'{workdir}: {why}')
  if stale:
    raise app.UsageError(
        f'--runs_name: {len(stale)} finished cell(s) ran with other flags; '
        'pass another --runs_name (or delete them) to run this sweep:\n  '
        + '\n  '.join(stale))
  for i, cell in enumerate(cells):
    workdir = cell_workdir(cell)
    if FLAGS.dry_run:
      print(workdir)
      continue
    t0 = time.time()
    status, note = finished(workdir) or run_cell(cell_flags(cell, axes),
                                                 workdir)
    row = dict(cell, status=status, note=note)
    if status == 'ok':
      row.update(read_final(workdir, metrics, FLAGS.last_k))
    if FLAGS.reference:
      row.update(paper_columns(cell, workdir, axes, paper, paper_rows,
                               metrics))
    results.append(row)
    print(f'[{i + 1}/{len(cells)}] {cell_name(cell)}: {status} '
          f'{note[:120]} ({time.time() - t0:.0f}s) '
          + ' '.join(f'{m}={row.get(m)}' for m in metrics), flush=True)
    write_outputs(FLAGS.name, results, keys, metrics,
                  with_paper=bool(FLAGS.reference))
    if FLAGS.pivot:
      row_key, col_key = FLAGS.pivot.split(',')
      write_pivot(FLAGS.name, results, row_key, col_key, metrics[0])


if __name__ == '__main__':
  app.run(main)
