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
older ones if a step does not restore. A step that fails is never deleted:
it is moved aside to `.broken/<step>` and named in the log. If steps exist
but none restores (a corrupt run, or one written by a version whose state
had another structure), `CheckpointError` is raised instead of silently
starting over.
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
_BROKEN = '.broken'


class CheckpointError(ValueError):
  """Checkpoints exist but none restores into the expected state."""


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

  def _set_aside(self, step: int) -> str:
    """Moves a step that does not restore to .broken/ (kept, not deleted)."""
    path = os.path.join(self.directory, str(step))
    broken = os.path.join(self.directory, _BROKEN)
    os.makedirs(broken, exist_ok=True)
    target = os.path.join(broken, str(step))
    suffix = 0
    while os.path.exists(target):
      suffix += 1
      target = os.path.join(broken, f'{step}.{suffix}')
    if os.path.exists(path):
      os.replace(path, target)
    self._manager.reload()
    return target

  def restore_latest(self, like: PyTree) -> tuple[int, PyTree] | None:
    """(step, state) of the newest step that restores, or None if none exist.

    Args:
      like: a pytree with the target's structure, shapes and dtypes.

    Raises:
      CheckpointError: steps exist but none restores.
    """
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    failed = []
    for step in reversed(self.steps()):
      try:
        state = self._manager.restore(
            step, args=ocp.args.StandardRestore(abstract))
      except Exception as err:  # pylint: disable=broad-except
        moved = self._set_aside(step)
        logging.warning('checkpoint step %d does not restore (%s: %s); '
                        'moved aside to %s', step, type(err).__name__,
                        str(err).split('\n')[0][:300], moved)
        failed.append((step, moved))
        continue
      return step, state
    if failed:
      raise CheckpointError(
          f'no checkpoint in {self.directory} restores (tried steps '
          f'{[s for s, _ in failed]}, now under {_BROKEN}/): the run is '
          'corrupt or was written by a version with another state layout. '
          'Nothing was deleted; use another workdir to start over.')
    return None

  def close(self) -> None:
    self._manager.close()
