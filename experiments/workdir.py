"""The run directory: an exclusive lock, safe overwrite, strict and atomic
files.

Files the runner writes (and the only ones --overwrite removes):
  config.json, client_histograms.json, metrics.jsonl, summary.json,
  curves.png, clients.png, checkpoints/, .lock, and their *.tmp siblings.

Every JSON file is strict JSON: a non-finite number is written as null and
the row (or summary) gets a 'nonfinite' list naming the keys. Whole files
are written through a fresh temporary file (O_EXCL | O_NOFOLLOW) and a
rename, so a symlink planted in the workdir is never followed; metrics rows
are appended with O_NOFOLLOW and fsynced one by one.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import shutil
from typing import Any, Callable

from absl import logging

from fedrobust.checkpoint import write_atomic

RUNNER_FILES = ('config.json', 'client_histograms.json', 'metrics.jsonl',
                'rounds.jsonl', 'summary.json', 'curves.png', 'clients.png',
                'checkpoints', 'tensorboard', '.lock')


class WorkdirError(ValueError):
  """The workdir cannot be used as asked (locked, foreign files, corrupt)."""


class ConfigMismatchError(ValueError):
  """A resume whose config differs from the run in the workdir."""


def strict(obj: Any, path: str = '') -> tuple[Any, list[str]]:
  """(obj with non-finite floats as None, the keys where that happened)."""
  if isinstance(obj, float) and not math.isfinite(obj):
    return None, [path]
  if isinstance(obj, dict):
    out, bad = {}, []
    for k, v in obj.items():
      out[k], b = strict(v, f'{path}.{k}' if path else str(k))
      bad += b
    return out, bad
  if isinstance(obj, (list, tuple)):
    out, bad = [], []
    for i, v in enumerate(obj):
      value, b = strict(v, f'{path}[{i}]')
      out.append(value)
      bad += b
    return out, bad
  return obj, []


def dumps(obj: dict[str, Any], **kwargs) -> str:
  """Strict JSON of a dict; non-finite numbers -> null + 'nonfinite' keys."""
  clean, bad = strict(obj)
  if bad:
    clean['nonfinite'] = sorted(set(bad) | set(clean.get('nonfinite') or ()))
  return json.dumps(clean, allow_nan=False, **kwargs)


def write_json(path: str, obj: dict[str, Any]) -> None:
  write_atomic(path, dumps(obj, indent=2, sort_keys=True).encode())


def append_row(path: str, row: dict[str, Any]) -> None:
  """Appends one strict-JSON line whole and fsyncs it (never follows a
  symlink).

  The line goes out in one write(2) on an O_APPEND descriptor, not
  through a buffered file that may split it, so a reader never sees half
  a row next to a whole one, and only a crash inside that one call can
  leave a cut line (which `read_metrics` drops, and the runner restores).
  """
  data = (dumps(row) + '\n').encode()
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT |
               getattr(os, 'O_NOFOLLOW', 0), 0o644)
  try:
    view = memoryview(data)
    while view:                       # a short write: the rest follows
      view = view[os.write(fd, view):]
    os.fsync(fd)
  finally:
    os.close(fd)


def read_json_object(path: str) -> dict[str, Any]:
  """A JSON object from `path`, or WorkdirError naming the file."""
  try:
    with open(path) as f:
      value = json.load(f)
  except (OSError, ValueError) as err:
    raise WorkdirError(f'{path} is not readable JSON ({err}); fix or '
                       'remove it, or use another workdir') from None
  if not isinstance(value, dict):
    raise WorkdirError(f'{path} holds a {type(value).__name__}, not a JSON '
                       'object; fix or remove it, or use another workdir')
  return value


def read_metrics(path: str, last_round: int, *, rewrite: bool = True
                 ) -> list[dict[str, Any]]:
  """The rows of metrics.jsonl up to `last_round`; with `rewrite`, the file
  is rewritten without later rows (they will be recomputed).

  A cut last line (a kill mid-write) is dropped; any other line that is
  not a metrics row is an error naming the file and line.
  """
  rows = []
  if os.path.lexists(path):
    with open(path) as f:
      lines = f.read().split('\n')
    while lines and not lines[-1].strip():
      lines.pop()
    for number, line in enumerate(lines, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except ValueError:
        if number == len(lines):      # a line cut by a kill
          logging.warning('%s:%d was cut mid-write (a crash); dropped it',
                          path, number)
          continue
        raise WorkdirError(f'{path}:{number} is not JSON; fix or remove '
                           'the line') from None
      if not (isinstance(row, dict) and isinstance(row.get('round'), int)):
        raise WorkdirError(f'{path}:{number} is not a metrics row (a JSON '
                           "object with an integer 'round'); fix or remove "
                           'the line')
      if row['round'] <= last_round:
        rows.append(row)
  if rewrite:
    write_atomic(path, ''.join(dumps(r) + '\n' for r in rows).encode())
  return rows


class Lock:
  """An exclusive lock on the workdir, held for the life of the run."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, '.lock')
    self._fd = None

  def __enter__(self) -> 'Lock':
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT |
                 getattr(os, 'O_NOFOLLOW', 0), 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
      holder = os.pread(fd, 64, 0).decode(errors='replace').strip()
      os.close(fd)
      if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        raise WorkdirError(
            f'{os.path.dirname(self.path)} is in use by another run '
            f'(pid {holder or "?"} holds {self.path}); wait for it to '
            'finish or use another --workdir') from None
      raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    self._fd = fd
    return self

  def __exit__(self, *exc) -> None:
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None


def foreign_entries(workdir: str) -> list[str]:
  """Entries of the workdir the runner did not write."""
  ours = set(RUNNER_FILES) | {f + '.tmp' for f in RUNNER_FILES}
  return sorted(e for e in os.listdir(workdir) if e not in ours)


def remove_runner_files(workdir: str, *, force: bool) -> None:
  """--overwrite: removes the runner's files, and nothing else.

  Raises:
    WorkdirError: the workdir holds other entries and force is False.
  """
  foreign = foreign_entries(workdir)
  if foreign and not force:
    raise WorkdirError(
        f'--overwrite would discard the run in {workdir}, which also holds '
        f'files the runner did not write: {foreign[:10]}'
        f'{" ..." if len(foreign) > 10 else ""}. They are left alone; pass '
        '--force_overwrite as well to remove only the runner\'s files '
        'anyway, or use another --workdir.')
  for name in RUNNER_FILES:
    if name == '.lock':
      continue                    # held by this run
    for entry in (name, name + '.tmp'):
      path = os.path.join(workdir, entry)
      if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
      elif os.path.lexists(path):
        os.unlink(path)


def prepare(config: dict[str, Any], *, defaults: dict[str, Any],
            resumable: frozenset, execution: frozenset,
            normalize: Callable[[dict], dict]) -> bool:
  """Checks a resume keeps the config, or discards the run on --overwrite;
  then writes config.json. Call with the lock held.

  Returns:
    True if an existing run was discarded.
  """
  workdir = config['workdir']
  path = os.path.join(workdir, 'config.json')
  discarded = False
  if os.path.lexists(path):
    saved = normalize({**defaults, **read_json_object(path)})
    current = normalize({**defaults, **config})
    differ = sorted(k for k in set(saved) | set(current)
                    if k not in resumable | execution
                    and saved.get(k) != current.get(k))
    if differ and not config['overwrite']:
      details = ', '.join(f'--{k} (was {saved.get(k)!r}, now '
                          f'{current.get(k)!r})' for k in differ)
      raise ConfigMismatchError(
          f'{workdir} holds a run with a different config: {details}. '
          'Pass --overwrite to discard it, or use another --workdir.')
    if differ:
      logging.warning('--overwrite: discarding the run in %s', workdir)
      remove_runner_files(workdir, force=config['force_overwrite'])
      discarded = True
    else:
      changed = sorted(k for k in execution if saved.get(k) !=
                       current.get(k))
      if changed:
        logging.warning('resuming with changed execution settings %s: '
                        'results match within float tolerance, not '
                        'bitwise', changed)
  write_json(path, {k: v for k, v in config.items()
                    if k not in ('overwrite', 'force_overwrite')})
  return discarded
