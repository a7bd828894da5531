"""From a Dataset to the fixed-shape arrays a compiled round consumes.

Host-side numpy only. Every client's examples are padded to the largest
client (N) so all clients share one program; `count` says how many rows
are real, and the engine's batch plan masks the rest. Examples keep their
stored dtype (uint8 images, int32 token ids).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fedrobust.data.partition import (SUPERCLASSES, class_histograms,
                                      partition)
from fedrobust.errors import SettingError
from fedrobust.data.sources import Dataset, LazyHostArray
from fedrobust.data.splits import local_train_test_split, make_server_splits
from fedrobust.engine.evaluate import pad_to_batches
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


class ClientRows(LazyHostArray):
  """Clients' examples as a lazy [K, N, ...] array, padded with zeros to N.

  Holds only the source (any array that takes an index array: a numpy
  array, a memmap, a random-access reader) and each client's row indices
  into it. Rows are gathered when asked for: `block(lo, hi)` builds
  clients lo .. hi - 1 only, so a process that places one block of clients
  on its devices (engine.place_clients) never builds the others', and no
  padded [K, N, ...] copy outlives the placement. Anything else (numpy's
  `__array__`, `jnp.asarray`, indexing) behaves as the full array;
  indexing the client axis with an integer array keeps it lazy
  (select_clients, hold_out).
  """

  def __init__(self, source, parts: list[np.ndarray], n: int):
    self.source = source
    self.parts = [np.asarray(p, np.int64) for p in parts]
    self.n = int(n)
    self.shape = (len(self.parts), self.n, *source.shape[1:])
    self.dtype = np.dtype(source.dtype)

  def block(self, lo: int, hi: int) -> np.ndarray:
    """Clients lo .. hi - 1 as an array [hi - lo, N, ...]."""
    if not 0 <= lo <= hi <= len(self):
      raise IndexError(f'client block [{lo}, {hi}) is outside the '
                       f'{len(self)} clients')
    out = np.zeros((hi - lo, *self.shape[1:]), self.dtype)
    for k in range(lo, hi):
      p = self.parts[k]
      if len(p):
        out[k - lo, :len(p)] = self.source[p]
    return out

  def _whole(self) -> np.ndarray:
    return self.block(0, len(self))

  def __getitem__(self, index):
    if isinstance(index, slice) and index.step in (None, 1):
      return self.block(*index.indices(len(self))[:2])
    if (isinstance(index, (list, np.ndarray)) and np.ndim(index) == 1 and
        np.asarray(index).dtype.kind in 'iu'):
      return ClientRows(self.source, [self.parts[i] for i in
                                      np.asarray(index)], self.n)
    head, rest = (index[0], index[1:]) if isinstance(index, tuple) else (
        index, ())
    if isinstance(head, (int, np.integer)):
      k = range(len(self))[head]
      return self.block(k, k + 1)[(0, *rest)]
    return np.asarray(self)[index]

  def __repr__(self) -> str:
    return f'ClientRows(shape={self.shape}, dtype={self.dtype})'


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
  ys = np.zeros((len(parts), n), np.int32)
  for k, p in enumerate(parts):
    ys[k, :len(p)] = y[p]
  return FederatedData(ClientRows(x, parts, n), ys, counts)


def stack_eval_sets(x: np.ndarray, y: np.ndarray, parts: list[np.ndarray],
                    batch_size: int) -> EvalSet:
  """Per-client evaluation sets batched to [K, T, B, ...] with masks.

  B is at most batch_size and no larger than the longest client needs:
  T = ceil(longest / batch_size) batches of B = ceil(longest / T). Many
  small clients (1,000 clients with a few test examples each) are not
  padded to a full evaluation batch each, which would cost memory and
  forward passes a hundred times their data.
  """
  longest = max((len(p) for p in parts), default=0)
  t = max(1, -(-longest // batch_size))
  batch_size = max(1, -(-longest // t))
  batched = [pad_to_batches(x[p], y[p].astype(np.int32), batch_size)
             for p in parts]
  out_x = np.zeros((len(parts), t, batch_size, *x.shape[1:]), x.dtype)
  out_y = np.zeros((len(parts), t, batch_size), np.int32)
  out_m = np.zeros((len(parts), t, batch_size), bool)
  for k, (bx, by, bm) in enumerate(batched):
    out_x[k, :len(bx)], out_y[k, :len(by)], out_m[k, :len(bm)] = bx, by, bm
  return EvalSet(out_x, out_y, out_m)


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
    test_x, test_y = test_x[keep], test_y[keep]
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
