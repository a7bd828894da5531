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
  Eq. 4  M_i <- beta^tau_i on m_i, beta M_i on m~_i; others M_i <- beta M_i
         (kept lazily: M_i = scale_i beta^(j - last_i), so a round touches
         the arrivals' rows only).
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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.aggregators.clustering import cluster_count, dbscan, kmeans2_1d
from fedrobust.aggregators.finetune import finite_clients
from fedrobust.tree import ravel_clients, sum_clients


class FedHANCache(NamedTuple):
  gbar: jax.Array        # [N, D], latest imputed local update (Eq. 3)
  scale: jax.Array       # [N, D], Eq. 4's weight matrix at round `last`:
                         # M_i(j) = scale_i * beta^(j - last_i)
  mask: jax.Array        # bool[N, D], width mask of the latest upload
  gchk: jax.Array        # [N, D], latest imputed global update (Eq. 9)
  norm: jax.Array        # float32[N], ||gbar_i|| (Eq. 7's denominator)
  last: jax.Array        # int32[N], round of the latest upload (0: none;
                         # rounds count from 1)

  @property
  def seen(self) -> jax.Array:
    """bool[N]: the client has uploaded at least once."""
    return self.last > 0


def init_cache(num_clients: int, dim: int, dtype=jnp.float32) -> FedHANCache:
  """An empty cache for N clients of D parameters.

  The three [N, D] value arrays are kept in `dtype` (float32, or bfloat16
  to halve the O(4Np) state); every computation on them is in float32.
  """
  z = jnp.zeros((num_clients, dim), storage_dtype(dtype))
  return FedHANCache(z, z, jnp.zeros((num_clients, dim), bool), z,
                     jnp.zeros((num_clients,), jnp.float32),
                     jnp.zeros((num_clients,), jnp.int32))


def storage_dtype(dtype) -> jnp.dtype:
  """How values of `dtype` are stored: bfloat16 as its uint16 bit pattern.

  XLA's CPU backend widens a bfloat16 scatter or dynamic-update-slice to
  float32 over the whole array (at N = 1000 and the paper's CNN, a 6.6 GB
  temporary per cache array); on the bit pattern the write is an in-place
  integer scatter on every backend.
  """
  return jnp.dtype(jnp.uint16) if jnp.dtype(dtype) == jnp.bfloat16 else (
      jnp.dtype(jnp.float32))


def encode(x: jax.Array, stored) -> jax.Array:
  """float values -> the storage type `stored` (see storage_dtype)."""
  if jnp.dtype(stored) == jnp.uint16:
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
  return x.astype(stored)


def decode(a: jax.Array) -> jax.Array:
  """Stored values -> float32 (bool and int arrays unchanged)."""
  if a.dtype == jnp.uint16:
    return jax.lax.bitcast_convert_type(a, jnp.bfloat16).astype(jnp.float32)
  if jnp.issubdtype(a.dtype, jnp.floating):
    return a.astype(jnp.float32)
  return a


def cache_bytes(num_clients: int, dim: int, dtype=jnp.float32) -> int:
  """Bytes of `init_cache(num_clients, dim, dtype)` (without building it)."""
  item = storage_dtype(dtype).itemsize
  return num_clients * (dim * (3 * item + 1) + 8)


def _rows(ids: jax.Array, mask: jax.Array, n: int) -> jax.Array:
  """Row of each slot; masked slots point past the end (dropped)."""
  return jnp.where(mask, jnp.asarray(ids, jnp.int32), n)


def _get(a: jax.Array, rows: jax.Array, fill=0) -> jax.Array:
  """Rows of `a` (float32 for value arrays); rows past the end: fill."""
  return decode(a.at[rows].get(mode='fill', fill_value=fill))


def weights_at(cache: FedHANCache, round_: jax.Array, beta: float,
               rows: jax.Array | None = None) -> jax.Array:
  """Eq. 4's weight matrix M at round j: float32[N, D] (or of `rows`).

  Every coordinate of every row decays by beta per round unless an upload
  resets it, so M_i(j) = scale_i * beta^(j - last_i): the decay of clients
  that did not arrive costs no pass over the cache.
  """
  if rows is None:
    scale, last = decode(cache.scale), cache.last
  else:
    scale, last = _get(cache.scale, rows), _get(cache.last, rows)
  age = jnp.maximum(jnp.asarray(round_, jnp.int32) - last, 0)
  return scale * jnp.power(beta, age.astype(jnp.float32))[:, None]


def receive(cache: FedHANCache, ids: jax.Array, mask: jax.Array,
            updates: jax.Array, masks: jax.Array, staleness: jax.Array,
            global_then: jax.Array, *, round_: jax.Array,
            beta: float) -> FedHANCache:
  """Eq. 3, 4 and 9 for the round's arrivals; touches their rows only.

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
  tau = jnp.asarray(staleness, jnp.float32)[:, None]
  new_gbar = jnp.where(m, updates, _get(cache.gbar, rows))
  # Eq. 4: beta^tau on the new part, the decayed old weight elsewhere.
  new_scale = jnp.where(m, jnp.power(beta, tau),
                        weights_at(cache, round_, beta, rows))
  new_gchk = jnp.where(m, global_then, _get(cache.gchk, rows))
  put = lambda a, v: a.at[rows].set(encode(v, a.dtype), mode='drop')
  stored = decode(encode(new_gbar, cache.gbar.dtype))
  return FedHANCache(
      gbar=put(cache.gbar, new_gbar),
      scale=put(cache.scale, new_scale),
      mask=put(cache.mask, m),
      gchk=put(cache.gchk, new_gchk),
      norm=put(cache.norm, jnp.linalg.norm(stored, axis=1)),
      last=put(cache.last, jnp.full(rows.shape, round_, jnp.int32)))


# ----------------------------------------------------------------------------
# The round's arrivals a block of slots at a time.
#
# Done at once over K arrivals, every per-slot step above makes [K, D]
# temporaries (the uploads raveled, the masks, g(w_{j - tau}), the three
# rows written, the rows read back, Eq. 5's p): at K = 100 and the paper's
# CNN each is 0.63 GB, 4.4 GB in all, and the server step spent most of its
# time writing them (BUILD_NOTES §3d). The functions below walk
# the slots in blocks of `slot_block(K)` with the same arithmetic per slot;
# only [block, D] temporaries are made.
# ----------------------------------------------------------------------------

SLOT_BLOCK = 8


def slot_block(k: int, block: int = SLOT_BLOCK) -> int:
  """The largest divisor of k that is <= block (the slots split evenly)."""
  return max(b for b in range(1, min(block, k) + 1) if k % b == 0)


def _blocks(x: jax.Array, b: int) -> jax.Array:
  """[K, ...] -> [K / b, b, ...]."""
  return x.reshape((x.shape[0] // b, b) + x.shape[1:])


def _unblock(x: jax.Array) -> jax.Array:
  return x.reshape((-1,) + x.shape[2:])


def receive_uploads(cache: FedHANCache, history: jax.Array, uploads: Any,
                    coverage: Any | None, ids: jax.Array, mask: jax.Array,
                    staleness: jax.Array, *, round_: jax.Array, beta: float,
                    block: int = SLOT_BLOCK
                    ) -> tuple[FedHANCache, jax.Array, jax.Array]:
  """`receive` for the round's raw uploads, a block of slots at a time.

  Per slot (Eq. 3, 4, 9): a slot whose upload has a NaN or Inf is not
  received; the upload is kept on its width mask (coverage > 0, or
  everywhere without coverage); g(w_{j - tau}) is the global update applied
  in round j - 1 - tau, read from `history` (row t mod H; staleness beyond
  the history reads the oldest kept). A model sent before any global
  update existed (round 1) has none: its imputed global update takes its
  own upload there.

  Slots of one client in one round are received in slot order.

  Args:
    cache: the cache before round j.
    history: float32[H, D], the applied global updates.
    uploads: stacked tree, leaves [K, ...] (the uploads, any float dtype).
    coverage: None or a tree like `uploads` (> 0 where the client trained).
    ids, mask, staleness: [K] slot ids, real slots, tau (clamped at 0).
    round_: int32[] j (>= 1).

  Returns:
    (cache after round j, finite bool[K] (real slots with a finite upload,
    the ones received), coverage share float32[K] per slot).
  """
  k = jax.tree.leaves(uploads)[0].shape[0]
  b = slot_block(k, block)
  h = history.shape[0]

  def body(cache, xs):
    up, cov, ids_b, mask_b, tau_b = xs
    flat = ravel_clients(up).astype(jnp.float32)
    own = (jnp.ones(flat.shape, bool) if cov is None else
           ravel_clients(cov) > 0)
    finite = finite_clients(flat, mask_b)
    clean = jnp.where(finite[:, None] & own, flat, 0.0)
    src = jnp.maximum(round_ - 1 - tau_b, round_ - h)
    have_global = round_ - 1 - tau_b >= 1
    then = jnp.where(have_global[:, None], history[jnp.mod(src, h)], clean)
    cache = receive(cache, ids_b, finite, clean, own, tau_b, then,
                    round_=round_, beta=beta)
    return cache, (finite, jnp.mean(own.astype(jnp.float32), axis=1))

  tau = jnp.maximum(jnp.asarray(staleness, jnp.int32), 0)
  xs = (jax.tree.map(lambda a: _blocks(a, b), uploads),
        None if coverage is None else
        jax.tree.map(lambda a: _blocks(a, b), coverage),
        _blocks(jnp.asarray(ids, jnp.int32), b),
        _blocks(jnp.asarray(mask, bool), b), _blocks(tau, b))
  cache, (finite, share) = jax.lax.scan(body, cache, xs)
  return cache, _unblock(finite), _unblock(share)


def slot_norms(cache: FedHANCache, ids: jax.Array, mask: jax.Array, *,
               block: int = SLOT_BLOCK
               ) -> tuple[jax.Array, jax.Array]:
  """(`suspicion`, `global_norms`) of the slots where mask, a block of
  slots at a time: float32[K] each, 0 where masked."""
  b = slot_block(ids.shape[0], block)

  def one(xs):
    ids_b, mask_b = xs
    return suspicion(cache, ids_b, mask_b), global_norms(cache, ids_b,
                                                         mask_b)

  s, g = jax.lax.map(one, (_blocks(jnp.asarray(ids, jnp.int32), b),
                           _blocks(jnp.asarray(mask, bool), b)))
  return _unblock(s), _unblock(g)


def aggregate_slots(cache: FedHANCache, ids: jax.Array, keep: jax.Array, *,
                    alpha: float, block: int = SLOT_BLOCK) -> jax.Array:
  """`aggregate_arrivals` a block of slots at a time: Eq. 5-6 over the
  slots where keep (after `receive`), float32[D]."""
  b = slot_block(ids.shape[0], block)
  d = cache.gbar.shape[1]

  def body(carry, xs):
    ids_b, keep_b = xs
    sums = weighted_sums(*arrival_rows(cache, ids_b, keep_b), keep_b, alpha)
    return jax.tree.map(jnp.add, carry, sums), None

  zero = jnp.zeros((d,), jnp.float32)
  (total, agg), _ = jax.lax.scan(
      body, (zero, zero), (_blocks(jnp.asarray(ids, jnp.int32), b),
                           _blocks(jnp.asarray(keep, bool), b)))
  return normalised(total, agg)


def weighted_sums(gbar: jax.Array, weight: jax.Array, mask: jax.Array,
                  keep: jax.Array, alpha: float
                  ) -> tuple[jax.Array, jax.Array]:
  """Eq. 5-6's two sums over the rows where keep, float32[D] each:
  (sum_i p'_i, sum_i p'_i gbar_i), p'_i = M_i (m_i + alpha m~_i) per
  coordinate. The sums over the rows are dots (sum_clients: at K = 100
  and the paper's CNN, XLA CPU's jnp.sum(axis=0) took 4.1 s of 4.6 s)."""
  keep = jnp.asarray(keep, bool)[:, None]
  p = jnp.where(keep, decode(weight) * jnp.where(mask, 1.0, alpha), 0.0)
  return sum_clients(p), sum_clients(p * jnp.where(keep, decode(gbar), 0.0))


def normalised(total: jax.Array, agg: jax.Array) -> jax.Array:
  """agg / total per coordinate; a coordinate nobody weighs stays 0."""
  return jnp.where(total > 0, agg / jnp.where(total > 0, total, 1.0), 0.0)


def weighted(gbar: jax.Array, weight: jax.Array, mask: jax.Array,
             keep: jax.Array, alpha: float) -> jax.Array:
  """Eq. 5-6 over the rows where keep: float32[D].

  p'_i = M_i (m_i + alpha m~_i) per coordinate, normalised per coordinate
  over the kept rows; a coordinate nobody weighs stays 0.
  """
  return normalised(*weighted_sums(gbar, weight, mask, keep, alpha))


def arrival_rows(cache: FedHANCache, ids: jax.Array, mask: jax.Array
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(gbar, M, mask) of the round's slots after `receive` ([K, D] each;
  an arrival's M is its scale, since its last upload is this round)."""
  rows = _rows(ids, mask, cache.gbar.shape[0])
  return (_get(cache.gbar, rows), _get(cache.scale, rows),
          _get(cache.mask, rows, False))


def aggregate_arrivals(cache: FedHANCache, ids: jax.Array, mask: jax.Array,
                       *, alpha: float) -> jax.Array:
  """Eq. 5-6: gbar(w_j) over the arrivals (after `receive`): float32[D]."""
  gbar, weight, m = arrival_rows(cache, ids, mask)
  return weighted(gbar, weight, m, mask, alpha)


def select_history(cache: FedHANCache, ids: jax.Array, mask: jax.Array,
                   estimate: jax.Array, *, round_: jax.Array, sim_min: float,
                   tau_max: int, alpha: float, beta: float,
                   excluded: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Eq. 7-8's historical part.

  One pass over the cache for the cosines (row norms are kept by
  `receive`); the Eq. 5-6 aggregate of the selected rows costs a second
  pass only in rounds where some row is selected.

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
  dot = row_dots(cache.gbar, estimate, candidate)
  norms = cache.norm * jnp.linalg.norm(estimate)
  ok = candidate & (norms > 0)
  sim = jnp.where(ok, dot / jnp.where(norms > 0, norms, 1.0), 0.0)
  selected = ok & (sim >= sim_min)
  gtilde = jax.lax.cond(
      jnp.any(selected),
      lambda: weighted_cache(cache, selected, round_=round_, beta=beta,
                             alpha=alpha),
      lambda: jnp.zeros(estimate.shape, jnp.float32))
  return gtilde, selected, sim


def _compact(keep: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """(rows int32[nb * block]: the kept rows first, in row order, then the
  rest; number of blocks that hold every kept row)."""
  n = keep.shape[0]
  nb = -(-n // block)
  order = jnp.argsort(~keep, stable=True).astype(jnp.int32)
  order = jnp.concatenate([order, jnp.full((nb * block - n,), n,
                                           jnp.int32)])
  return order, (jnp.sum(keep) + block - 1) // block


def row_dots(x: jax.Array, v: jax.Array, keep: jax.Array | None = None,
             block: int = SLOT_BLOCK) -> jax.Array:
  """x @ v in float32 for the rows where keep (0 elsewhere), `block` rows
  at a time: a bfloat16 x is widened a block at a time, not as a whole
  [N, D] float32 copy, and only blocks holding kept rows are read (at
  N = 1000 and the paper's CNN a full pass decodes 1.7 G values)."""
  n = x.shape[0]
  keep = jnp.ones((n,), bool) if keep is None else keep
  block = max(1, min(block, n))
  order, blocks = _compact(keep, block)

  def body(b, out):
    rows = jax.lax.dynamic_slice_in_dim(order, b * block, block)
    dots = _get(x, rows) @ v
    return out.at[rows].set(jnp.where(keep.at[rows].get(
        mode='fill', fill_value=False), dots, 0.0), mode='drop')

  return jax.lax.fori_loop(0, blocks, body, jnp.zeros((n,), jnp.float32))


def weighted_cache(cache: FedHANCache, keep: jax.Array, *, round_: jax.Array,
                   beta: float, alpha: float,
                   block: int = SLOT_BLOCK) -> jax.Array:
  """`weighted` over the cache rows where keep, `block` rows at a time, so
  no [N, D] temporary is made (at N = 1000 and the paper's CNN, one would
  be 6.6 GB), and only the blocks holding kept rows are read."""
  n, d = cache.gbar.shape
  block = max(1, min(block, n))
  order, blocks = _compact(keep, block)

  def body(b, carry):
    rows = jax.lax.dynamic_slice_in_dim(order, b * block, block)
    sel = keep.at[rows].get(mode='fill', fill_value=False)
    sums = weighted_sums(_get(cache.gbar, rows),
                         weights_at(cache, round_, beta,
                                    jnp.where(sel, rows, n)),
                         _get(cache.mask, rows, False), sel, alpha)
    return jax.tree.map(jnp.add, carry, sums)

  zero = jnp.zeros((d,), jnp.float32)
  return normalised(*jax.lax.fori_loop(0, blocks, body, (zero, zero)))


def global_norms(cache: FedHANCache, ids: jax.Array, mask: jax.Array
                 ) -> jax.Array:
  """||gchk_i|| per slot (0 if masked)."""
  rows = _rows(ids, mask, cache.gbar.shape[0])
  return jnp.where(mask, jnp.linalg.norm(_get(cache.gchk, rows), axis=1), 0.0)


def suspicion(cache: FedHANCache, ids: jax.Array, mask: jax.Array
              ) -> jax.Array:
  """Sec. 3.5.3: s_i = ||gchk_i - gbar_i||_2 per slot (0 if masked)."""
  rows = _rows(ids, mask, cache.gbar.shape[0])
  return jnp.where(mask, jnp.linalg.norm(
      _get(cache.gchk, rows) - _get(cache.gbar, rows), axis=1), 0.0)


def detect(scores: jax.Array, mask: jax.Array, *, eps: float,
           min_samples: int, iters: int = 10, min_flag_score: float = 0.0
           ) -> tuple[jax.Array, jax.Array]:
  """Sec. 3.5.3: DBSCAN on the scores; if it finds more than one cluster
  or any noise point, 2-means splits the scores and the higher-mean
  cluster is flagged.

  The scores are divided by their median over the real slots first, so
  eps is scale free (the paper gives no eps; an assumption).

  min_flag_score: a member of the higher-mean cluster is flagged only if
    its score is at least this multiple of the median (0: every member,
    the rule as the paper writes it). The paper's contributions name "a
    suspicion score threshold that separates benign from malicious
    clients" without giving one; this is that threshold, applied on top
    of the clustering (BUILD_NOTES §3d).

  Returns:
    (flagged bool[K], detected bool[]: some slot was flagged).
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
  flagged = high & split & (jnp.sum(mask) >= 2)
  if min_flag_score > 0:
    flagged = flagged & (x >= min_flag_score)
  return flagged, jnp.any(flagged)


def detect_latest(latest: jax.Array, member: jax.Array, ids: jax.Array,
                  scored: jax.Array, *, eps: float, min_samples: int,
                  min_flag_score: float = 0.0
                  ) -> tuple[jax.Array, jax.Array]:
  """Sec. 3.5.3 over every client's latest score: `detect` on S_j = the
  members' scores, and the scored arrivals in the higher-mean cluster are
  flagged (a non-arriving member of it is not: it is in no round to be
  removed from).

  Args:
    latest: float32[N], each client's latest suspicion score.
    member: bool[N], the clients in S_j.
    ids: int32[K], the round's arrivals (an id >= N is no client).
    scored: bool[K], arrivals scored this round (their latest score is
      this round's).

  Returns:
    (flagged bool[K], detected bool[]: some arrival was flagged).
  """
  high, _ = detect(latest, member, eps=eps, min_samples=min_samples,
                   min_flag_score=min_flag_score)
  flagged = scored & high.at[ids].get(mode='fill', fill_value=False)
  return flagged, jnp.any(flagged)
