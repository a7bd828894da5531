"""HDBSCAN labels (Campello, Moulavi, Sander 2013; McInnes et al.'s
`hdbscan` package) as a pure, jittable function of a distance matrix.

  core_i   = distance of i to its min_samples-th nearest other point
             (at most the (n-1)-th; the package's `mutual_reachability`)
  mr_ij    = max(d_ij, core_i, core_j)          mutual reachability
  tree     = single linkage over mr (the package's MST + `label`)
  condense = walking the tree from the root: a split with both sides of
             at least min_cluster_size points births two clusters at
             lambda = 1 / distance; a smaller side's points fall out of
             the cluster at that lambda (distance 0: lambda = inf)
  stability(c) = sum over its points and child clusters of
             (lambda when they leave - lambda when c was born) * size
  selection = excess of mass: from the youngest cluster up, a cluster is
             kept when its stability is at least its children's selected
             total, which then drops every descendant; the root takes
             part only with allow_single_cluster
  labels   = a point's selected ancestor (the cluster it fell out of, or
             one above), numbered by cluster age; -1 (noise) when none.
             A selected root labels only the points that stay longest
             (largest lambda among the root's rows), as the package does.

Mutual reachability makes exact ties common (every pair within a core
distance). The tree is built as the package builds it (Prim's walk from
the first valid point, `single_linkage`), but its edges are sorted with a
stable sort, where the package's NumPy quicksort is not stable past 16
edges: merges at one tied height can then pair up in another order and,
rarely, change the partition. Cluster numbers follow the merge heights,
not the package's breadth-first walk, so compare partitions, not label
values. Slots are order-sensitive under ties for the same reason (the
walk starts at the first valid slot).

Cost: three O(C)-step scans of O(C) work (walk, unions, selection) and
one of O(C^2) (condensing, with the ancestor table), fine for the tens to
hundreds of clients a round aggregates.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp



class Merge(NamedTuple):
  """One union of the single-linkage tree (leading axis: the C - 1 steps,
  in merge order)."""
  go: jax.Array            # bool: a real merge (False past the n - 1)
  lo: jax.Array            # int32: the kept representative (left child)
  hi: jax.Array            # int32: the absorbed representative
  distance: jax.Array      # float32
  size_lo: jax.Array       # float32: points under lo before the merge
  size_hi: jax.Array       # float32: points under hi before the merge
  labels: jax.Array        # int32[C]: representatives before the merge


def single_linkage(mr: jax.Array, valid: jax.Array):
  """(Merge records, int32[C] final representatives) of the package's
  single-linkage tree: Prim's walk from the first valid point (ties to
  the lowest index; an edge's source is the tree point that first reached
  the new point's distance, as in `mst_linkage_core`), edges stably sorted
  by weight, then unions (`label`)."""
  c = mr.shape[0]
  ids = jnp.arange(c)
  start = jnp.argmax(valid)

  def prim(carry, _):
    in_tree, best, source = carry
    free = valid & ~in_tree
    go = jnp.any(free)
    j = jnp.argmin(jnp.where(free, best, jnp.inf))
    edge = (go, source[j], j, jnp.where(go, best[j], jnp.inf))
    in_tree = in_tree | (go & (ids == j))
    closer = go & (mr[j] < best)
    return (in_tree, jnp.where(closer, mr[j], best),
            jnp.where(closer, j, source)), edge

  _, (go, a, b, w) = jax.lax.scan(
      prim, (ids == start, mr[start], jnp.full(c, start)), None,
      length=max(c - 1, 0))
  order = jnp.argsort(w, stable=True)
  go, a, b, w = go[order], a[order], b[order], w[order]

  def union(carry, edge):
    labels, size = carry
    go, a, b, w = edge
    lo, hi = labels[a], labels[b]
    record = Merge(go, lo.astype(jnp.int32), hi.astype(jnp.int32), w,
                   size[lo], size[hi], labels)
    labels = jnp.where(go & (labels == hi), lo, labels)
    size = jnp.where(go, size.at[lo].add(size[hi]).at[hi].set(0.0), size)
    return (labels, size), record

  labels = jnp.where(valid, ids, -1).astype(jnp.int32)
  (labels, _), merges = jax.lax.scan(
      union, (labels, valid.astype(jnp.float32)), (go, a, b, w))
  return merges, labels


def mutual_reachability(dist: jax.Array, valid: jax.Array,
                        min_samples: int) -> jax.Array:
  """float32[C, C]: max(d_ij, core_i, core_j) among valid points, +inf
  elsewhere (the diagonal included)."""
  c = dist.shape[0]
  pair = valid[:, None] & valid[None, :]
  off = pair & ~jnp.eye(c, dtype=bool)
  d = jnp.where(off, dist.astype(jnp.float32), jnp.inf)
  n = jnp.sum(valid)
  k = jnp.clip(jnp.minimum(min_samples, n - 1), 1, max(c - 1, 1))
  # Row i sorted: its other points' distances, nearest first (k-th: k - 1).
  core = jnp.take_along_axis(jnp.sort(d, axis=1),
                             jnp.broadcast_to(k - 1, (c, 1)), axis=1)[:, 0]
  return jnp.where(off, jnp.maximum(d, jnp.maximum(core[:, None],
                                                   core[None, :])), jnp.inf)


def hdbscan(dist: jax.Array, valid: jax.Array, *, min_cluster_size: int = 5,
            min_samples: int | None = None,
            allow_single_cluster: bool = False) -> jax.Array:
  """int32[C] HDBSCAN labels (-1: noise or not valid).

  Args:
    dist: float32[C, C] symmetric distances (the package's 'precomputed').
    valid: bool[C]; other points take no part and get -1.
    min_cluster_size: >= 2 (a Python int, or traced: no check then).
    min_samples: None: min_cluster_size, as in the package. May be traced.
    allow_single_cluster: the root may be the one cluster. May be traced.
  """
  if isinstance(min_cluster_size, int) and min_cluster_size < 2:
    raise ValueError(f'min_cluster_size must be >= 2, got '
                     f'{min_cluster_size}')
  if min_samples is None:
    min_samples = min_cluster_size
  c = dist.shape[0]
  valid = jnp.asarray(valid, bool)
  n = jnp.sum(valid)
  m = jnp.float32(min_cluster_size)
  mr = mutual_reachability(dist, valid, min_samples)
  merges, final = single_linkage(mr, valid)
  ids = jnp.arange(c)
  root_rep = final[jnp.argmax(valid)]
  # Condensed clusters: at most C (each split of a cluster with >= 2m
  # points adds two, m >= 2); cluster 0 is the root.
  cond = jnp.where(ids == root_rep, 0, -1)        # per representative
  birth = jnp.zeros(c, jnp.float32)
  parent = jnp.full(c, -1)
  stab = jnp.zeros(c, jnp.float32)
  anc = jnp.zeros((c, c), bool)                   # anc[a, b]: b above a
  fall_lam = jnp.zeros(c, jnp.float32)
  fall_cl = jnp.full(c, -1)
  count = jnp.int32(1)

  def split(carry, step):
    cond, birth, parent, stab, anc, fall_lam, fall_cl, count = carry
    p = cond[step.lo]
    alive = step.go & (p >= 0)
    lam = jnp.where(step.distance > 0, 1.0 / step.distance, jnp.inf)
    big_lo, big_hi = step.size_lo >= m, step.size_hi >= m
    both = alive & big_lo & big_hi
    pc = jnp.maximum(p, 0)
    gain = lam - birth[pc]
    # Rows of p: two child clusters, or the small sides' points.
    stab = stab.at[pc].add(jnp.where(
        alive, jnp.where(both, gain * step.size_lo + gain * step.size_hi,
                         jnp.where(big_lo, 0.0, gain * step.size_lo) +
                         jnp.where(big_hi, 0.0, gain * step.size_hi)), 0.0))
    new_lo, new_hi = count, count + 1
    above = anc[pc].at[pc].set(True)
    for new in (new_lo, new_hi):
      birth = birth.at[new].set(jnp.where(both, lam, birth[new]), mode='drop')
      parent = parent.at[new].set(jnp.where(both, pc, parent[new]),
                                  mode='drop')
      anc = anc.at[new].set(jnp.where(both, above, anc[new]), mode='drop')
    count = jnp.where(both, count + 2, count)
    keep_lo = jnp.where(both, new_lo, jnp.where(big_lo, p, -1))
    keep_hi = jnp.where(both, new_hi, jnp.where(big_hi, p, -1))
    cond = jnp.where(alive, cond.at[step.lo].set(keep_lo)
                     .at[step.hi].set(keep_hi), cond)
    falls = alive & (((step.labels == step.lo) & ~big_lo) |
                     ((step.labels == step.hi) & ~big_hi))
    fall_lam = jnp.where(falls, lam, fall_lam)
    fall_cl = jnp.where(falls, p, fall_cl)
    return (cond, birth, parent, stab, anc, fall_lam, fall_cl, count), None

  carry = (cond, birth, parent, stab, anc, fall_lam, fall_cl, count)
  carry, _ = jax.lax.scan(split, carry, merges, reverse=True)
  _, birth, parent, stab, anc, fall_lam, fall_cl, count = carry
  exists = ids < count

  # Excess of mass, youngest cluster first (children are younger).
  def select(carry, node):
    stab, chosen = carry
    kids = exists & (parent == node) & (ids > 0)
    subtree = jnp.sum(jnp.where(kids, stab, 0.0))
    take = (node < count) & ((node > 0) | allow_single_cluster)
    keep = take & ~(subtree > stab[node])
    stab = stab.at[node].set(jnp.where(take & ~keep, subtree, stab[node]))
    chosen = chosen.at[node].set(keep)
    chosen = jnp.where(keep, chosen & ~anc[:, node], chosen)
    return (stab, chosen), None

  (_, chosen), _ = jax.lax.scan(select, (stab, jnp.zeros(c, bool)),
                                ids[::-1])
  # A point's label: the chosen cluster on its chain (at most one).
  on_chain = (ids[None, :] == fall_cl[:, None]) | anc[jnp.maximum(fall_cl, 0)]
  hit = on_chain & chosen[None, :] & (fall_cl[:, None] >= 0)
  owner = jnp.argmax(hit, axis=1)
  found = jnp.any(hit, axis=1)
  rank = jnp.cumsum(chosen) - 1                   # numbered by age
  # A chosen root keeps only the points that leave it last.
  root_rows = jnp.concatenate([
      jnp.where(fall_cl == 0, fall_lam, -jnp.inf),
      jnp.where(exists & (parent == 0) & (ids > 0), birth, -jnp.inf)])
  last = fall_lam >= jnp.max(root_rows)
  labelled = found & ((owner > 0) | last)
  return jnp.where(valid & labelled & (n >= 2), rank[owner], -1).astype(
      jnp.int32)
