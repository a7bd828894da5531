"""Writes tests/data/hdbscan_golden.json: HDBSCAN labels from the `hdbscan`
package (McInnes et al.) on seeded inputs, for tests/hdbscan_test.py.

Not run by the tests (the package is not a dependency). Regenerate with

  python -m venv /tmp/hv && /tmp/hv/bin/pip install hdbscan==0.8.44
  /tmp/hv/bin/python tests/data/make_hdbscan_golden.py

The package sorts its MST edges with NumPy's default (unstable) argsort,
so merges at tied heights pair up in an order that depends on NumPy's
sort kernel; fedrobust.aggregators.hdbscan sorts stably. Every case here
records both labelings: `labels` with the package's sort patched to be
stable (what the JAX function must reproduce exactly, as a partition) and
`labels_unpatched` (the package as shipped), which differ on a few tied
cases.
"""

import json
import os

import hdbscan
import hdbscan.hdbscan_ as hdbscan_module
from hdbscan_inputs import distances
import numpy as np


class _StableNumpy:
  """numpy, with argsort stable (the only call hdbscan_ makes on edges)."""

  def __getattr__(self, name):
    if name == 'argsort':
      return lambda a, *args, **kw: np.argsort(a, kind='stable')
    return getattr(np, name)


def labels(d, mcs, ms, single, stable):
  saved = hdbscan_module.np
  if stable:
    hdbscan_module.np = _StableNumpy()
  try:
    return hdbscan.HDBSCAN(metric='precomputed', min_cluster_size=mcs,
                           min_samples=ms, allow_single_cluster=single
                           ).fit_predict(d).tolist()
  finally:
    hdbscan_module.np = saved


def main():
  rng = np.random.default_rng(2026)
  cases = []
  for t in range(48):
    n = int(rng.integers(6, 30))
    mcs, ms = int(rng.integers(2, 7)), int(rng.integers(1, 5))
    single = bool(t % 2)
    case = {}
    if t % 6 == 5:      # DeepSight's merged 0/1 matrices: many exact ties
      case['partitions'] = [rng.integers(-1, 3, n).tolist()
                            for _ in range(3)]
    else:
      k = int(rng.integers(1, 5))
      centres = rng.normal(size=(k, 4)) * rng.uniform(1, 6)
      x = (centres[rng.integers(0, k, n)] +
           rng.normal(size=(n, 4)) * rng.uniform(0.2, 1.5, (n, 1)))
      case['points'] = np.round(x, 4).tolist()
    d = distances(case).astype(np.float64)    # what the test feeds
    cases.append(dict(case, min_cluster_size=mcs, min_samples=ms,
                      allow_single_cluster=single,
                      labels=labels(d, mcs, ms, single, True),
                      labels_unpatched=labels(d, mcs, ms, single, False)))
  path = os.path.join(os.path.dirname(__file__), 'hdbscan_golden.json')
  with open(path, 'w') as f:
    json.dump({'package': 'hdbscan ' + getattr(hdbscan, '__version__',
                                               '0.8.44'),
               'cases': cases}, f)


if __name__ == '__main__':
  main()
