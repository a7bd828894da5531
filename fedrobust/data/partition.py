"""Partitioning a labelled set of examples among federated clients.

Every partitioner has the signature
`(labels, num_clients, *, seed, **kwargs) -> list[np.ndarray]` and returns
`num_clients` index arrays into `labels` that form a true partition of
`range(len(labels))`: pairwise disjoint, union equal to all indices. Each array
is int64 and sorted ascending. Results are deterministic given `seed`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from fedrobust.errors import SettingError

# Resampling attempts before giving up on a minimum client size.
_MAX_DIRICHLET_TRIES = 1000

Partitioner = Callable[..., list[np.ndarray]]


def _check_labels(labels: np.ndarray) -> np.ndarray:
  """Validates labels as a 1-D non-negative integer array."""
  labels = np.asarray(labels)
  if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(
        f'labels must be a 1-D integer array, got {labels.dtype} '
        f'{labels.shape}.'
    )
  if labels.size and labels.min() < 0:
    raise ValueError('labels must be non-negative.')
  return labels


def _check_num_clients(num_clients: int, n: int) -> None:
  if not 1 <= num_clients <= n:
    raise SettingError(
        'num_clients', f'must be in [1, {n}] (the number of examples to '
        f'partition), got {num_clients}.')


def _check_min_size(num_clients: int, min_size: int, n: int) -> None:
  if min_size * num_clients > n:
    raise SettingError(
        'num_clients', f'cannot give each of num_clients={num_clients} '
        f'clients {min_size} examples out of {n}.')


def _as_parts(chunks: list[np.ndarray]) -> list[np.ndarray]:
  """Sorted int64 copies of per-client index chunks."""
  return [np.sort(np.asarray(c, dtype=np.int64)) for c in chunks]


def _cut_points(sizes: np.ndarray, proportions: np.ndarray) -> np.ndarray:
  """Where to cut each row's items so chunk sizes follow `proportions`.

  Args:
    sizes: int `[R]` number of items in each row.
    proportions: float `[R, K]`, rows summing to 1.

  Returns:
    int64 `[R, K]` non-decreasing cut positions; row r's chunk k is
    `[cuts[r, k - 1], cuts[r, k])` (with `cuts[r, -1] == sizes[r]`).
  """
  cuts = np.floor(np.cumsum(proportions, axis=1) * sizes[:, None])
  cuts = np.minimum(cuts.astype(np.int64), sizes[:, None])
  cuts[:, -1] = sizes
  return cuts


def _class_indices(
    labels: np.ndarray, rng: np.random.Generator
) -> dict[int, np.ndarray]:
  """Shuffled indices of each class present in `labels`."""
  return {
      int(c): rng.permutation(np.flatnonzero(labels == c))
      for c in np.unique(labels)
  }


def iid(labels: np.ndarray, num_clients: int, *, seed: int) -> list[np.ndarray]:
  """Uniformly random partition into near-equal parts.

  Args:
    labels: int `[N]` labels (only their number is used).
    num_clients: Number of parts, in `[1, N]`.
    seed: Random seed.

  Returns:
    `num_clients` sorted int64 index arrays whose sizes differ by at most one.
  """
  labels = _check_labels(labels)
  _check_num_clients(num_clients, len(labels))
  perm = np.random.default_rng(seed).permutation(len(labels))
  return _as_parts(np.array_split(perm, num_clients))


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    *,
    alpha: float,
    seed: int,
    min_size: int = 1,
) -> list[np.ndarray]:
  """Label-skewed partition with Dirichlet class proportions.

  For every class independently, its shuffled examples are split among the
  clients in proportions drawn from `Dir(alpha * 1)`. Small `alpha` gives
  each client few dominant classes; large `alpha` approaches IID. The
  proportions are redrawn (at most 1000 times) until every client has at
  least `min_size` examples.

  Args:
    labels: int `[N]` labels.
    num_clients: Number of clients, in `[1, N]`.
    alpha: Dirichlet concentration, > 0.
    seed: Random seed.
    min_size: Minimum number of examples per client.

  Returns:
    `num_clients` sorted int64 index arrays.

  Raises:
    ValueError: If `alpha <= 0`, or no draw meets `min_size` after a bounded
      number of attempts.
  """
  labels = _check_labels(labels)
  _check_num_clients(num_clients, len(labels))
  if not alpha > 0:
    raise SettingError('dirichlet_alpha', f'must be > 0, got {alpha}.')
  _check_min_size(num_clients, min_size, len(labels))
  rng = np.random.default_rng(seed)
  by_class = list(_class_indices(labels, rng).values())
  class_sizes = np.array([len(ix) for ix in by_class], dtype=np.int64)
  concentration = np.full(num_clients, float(alpha))
  for _ in range(_MAX_DIRICHLET_TRIES):
    proportions = rng.dirichlet(concentration, size=len(by_class))
    cuts = _cut_points(class_sizes, proportions)
    client_sizes = np.diff(cuts, axis=1, prepend=0).sum(axis=0)
    if client_sizes.min() >= min_size:
      chunks = zip(*(np.split(ix, c[:-1]) for ix, c in zip(by_class, cuts)))
      return _as_parts([np.concatenate(c) for c in chunks])
  raise SettingError(
      'dirichlet_alpha', f'dirichlet_alpha={alpha} left some client with '
      f'fewer than {min_size} examples in {_MAX_DIRICHLET_TRIES} attempts; '
      'raise dirichlet_alpha or lower num_clients.')


def _class_slots(
    class_sizes: np.ndarray, num_slots: int, rng: np.random.Generator
) -> np.ndarray:
  """Number of shards per class: equal, extras to the largest classes."""
  num_classes = len(class_sizes)
  slots = np.full(num_classes, num_slots // num_classes, dtype=np.int64)
  extra = num_slots % num_classes
  order = np.lexsort((rng.random(num_classes), -class_sizes))
  slots[order[:extra]] += 1
  return slots


def _assign_classes(
    slots: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
  """Picks `classes_per_client` distinct classes per client.

  Class `c` is picked by exactly `slots[c]` clients. Each client in turn takes
  the classes with the most remaining slots (ties broken at random), which
  always succeeds when `max(slots) <= num_clients` and
  `sum(slots) == num_clients * classes_per_client`. The resulting class sets
  are handed to the clients in random order.
  """
  remaining = slots.copy()
  picks = []
  for _ in range(num_clients):
    order = np.lexsort((rng.random(len(remaining)), -remaining))
    chosen = order[:classes_per_client]
    remaining[chosen] -= 1
    picks.append(chosen)
  assert not remaining.any(), remaining
  return [picks[k] for k in rng.permutation(num_clients)]


def pathological(
    labels: np.ndarray,
    num_clients: int,
    *,
    classes_per_client: int,
    seed: int,
) -> list[np.ndarray]:
  """Shard partition in which each client sees only a few classes.

  As in McMahan et al. (2017), each class's shuffled examples are cut into
  near-equal shards and each client receives `classes_per_client` shards.
  Unlike random shard dealing, shards never straddle two classes and a client
  never receives two shards of the same class, so each client holds exactly
  `classes_per_client` distinct labels. The `num_clients * classes_per_client`
  shards are spread over the classes as evenly as possible, and which clients
  share which classes is random.

  Args:
    labels: int `[N]` labels.
    num_clients: Number of clients, in `[1, N]`.
    classes_per_client: Distinct classes per client, in `[1, C]` where `C` is
      the number of distinct labels; `num_clients * classes_per_client` must
      be at least `C` so that every example is assigned.
    seed: Random seed.

  Returns:
    `num_clients` sorted int64 index arrays.

  Raises:
    ValueError: If `classes_per_client` is out of range, or too few shards
      cover all classes, or some shard would be empty.
  """
  labels = _check_labels(labels)
  _check_num_clients(num_clients, len(labels))
  rng = np.random.default_rng(seed)
  by_class = list(_class_indices(labels, rng).values())
  num_classes = len(by_class)
  if not 1 <= classes_per_client <= num_classes:
    raise SettingError(
        'classes_per_client', f'must be in [1, {num_classes}] (the number '
        f'of classes), got {classes_per_client}.')
  num_shards = num_clients * classes_per_client
  if num_shards < num_classes:
    raise SettingError(
        'classes_per_client', f'num_clients={num_clients} x '
        f'classes_per_client={classes_per_client} = {num_shards} shards '
        f'cannot cover all {num_classes} classes; raise either.')
  sizes = np.array([len(ix) for ix in by_class], dtype=np.int64)
  slots = _class_slots(sizes, num_shards, rng)
  if np.any(slots > sizes):
    raise SettingError(
        'classes_per_client', f'a class has fewer examples than its '
        f'{slots.max()} shards; lower num_clients or classes_per_client.')
  shards = [list(np.array_split(ix, s)) for ix, s in zip(by_class, slots)]
  picks = _assign_classes(slots, num_clients, classes_per_client, rng)
  chunks = [np.concatenate([shards[c].pop() for c in p]) for p in picks]
  return _as_parts(chunks)


def _skewed_sizes(
    n: int,
    num_clients: int,
    alpha: float,
    min_size: int,
    rng: np.random.Generator,
) -> np.ndarray:
  """Client sizes: `min_size` each plus a `Dir(alpha)` share of the rest."""
  rest = n - num_clients * min_size
  shares = rng.dirichlet(np.full(num_clients, float(alpha))) * rest
  sizes = np.floor(shares).astype(np.int64)
  leftover = rest - sizes.sum()
  sizes[np.argsort(sizes - shares)[:leftover]] += 1  # Largest remainders.
  return sizes + min_size


def quantity_skew(
    labels: np.ndarray,
    num_clients: int,
    *,
    alpha: float,
    seed: int,
    min_size: int = 1,
) -> list[np.ndarray]:
  """Partition with Dirichlet-distributed client sizes and IID labels.

  Every client first gets `min_size` examples; the remaining
  `N - num_clients * min_size` examples are shared out in proportions drawn
  from `Dir(alpha * 1)` over the clients. Examples are assigned uniformly at
  random, so each client's label distribution matches the global one in
  expectation.

  Args:
    labels: int `[N]` labels (only their number is used).
    num_clients: Number of clients, in `[1, N]`.
    alpha: Dirichlet concentration over clients, > 0; smaller is more skewed.
    seed: Random seed.
    min_size: Minimum number of examples per client.

  Returns:
    `num_clients` sorted int64 index arrays.

  Raises:
    ValueError: If `alpha <= 0` or `num_clients * min_size > N`.
  """
  labels = _check_labels(labels)
  _check_num_clients(num_clients, len(labels))
  if not alpha > 0:
    raise SettingError('quantity_alpha', f'must be > 0, got {alpha}.')
  _check_min_size(num_clients, min_size, len(labels))
  rng = np.random.default_rng(seed)
  sizes = _skewed_sizes(len(labels), num_clients, alpha, min_size, rng)
  perm = rng.permutation(len(labels))
  return _as_parts(np.split(perm, np.cumsum(sizes)[:-1]))


def group_of_clients(num_clients: int, num_groups: int) -> np.ndarray:
  """int64 [num_clients]: the group each client of `group_dirichlet` holds,
  in contiguous blocks as equal as possible (extras to the first groups)."""
  sizes = np.full(num_groups, num_clients // num_groups)
  sizes[:num_clients % num_groups] += 1
  return np.repeat(np.arange(num_groups), sizes)


def group_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    *,
    groups: np.ndarray | None,
    alpha: float,
    seed: int,
    min_size: int = 1,
) -> list[np.ndarray]:
  """Clients spread over groups (domains), Dirichlet labels inside each.

  The clients are dealt to the groups by `group_of_clients`; each group's
  examples are split over its clients by `dirichlet` with `alpha`
  (HiLoRA's DomainNet setting: one domain per client, intra-domain label
  sampling Dir(0.6)). The true cluster of client k is
  `group_of_clients(num_clients, G)[k]`.

  Args:
    labels: int `[N]` labels.
    num_clients: Number of clients, at least the number of groups G.
    groups: int `[N]` group of each example, in `[0, G)`.
    alpha: Dirichlet concentration within a group, > 0.
    seed: Random seed.
    min_size: Minimum number of examples per client.
  """
  labels = _check_labels(labels)
  if groups is None:
    raise SettingError('partition', 'group_dirichlet deals clients by the '
                       "examples' groups, and this dataset has none (use "
                       'vader_domains)')
  groups = _check_labels(groups)
  if groups.shape != labels.shape:
    raise ValueError(f'groups {groups.shape} must match labels '
                     f'{labels.shape}')
  num_groups = int(groups.max()) + 1
  if num_clients < num_groups:
    raise SettingError('num_clients', f'group_dirichlet needs at least one '
                       f'client per group: {num_groups} groups, got '
                       f'num_clients={num_clients}')
  owner = group_of_clients(num_clients, num_groups)
  parts = []
  for g in range(num_groups):
    rows = np.flatnonzero(groups == g)
    for part in dirichlet(labels[rows], int(np.sum(owner == g)), alpha=alpha,
                          seed=seed + 7919 * g, min_size=min_size):
      parts.append(rows[part])
  return _as_parts(parts)


# Natural superclasses of a dataset's labels (label -> superclass), for
# 'superclass_dirichlet'. Fashion-MNIST: tops (T-shirt 0, pullover 2,
# coat 4, shirt 6), footwear (sandal 5, sneaker 7, ankle boot 9) and
# other (trouser 1, dress 3, bag 8).
SUPERCLASSES: dict[str, tuple[int, ...]] = {
    'fashion_mnist': (0, 2, 0, 2, 0, 1, 0, 1, 2, 1),
}


def superclass_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    *,
    superclasses: tuple[int, ...] | None,
    alpha: float,
    seed: int,
    min_size: int = 1,
) -> list[np.ndarray]:
  """HiLoRA's SC-Dir(alpha) (Sec. 5.1): the clients are dealt to the
  label superclasses (`group_of_clients`), each superclass's examples are
  split over its clients with Dirichlet(alpha) labels over its fine
  classes. The superclasses are the true clusters.

  Args:
    labels: int `[N]` labels.
    num_clients: at least the number of superclasses.
    superclasses: label -> superclass (SUPERCLASSES[dataset]); None for a
      dataset without them.
    alpha, seed, min_size: as for `dirichlet`.
  """
  labels = _check_labels(labels)
  if superclasses is None:
    raise SettingError('partition', 'superclass_dirichlet needs the '
                       "dataset's label superclasses; known for "
                       f'{sorted(SUPERCLASSES)}')
  table = np.asarray(superclasses)
  if labels.max(initial=0) >= len(table):
    raise ValueError(f'labels up to {labels.max()} but superclasses for '
                     f'{len(table)} classes')
  return group_dirichlet(labels, num_clients, groups=table[labels],
                         alpha=alpha, seed=seed, min_size=min_size)


def severe_profiles(num_classes: int) -> np.ndarray:
  """RFD-LoRA's severe non-IID label profiles (seeds/003, App. G):
  binary [0.1, 0.9], [0.9, 0.1], [0.5, 0.5]; 3-class 0.9 on one class and
  0.05 on each other; more classes: 0.9 on one, 0.1 shared by the rest."""
  if num_classes == 1:
    return np.ones((1, 1))
  if num_classes == 2:
    return np.array([[0.1, 0.9], [0.9, 0.1], [0.5, 0.5]])
  out = np.full((num_classes, num_classes), 0.1 / (num_classes - 1))
  np.fill_diagonal(out, 0.9)
  return out


def label_profiles(labels: np.ndarray, num_clients: int, *,
                   seed: int) -> list[np.ndarray]:
  """Client k draws its labels in the proportions of profile k mod P
  (`severe_profiles`), every client the same number s of examples, s the
  largest size the class pools allow. What the profiles leave over goes,
  round-robin, to the clients whose profile favours that class most, so
  every example is used and the skew only grows.

  Args:
    labels: int `[N]` labels.
    num_clients: Number of clients, in `[1, N]`.
    seed: Random seed.

  Returns:
    `num_clients` sorted int64 index arrays.
  """
  labels = _check_labels(labels)
  _check_num_clients(num_clients, len(labels))
  num_classes = int(labels.max()) + 1
  profiles = severe_profiles(num_classes)
  prof = profiles[np.arange(num_clients) % len(profiles)]      # [K, C]
  rng = np.random.default_rng(seed)
  pools = [rng.permutation(np.flatnonzero(labels == c))
           for c in range(num_classes)]
  avail = np.array([len(p) for p in pools], np.float64)
  demand = prof.sum(axis=0)
  room = np.where(demand > 0, avail / np.where(demand > 0, demand, 1.0),
                  np.inf)
  size = int(min(np.floor(room.min()), len(labels) // num_clients))
  counts = np.floor(prof * size).astype(np.int64)               # [K, C]
  parts = [[] for _ in range(num_clients)]
  for c, pool in enumerate(pools):
    start = 0
    for k in range(num_clients):
      parts[k].append(pool[start:start + counts[k, c]])
      start += counts[k, c]
    rest = pool[start:]
    favoured = np.flatnonzero(prof[:, c] == prof[:, c].max())
    for j, k in enumerate(favoured):
      parts[k].append(rest[j::len(favoured)])
  return _as_parts([np.concatenate(p) for p in parts])


def natural(labels: np.ndarray, num_clients: int, *,
            groups: np.ndarray | None, seed: int = 0) -> list[np.ndarray]:
  """Each client id of the data is one client (FEMNIST's writers, a
  user's device): client k holds the examples of the k-th smallest id
  present. `groups` holds the ids (`Dataset.train_groups`, which
  `data.from_arrays(..., client_ids=...)` fills).

  Raises:
    SettingError: naming `partition` when the data has no client ids, and
      `num_clients` when it is not the number of ids present.
  """
  del seed
  labels = _check_labels(labels)
  if groups is None:
    raise SettingError('partition', 'natural keeps each client id as one '
                       'client, and this dataset has none (give client_ids '
                       'to data.from_arrays, or client_id in an .npz)')
  groups = np.asarray(groups)
  if groups.shape != labels.shape:
    raise ValueError(f'groups {groups.shape} must match labels '
                     f'{labels.shape}')
  ids = np.unique(groups)
  if len(ids) != num_clients:
    raise SettingError('num_clients', f'natural keeps each of the '
                       f'{len(ids)} client ids in the data as one client: '
                       f'expected num_clients={len(ids)}, got {num_clients}')
  return _as_parts([np.flatnonzero(groups == i) for i in ids])


PARTITIONERS: dict[str, Partitioner] = {
    'iid': iid,
    'natural': natural,
    'dirichlet': dirichlet,
    'label_profiles': label_profiles,
    'group_dirichlet': group_dirichlet,
    'pathological': pathological,
    'quantity_skew': quantity_skew,
    'superclass_dirichlet': superclass_dirichlet,
}


def partition(
    name: str,
    labels: np.ndarray,
    num_clients: int,
    *,
    seed: int,
    dirichlet_alpha: float = 0.5,
    classes_per_client: int = 2,
    quantity_alpha: float = 0.5,
    min_size: int = 1,
    groups: np.ndarray | None = None,
    superclasses: tuple[int, ...] | None = None,
) -> list[np.ndarray]:
  """Partitions `labels` among `num_clients` clients with a named scheme.

  Args:
    name: A key of `PARTITIONERS`.
    labels: int `[N]` labels.
    num_clients: Number of clients, in `[1, N]`.
    seed: Random seed.
    dirichlet_alpha: `alpha` for 'dirichlet'.
    classes_per_client: `classes_per_client` for 'pathological'.
    quantity_alpha: `alpha` for 'quantity_skew'.
    min_size: `min_size` for 'dirichlet' and 'quantity_skew'.
    groups: int `[N]` example groups for 'group_dirichlet' (which also
      takes `dirichlet_alpha`), or client ids for 'natural'.
    superclasses: label -> superclass for 'superclass_dirichlet' (with
      `dirichlet_alpha`).

  Returns:
    `num_clients` sorted int64 index arrays forming a partition of
    `range(N)`.

  Raises:
    ValueError: If `name` is unknown or an argument is out of range.
  """
  if name not in PARTITIONERS:
    raise SettingError(
        'partition', f'unknown {name!r}; valid choices: '
        f'{", ".join(sorted(PARTITIONERS))}.')
  _check_num_clients(num_clients, len(labels))
  if name == 'iid':
    return iid(labels, num_clients, seed=seed)
  if name == 'natural':
    return natural(labels, num_clients, groups=groups, seed=seed)
  if name == 'dirichlet':
    return dirichlet(labels, num_clients, alpha=dirichlet_alpha, seed=seed,
                     min_size=min_size)
  if name == 'group_dirichlet':
    return group_dirichlet(labels, num_clients, groups=groups,
                           alpha=dirichlet_alpha, seed=seed,
                           min_size=min_size)
  if name == 'superclass_dirichlet':
    return superclass_dirichlet(labels, num_clients,
                                superclasses=superclasses,
                                alpha=dirichlet_alpha, seed=seed,
                                min_size=min_size)
  if name == 'label_profiles':
    return label_profiles(labels, num_clients, seed=seed)
  if name == 'pathological':
    return pathological(labels, num_clients,
                        classes_per_client=classes_per_client, seed=seed)
  return quantity_skew(labels, num_clients, alpha=quantity_alpha, seed=seed,
                       min_size=min_size)


def class_histograms(
    labels: np.ndarray, parts: list[np.ndarray], num_classes: int
) -> np.ndarray:
  """Per-client label counts.

  Args:
    labels: int `[N]` labels.
    parts: Per-client index arrays into `labels`.
    num_classes: Number of classes (histogram width).

  Returns:
    int64 `[len(parts), num_classes]` counts.
  """
  labels = np.asarray(labels)
  hist = np.zeros((len(parts), num_classes), dtype=np.int64)
  for k, part in enumerate(parts):
    hist[k] = np.bincount(labels[part], minlength=num_classes)[:num_classes]
  return hist
