"""Your own data: arrays in, a `Dataset` the runner and the library take.

  from fedrobust.data import from_arrays
  dataset = from_arrays(x, y, client_ids=writer)   # x uint8 [N, H, W(, C)]

With `client_ids` (one id per example, e.g. FEMNIST's writer), the
'natural' partitioner keeps each id as one client. The runner reads the
same arrays from an .npz file: `--dataset=npz --data_dir=FILE.npz`, the
file holding `x` and `y`, and optionally `client_id`, `test_x` and
`test_y` (`save_npz` writes one).
"""

from __future__ import annotations

import os

import numpy as np

from fedrobust.data.sources import DataNotFoundError, Dataset, check_labels
from fedrobust.errors import SettingError


def _images(x: np.ndarray, what: str) -> np.ndarray:
  """uint8 images [N, H, W, C] (a missing channel axis is added; floats
  in [0, 1] are scaled to 0..255), or int32 token ids [N, L] kept as they
  are."""
  x = np.asarray(x)
  if x.ndim == 2 and np.issubdtype(x.dtype, np.integer):
    return x.astype(np.int32)                  # token ids
  if x.ndim == 3:
    x = x[..., None]
  if x.ndim != 4:
    raise SettingError(what, 'expected images [N, H, W] or [N, H, W, C], or '
                       f'token ids [N, L], got shape {x.shape}')
  if x.dtype == np.uint8:
    return x
  if np.issubdtype(x.dtype, np.floating):
    if x.size and (np.nanmin(x) < 0 or np.nanmax(x) > 1 or
                   not np.all(np.isfinite(x))):
      raise SettingError(what, 'float images must lie in [0, 1] (they are '
                         'stored as uint8); pass uint8 0..255 instead')
    return np.round(x * 255).astype(np.uint8)
  raise SettingError(what, f'expected uint8 or float images, got {x.dtype}')


def _labels(y: np.ndarray, n: int, what: str) -> np.ndarray:
  y = np.asarray(y)
  if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
    raise SettingError(what, f'expected integer labels [N], got {y.dtype} '
                       f'{y.shape}')
  if len(y) != n:
    raise SettingError(what, f'has {len(y)} labels for {n} examples')
  if y.size and y.min() < 0:
    raise SettingError(what, 'labels must be non-negative')
  return y.astype(np.int32)


def from_arrays(x: np.ndarray, y: np.ndarray, *,
                client_ids: np.ndarray | None = None,
                test_x: np.ndarray | None = None,
                test_y: np.ndarray | None = None,
                num_classes: int | None = None,
                test_fraction: float = 0.2, seed: int = 0,
                name: str = 'arrays') -> Dataset:
  """A classification `Dataset` from arrays.

  Args:
    x: uint8 images [N, H, W] or [N, H, W, C] (float images in [0, 1] are
      scaled to uint8), or int32 token ids [N, L].
    y: int labels [N] in [0, num_classes).
    client_ids: optional [N] id of the client (writer, device, user) each
      example belongs to, any integers; stored 0..G-1 in order of the ids
      as `train_groups` (and `test_groups`), which the 'natural'
      partitioner turns into one client each.
    test_x, test_y: a test split. Without one, a seeded `test_fraction` of
      the examples, stratified by label, is held out as the test split.
    num_classes: the class count (default: max label + 1).
    test_fraction: the held-out share when no test split is given.
    seed: the hold-out's seed.
    name: the dataset's name in summaries.

  Raises:
    SettingError: naming the argument that is malformed.
  """
  x = _images(x, 'x')
  y = _labels(y, len(x), 'y')
  ids = None
  if client_ids is not None:
    raw = np.asarray(client_ids)
    if raw.shape != (len(x),):
      raise SettingError('client_ids', f'expected one id per example, shape '
                         f'({len(x)},), got {raw.shape}')
    _, ids = np.unique(raw, return_inverse=True)
    ids = ids.astype(np.int32)
  if (test_x is None) != (test_y is None):
    raise SettingError('test_x', 'give test_x and test_y together, or '
                       'neither (a share of x is then held out)')
  test_ids = None
  if test_x is None:
    if not 0 < test_fraction < 1:
      raise SettingError('test_fraction', f'must be in (0, 1), got '
                         f'{test_fraction}')
    rng = np.random.default_rng(seed)
    held = np.concatenate([
        rows[:int(round(test_fraction * len(rows)))]
        for rows in (rng.permutation(np.flatnonzero(y == c))
                     for c in np.unique(y))])
    keep = np.setdiff1d(np.arange(len(y)), held)
    held = np.sort(held)
    test_x, test_y = x[held], y[held]
    if ids is not None:
      test_ids = ids[held]
    x, y = x[keep], y[keep]
    ids = None if ids is None else ids[keep]
  else:
    test_x = _images(test_x, 'test_x')
    test_y = _labels(test_y, len(test_x), 'test_y')
    if test_x.shape[1:] != x.shape[1:]:
      raise SettingError('test_x', f'examples of shape {test_x.shape[1:]} '
                         f'differ from x\'s {x.shape[1:]}')
  classes = int(max(y.max(initial=-1), test_y.max(initial=-1))) + 1
  if num_classes is None:
    num_classes = classes
  elif num_classes < classes:
    raise SettingError('num_classes', f'{num_classes} is below the largest '
                       f'label + 1 ({classes})')
  return check_labels(Dataset(x, y, test_x, test_y, int(num_classes), name,
                              train_groups=ids, test_groups=test_ids))


def save_npz(path: str, x: np.ndarray, y: np.ndarray, **arrays) -> None:
  """Writes the .npz file `--dataset=npz --data_dir=PATH` reads: `x`, `y`
  and any of `client_id`, `test_x`, `test_y`."""
  unknown = set(arrays) - {'client_id', 'test_x', 'test_y'}
  if unknown:
    raise SettingError('arrays', f'unknown keys {sorted(unknown)}; expected '
                       'client_id, test_x, test_y')
  np.savez_compressed(path, x=x, y=y, **arrays)


def load_npz(path: str | None) -> Dataset:
  """The `npz` source: `from_arrays` on the arrays of an .npz file."""
  if not path or not os.path.isfile(path):
    raise DataNotFoundError(
        f'--dataset=npz reads an .npz file named by --data_dir (got '
        f'{path!r}): arrays x [N, H, W(, C)] uint8 and y [N] int, '
        'optionally client_id [N], test_x and test_y '
        '(fedrobust.data.save_npz writes one)')
  with np.load(path) as f:
    arrays = {k: f[k] for k in f.files}
  missing = {'x', 'y'} - set(arrays)
  if missing:
    raise SettingError('data_dir', f'{path} lacks the arrays '
                       f'{sorted(missing)} (has {sorted(arrays)})')
  return from_arrays(arrays['x'], arrays['y'],
                     client_ids=arrays.get('client_id'),
                     test_x=arrays.get('test_x'), test_y=arrays.get('test_y'),
                     name=os.path.splitext(os.path.basename(path))[0])
