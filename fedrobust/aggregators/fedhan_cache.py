"""FedHAN's server cache: imputation, weights, history and suspicion.

FedHAN (paper 004 in shared/seeds, Sec. 3.5) keeps, for each of the N
clients, its latest imputed update, the weight matrix of that update, the
mask of its latest upload and its latest imputed global update: the
O(4Np) state of Sec. 4.1. Everything here is a pure function over flat
vectors (D = the model's parameter count) with static shapes: the K
arrivals of a round come as slots with a mask, and a masked slot never
writes or reads a row.

Per round j, for each arriving client i (its upload g_i, sparse under its
width mask m_i, m~_i = 1 - m_i, staleness tau_i):

  Eq. 3  gbar_i <- g_i on m_i, gbar_i (previous) on m~_i;
         clients that did not arrive keep gbar_i.
  Eq. 4  M_i <- beta^tau_i on m_i, beta M_i on m~_i; others M_i <- beta M_i.
  Eq. 9  gchk_i <- g(w_{j - tau_i}) on m_i, gchk_i on m~_i, where
         g(w_t) is the global update of round t (the one the client's model
         came from); others keep gchk_i.
  Eq. 5  p'_i = M_i (m_i + alpha m~_i)                      (per coordinate)
  Eq. 6  gbar(w_j) = sum_i p_i gbar_i,  p_i = p'_i / sum_k p'_k   over the
         K arrivals, per coordinate (a coordinate nobody weighs stays 0).
  Eq. 7  sim_i = cos(gbar_i, gbar(w_j)) for cached clients that did not
         arrive, last uploaded at most tau_max rounds ago; selected if
         sim_i >= sim_min.
  Eq. 8  g(w_j) = gbar(w_j) + alpha gtilde(w_j), gtilde the Eq. 5-6
         aggregate of the selected clients.
  Sec. 3.5.3  suspicion s_i = ||gchk_i - gbar_i||_2 of each arrival.

What the paper leaves open and is assumed here (BUILD_NOTES):
  * Eq. 6 normalises p' per coordinate (p' is a matrix) over the arrivals;
  * gtilde uses the same Eq. 5-6 weights over the selected clients;
  * Eq. 7's candidates are limited to staleness <= tau_max (Sec. 4.1's
    "clients that satisfy tau <= tau_max");
  * the suspicion is computed for the round's arrivals (the updates that
    enter the aggregate).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.aggregators.clustering import cluster_count, dbscan, kmeans2_1d


class FedHANCache(NamedTuple):
  gbar: jax.Array        # float32[N, D], latest imputed local update (Eq. 3)
  weight: jax.Array      # float32[N, D], its weight matrix M (Eq. 4)
  mask: jax.Array        # bool[N, D], width mask of the latest upload
  gchk: jax.Array        # float32[N, D], latest imputed global update (Eq. 9)
  last: jax.Array        # int32[N], round of the latest upload (0: none;
                         # rounds count from 1)

  @property
  def seen(self) -> jax.Array:
    """bool[N]: the client has uploaded at least once."""
    return self.last > 0


def init_cache(num_clients: int, dim: int) -> FedHANCache:
  """An empty cache for N clients of D parameters."""
  z = jnp.zeros((num_clients, dim), jnp.float32)
  return FedHANCache(z, z, jnp.zeros((num_clients, dim), bool), z,
                     jnp.zeros((num_clients,), jnp.int32))


def _rows(ids: jax.Array, mask: jax.Array, n: int) -> jax.Array:
  """Row of each slot; masked slots point past the end (dropped)."""
  return jnp.where(mask, jnp.asarray(ids, jnp.int32), n)


def receive(cache: FedHANCache, ids: jax.Array, mask: jax.Array,
            updates: jax.Array, masks: jax.Array, staleness: jax.Array,
            global_then: jax.Array, *, round_: jax.Array,
            beta: float) -> FedHANCache:
  """Eq. 3, 4 and 9 for the round's arrivals.

  Args:
    cache: the cache before round j.
    ids: int32[K] client ids of the slots; mask: bool[K] real arrivals.
    updates: float32[K, D] the uploads (zero off the client's mask).
    masks: bool[K, D] each upload's width mask m^{d_i}.
    staleness: int32[K] tau_i (rounds since the client's model was sent).
    global_then: float32[K, D] g(w_{j - tau_i}), the global update of the
      round each arrival's model came from.
    round_: int32[] j (>= 1).
    beta: the staleness decay (the paper's 0.9).

  Returns:
    The cache after round j.
  """
  n = cache.gbar.shape[0]
  rows = _rows(ids, mask, n)
  m = jnp.asarray(masks, bool)
  old = lambda a, fill: a.at[rows].get(mode='fill', fill_value=fill)
  tau = jnp.asarray(staleness, jnp.float32)[:, None]
  new_gbar = jnp.where(m, updates, old(cache.gbar, 0.0))
  decayed = beta * cache.weight                      # everyone decays ...
  new_w = jnp.where(m, jnp.power(beta, tau), old(decayed, 0.0))
  new_gchk = jnp.where(m, global_then, old(cache.gchk, 0.0))
  put = lambda a, v: a.at[rows].set(v, mode='drop')
  return FedHANCache(
      gbar=put(cache.gbar, new_gbar),
      weight=put(decayed, new_w),                    # ... arrivals reset
      mask=put(cache.mask, m),
      gchk=put(cache.gchk, new_gchk),
      last=put(cache.last, jnp.full(rows.shape, round_, jnp.int32)))


def _weighted(gbar: jax.Array, weight: jax.Array, mask: jax.Array,
              keep: jax.Array, alpha: float) -> jax.Array:
  """Eq. 5-6 over the rows where keep: float32[D]."""
  p = weight * jnp.where(mask, 1.0, alpha) * keep[:, None]
  total = jnp.sum(p, axis=0)
  agg = jnp.sum(p * jnp.where(keep[:, None], gbar, 0.0), axis=0)
  return jnp.where(total > 0, agg / jnp.where(total > 0, total, 1.0), 0.0)


def aggregate_arrivals(cache: FedHANCache, ids: jax.Array, mask: jax.Array,
                       *, alpha: float) -> jax.Array:
  """Eq. 5-6: gbar(w_j) over the arrivals (after `receive`): float32[D]."""
  n = cache.gbar.shape[0]
  keep = jnp.zeros((n,), bool).at[_rows(ids, mask, n)].set(True, mode='drop')
  return _weighted(cache.gbar, cache.weight, cache.mask, keep, alpha)


def select_history(cache: FedHANCache, ids: jax.Array, mask: jax.Array,
                   estimate: jax.Array, *, round_: jax.Array, sim_min: float,
                   tau_max: int, alpha: float, excluded: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Eq. 7-8's historical part.

  Args:
    estimate: float32[D], gbar(w_j) from `aggregate_arrivals`.
    excluded: bool[N], clients never selected (e.g. detected attackers).

  Returns:
    (gtilde float32[D], selected bool[N], sim float32[N] (0 where not a
    candidate)).
  """
  n = cache.gbar.shape[0]
  arrived = jnp.zeros((n,), bool).at[_rows(ids, mask, n)].set(
      True, mode='drop')
  candidate = cache.seen & ~arrived & (round_ - cache.last <= tau_max)
  if excluded is not None:
    candidate = candidate & ~excluded
  dot = cache.gbar @ estimate
  norms = jnp.linalg.norm(cache.gbar, axis=1) * jnp.linalg.norm(estimate)
  sim = jnp.where(candidate & (norms > 0), dot / jnp.where(norms > 0, norms,
                                                            1.0), 0.0)
  selected = candidate & (norms > 0) & (sim >= sim_min)
  return (_weighted(cache.gbar, cache.weight, cache.mask, selected, alpha),
          selected, sim)


def suspicion(cache: FedHANCache, ids: jax.Array, mask: jax.Array
              ) -> jax.Array:
  """Sec. 3.5.3: s_i = ||gchk_i - gbar_i||_2 per slot (0 if masked)."""
  n = cache.gbar.shape[0]
  rows = _rows(ids, mask, n)
  get = lambda a: a.at[rows].get(mode='fill', fill_value=0.0)
  return jnp.where(mask, jnp.linalg.norm(get(cache.gchk) - get(cache.gbar),
                                         axis=1), 0.0)


def detect(scores: jax.Array, mask: jax.Array, *, eps: float,
           min_samples: int, iters: int = 10
           ) -> tuple[jax.Array, jax.Array]:
  """Sec. 3.5.3: DBSCAN on the scores; if it finds more than one cluster
  or any noise point, 2-means splits the scores and the higher-mean
  cluster is flagged.

  The scores are divided by their median over the real slots first, so
  eps is scale free (the paper gives no eps; an assumption).

  Returns:
    (flagged bool[K], detected bool[]).
  """
  mask = jnp.asarray(mask, bool)
  s = jnp.where(mask, scores, 0.0)
  med = jnp.nanmedian(jnp.where(mask, s, jnp.nan))
  med = jnp.where(jnp.isfinite(med) & (med > 0), med, 1.0)
  x = s / med
  labels = dbscan(x, mask, eps=eps, min_samples=min_samples)
  noise = jnp.any(mask & (labels < 0))
  split = (cluster_count(labels) > 1) | noise
  high, _ = kmeans2_1d(x, mask, iters)
  detected = split & (jnp.sum(mask) >= 2) & jnp.any(high)
  return high & detected, detected
