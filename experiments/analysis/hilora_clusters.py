r"""HiLoRA's clustering, recomputed from a run's checkpoint.

  python experiments/analysis/hilora_clusters.py --workdir=runs/hilora_domains_quick

HiLoRA clusters its clients once, when the root stage ends, from the EMA of
each client's LoRA subspace (Sec. 3.2, Eq. 7-9); the EMA is frozen after
that and checkpointed with the run. This tool restores the run's latest
step and redoes the clustering with the package's own functions
(fedrobust.methods.hilora.subspace), printing what the eigengap saw:
- the normalised Laplacian's smallest eigenvalues and their gaps;
- the K the eigengap picks in [--k_min, --k_max] (the run's own range by
  default) and that clustering's ARI against the true groups (domains,
  superclasses) when the partition knows them;
- the ARI at every fixed K in the range, and the mean subspace distance
  within and across true groups.

The eigengap's labels reproduce the run's stored assignment
(`stored_ari_match` is 1.0), which checks that the analysis sees what the
run saw. Nothing is written to the workdir.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import train
from fedrobust.aggregators.spectral import per_matrix
from fedrobust.checkpoint import Checkpointer
from fedrobust.methods.hilora import subspace as hs
from fedrobust.types import legacy_server_state


def analyze(workdir: str, k_min: int | None = None,
            k_max: int | None = None) -> dict[str, Any]:
  """The clustering of the HiLoRA run in `workdir` (see the module doc).

  Raises:
    ValueError: the workdir holds no HiLoRA run, no checkpoint, or a run
      that had not clustered yet.
  """
  config, program, _, template = train.open_run(workdir, 'hilora')
  k_min = config['hilora_k_min'] if k_min is None else k_min
  k_max = config['hilora_k_max'] if k_max is None else k_max
  restored = Checkpointer(os.path.join(workdir, 'checkpoints')).restore_latest(
      template, legacy=legacy_server_state(template))
  if restored is None:
    raise ValueError(f'--workdir={workdir} has no checkpoint')
  step, state = restored[0], restored[1]
  ms = state.method_state
  if int(ms.num_clusters) == 0:
    raise ValueError(f'the run in {workdir} had not clustered by round '
                     f'{step} (the root stage was still running)')
  stored = np.asarray(ms.assign)
  seen = jnp.asarray(ms.seen)
  dist = hs.distance_matrix([per_matrix(hs.subspace, ms.ema[p])
                             for p in sorted(ms.ema)])
  labels, k, eigenvalues = hs.spectral_clusters(dist, seen, k_min=k_min,
                                                k_max=k_max)
  labels = np.asarray(labels)
  ev = np.asarray(eigenvalues, np.float64)
  real = np.asarray(seen)
  out: dict[str, Any] = {
      'round': int(step), 'stored_clusters': int(ms.num_clusters),
      'eigengap_k': int(k), 'eigenvalues': ev[:k_max + 2].tolist(),
      'gaps': np.diff(ev[:k_max + 2]).tolist(),
      'stored_ari_match': hs.adjusted_rand_index(stored[real], labels[real])}
  groups = program.setup.client_groups
  if groups is not None:
    truth = np.asarray(groups)[:len(stored)]
    d = np.asarray(dist)
    pair = real[:, None] & real[None, :] & ~np.eye(len(truth), dtype=bool)
    same = truth[:, None] == truth[None, :]
    out['distance_within'] = float(d[pair & same].mean())
    out['distance_across'] = float(d[pair & ~same].mean())
    out['ari'] = hs.adjusted_rand_index(truth[real], labels[real])
    out['ari_at_k'] = {
        kk: hs.adjusted_rand_index(truth[real], np.asarray(
            hs.spectral_clusters(dist, seen, k_min=kk, k_max=kk)[0])[real])
        for kk in range(k_min, k_max + 1)}
  return out


def main(argv):
  del argv
  f = flags.FLAGS
  print(json.dumps(analyze(f.workdir, f.k_min, f.k_max), indent=1))


if __name__ == '__main__':
  # Defined here, not at import: the runner's flags (experiments/main.py)
  # also have --workdir, and tests import both modules.
  flags.DEFINE_string('workdir', None, 'A HiLoRA run directory.')
  flags.DEFINE_integer('k_min', None, "Smallest K (default: the run's).")
  flags.DEFINE_integer('k_max', None, "Largest K (default: the run's).")
  flags.mark_flag_as_required('workdir')
  app.run(main)
