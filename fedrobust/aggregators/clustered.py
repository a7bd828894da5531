"""Rules of the peer libraries: Meamed (ByzFL), simple clustering and
SignGuard (FLPoison), ClippedClustering (Blades).

  meamed              per coordinate, the mean of the n - f values closest
                      to the coordinate-wise median (Xie, Koyejo, Gupta
                      2018, "Generalized Byzantine-tolerant SGD"; ByzFL's
                      Meamed).
  simple_clustering   DBSCAN over the updates (eps 0.05, min_samples 3, as
                      FLPoison's SimpleClustering), then the mean of the
                      largest cluster. eps is absolute, as in the
                      reference; `relative=True` scales it by the median
                      pairwise distance of the round. A round with no
                      cluster (everything noise) gives a zero update.
  clipped_clustering  (Li et al., "An Experimental Study of Byzantine-Robust
                      Aggregation Schemes in Federated Learning", Blades):
                      every update is clipped to the median of all update
                      norms seen so far (capped at max_tau), the clipped
                      updates are split into two clusters by agglomerative
                      clustering with average linkage on cosine distance,
                      and the larger cluster is averaged.
  signguard           (Xu et al., ICDCS 2022; FLPoison's SignGuard): a norm
                      filter and a sign-statistics DBSCAN filter, then the
                      survivors clipped to the median norm and averaged.

Masked slots are never a neighbour, a cluster member or a norm in the
history. info['weights'] is each client's share of the output.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.aggregators.base import Aggregator, stateless_init
from fedrobust.aggregators.clustering import dbscan_distances
from fedrobust.aggregators import krum as krum_lib
from fedrobust.aggregators.finetune import (clip_factors, finite_clients,
                                            first_client, masked_median,
                                            safe_norm, select_rows,
                                            unit_rows)
from fedrobust.aggregators.mean import check_num_byzantine, setting
from fedrobust.tree import ravel_clients, unravel_like

REQUIREMENTS = {
    'meamed': ('f < n', lambda f: f + 1),
}


def cosine_distances(x: jax.Array) -> jax.Array:
  """float32[C, C]: 1 - cos(x_i, x_j); a zero row is at distance 1."""
  unit = unit_rows(x)
  return 1.0 - jnp.matmul(unit, unit.T, precision='highest')


def euclidean_distances(x: jax.Array) -> jax.Array:
  """float32[C, C]: |x_i - x_j| from the differences (exact for small
  feature vectors; krum.pairwise_sq_dists is the Gram form for updates)."""
  return jnp.sqrt(jnp.sum(jnp.square(x[:, None] - x[None]), -1))


def clean_rows(updates, mask):
  """(float32[C, D] rows with non-finite and masked ones zeroed, bool[C]
  the real finite clients)."""
  flat = ravel_clients(updates).astype(jnp.float32)
  valid = finite_clients(flat, jnp.asarray(mask, bool))
  return select_rows(flat, valid), valid


def weighted_update(updates, clean, weights):
  """sum_c weights[c] clean[c], as one client's tree (shapes of updates)."""
  agg = jnp.einsum('c,cd->d', weights, clean, precision='highest')
  return unravel_like(agg, first_client(updates))


def meamed(*, num_byzantine: int = 0) -> Aggregator:
  """Mean around the median with f = num_byzantine."""
  f = check_num_byzantine('meamed', num_byzantine)

  def aggregate(updates, mask, state, key):
    del key
    x, valid = clean_rows(updates, mask)
    n = jnp.sum(valid)
    k = jnp.maximum(n - f, 1)
    med = masked_median(x, valid)
    gap = jnp.where(valid[:, None], jnp.abs(x - med[None]), jnp.inf)
    order = jnp.argsort(gap, axis=0, stable=True)
    rank = jnp.argsort(order, axis=0)
    keep = (rank < k) & valid[:, None]                     # [C, D]
    agg = jnp.sum(jnp.where(keep, x, 0.0), axis=0) / k.astype(jnp.float32)
    agg = jnp.where(n > 0, agg, 0.0)
    update = unravel_like(agg, first_client(updates))
    weights = jnp.mean(keep, axis=1) / k.astype(jnp.float32)
    return update, state, {'weights': weights.astype(jnp.float32)}

  return Aggregator(stateless_init, aggregate)


def simple_clustering(*, num_byzantine: int = 0, eps: float = 0.05,
                      min_samples: int = 3,
                      relative: bool = False) -> Aggregator:
  """FLPoison's SimpleClustering (DBSCAN, majority cluster, mean)."""
  del num_byzantine
  if not eps > 0:
    raise setting('simple_clustering', 'eps', f'must be > 0, got {eps}')
  if min_samples < 1:
    raise setting('simple_clustering', 'min_samples',
                  f'must be >= 1, got {min_samples}')

  def aggregate(updates, mask, state, key):
    del key
    x, valid = clean_rows(updates, mask)
    radius = jnp.float32(eps)
    # Distances from a Gram matrix (no [C, C, D] differences); +inf off
    # the real rows.
    d = jnp.sqrt(krum_lib.pairwise_sq_dists(x, valid))
    if relative:
      pair = valid[:, None] & valid[None, :] & ~jnp.eye(len(x), dtype=bool)
      ranked = jnp.sort(jnp.where(pair, d, jnp.inf).ravel())
      count = jnp.sum(pair)
      radius = radius * jnp.where(count > 0, ranked[jnp.maximum(count // 2,
                                                               0)], 1.0)
    labels = dbscan_distances(d, valid, eps=radius, min_samples=min_samples)
    c = x.shape[0]
    sizes = jnp.sum((labels[None, :] == jnp.arange(c)[:, None]) &
                    (labels[None, :] >= 0), axis=1)
    biggest = jnp.argmax(sizes)
    member = valid & (labels == biggest) & (sizes[biggest] > 0)
    total = jnp.sum(member).astype(jnp.float32)
    weights = jnp.where(member, 1.0 / jnp.maximum(total, 1.0), 0.0)
    return (weighted_update(updates, x, weights), state,
            {'weights': weights.astype(jnp.float32),
             'clusters': jnp.sum(sizes > 0).astype(jnp.float32)})

  return Aggregator(stateless_init, aggregate)


class ClippedClusteringState(NamedTuple):
  norms: jax.Array   # float32[H]: update norms seen so far (ring buffer)
  count: jax.Array   # int32[]: how many were written


LINKAGES = ('average', 'single')


def _agglomerate(dist: jax.Array, valid: jax.Array, linkage: str,
                 clusters: int, min_size: jax.Array | None = None):
  """Agglomerative merges down to `clusters` clusters (static).

  Returns (labels int32[C]: the smallest member index of each point's
  cluster, -1 for invalid points; first bool[C]: the members of the first
  cluster to reach min_size points, all False if none did or min_size is
  None).
  """
  if linkage not in LINKAGES:
    raise ValueError(f'linkage {linkage!r}; expected one of {LINKAGES}')
  c = dist.shape[0]
  labels = jnp.where(valid, jnp.arange(c), -1)
  active = valid
  size = valid.astype(jnp.float32)
  big = jnp.float32(jnp.inf)
  d = jnp.where(valid[:, None] & valid[None, :] & ~jnp.eye(c, dtype=bool),
                dist, big)
  if min_size is None:
    first = jnp.zeros(c, bool)
  else:                                     # a singleton may already do
    start = jnp.argmax(size)
    first = valid & (jnp.arange(c) == start) & (size[start] >= min_size)

  def merge(_, carry):
    labels, active, size, d, first = carry
    go = jnp.sum(active) > clusters
    flat = jnp.argmin(d)
    i, j = flat // c, flat % c
    lo, hi = jnp.minimum(i, j), jnp.maximum(i, j)
    # Lance-Williams: for average linkage d(lo+hi, k) is the size-weighted
    # mean of d(lo, k) and d(hi, k); for single linkage their minimum.
    if linkage == 'single':
      new_row = jnp.minimum(d[lo], d[hi])
    else:
      new_row = ((size[lo] * d[lo] + size[hi] * d[hi]) /
                 (size[lo] + size[hi]))
    new_row = jnp.where(active & (jnp.arange(c) != lo) &
                        (jnp.arange(c) != hi), new_row, big)
    d2 = d.at[lo].set(new_row).at[:, lo].set(new_row)
    d2 = d2.at[hi].set(big).at[:, hi].set(big)
    size2 = size.at[lo].add(size[hi]).at[hi].set(0.0)
    active2 = active.at[hi].set(False)
    labels2 = jnp.where(labels == hi, lo, labels)
    if min_size is not None:
      reached = go & ~jnp.any(first) & (size2[lo] >= min_size)
      first = jnp.where(reached, labels2 == lo, first)
    pick = lambda new, old: jnp.where(go, new, old)
    return (pick(labels2, labels), pick(active2, active),
            pick(size2, size), pick(d2, d), first)

  labels, _, _, _, first = jax.lax.fori_loop(
      0, max(c - clusters, 0), merge, (labels, active, size, d, first))
  return labels, first & valid


def linkage_two(dist: jax.Array, valid: jax.Array,
                linkage: str = 'average') -> jax.Array:
  """Agglomerative clustering down to two clusters.

  Args:
    dist: float32[C, C] pairwise distances (symmetric).
    valid: bool[C]; other points take no part.
    linkage: 'average' (ClippedClustering) or 'single' (the distance of
      two clusters is their closest pair; Blades' attack on
      ClippedClustering).

  Returns:
    int32[C]: a cluster id per point (the smallest member index of its
    cluster), -1 for invalid points.
  """
  return _agglomerate(dist, valid, linkage, 2)[0]


def hdbscan_majority(dist: jax.Array, valid: jax.Array) -> jax.Array:
  """The members HDBSCAN labels 0 with min_cluster_size = n // 2 + 1,
  min_samples = 1 and allow_single_cluster (FLAME's clustering).

  With min_samples = 1 a point's core distance is its nearest-neighbour
  distance, never more than its distance to any other point, so mutual
  reachability equals the distance and the hierarchy is single linkage.
  With min_cluster_size m > n / 2 no split has two children of m points:
  the condensed tree is the root alone, points dropping out as the
  smaller side of each split, and allow_single_cluster labels 0 the points
  that stay longest (largest lambda), i.e. the deepest single-linkage node
  that still holds m points, which is the first cluster to reach m points
  while merging.

  Args:
    dist: float32[C, C] pairwise distances.
    valid: bool[C].

  Returns:
    bool[C]: the admitted points.
  """
  n = jnp.sum(valid)
  return _agglomerate(dist, valid, 'single', 1, n // 2 + 1)[1]


def clipped_clustering(*, num_byzantine: int = 0, max_tau: float = 1e5,
                       history: int = 4096) -> Aggregator:
  """Blades' ClippedClustering.

  Args:
    num_byzantine: unused.
    max_tau: cap on the clipping threshold.
    history: how many past update norms the median runs over (a ring
      buffer; Blades keeps all of them).
  """
  del num_byzantine
  if not max_tau > 0:
    raise setting('clipped_clustering', 'max_tau', f'must be > 0, got '
                  f'{max_tau}')
  if history < 1:
    raise setting('clipped_clustering', 'history', f'must be >= 1, got '
                  f'{history}')

  def init(params):
    del params
    return ClippedClusteringState(jnp.zeros((history,), jnp.float32),
                                  jnp.int32(0))

  def aggregate(updates, mask, state, key):
    del key
    x, valid = clean_rows(updates, mask)
    c = x.shape[0]
    norms = safe_norm(x, axis=1)
    # Append this round's norms to the ring buffer (valid ones only).
    slot = state.count + jnp.cumsum(valid) - 1
    where = jnp.where(valid, slot % history, history)
    buffer = state.norms.at[where].set(norms, mode='drop')
    count = state.count + jnp.sum(valid)
    seen = jnp.minimum(count, history)
    tau = jnp.minimum(masked_median(buffer, jnp.arange(history) < seen),
                      max_tau)
    scale = clip_factors(norms, tau)
    clipped = x * scale[:, None]
    dist = cosine_distances(clipped)
    labels = linkage_two(dist, valid)
    member = labels[None, :] == jnp.arange(c)[:, None]        # [cluster, c]
    sizes = jnp.sum(member, axis=1).astype(jnp.float32)
    # The larger cluster; on a tie the tighter one (smaller mean pairwise
    # distance), so the choice does not depend on the slot order.
    within = jnp.einsum('kc,cd,kd->k', member.astype(jnp.float32), dist,
                        member.astype(jnp.float32))
    spread = within / jnp.maximum(sizes * (sizes - 1), 1.0)
    score = jnp.where(sizes > 0, sizes - jnp.clip(spread, 0.0, 2.0) / 4.0,
                      -jnp.inf)
    keep = valid & (labels == jnp.argmax(score))
    total = jnp.sum(keep).astype(jnp.float32)
    weights = jnp.where(keep, 1.0 / jnp.maximum(total, 1.0), 0.0)
    info = {'weights': weights.astype(jnp.float32),
            'clip_norm': tau.astype(jnp.float32)}
    return (weighted_update(updates, clipped, weights),
            ClippedClusteringState(buffer, count), info)

  return Aggregator(init, aggregate)


def signguard(*, num_byzantine: int = 0, lower_bound: float = 0.1,
              upper_bound: float = 3.0, selection_fraction: float = 0.1,
              eps: float = 0.05, min_samples: int = 3) -> Aggregator:
  """SignGuard (Xu et al., ICDCS 2022), as FLPoison runs it.

    1. norm filter: keep lower_bound * med < ||g_i|| < upper_bound * med,
       med the median norm of the round;
    2. sign filter: on a random contiguous window of selection_fraction of
       the coordinates, each client's shares of positive, zero and negative
       signs (each divided by its maximum over the clients) are clustered
       by DBSCAN (eps 0.05, min_samples 3, FLPoison's default; the paper
       uses MeanShift) and the largest cluster is kept;
    3. the clients in both sets are clipped to the median norm and
       averaged. No client in both: a zero update.
  """
  del num_byzantine
  if not 0 < lower_bound < upper_bound:
    raise setting('signguard', 'lower_bound', f'needs 0 < lower_bound < '
                  f'upper_bound, got {lower_bound}, {upper_bound}')
  if not 0 < selection_fraction <= 1:
    raise setting('signguard', 'selection_fraction', f'must be in (0, 1], '
                  f'got {selection_fraction}')
  if not eps > 0:
    raise setting('signguard', 'eps', f'must be > 0, got {eps}')

  def aggregate(updates, mask, state, key):
    x, valid = clean_rows(updates, mask)
    c, d = x.shape
    norms = safe_norm(x, axis=1)
    med = masked_median(norms, valid)
    by_norm = (norms > lower_bound * med) & (norms < upper_bound * med)
    width = max(int(selection_fraction * d), 1)
    start = jax.random.randint(key, (), 0, d - width + 1)
    window = jax.lax.dynamic_slice_in_dim(x, start, width, axis=1)
    signs = jnp.sign(window)
    feats = jnp.stack([jnp.mean(signs == s, axis=1) for s in (1, 0, -1)],
                      axis=1)
    top = jnp.max(jnp.where(valid[:, None], feats, 0.0), axis=0)
    feats = feats / (top + 1e-8)[None, :]
    dist = euclidean_distances(feats)
    labels = dbscan_distances(dist, valid, eps=eps, min_samples=min_samples)
    sizes = jnp.sum((labels[None, :] == jnp.arange(c)[:, None]) &
                    (labels[None, :] >= 0), axis=1)
    by_sign = (labels == jnp.argmax(sizes)) & (jnp.max(sizes) > 0)
    keep = valid & by_norm & by_sign
    clip = clip_factors(norms, med)
    total = jnp.sum(keep).astype(jnp.float32)
    weights = jnp.where(keep, 1.0 / jnp.maximum(total, 1.0), 0.0)
    info = {'weights': weights.astype(jnp.float32),
            'norm_kept': jnp.sum(valid & by_norm).astype(jnp.float32),
            'sign_kept': jnp.sum(valid & by_sign).astype(jnp.float32)}
    return weighted_update(updates, x * clip[:, None], weights), state, info

  return Aggregator(stateless_init, aggregate)


def flame(*, num_byzantine: int = 0, gamma: float = 1.2e-5) -> Aggregator:
  """FLAME (Nguyen et al., USENIX Security 2022), as FLPoison runs it.

    admitted = HDBSCAN(cosine distances of the updates, min_cluster_size =
               n // 2 + 1, min_samples = 1, allow_single_cluster) label 0
               (`hdbscan_majority`);
    S        = median of every real client's update norm;
    update   = mean over admitted of Delta_i min(1, S / ||Delta_i||);
    new model w + update gets Gaussian noise on every parameter tensor,
               std = gamma * S * std(that tensor of w + update)
               (FLPoison's weak-DP step, gamma = 1.2e-5; the paper's
               sigma = lambda S with lambda = 0.001 for images).
  The noise is returned as part of the update. Deviation: FLPoison
  clusters the flattened local models (model updates for FedAvg); here
  the updates, which is what the cosine distance of FLAME's Sec. 4 is
  about once the shared global model is subtracted.

  info: 'weights' (min(1, S / ||Delta_i||) / |admitted| on the admitted),
  'clip_norm' (S).
  """
  del num_byzantine
  if not gamma >= 0:
    raise setting('flame', 'gamma', f'must be >= 0, got {gamma}')

  def aggregate(updates, mask, state, key, params):
    x, valid = clean_rows(updates, mask)
    dist = cosine_distances(x)
    admitted = hdbscan_majority(dist, valid)
    norms = safe_norm(x, axis=1)
    clip = masked_median(norms, valid)
    scale = clip_factors(norms, clip)
    k = jnp.maximum(jnp.sum(admitted), 1).astype(jnp.float32)
    weights = jnp.where(admitted, scale / k, 0.0).astype(jnp.float32)
    update = weighted_update(updates, x, weights)
    leaves, treedef = jax.tree.flatten(update)
    keys = jax.random.split(key, len(leaves))
    noisy = []
    for leaf, base, k_leaf in zip(leaves, jax.tree.leaves(params), keys):
      new = base.astype(jnp.float32) + leaf.astype(jnp.float32)
      spread = jnp.std(new, ddof=1) if new.size > 1 else jnp.float32(0.0)
      noise = gamma * clip * spread * jax.random.normal(k_leaf, leaf.shape)
      noisy.append((leaf + noise).astype(leaf.dtype))
    return (jax.tree.unflatten(treedef, noisy), state,
            {'weights': weights, 'clip_norm': clip.astype(jnp.float32)})

  return Aggregator(stateless_init, aggregate, reads=('params',))
