"""Auror (Shen, Tople, Saxena, ACSAC 2016), as FLPoison runs it.

  1. Indicative features (the first `find_rounds` rounds; then fixed): for
     every coordinate j of the output layer, split the clients' values
     x_ij into two groups by 1-D 2-means; j is indicative when the two
     centres are at least `threshold` apart.
  2. Every round: 2-means over the clients on their indicative
     coordinates; the larger cluster is benign and averaged.

Jittable form: the indicative set is a bool mask over the output layer's
coordinates in the state, recomputed while `round < find_rounds`. The 1-D
split is `clustering.kmeans2_1d` (initialised at the extremes). The
multi-dimensional 2-means starts from the client farthest from the real
clients' mean and the client farthest from that one, then runs `iters`
Lloyd steps; FLPoison calls scikit-learn's KMeans (k-means++, random_state
0), so the two can split differently when the data has no clear two
groups. A tie in size goes to the cluster of the second start (the one
not chosen for being far from the mean); FLPoison's goes to label 0. With
no indicative coordinate every real client is kept.

The output layer is the module the runner names (`output_path`, the
model's head, as for FoolsGold): its weights, not its bias; FLPoison's
`ol_from_vector` also takes the bias. FLPoison clusters gradient-like
updates of FedSGD; here the clients send deltas after local training, so
the output layer is divided by `delta_scale` before the threshold test
(default 0.002, FLPoison's). The runner sets delta_scale to the clients'
effective step, lr x local steps / (1 - momentum), which turns a delta
into the mean gradient it followed; delta_scale = 1 tests the deltas
themselves (formerly the only choice: 1,966 of 2,570 output
coordinates counted as indicative on the backdoor table's flags).

info: 'weights' (1 / |benign| on the benign cluster), 'indicative' (the
number of indicative coordinates).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.aggregators.base import Aggregator
from fedrobust.aggregators.clustered import clean_rows, weighted_update
from fedrobust.aggregators.clustering import kmeans2_1d
from fedrobust.aggregators.finetune import first_client, ravel_one
from fedrobust.aggregators.foolsgold import feature_index
from fedrobust.aggregators.mean import check_int, setting


class AurorState(NamedTuple):
  indicative: jax.Array   # bool[F]: indicative output-layer coordinates
  round: jax.Array        # int32[]: rounds aggregated so far


def indicative_features(h: jax.Array, valid: jax.Array, threshold: float,
                        iters: int) -> jax.Array:
  """bool[F]: coordinates whose 1-D 2-means centres are >= threshold apart.

  Args:
    h: float32[C, F] the clients' output-layer values.
    valid: bool[C].
  """

  def gap(column):
    upper, _ = kmeans2_1d(column, valid, iters)
    lower = valid & ~upper
    mean = lambda sel: (jnp.sum(jnp.where(sel, column, 0.0)) /
                        jnp.maximum(jnp.sum(sel), 1))
    both = jnp.any(upper) & jnp.any(lower)
    return jnp.where(both, jnp.abs(mean(upper) - mean(lower)), 0.0)

  return jax.vmap(gap, in_axes=1)(h) >= threshold


def kmeans2(points: jax.Array, valid: jax.Array, iters: int) -> jax.Array:
  """bool[C]: the members of the larger of two k-means clusters of the
  valid rows (see the module docstring for the start and the tie)."""
  mean = jnp.sum(jnp.where(valid[:, None], points, 0.0), axis=0) / (
      jnp.maximum(jnp.sum(valid), 1))
  far = lambda centre: jnp.argmax(jnp.where(
      valid, jnp.sum(jnp.square(points - centre[None, :]), axis=1), -1.0))
  first = far(mean)
  second = far(points[first])
  centres = jnp.stack([points[first], points[second]])

  def assign(centres):
    d = jnp.sum(jnp.square(points[:, None, :] - centres[None, :, :]),
                axis=-1)
    return valid & (d[:, 1] <= d[:, 0])          # True: the second cluster

  def step(centres, _):
    to_second = assign(centres)
    groups = jnp.stack([valid & ~to_second, to_second])      # [2, C]
    sums = jnp.einsum('kc,cf->kf', groups.astype(points.dtype), points)
    counts = jnp.sum(groups, axis=1)[:, None]
    return jnp.where(counts > 0, sums / jnp.maximum(counts, 1),
                     centres), None

  centres, _ = jax.lax.scan(step, centres, None, length=iters)
  to_second = assign(centres)
  second_size = jnp.sum(to_second)
  first_size = jnp.sum(valid) - second_size
  return jnp.where(second_size >= first_size, to_second,
                   valid & ~to_second)


def auror(*, num_byzantine: int = 0, threshold: float = 0.002,
          find_rounds: int = 10, iters: int = 20,
          output_path: str | None = None,
          delta_scale: float = 1.0) -> Aggregator:
  """Auror; see the module docstring."""
  del num_byzantine
  if not threshold > 0:
    raise setting('auror', 'threshold', f'must be > 0, got {threshold}')
  if not delta_scale > 0:
    raise setting('auror', 'delta_scale', f'must be > 0, got {delta_scale}')
  check_int('auror', 'find_rounds', find_rounds)
  check_int('auror', 'iters', iters)

  def head(flat, one):
    index = feature_index(one, output_path)
    return flat if index is None else flat[:, index]

  def init(params):
    index = feature_index(params, output_path)
    features = ravel_one(params).shape[0] if index is None else len(index)
    return AurorState(jnp.zeros((features,), bool), jnp.int32(0))

  def aggregate(updates, mask, state, key):
    del key
    x, valid = clean_rows(updates, mask)
    h = head(x, first_client(updates))
    finding = state.round < find_rounds
    indicative = jnp.where(
        finding, indicative_features(h / delta_scale, valid, threshold,
                                     iters),
        state.indicative)
    picked = jnp.where(indicative[None, :], h, 0.0)
    benign = jnp.where(jnp.any(indicative), kmeans2(picked, valid, iters),
                       valid)
    k = jnp.maximum(jnp.sum(benign), 1).astype(jnp.float32)
    weights = jnp.where(benign, 1.0 / k, 0.0).astype(jnp.float32)
    return (weighted_update(updates, x, weights),
            AurorState(indicative, state.round + 1),
            {'weights': weights,
             'indicative': jnp.sum(indicative).astype(jnp.float32)})

  return Aggregator(init, aggregate)
