"""Atomic, verified checkpoints of the ServerState (orbax).

Saves: orbax writes each step into a temporary directory and renames it
into place when complete, so a kill mid-save leaves no step that looks
finished.

Deletes: orbax's default deletion removes an old step's files in place; a
kill in the middle leaves a half-deleted step that is still listed and then
fails to restore. Here old steps are first renamed into a trash directory
(`todelete_subdir`, one atomic rename), and the trash is emptied afterwards
and at every start.

Start-up: `restore_latest` tries the newest step first and falls back to
older ones if a step does not restore, moving the broken one to the trash.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

PyTree = Any
_TRASH = '.trash'


class Checkpointer:
  """Keeps the last `keep` steps of a pytree under `directory`."""

  def __init__(self, directory: str, *, keep: int = 2):
    self.directory = os.path.abspath(directory)
    os.makedirs(self.directory, exist_ok=True)
    self._empty_trash()
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, todelete_subdir=_TRASH,
            enable_async_checkpointing=False))

  def _empty_trash(self) -> None:
    shutil.rmtree(os.path.join(self.directory, _TRASH), ignore_errors=True)

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: PyTree) -> None:
    self._manager.save(step, args=ocp.args.StandardSave(state), force=True)
    self._manager.wait_until_finished()
    self._empty_trash()

  def _discard(self, step: int) -> None:
    path = os.path.join(self.directory, str(step))
    trash = os.path.join(self.directory, _TRASH)
    os.makedirs(trash, exist_ok=True)
    if os.path.exists(path):
      os.replace(path, os.path.join(trash, f'{step}.broken'))
    self._manager.reload()
    self._empty_trash()

  def restore_latest(self, like: PyTree) -> tuple[int, PyTree] | None:
    """(step, state) of the newest step that restores, or None.

    Args:
      like: a pytree with the target's structure, shapes and dtypes.
    """
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    for step in reversed(self.steps()):
      try:
        state = self._manager.restore(
            step, args=ocp.args.StandardRestore(abstract))
      except Exception as err:  # pylint: disable=broad-except
        logging.warning('checkpoint step %d does not restore (%s); '
                        'discarding it', step, err)
        self._discard(step)
        continue
      return step, state
    return None

  def close(self) -> None:
    self._manager.close()
