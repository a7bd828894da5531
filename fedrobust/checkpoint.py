"""Atomic, verified checkpoints of the ServerState (orbax).

Saves: orbax writes each step into a temporary directory and renames it
into place when complete, so a kill mid-save leaves no step that looks
finished; such a temporary directory is removed at the next start. A
save that would not fit on the disk is refused before it writes
anything (uncompressed, the state's size is known). After the step is in
place, a content hash of the whole state (every leaf's dtype, shape and
bytes, in tree order) is written beside it as `.integrity/<step>.sha256`,
atomically. A kill between the two leaves a step without a hash, which
counts as unverified.

Deletes: orbax's default deletion removes an old step's files in place; a
kill in the middle leaves a half-deleted step that is still listed and then
fails to restore. Here old steps are first renamed into a trash directory
(`todelete_subdir`, one atomic rename), and the trash is emptied afterwards
and at every start.

File list: beside the hash, `.integrity/<step>.files.json` records every
file of the step with its size, and the sha256 of the small ones
(metadata, manifests). A restore compares them first, so a step with a
file cut short, lost, added or with a damaged manifest is set aside
before orbax reads it (orbax's asynchronous reads of such files fail
with tracebacks printed from callbacks that outlive their event loop).

Host ledger: `save(step, state, ledger=...)` can record a small JSON
object beside the step (`.integrity/<step>.ledger.json`, written
atomically before the hash, with its own sha256 inside): host-side run
totals, such as cumulative detection counts, that must resume with the
state. A step whose ledger does not match its checksum is bad, like a
step whose state does not match its hash.

Start-up: `restore_latest` tries the newest step first. A step that fails
to restore, has no hash, or whose restored content does not match its hash
(a flipped bit anywhere in its files) is never deleted: it is moved aside
to `.broken/<step>` and named in the log, and the next older step is
tried. If steps exist but none is good, `CheckpointError` is raised
instead of silently starting over.

Memory: a save adds nothing to the state's own footprint (no compression
by default, whole leaves in one chunk), the C heap is trimmed after saves
and restores, and a restore peaks at the state plus about one leaf. Each
is measured in BUILD_NOTES §2c.

Several processes (jax.distributed, one per host): every process calls
`save` and `restore_latest` on the same directory, which must be shared.
Orbax writes each array's shards from the process that holds them and
synchronises the processes on each save. Process 0 alone writes the
hashes, moves bad steps aside and empties the trash; the others wait for
it at a barrier. The state must be fully replicated (the runner's is) so
that every process can hash it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
import shutil
from typing import Any, Callable

import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

PyTree = Any
_TRASH = '.trash'
_BROKEN = '.broken'
_INTEGRITY = '.integrity'
# Files of a step up to this size have their sha256 in its file list.
_HASHED_FILE_BYTES = 1 << 20
_UNFINISHED = '.orbax-checkpoint-tmp'   # orbax's name for a step in writing
# Bytes a restore may hold in flight beyond the restored state (GB; at
# least the largest leaf's size, Checkpointer._restore).
RESTORE_IN_FLIGHT_GB = 1.0


class CheckpointError(ValueError):
  """Checkpoints exist but none restores into the expected state."""


class CheckpointSpaceError(OSError):
  """A step would not fit on its disk; nothing of it was written."""


def is_primary() -> bool:
  """True in the process that writes shared files (process 0)."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits for every process to reach `name` (a no-op in one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def state_digest(tree: PyTree) -> str:
  """sha256 over every leaf's dtype, shape and bytes, in tree order."""
  digest = hashlib.sha256()
  # One leaf at a time, and its bytes through a uint8 view: no host copy
  # of the tree or of a leaf's bytes (a CPU array's device_get shares its
  # buffer), so hashing FedHAN's multi-GB client cache adds no peak memory.
  for leaf in jax.tree.leaves(tree):
    leaf = np.asarray(jax.device_get(leaf))
    digest.update(f'{leaf.dtype.str}{leaf.shape};'.encode())
    digest.update(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8))
  return digest.hexdigest()


def release_freed_heap() -> bool:
  """Returns the C heap's freed pages to the OS (glibc's malloc_trim).

  Orbax's writer (tensorstore) compresses a save in many small buffers
  spread over its threads' malloc arenas. Freed, they stay in the process:
  measured on a 1 GB random bfloat16 state, each save left 0.69 GB behind
  and the next save grew it again, so FedHAN's 1,000-client run crept by
  about 1 GB a save. Trimming after each save and restore gives it back.
  False where the C library has no malloc_trim (not glibc).
  """
  try:
    libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
    return bool(libc.malloc_trim(0))
  except (OSError, AttributeError):
    return False


def _itemsize(dtype) -> int:
  """Bytes per element (a typed PRNG key's dtype counts its key data)."""
  try:
    return np.dtype(dtype).itemsize
  except TypeError:
    return int(getattr(dtype, 'itemsize', 0)) or 16


def _nbytes(leaf) -> int:
  """A leaf's size in bytes, from its shape and dtype (no host copy)."""
  dtype = leaf.dtype if hasattr(leaf, 'dtype') else np.asarray(leaf).dtype
  return int(np.prod(np.shape(leaf))) * _itemsize(dtype)


def write_atomic(path: str, data: bytes) -> None:
  """Writes `data` to `path` through a fresh temporary file and a rename.

  The temporary file is created with O_EXCL | O_NOFOLLOW, so a symlink (or
  a stale file) planted at `path + '.tmp'` is removed first and never
  followed; the rename replaces `path` itself, even if it is a symlink.
  """
  tmp = path + '.tmp'
  if os.path.lexists(tmp):
    os.unlink(tmp)
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL |
               getattr(os, 'O_NOFOLLOW', 0), 0o644)
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
  except BaseException:
    os.unlink(tmp)
    raise
  os.replace(tmp, path)


def _to_device(leaves: list, treedef, abstract: PyTree) -> PyTree:
  """The tree of `leaves` (NumPy; the list is consumed) as jax arrays
  placed like `abstract`'s leaves (this process's first device where a
  leaf has no sharding), one leaf at a time, each host leaf released once
  its copy is made. The caller must hold no other reference to them."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  targets = jax.tree.leaves(abstract)
  for i, target in enumerate(targets):
    sharding = getattr(target, 'sharding', None) or device
    # may_alias=False: a copy the runtime owns. An array aliasing NumPy
    # memory cannot be donated in place, so the first round would hold
    # the state twice.
    leaves[i] = jax.block_until_ready(
        jax.device_put(leaves[i], sharding, may_alias=False))
  return jax.tree.unflatten(treedef, leaves)


class Checkpointer:
  """Keeps the last `keep` steps of a pytree under `directory`."""

  def __init__(self, directory: str, *, keep: int = 2,
               restore_in_flight_gb: float = RESTORE_IN_FLIGHT_GB,
               compress: bool = False):
    """restore_in_flight_gb: bytes (in GB) a restore may read ahead of the
    state it builds; raised to just above the largest leaf, which orbax
    reads in one piece.

    compress: zstd-compress new steps. Off by default: orbax compresses a
    leaf into a buffer of about its compressed size before writing it, so
    a save of S bytes peaked at about 1.76 S (measured: a 3 GB random
    bfloat16 state, +2.29 GB), against S without, for files about 29%
    larger. A save that runs out of memory loses the rounds since the
    last step; disk is the cheaper resource. Steps written either way
    restore either way."""
    self.directory = os.path.abspath(directory)
    self._keep = keep
    self._compress = compress
    self._restore_bytes = int(restore_in_flight_gb * 1e9)
    if is_primary():
      os.makedirs(self.directory, exist_ok=True)
      self._empty_trash()
    barrier(f'checkpointer-open {self.directory}')
    self._manager = self._open(self._restore_bytes)

  def _open(self, restore_bytes: int) -> ocp.CheckpointManager:
    """The orbax manager, with `restore_bytes` in flight on restore.

    A restore reads each leaf into a buffer and then copies it out, so
    with orbax's default (96 GB in flight) a state of S bytes peaks at
    about 1.7-2 S. Limited, the leaves come in a few at a time and the
    peak is S plus about the largest leaf: FedHAN's 1,000-client cache
    (about 13 GB of state) resumes on a 24 GB host. Orbax refuses a leaf
    that does not fit in the limit, so _restore raises it per state.
    """
    self._manager_restore_bytes = restore_bytes
    return ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=self._keep, create=True, todelete_subdir=_TRASH,
            enable_async_checkpointing=False),
        item_handlers=ocp.PyTreeCheckpointHandler(
            use_compression=self._compress,
            restore_concurrent_gb=restore_bytes / 1e9))

  def _empty_trash(self) -> None:
    """Empties the trash, and removes the temporary directories of saves
    that never finished (killed, or out of disk). Orbax's own clean-up of
    those runs in a background thread; this one is done when it returns.
    """
    shutil.rmtree(os.path.join(self.directory, _TRASH), ignore_errors=True)
    for name in os.listdir(self.directory):
      if _UNFINISHED in name:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def _hash_path(self, step: int) -> str:
    return os.path.join(self.directory, _INTEGRITY, f'{step}.sha256')

  def _ledger_path(self, step: int) -> str:
    return os.path.join(self.directory, _INTEGRITY, f'{step}.ledger.json')

  def _files_path(self, step: int) -> str:
    return os.path.join(self.directory, _INTEGRITY, f'{step}.files.json')

  def _step_files(self, step: int) -> dict[str, list]:
    """{path relative to the step: [size in bytes, sha256 or None]} of
    its files; the sha256 of the small ones (metadata and manifests, up
    to _HASHED_FILE_BYTES), whose damage orbax cannot survive quietly.
    The array data is covered by the state's content hash."""
    top = os.path.join(self.directory, str(step))
    found = {}
    for folder, _, names in os.walk(top):
      for name in names:
        path = os.path.join(folder, name)
        size = os.path.getsize(path)
        digest = None
        if size <= _HASHED_FILE_BYTES:
          with open(path, 'rb') as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        found[os.path.relpath(path, top)] = [size, digest]
    return found

  def _files_changed(self, step: int) -> str | None:
    """Why the step's files are not those it was saved with (a file
    missing, added or of another size), or None; None too for a step
    saved without a file list. Checked before orbax reads the step: a
    truncated file fails inside orbax's asynchronous reads, which then
    print tracebacks from callbacks that outlive their event loop."""
    try:
      with open(self._files_path(step)) as f:
        recorded = json.load(f)
    except FileNotFoundError:
      return None
    except (OSError, ValueError) as err:
      return f'unreadable file list ({type(err).__name__})'
    found = self._step_files(step)
    for name in sorted(set(recorded) | set(found)):
      if name not in found:
        return f'its file {name} is missing'
      if name not in recorded:
        return f'it has a file {name} it was not saved with'
      (size, digest), (saved_size, saved_digest) = found[name], recorded[name]
      if size != saved_size:
        return (f'its file {name} has {size} bytes, {saved_size} when '
                'saved (cut short or replaced)')
      if digest != saved_digest:
        return f'its file {name} does not match its recorded sha256'
    return None

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: PyTree, ledger: dict | None = None
           ) -> None:
    """Saves `state` as `step`, and `ledger` (a JSON-serialisable dict of
    host-side totals) beside it when given.

    Raises:
      CheckpointSpaceError: uncompressed, the state is larger than the
        disk's free space (checked first: a save that fills the disk
        fails halfway and leaves a temporary directory). Older steps are
        untouched.
    """
    if not self._compress:
      needed = sum(_nbytes(leaf) for leaf in jax.tree.leaves(state))
      free = shutil.disk_usage(self.directory).free
      if needed > free:
        raise CheckpointSpaceError(
            f'step {step} needs about {needed / 1e9:.2f} GB (the state, '
            f'uncompressed) and {self.directory} has {free / 1e9:.2f} GB '
            'free; free space there, keep fewer steps (keep), or compress '
            'them (compress=True)')
    # No OCDBT file-size target: with orbax's default (2 GiB) a larger leaf
    # is cut into chunks along its largest axis, which copies it (measured:
    # +3.25 GB saving FedHAN's [1000, 1663370] cache leaf; +0 without).
    self._manager.save(step, args=ocp.args.PyTreeSave(
        state, ocdbt_target_data_file_size=0), force=True)
    self._manager.wait_until_finished()
    release_freed_heap()
    if is_primary():
      os.makedirs(os.path.join(self.directory, _INTEGRITY), exist_ok=True)
      if ledger is not None:    # before the hash, which completes the step
        body = json.dumps(ledger, sort_keys=True)
        write_atomic(self._ledger_path(step), json.dumps(
            {'sha256': hashlib.sha256(body.encode()).hexdigest(),
             'ledger': json.loads(body)}, sort_keys=True).encode())
      elif os.path.exists(self._ledger_path(step)):   # a stale one
        os.unlink(self._ledger_path(step))
      write_atomic(self._files_path(step), json.dumps(
          self._step_files(step), sort_keys=True).encode())
      write_atomic(self._hash_path(step), state_digest(state).encode())
      self._empty_trash()
      kept = {str(s) for s in self.steps()}
      for name in os.listdir(os.path.join(self.directory, _INTEGRITY)):
        if name.split('.')[0] not in kept:      # hashes of retired steps
          os.unlink(os.path.join(self.directory, _INTEGRITY, name))
    barrier(f'checkpoint-saved {self.directory} {step}')

  def _set_aside(self, step: int) -> str:
    """Moves a bad step (and its hash) to .broken/ (kept, not deleted).

    Every process reads the same files, so all of them find the step bad;
    process 0 moves it."""
    path = os.path.join(self.directory, str(step))
    broken = os.path.join(self.directory, _BROKEN)
    os.makedirs(broken, exist_ok=True)
    target = os.path.join(broken, str(step))
    suffix = 0
    while os.path.exists(target):
      suffix += 1
      target = os.path.join(broken, f'{step}.{suffix}')
    barrier(f'checkpoint-set-aside {self.directory} {step} read')
    if is_primary():
      if os.path.exists(path):
        os.replace(path, target)
      if os.path.exists(self._hash_path(step)):
        os.replace(self._hash_path(step), target + '.sha256')
      if os.path.exists(self._ledger_path(step)):
        os.replace(self._ledger_path(step), target + '.ledger.json')
      if os.path.exists(self._files_path(step)):
        os.replace(self._files_path(step), target + '.files.json')
    barrier(f'checkpoint-set-aside {self.directory} {step} moved')
    self._manager.reload()
    return target

  def _verified(self, step: int, state: PyTree) -> str | None:
    """None if `state` matches the step's recorded hash, else the reason."""
    try:
      with open(self._hash_path(step)) as f:
        expected = f.read().strip()
    except FileNotFoundError:
      return 'no integrity hash (saved by an older version or cut short)'
    except (OSError, ValueError) as err:
      return f'unreadable integrity hash ({type(err).__name__})'
    actual = state_digest(state)
    if actual != expected:
      return (f'content hash {actual[:12]}... differs from the recorded '
              f'{expected[:12]}...')
    try:
      self.ledger(step)
    except (OSError, ValueError, KeyError, TypeError) as err:
      return f'bad ledger ({type(err).__name__}: {err})'
    return None

  def ledger(self, step: int) -> dict | None:
    """The ledger saved with `step`: None when the step has none (e.g.
    one written by an older version), ValueError if it does not match its
    checksum (restore_latest sets such a step aside)."""
    try:
      with open(self._ledger_path(step)) as f:
        record = json.load(f)
    except FileNotFoundError:
      return None
    body = json.dumps(record['ledger'], sort_keys=True)
    if hashlib.sha256(body.encode()).hexdigest() != record['sha256']:
      raise ValueError('its content does not match its recorded sha256')
    return record['ledger']

  def _restore(self, step: int, like: PyTree) -> tuple[PyTree, str | None]:
    """(state, None) if the step restores as `like` and verifies, else
    (None, why not).

    Leaves come back as jax arrays with `like`'s shardings; a leaf of
    `like` without one (a jax.eval_shape template) comes back on this
    process's first device. Orbax reads the step into host memory (NumPy,
    a few leaves in flight), the digest is checked there, and each leaf
    is then copied into an array the runtime owns, its host copy freed
    before the next: the peak is the state plus about one leaf. Measured
    on FedHAN's 1,000-client state (12.4 GB, a 3.3 GB largest leaf): a
    restore straight into jax arrays peaked at 20.5-23.7 GB; a NumPy
    state handed to the caller's device_put, held while copied, took the
    process past 24 GB (OOM).
    """
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    largest = max(map(_nbytes, jax.tree.leaves(abstract)), default=0)
    needed = max(self._restore_bytes, largest + 1)
    if needed != self._manager_restore_bytes:
      self._manager.close()
      self._manager = self._open(needed)
    on_host = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), abstract)
    changed = self._files_changed(step)
    if changed is not None:
      return None, changed
    try:
      state = self._manager.restore(step, args=ocp.args.PyTreeRestore(
          on_host, restore_args=ocp.checkpoint_utils.construct_restore_args(
              on_host)))
      release_freed_heap()
      reason = self._verified(step, state)
    except Exception as err:  # pylint: disable=broad-except
      return None, (f'does not restore ({type(err).__name__}: '
                    f'{str(err).splitlines()[0][:300] if str(err) else ""})')
    if reason is not None:
      return None, reason
    # Orbax restores a leaf in its saved shape whatever the template
    # says: a state of another size (another client count, rank, model)
    # must not pass as this one.
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(
        state)[0], jax.tree.leaves(on_host)):
      if tuple(np.shape(got)) != tuple(want.shape):
        return None, (f'has {jax.tree_util.keystr(path)} of shape '
                      f'{tuple(np.shape(got))}, expected {tuple(want.shape)}')
    leaves, treedef = jax.tree.flatten(state)
    del state
    return _to_device(leaves, treedef, abstract), None

  def restore_latest(self, like: PyTree, *,
                     legacy: tuple[tuple[PyTree, Callable[[PyTree], PyTree]],
                                   ...] = ()
                     ) -> tuple[int, PyTree] | None:
    """(step, state) of the newest good step, or None if none exist.

    Args:
      like: a pytree with the target's structure, shapes and dtypes.
      legacy: (template, convert) pairs for layouts written by earlier
        versions: a step that does not restore as `like` is tried as each
        template in turn (verified as written), then converted.

    Raises:
      CheckpointError: steps exist but none is good.
    """
    failed = []
    for step in reversed(self.steps()):
      state, reason = self._restore(step, like)
      for old_like, convert in legacy if reason is not None else ():
        old, why = self._restore(step, old_like)
        if why is None:
          state, reason = convert(old), None
          break
      if reason is None:
        return step, state
      moved = self._set_aside(step)
      logging.warning('checkpoint step %d in %s is bad: %s; moved aside to '
                      '%s, trying the previous step', step, self.directory,
                      reason, moved)
      failed.append(step)
    if failed:
      raise CheckpointError(
          f'no checkpoint in {self.directory} is good (steps {failed} failed '
          f'to restore or verify; they are kept under {_BROKEN}/): the run '
          'is corrupt or was written by a version with another state '
          'layout. Nothing was deleted; use another workdir, or overwrite '
          'the run, to start over.')
    return None

  def restore(self, step: int, like: PyTree) -> PyTree:
    """The state saved as `step`, verified, for a reader of a run (an
    analysis tool). Unlike `restore_latest` it never moves a step aside.

    Raises:
      CheckpointError: no such step, or it does not restore as `like` or
        verify.
    """
    if step not in self.steps():
      raise CheckpointError(f'{self.directory} has no step {step} (steps: '
                            f'{self.steps()})')
    state, reason = self._restore(step, like)
    if reason is not None:
      raise CheckpointError(f'step {step} in {self.directory} is bad: '
                            f'{reason}')
    return state

  def close(self) -> None:
    self._manager.close()
