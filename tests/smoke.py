"""Documented commands as tests: every command a reader can copy from
README.md or docs/, and every preset in experiments/configs/, runs for real
on small data with the runner's own device count.

Commands are read from the Markdown files themselves (fenced ``bash``
blocks), so a command added to the docs is tested without being listed
here. A fenced ``python`` block is a program a reader runs as it stands:
it runs whole, unshrunk (it is written small), as a script in the scratch
directory. A sketch that is not meant to run goes in a ``py`` or ``text``
block. Each one runs as written, as a subprocess, with a few flags appended
or replaced that shrink the work (one round, a few thousand examples, one
timed repetition) but not the code path. A script that the docs run and
`SHRINK` does not know fails the test, naming the script, so no documented
command is skipped by accident.

A page's blocks run in order in one scratch directory that mirrors the
repository (its top-level entries are symbolic links), so a later command
finds what an earlier one wrote (a workdir under runs/, a data file), and
nothing is written into the checkout.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shlex
import subprocess
import sys
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, 'experiments', 'configs')
# The files whose commands are tested: the front page and every docs page.
DOC_GLOBS = ('README.md', 'docs/**/*.md')
# One command's limit: a hang fails the test instead of stalling CI.
TIMEOUT_S = 600
# A shrunk run: at most this many clients, and this many training
# examples (at least MIN_PER_CLIENT per client, so a skewed partition can
# still give every client one), one local epoch, one round.
MAX_CLIENTS = 100
SMALL_TRAIN = 400
MIN_PER_CLIENT = 20
# Test examples a shrunk run evaluates on, and per class where a preset
# draws a per-class global test set.
SMALL_TEST = 200
# The largest server validation set (--validation_size) a shrunk run keeps.
SMALL_VALIDATION = 64
# The largest public split (--public_size) a shrunk run pretrains on.
SMALL_PUBLIC = 200
SMALL_TEST_PER_CLASS = 10
_XLA_DEVICES = '--xla_force_host_platform_device_count'


@dataclasses.dataclass(frozen=True)
class Block:
  """One fenced bash block (its commands) or python block (its source as
  the one 'command'): file, first line, kind."""
  path: str
  line: int
  commands: tuple[str, ...]
  kind: str = 'bash'

  @property
  def name(self) -> str:
    return f'{self.path}:{self.line}'


def doc_files(root: str = ROOT) -> list[str]:
  """The Markdown files whose commands are tested, relative to root."""
  found = set()
  for pattern in DOC_GLOBS:
    found.update(os.path.relpath(p, root) for p in
                 glob.glob(os.path.join(root, pattern), recursive=True))
  return sorted(found)


def blocks(text: str, path: str) -> list[Block]:
  """The ``bash`` / ``sh`` / ``shell`` fenced blocks of a Markdown text,
  each as its commands: continuation lines joined, comments and blank
  lines dropped."""
  out, lines = [], text.split('\n')
  i = 0
  while i < len(lines):
    match = re.match(r'^\s*```(bash|sh|shell|console|python)\s*$', lines[i])
    if not match:
      i += 1
      continue
    start, body = i + 1, []
    i += 1
    while i < len(lines) and not lines[i].strip().startswith('```'):
      body.append(lines[i])
      i += 1
    i += 1
    if match[1] == 'python':
      out.append(Block(path, start, ('\n'.join(body) + '\n',), 'python'))
      continue
    commands, current = [], ''
    for raw in body:
      line = raw.strip()
      if not current and (not line or line.startswith('#')):
        continue
      line = line.removeprefix('$ ') if not current else line
      if line.endswith('\\'):
        current += line[:-1].rstrip() + ' '
        continue
      commands.append((current + line).strip())
      current = ''
    if current.strip():
      commands.append(current.strip())
    if commands:
      out.append(Block(path, start, tuple(commands)))
  return out


def block_segments(block: Block) -> list[tuple[str, bool]]:
  """(segment, skip_presets) for each command segment of a bash block, in
  order: a bare preset command is left to the preset test unless a later
  command of the block reads a run directory (runs/...)."""
  if block.kind != 'bash':
    return []
  flat = [seg for command in block.commands for seg in segments(command)]
  return [(seg, not any(_reads_run(seg, later) for later in flat[i + 1:]))
          for i, seg in enumerate(flat)]


def _reads_run(segment: str, later: str) -> bool:
  """Whether `later` may read the run `segment` writes: its preset's
  workdir where the segment is a bare preset that names one, else any
  run directory."""
  preset = covered_preset(segment)
  if not preset:
    return 'runs/' in later
  from experiments import config as config_lib  # pylint: disable=g-import-not-at-top
  from experiments import train  # pylint: disable=g-import-not-at-top
  values = dict(config_lib.defaults())
  values.update(_preset_values(
      [f'--flagfile=experiments/configs/{preset}'], ROOT))
  workdir = values.get('workdir') or train.default_workdir({
      'method': values['method'], 'dataset': values['dataset'],
      'model': values['model'], 'seed': int(values['seed']),
      'num_seeds': int(values.get('num_seeds') or 1)})
  return str(workdir) in later



def doc_blocks(root: str = ROOT) -> list[Block]:
  found = []
  for path in doc_files(root):
    with open(os.path.join(root, path)) as f:
      found.extend(blocks(f.read(), path))
  return found


def segments(command: str) -> list[str]:
  """A command line's `&&`-joined parts."""
  return [part.strip() for part in command.split('&&') if part.strip()]


# Steps a reader runs that the test suite cannot run from inside itself:
# the setup (CI runs it before the suite) and the suite itself.
NOT_RUN = (
    (re.compile(r'^(\./setup\.sh|bash \.ci/run)\b'), 'setup: CI runs it'),
    (re.compile(r'(^|\s)-m pytest\b'), 'the test suite: CI runs it'),
    (re.compile(r'^(\S*/)?pip install\b|-m pip install\b'),
     'an install step'),
)


def not_run(segment: str) -> str | None:
  for pattern, why in NOT_RUN:
    if pattern.search(segment):
      return why
  return None


def _flag_name(arg: str) -> str | None:
  match = re.match(r'^--(no)?([A-Za-z_][A-Za-z0-9_]*)(=|$)', arg)
  return match.group(2) if match else None


def set_flags(argv: list[str], values: dict[str, str | None]) -> list[str]:
  """argv with each --name in `values` replaced (or appended): `--name=v`,
  or dropped where the value is None."""
  kept = [a for a in argv if _flag_name(a) not in values]
  return kept + [f'--{k}={v}' for k, v in values.items() if v is not None]


def flag_value(argv: list[str], name: str) -> str | None:
  value = None
  for arg in argv:
    if arg.startswith(f'--{name}='):
      value = arg.split('=', 1)[1]
  return value


def first_of_list(argv: list[str], name: str) -> dict[str, str]:
  """{name: its first comma-separated value}, where argv sets it."""
  value = flag_value(argv, name)
  return {} if value is None else {name: value.split(',')[0]}


def _preset_values(argv: list[str], cwd: str) -> dict[str, object]:
  """The values the command's flagfiles set (later files win)."""
  from experiments import config as config_lib  # pylint: disable=g-import-not-at-top
  values: dict[str, object] = {}
  for arg in argv:
    if arg.startswith('--flagfile='):
      values.update(config_lib.read_flagfile(
          os.path.join(cwd, arg.split('=', 1)[1])))
  return values


def small_values(argv: list[str], cwd: str) -> dict[str, str | None]:
  """The flags that shrink a run of experiments/main.py with `argv`: one
  round of one local epoch on few examples (enough for the validation
  reserve the run asks for) and at most MAX_CLIENTS clients; pretraining
  and the private backbones' warm-up one epoch (pretraining stored under
  the scratch directory); at most two seeds, still run as replicas."""
  from experiments import config as config_lib  # pylint: disable=g-import-not-at-top
  values = dict(config_lib.defaults())
  values.update(_preset_values(argv, cwd))
  for arg in argv:
    name = _flag_name(arg)
    if name and '=' in arg and name != 'flagfile':
      values[name] = arg.split('=', 1)[1]
  clients = min(int(values['num_clients']), MAX_CLIENTS)
  small = max(SMALL_TRAIN, MIN_PER_CLIENT * clients)
  fraction = float(values.get('validation_fraction') or 0)
  validation = int(values.get('validation_size') or 0)
  if fraction and validation:
    # The server's validation set (|U|) shrinks too; the reserve it is
    # drawn from must still hold it.
    validation = min(validation, SMALL_VALIDATION)
    small = max(small, int(1.1 * validation / fraction) + 1)
  limit = int(values.get('max_train_examples') or 0)
  change: dict[str, str | None] = {
      'num_rounds': '1', 'local_epochs': '1',
      'max_train_examples': str(min(limit, small) if limit else small),
      'max_test_examples': str(SMALL_TEST)}
  if clients < int(values['num_clients']):
    change['num_clients'] = str(clients)
    per_round = int(values.get('clients_per_round') or 0)
    if per_round > clients:
      change['clients_per_round'] = str(clients)
  if validation and validation < int(values['validation_size']):
    change['validation_size'] = str(validation)
  per_class = int(values.get('global_test_per_class') or 0)
  if per_class > SMALL_TEST_PER_CLASS:
    change['global_test_per_class'] = str(SMALL_TEST_PER_CLASS)
  public = int(values.get('public_size') or 0)
  if public:
    public = min(public, SMALL_PUBLIC)
    change['public_size'] = str(public)
    train = int(change['max_train_examples'])
    if train - public < small:     # the clients keep `small` examples
      change['max_train_examples'] = str(public + small)
  if int(values.get('pretrain_epochs') or 0):
    change['pretrain_epochs'] = '1'
  if int(values.get('warmup_epochs') or 0) > 1:
    change['warmup_epochs'] = '1'
  if int(values.get('num_seeds') or 1) > 2:
    change['num_seeds'] = '2'            # still one replicated program
  if values.get('pretrained_dir'):
    change['pretrained_dir'] = os.path.join(cwd, 'pretrained')
  if 'unseen_clients' in values and int(values['unseen_clients'] or 0):
    change['unseen_epochs'] = '1'
  return change


def shrink_main(argv: list[str], cwd: str) -> list[str]:
  """experiments/main.py, shrunk by `small_values`."""
  return set_flags(argv, small_values(argv, cwd))


def shrink_sweep(argv: list[str], cwd: str) -> list[str]:
  """experiments/sweep.py: its first cell only, shrunk as main.py is;
  tables and runs under the scratch directory."""
  base = flag_value(argv, 'base_flags') or ''
  if flag_value(argv, 'merge'):          # tabulates CSVs; runs nothing
    return set_flags(argv, {'out': os.path.join(cwd, 'results')})
  flagfile = flag_value(argv, 'base_flagfile')
  cell = ([f'--flagfile={flagfile}'] if flagfile else []) + base.split()
  small = [f'--{k}={v}' for k, v in small_values(cell, cwd).items()
           if v is not None and k not in ('pretrained_dir',)]
  return set_flags(argv, {
      'base_flags': ' '.join(base.split() + small),
      'max_cells': '1',
      'out': os.path.join(cwd, 'results'),
      'runs_dir': os.path.join(cwd, 'runs', 'sweeps')})


def shrink_round_throughput(argv: list[str], cwd: str) -> list[str]:
  del cwd
  change = {'rounds': '1', 'settle_seconds': '0',
            **first_of_list(argv, 'method_clients')}
  if flag_value(argv, 'num_seeds') is not None:
    change['num_seeds'] = '2'            # one replicated program
  if flag_value(argv, 'method') is None:
    change['local_steps'] = '2'
  else:
    change['total_examples'] = str(SMALL_TRAIN)
    clients = flag_value(argv, 'method_clients')
    if clients is not None and int(clients.split(',')[0]) > 20:
      change['method_clients'] = '20'
  return set_flags(argv, change)


def shrink_fedhan_detection(argv: list[str], cwd: str) -> list[str]:
  del cwd
  return argv


SHRINK: dict[str, Callable[[list[str], str], list[str]]] = {
    'experiments/main.py': shrink_main,
    'experiments/sweep.py': shrink_sweep,
    'experiments/analysis/fedhan_detection.py': shrink_fedhan_detection,
    'experiments/paper_suite.py': lambda argv, cwd: set_flags(
        argv, {'scale': 'tiny', 'only': 'sdfc_t5_b05_m30_dnc'}),
    'examples/quickstart.py': lambda argv, cwd: set_flags(
        argv, {'rounds': '1', 'examples': str(SMALL_TRAIN)}),
    'examples/custom_rule.py': lambda argv, cwd: set_flags(
        argv, {'rounds': '1', 'examples': str(SMALL_TRAIN)}),
    'benchmarks/round_throughput.py': shrink_round_throughput,
    'benchmarks/scale_model.py': lambda argv, cwd: argv,
    'benchmarks/aggregation_cost.py': lambda argv, cwd: set_flags(
        argv, {'clients': '10', 'repeats': '1'}),
    'benchmarks/machine_ceilings.py': lambda argv, cwd: set_flags(
        argv, {'matmul_size': '256', 'stream_mb': '16', 'repeats': '1'}),
    'benchmarks/eval_split.py': lambda argv, cwd: set_flags(
        argv, {'clients': '100', 'passes': '1'}),
}
# What a script's output must show besides exit status 0 (a sweep exits 0
# with failed cells in its table).
EXPECT = {'experiments/main.py': r'run completed',
          'experiments/sweep.py': r'\[1/1\] .*: ok |cells from'}
# Scripts whose documented commands need an optional extra; the command is
# skipped, naming the extra, where its module is missing.
NEEDS = {'--reference=torch': ('torch', '.[bench]')}


class CommandError(AssertionError):
  """A documented command failed; the message names it."""


def scratch_dir(path: str) -> str:
  """A directory that mirrors the checkout: its top-level entries as
  links, so relative paths in a command resolve, and runs/ is its own."""
  os.makedirs(path, exist_ok=True)
  for entry in os.listdir(ROOT):
    if entry in ('runs', '.git'):
      continue
    link = os.path.join(path, entry)
    if not os.path.lexists(link):
      os.symlink(os.path.join(ROOT, entry), link)
  return path


def environment() -> dict[str, str]:
  """The subprocess environment: the runner's own device count (the
  suite's forced count is removed), everything else inherited."""
  env = dict(os.environ)
  flags = [f for f in env.get('XLA_FLAGS', '').split()
           if not f.startswith(_XLA_DEVICES + '=')]
  env['XLA_FLAGS'] = ' '.join(flags)
  env['PYTHONUNBUFFERED'] = '1'
  return env


def covered_preset(segment: str) -> str | None:
  """The preset a segment runs as is, if it is exactly a preset's
  documented command (tests/smoke_configs_test.py runs those)."""
  words = segment.split()
  if len(words) == 3 and words[1] == 'experiments/main.py':
    match = re.match(r'^--flagfile=experiments/configs/([\w.-]+\.flags)$',
                     words[2])
    if match and match[1] in presets():
      return match[1]
  return None


def prepare(segment: str, cwd: str, *, skip_presets: bool = False
            ) -> tuple[list[str] | None, str]:
  """The argv a documented command segment runs as, shrunk, or None and
  why it is not run here. With skip_presets, a bare preset command is not
  run again (the preset test runs it; the caller passes False where a
  later command of the block reads the preset's run)."""
  why = not_run(segment)
  if why:
    return None, why
  if skip_presets and covered_preset(segment):
    return None, f'the preset test runs {covered_preset(segment)}'
  for marker, (module, extra) in NEEDS.items():
    if marker in segment:
      try:
        __import__(module)
      except ImportError:
        return None, f'needs {module} (pip install -e "{extra}")'
  try:
    words = shlex.split(segment)
  except ValueError as err:
    raise CommandError(f'{segment!r} is not a valid shell command: {err}')
  env = []
  while words and re.match(r'^[A-Z_][A-Z0-9_]*=', words[0]):
    env.append(words.pop(0))
  if env:
    raise CommandError(f'{segment!r}: environment assignments are not '
                       'supported by the smoke test')
  if len(words) < 2 or not re.search(r'(^|/)python[0-9.]*$', words[0]):
    raise CommandError(f'{segment!r} is not a python command the smoke test '
                       'knows how to run; extend tests/smoke.py')
  script, args = words[1], words[2:]
  if script not in SHRINK:
    raise CommandError(f'{segment!r}: no shrink rule for {script}; add one '
                       'to SHRINK in tests/smoke.py')
  for arg in args:
    if re.match(r'^\[.*\]$', arg):
      raise CommandError(f'{segment!r}: {arg} is not an argument the '
                         'shell passes as meant (optional parts belong in '
                         'prose or a separate command)')
  return [sys.executable, script] + SHRINK[script](args, cwd), ''


def run_segment(segment: str, cwd: str, label: str, *,
                skip_presets: bool = False) -> str:
  """Runs one documented command (shrunk) in `cwd`; its output, or
  CommandError naming the command and its output's tail."""
  argv, why = prepare(segment, cwd, skip_presets=skip_presets)
  if argv is None:
    return f'not run ({why}): {segment}'
  try:
    done = subprocess.run(argv, cwd=cwd, env=environment(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=TIMEOUT_S, check=False)
  except subprocess.TimeoutExpired as err:
    raise CommandError(f'{label}: `{segment}` ran past {TIMEOUT_S} s '
                       f'(as {shlex.join(argv[1:])})') from err
  if done.returncode != 0:
    raise CommandError(
        f'{label}: `{segment}` exited {done.returncode} (run as '
        f'{shlex.join(argv[1:])}); its output ends:\n'
        + done.stdout[-4000:])
  script = argv[1]
  if script in EXPECT and not re.search(EXPECT[script], done.stdout):
    raise CommandError(
        f'{label}: `{segment}` exited 0 but its output lacks '
        f'{EXPECT[script]!r} (run as {shlex.join(argv[1:])}); it ends:\n'
        + done.stdout[-4000:])
  return done.stdout


def run_python(source: str, cwd: str, label: str) -> str:
  """Runs a documented python block as a script in `cwd`; its output, or
  CommandError naming the block and the output's tail."""
  script = os.path.join(cwd, '_doc_block.py')
  with open(script, 'w') as f:
    f.write(source)
  env = environment()
  env['PYTHONPATH'] = os.pathsep.join(
      [cwd] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p])
  try:
    done = subprocess.run([sys.executable, script], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=TIMEOUT_S, check=False)
  except subprocess.TimeoutExpired as err:
    raise CommandError(f'{label}: the python block ran past {TIMEOUT_S} s'
                       ) from err
  if done.returncode != 0:
    raise CommandError(f'{label}: the python block exited {done.returncode}'
                       '; its output ends:\n' + done.stdout[-4000:])
  return done.stdout


def preset_command(name: str) -> str:
  """The documented way to run a preset."""
  return ('.venv/bin/python experiments/main.py '
          f'--flagfile=experiments/configs/{name}')


def presets() -> list[str]:
  return sorted(f for f in os.listdir(CONFIGS) if f.endswith('.flags'))


def preset_shard(index: int, count: int) -> list[str]:
  """Shard `index` of `count` of the presets, dealt longest first to the
  least loaded shard by the measured costs in smoke_costs.json, so the
  shards' files take about the same time on xdist's workers."""
  import json  # pylint: disable=g-import-not-at-top
  with open(os.path.join(ROOT, 'tests', 'smoke_costs.json')) as f:
    costs = json.load(f)
  loads, shards = [0.0] * count, [[] for _ in range(count)]
  for name in sorted(presets(), key=lambda n: (-costs.get(n, 30), n)):
    k = loads.index(min(loads))
    shards[k].append(name)
    loads[k] += costs.get(name, 30)
  return sorted(shards[index])
