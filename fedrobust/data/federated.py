"""From a Dataset to the fixed-shape arrays a compiled round consumes.

Host-side numpy only. Every client's examples are padded to the largest
client (N) so all clients share one program; `count` says how many rows
are real, and the engine's batch plan masks the rest. Examples keep their
stored dtype (uint8 images, int32 token ids).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from fedrobust.data.partition import (SUPERCLASSES, class_histograms,
                                      partition)
from fedrobust.errors import SettingError
from fedrobust.data.sources import Dataset, LazyHostArray
from fedrobust.data.splits import local_train_test_split, make_server_splits
from fedrobust.engine.evaluate import compose_index, pad_to_batches, regroup
from fedrobust.types import FederatedData


class EvalSet(NamedTuple):
  """Batched examples with a mask: x [..., T, B, H, W, Ch], y/mask [..., T, B]."""
  x: np.ndarray
  y: np.ndarray
  mask: np.ndarray


class FederatedSetup(NamedTuple):
  """Everything a run needs from its data, as host arrays."""
  # x a lazy ClientRows [K, N, ...]; y [K, N] and count [K] numpy.
  train: FederatedData
  # Both evaluation sets' x are lazy RowTables (built where placed).
  local_test: EvalSet       # each client's local test split, [K, T, B, ...]
  test: EvalSet             # the global test set, [T, B, ...]
  validation_x: np.ndarray  # clean server validation set U, uint8[V, ...]
  validation_y: np.ndarray  # int32[V]
  public_x: np.ndarray      # public/anchor split (distillation), uint8[P, ...]
  public_y: np.ndarray      # int32[P]
  histograms: np.ndarray    # int64[K, classes], training examples per class
  num_classes: int
  input_shape: tuple[int, ...]
  # int64[K]: each client's majority example group (its domain under
  # 'group_dirichlet'), the true clusters; None without groups.
  client_groups: np.ndarray | None = None


class RowTable(LazyHostArray):
  """Rows of a source laid out by an index table: a lazy array of shape
  table.shape + row shape, where each table entry is the source row at
  that place and a negative entry is a zero row (padding).

  Holds only the source (any array that takes an index array: a numpy
  array, a memmap, a random-access reader) and the int64 table. Rows are
  gathered when asked for: `block(lo, hi)` builds entries lo .. hi - 1 of
  the first axis only, so a process that places one block (of clients, or
  of evaluation batches) on its devices (engine.place_clients) never
  builds the others', and no padded copy outlives the placement.
  `transform`, if given, maps gathered rows to what the array holds (a
  backdoor trigger stamped on test images); it must act row by row.
  Anything else (numpy's `__array__`, `jnp.asarray`, indexing) behaves as
  the full array; indexing the first axis with an integer array, and
  `regroup` (the host-side re-cuts of engine.evaluate), stay lazy.
  """

  def __init__(self, source, table, transform: Callable | None = None,
               dtype=None):
    self.source = source
    self.table = np.asarray(table, np.int64)
    self.transform = transform
    self.shape = (*self.table.shape, *source.shape[1:])
    self.dtype = np.dtype(source.dtype if dtype is None else dtype)

  def block(self, lo: int, hi: int) -> np.ndarray:
    """Entries lo .. hi - 1 of the first axis as an array."""
    if not 0 <= lo <= hi <= len(self):
      raise IndexError(f'block [{lo}, {hi}) is outside the {len(self)} '
                       'rows of the first axis')
    index = self.table[lo:hi].reshape(-1)
    real = index >= 0
    out = np.zeros((len(index), *self.shape[self.table.ndim:]), self.dtype)
    if real.any():
      rows = np.asarray(self.source[index[real]])
      out[real] = rows if self.transform is None else self.transform(rows)
    return out.reshape((hi - lo, *self.shape[1:]))

  def regroup(self, index: np.ndarray, lead: int) -> 'RowTable':
    """The array whose first axes are `index` over the first `lead` axes
    flattened (negative: a zero entry), lazily (engine.evaluate.regroup)."""
    if not 1 <= lead <= self.table.ndim:
      raise ValueError(f'lead must be in [1, {self.table.ndim}] (the '
                       f'table\'s axes), got {lead}')
    return RowTable(self.source, compose_index(self.table, index, lead),
                    self.transform, self.dtype)

  def mapped(self, fn: Callable[[np.ndarray], np.ndarray]) -> 'RowTable':
    """The same rows passed through fn (after any transform already
    there), lazily; fn must act row by row and keep the row shape."""
    inner = self.transform
    both = fn if inner is None else (lambda rows: fn(inner(rows)))
    return RowTable(self.source, self.table, both, self.dtype)

  def _whole(self) -> np.ndarray:
    return self.block(0, len(self))

  def __getitem__(self, index):
    if isinstance(index, slice) and index.step in (None, 1):
      return self.block(*index.indices(len(self))[:2])
    if (isinstance(index, (list, np.ndarray)) and np.ndim(index) == 1 and
        np.asarray(index).dtype.kind in 'iu'):
      keys = np.arange(len(self))[np.asarray(index)]   # negatives wrap
      return self.regroup(keys, 1)
    head, rest = (index[0], index[1:]) if isinstance(index, tuple) else (
        index, ())
    if isinstance(head, (int, np.integer)):
      k = range(len(self))[head]
      return self.block(k, k + 1)[(0, *rest)]
    return np.asarray(self)[index]

  def __repr__(self) -> str:
    return f'{type(self).__name__}(shape={self.shape}, dtype={self.dtype})'


def parts_table(parts: list[np.ndarray], n: int) -> np.ndarray:
  """int64[K, n]: row k holds parts[k] (indices into a source), then -1
  (padding), the index table of a RowTable."""
  table = np.full((len(parts), n), -1, np.int64)
  for k, p in enumerate(parts):
    table[k, :len(p)] = p
  return table


class ClientRows(RowTable):
  """Clients' examples as a lazy [K, N, ...] RowTable, padded with zeros to
  N: client k's row indices `parts[k]` into the source, then padding."""

  def __init__(self, source, parts: list[np.ndarray], n: int):
    self.parts = [np.asarray(p, np.int64) for p in parts]
    self.n = int(n)
    super().__init__(source, parts_table(self.parts, self.n))

  def __getitem__(self, index):
    if (isinstance(index, (list, np.ndarray)) and np.ndim(index) == 1 and
        np.asarray(index).dtype.kind in 'iu'):
      return ClientRows(self.source, [self.parts[i] for i in
                                      np.asarray(index)], self.n)
    return super().__getitem__(index)


def stack_clients(x, y: np.ndarray, parts: list[np.ndarray]
                  ) -> FederatedData:
  """Pads every client's examples to the largest client.

  Args:
    x: [M, H, W, Ch] (or [M, T] token ids), any array indexable by an
      index array; y: int[M].
    parts: K index arrays into x (may be empty).

  Returns:
    FederatedData with x a lazy ClientRows [K, N, ...] over `x` (rows are
    gathered when placed on devices), y int32[K, N] and count int32[K] as
    numpy, N = max(1, largest part).
  """
  counts = np.array([len(p) for p in parts], np.int32)
  n = max(1, int(counts.max(initial=0)))
  rows = ClientRows(x, parts, n)
  ys = regroup(np.asarray(y, np.int32), rows.table, 1)
  return FederatedData(rows, ys, counts)


def pad_clients(train: FederatedData, n: int) -> FederatedData:
  """`train` with every client padded to `n` examples (n >= its N): the
  same real rows, more padding (replicas of a federation share one
  shape)."""
  if n <= train.y.shape[1]:
    return train
  if not isinstance(train.x, ClientRows):
    raise ValueError(f'cannot pad {type(train.x).__name__} client data')
  rows = ClientRows(train.x.source, train.x.parts, n)
  y = np.pad(np.asarray(train.y), ((0, 0), (0, n - train.y.shape[1])))
  return FederatedData(rows, y, train.count)


def stack_eval_sets(x: np.ndarray, y: np.ndarray, parts: list[np.ndarray],
                    batch_size: int) -> EvalSet:
  """Per-client evaluation sets batched to [K, T, B, ...] with masks.

  B is at most batch_size and no larger than the longest client needs:
  T = ceil(longest / batch_size) batches of B = ceil(longest / T). Many
  small clients (1,000 clients with a few test examples each) are not
  padded to a full evaluation batch each, which would cost memory and
  forward passes a hundred times their data. x is a lazy RowTable over
  the source (built by client block when placed); y and mask are numpy.
  """
  longest = max((len(p) for p in parts), default=0)
  t = max(1, -(-longest // batch_size))
  batch_size = max(1, -(-longest // t))
  table = parts_table(parts, t * batch_size).reshape(
      len(parts), t, batch_size)
  return EvalSet(RowTable(x, table),
                 regroup(np.asarray(y, np.int32), table, 1), table >= 0)


def subsample_rows(num_train: int, max_train_examples: int,
                   seed: int) -> np.ndarray:
  """Sorted indices of the training rows that `subsample` keeps."""
  if max_train_examples <= 0 or max_train_examples >= num_train:
    return np.arange(num_train)
  return np.sort(np.random.default_rng(seed).choice(
      num_train, max_train_examples, replace=False))


def unused_rows(num_train: int, max_train_examples: int,
                seed: int) -> np.ndarray:
  """Sorted indices of the training rows that `subsample` drops: data no
  client, newcomer or server split is built from (empty when it keeps
  everything)."""
  return np.setdiff1d(np.arange(num_train),
                      subsample_rows(num_train, max_train_examples, seed))


def subsample(dataset: Dataset, max_train_examples: int,
              seed: int) -> Dataset:
  """A seeded random subset of the training split (0 keeps everything)."""
  if max_train_examples <= 0 or max_train_examples >= len(dataset.train_y):
    return dataset
  keep = subsample_rows(len(dataset.train_y), max_train_examples, seed)
  groups = dataset.train_groups
  x = dataset.train_x
  # A lazy source (sources.RecordImages) stays lazy.
  return dataset._replace(train_x=x.subset(keep) if hasattr(x, 'subset')
                          else x[keep],
                          train_y=dataset.train_y[keep],
                          train_groups=None if groups is None else groups[keep])


def subsample_test(dataset: Dataset, max_test_examples: int,
                   seed: int) -> Dataset:
  """A seeded random subset of the test split (0 keeps everything), its
  rows in their original order and groups kept with them."""
  if max_test_examples <= 0 or max_test_examples >= len(dataset.test_y):
    return dataset
  keep = np.sort(np.random.default_rng(seed + 1).choice(
      len(dataset.test_y), max_test_examples, replace=False))
  groups = dataset.test_groups
  return dataset._replace(test_x=dataset.test_x[keep],
                          test_y=dataset.test_y[keep],
                          test_groups=None if groups is None else groups[keep])


def build_federated_setup(dataset: Dataset, *, num_clients: int,
                          partition_name: str, seed: int,
                          dirichlet_alpha: float = 0.5,
                          classes_per_client: int = 2,
                          quantity_alpha: float = 0.5,
                          validation_fraction: float = 0.0,
                          validation_size: int = 0, public_size: int = 0,
                          local_test_fraction: float = 0.0,
                          eval_batch_size: int = 500,
                          global_test_per_class: int = 0) -> FederatedSetup:
  """Splits, partitions and stacks a dataset for a federated run.

  Order: server splits (validation reserve, public set) are carved from the
  training split first; the rest is partitioned over the clients; each
  client's part is then split into local train and local test. With
  global_test_per_class > 0 the global test set is a seeded, class-balanced
  sample of that many test images per class (Horus's global test set).
  """
  server = make_server_splits(dataset.train_y,
                              validation_fraction=validation_fraction,
                              validation_size=validation_size,
                              public_size=public_size, seed=seed)
  pool = server.client_pool
  groups = dataset.train_groups
  superclasses = SUPERCLASSES.get(dataset.name)
  if partition_name == 'superclass_dirichlet' and superclasses is not None:
    # The superclasses are the true clusters (client_groups).
    groups = np.asarray(superclasses)[dataset.train_y]
  parts = partition(partition_name, dataset.train_y[pool], num_clients,
                    seed=seed, dirichlet_alpha=dirichlet_alpha,
                    classes_per_client=classes_per_client,
                    quantity_alpha=quantity_alpha,
                    groups=None if groups is None else groups[pool],
                    superclasses=superclasses)
  parts = [pool[p] for p in parts]
  client_groups = None if groups is None else np.array(
      [np.bincount(groups[p]).argmax() if len(p) else -1 for p in parts])
  train_parts, test_parts = local_train_test_split(
      parts, test_fraction=local_test_fraction, seed=seed)
  y = dataset.train_y.astype(np.int32)
  test_x, test_y = dataset.test_x, dataset.test_y.astype(np.int32)
  if global_test_per_class:
    rng = np.random.default_rng(seed + 3)
    keep = []
    for c in range(dataset.num_classes):
      rows = np.flatnonzero(test_y == c)
      if len(rows) < global_test_per_class:
        raise SettingError('global_test_per_class', f'class {c} has only '
                           f'{len(rows)} test images, fewer than '
                           f'{global_test_per_class}')
      keep.append(rng.choice(rows, global_test_per_class, replace=False))
    keep = np.sort(np.concatenate(keep))
  else:
    keep = np.arange(len(test_y))
  # Lazy (RowTable): a process builds only the batches its devices
  # evaluate (engine.place_clients), never the whole padded set.
  test_x, test_y = RowTable(test_x, keep), test_y[keep]
  return FederatedSetup(
      train=stack_clients(dataset.train_x, y, train_parts),
      local_test=stack_eval_sets(dataset.train_x, y, test_parts,
                                 eval_batch_size),
      test=EvalSet(*pad_to_batches(test_x, test_y, eval_batch_size)),
      validation_x=dataset.train_x[server.validation],
      validation_y=y[server.validation],
      public_x=dataset.train_x[server.public],
      public_y=y[server.public],
      histograms=class_histograms(y, train_parts, dataset.num_classes),
      num_classes=dataset.num_classes,
      input_shape=tuple(dataset.train_x.shape[1:]),
      client_groups=client_groups)


def unseen_clients(num_clients: int, num_unseen: int, seed: int,
                   groups: np.ndarray | None = None) -> np.ndarray:
  """Which of num_clients clients are held out as unseen (sorted ids).

  Without groups, a seeded random draw. With groups (each client's true
  domain), the draw is spread over the groups as evenly as it can be (a
  group's share differs by at most one), so every domain has newcomers.
  """
  if not 0 <= num_unseen < num_clients:
    raise SettingError('unseen_clients', f'must be in [0, {num_clients}) '
                       f'for {num_clients} clients in all, got {num_unseen}')
  rng = np.random.default_rng([seed, 0x0E5E])
  if groups is None:
    return np.sort(rng.permutation(num_clients)[:num_unseen])
  groups = np.asarray(groups)
  # Round robin over the groups (in a random order), a random client each.
  pools = {g: list(rng.permutation(np.flatnonzero(groups == g)))
           for g in rng.permutation(np.unique(groups))}
  out = []
  while len(out) < num_unseen:
    for pool in pools.values():
      if pool and len(out) < num_unseen:
        out.append(pool.pop())
  return np.sort(np.asarray(out, np.int64))


def select_clients(setup: FederatedSetup, ids: np.ndarray) -> FederatedSetup:
  """The setup restricted to clients `ids` (in that order), renumbered
  0..len(ids)-1; the server-side sets are kept. The padded client size N
  stays, so a program built for one part runs the other."""
  ids = np.asarray(ids, np.int64)
  pick = lambda tree: type(tree)(*(a[ids] for a in tree))
  return setup._replace(
      train=pick(setup.train), local_test=pick(setup.local_test),
      histograms=setup.histograms[ids],
      client_groups=(None if setup.client_groups is None
                     else setup.client_groups[ids]))


def hold_out(setup: FederatedSetup, num_unseen: int, seed: int
             ) -> tuple[FederatedSetup, FederatedSetup | None]:
  """Splits the federation into the clients that train and `num_unseen`
  newcomers that never take part (their own data and local test split
  are kept for adapting to them after training, HiLoRA Sec. 5.1)."""
  if not num_unseen:
    return setup, None
  k = setup.train.count.shape[0]
  out = unseen_clients(k, num_unseen, seed, setup.client_groups)
  keep = np.setdiff1d(np.arange(k), out)
  return select_clients(setup, keep), select_clients(setup, out)
