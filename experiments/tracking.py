"""Experiment tracking: every metrics row as TensorBoard scalars.

Each evaluated round's row (metrics.jsonl) goes to
`<workdir>/tensorboard/` as scalars at step = round: the headline metrics,
per-cohort and per-width values (`test_accuracy/<cohort>`), the backdoor
rates, detection rates and counts, and each per-client value's AUC
against the attackers (`clients_auc/<name>`). Lists (the per-client rows)
stay in metrics.jsonl. The writer is tensorboardX, which needs no
TensorFlow; `tensorboard --logdir <workdir>/tensorboard` reads the files.

On resume the writer purges the events of rounds after the checkpoint it
resumed from, so TensorBoard shows each round once.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Iterable

TENSORBOARD_DIR = 'tensorboard'


def scalars(row: dict[str, Any], prefix: str = '') -> Iterable[tuple[str,
                                                                     float]]:
  """(tag, value) for every finite number in a metrics row, nested dicts
  flattened with '/'; 'round' itself, strings, lists and non-finite
  values are left out."""
  for key, value in row.items():
    tag = f'{prefix}{key}'
    if key == 'round' and not prefix:
      continue
    if isinstance(value, dict):
      yield from scalars(value, tag + '/')
    elif isinstance(value, bool):
      yield tag, float(value)
    elif isinstance(value, (int, float)) and math.isfinite(value):
      yield tag, float(value)


class TensorBoard:
  """Writes metrics rows under `<workdir>/tensorboard/`.

  keep_through: on a resume, the last round whose earlier events stay
  (the checkpoint's round, or the round before the first restored row):
  events of later rounds from an earlier attempt are purged. None for a
  fresh run.
  """

  def __init__(self, workdir: str, keep_through: int | None):
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    self.logdir = os.path.join(workdir, TENSORBOARD_DIR)
    # A file name of its own: event files are named by the second, and a
    # run resumed within the same second would otherwise reopen (and
    # truncate) the earlier attempt's file.
    self._writer = SummaryWriter(
        self.logdir,
        purge_step=None if keep_through is None else keep_through + 1,
        filename_suffix=f'.{time.time_ns()}')

  def log(self, row: dict[str, Any]) -> None:
    step = int(row['round'])
    for tag, value in scalars(row):
      self._writer.add_scalar(tag, value, step)
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


class NoTracking:
  """Stands in where nothing is tracked (--notensorboard, other processes)."""

  def log(self, row: dict[str, Any]) -> None:
    del row

  def close(self) -> None:
    pass
