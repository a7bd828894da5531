"""The distance matrices of tests/data/hdbscan_golden.json's cases (NumPy
only: shared by the generator, which runs without fedrobust, and the
test)."""

import numpy as np


def distances(case):
  """float32[n, n]: Euclidean distances of `points`, or the mean of the 0/1
  different-label matrices of `partitions` (DeepSight's ensemble),
  computed in float64 and rounded to float32."""
  if 'points' in case:
    x = np.asarray(case['points'], np.float64)
    d = np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1))
  else:
    d = np.mean([(np.asarray(l)[:, None] != np.asarray(l)[None]).astype(
        np.float64) for l in case['partitions']], axis=0)
  return d.astype(np.float32)
