"""Server-side and client-side train/validation/test splits.

All functions are deterministic given `seed` and return sorted int64 index
arrays. Independent random streams (spawned from `seed`) drive the independent
choices, so e.g. changing `public_size` does not change the validation set.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fedrobust.errors import SettingError


class ServerSplits(NamedTuple):
  """Indices into the training set, by role.

  Attributes:
    client_pool: Indices to be partitioned among the clients.
    validation: Clean validation indices held by the server
      (`validation_size` of them).
    public: Public/anchor indices held by the server (`public_size` of them,
      possibly none), taken out of the client pool.
  """

  client_pool: np.ndarray
  validation: np.ndarray
  public: np.ndarray


def _rngs(seed: int, n: int) -> list[np.random.Generator]:
  """`n` independent generators derived from `seed`."""
  return [
      np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(n)
  ]


def _sorted(indices: np.ndarray) -> np.ndarray:
  return np.sort(np.asarray(indices, dtype=np.int64))


def make_server_splits(
    labels: np.ndarray,
    *,
    validation_fraction: float,
    validation_size: int,
    public_size: int,
    seed: int,
) -> ServerSplits:
  """Splits the training set into client pool, server validation and public.

  Follows the SDFC protocol: the training set is first split
  `(1 - validation_fraction) : validation_fraction` at random (e.g. 9:1); the
  smaller part is the validation reserve. `validation` is a random sample of
  `validation_size` examples from that reserve. Reserve examples not sampled
  into `validation` are deliberately unused: they are given neither to the
  clients nor to the server. `public` is a random sample of `public_size`
  examples removed from the larger part; what remains is the client pool.

  The splits are uniformly random (not stratified by label).

  Args:
    labels: int `[N]` training labels (only their number is used).
    validation_fraction: Fraction of the training set held out as the
      validation reserve, in `[0, 1)`; 0 means no reserve and no validation.
    validation_size: Number of validation examples drawn from the reserve.
    public_size: Number of public examples taken out of the client pool.
    seed: Random seed.

  Returns:
    The splits, as pairwise disjoint sorted int64 index arrays.

  Raises:
    ValueError: If a size or fraction is out of range (the message names the
      corresponding flag).
  """
  n = len(labels)
  if not 0.0 <= validation_fraction < 1.0:
    raise SettingError('validation_fraction', f'must be in [0, 1), got '
                       f'{validation_fraction}.')
  if validation_size < 0:
    raise SettingError('validation_size', f'must be >= 0, got '
                       f'{validation_size}.')
  if public_size < 0:
    raise SettingError('public_size', f'must be >= 0, got {public_size}.')
  reserve_size = int(round(n * validation_fraction))
  if validation_size > reserve_size:
    raise SettingError(
        'validation_size', f'{validation_size} exceeds the validation '
        f'reserve of {reserve_size} examples (validation_fraction='
        f'{validation_fraction} of {n}); lower validation_size or raise '
        'validation_fraction.')
  rng_reserve, rng_validation, rng_public = _rngs(seed, 3)
  perm = rng_reserve.permutation(n)
  reserve, rest = perm[:reserve_size], perm[reserve_size:]
  if public_size >= len(rest):
    raise SettingError(
        'public_size', f'{public_size} leaves no examples for the clients '
        f'(only {len(rest)} are outside the validation reserve).')
  validation = rng_validation.choice(reserve, validation_size, replace=False)
  public_pos = rng_public.choice(len(rest), public_size, replace=False)
  client_pool = np.delete(rest, public_pos)
  return ServerSplits(
      client_pool=_sorted(client_pool),
      validation=_sorted(validation),
      public=_sorted(rest[public_pos]),
  )


def _local_test_count(n: int, test_fraction: float) -> int:
  """Test examples for a client with `n` examples (see local split rules)."""
  if test_fraction == 0.0 or n < 2:
    return 0
  return min(max(int(round(n * test_fraction)), 1), n - 1)


def local_train_test_split(
    parts: list[np.ndarray], *, test_fraction: float, seed: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Splits each client's indices into local train and local test indices.

  Each client's examples are split at random, about
  `(1 - test_fraction) : test_fraction` (Horus uses 80/20, i.e.
  `test_fraction=0.2`). A client with at least 2 examples gets at least one
  train example and, if `test_fraction > 0`, at least one test example; a
  client with a single example keeps it for training.

  Args:
    parts: Per-client index arrays (e.g. from a partitioner).
    test_fraction: Fraction of each client's examples used for testing, in
      `[0, 1)`; 0 gives empty test arrays.
    seed: Random seed.

  Returns:
    `(train, test)`: per-client sorted int64 index arrays; for each client
    they are disjoint and their union is the client's part.

  Raises:
    ValueError: If `test_fraction` is not in `[0, 1)`.
  """
  if not 0.0 <= test_fraction < 1.0:
    raise ValueError(f'test_fraction must be in [0, 1), got {test_fraction}.')
  train, test = [], []
  for part, rng in zip(parts, _rngs(seed, len(parts))):
    part = np.asarray(part, dtype=np.int64)
    shuffled = rng.permutation(part)
    n_test = _local_test_count(len(part), test_fraction)
    test.append(_sorted(shuffled[:n_test]))
    train.append(_sorted(shuffled[n_test:]))
  return train, test
