"""Full-knowledge local model poisoning of Fang et al. (USENIX Security 2020).

The attacker knows the benign updates and estimates the direction in which
each coordinate would move without attack,

  s_j = sign(mu_j),   mu = mean of the benign updates,

then crafts updates that push every coordinate the other way. Fang et al.
work with local models w = w_global + Delta; in update space the global
model before the attack (their w_Re) is the origin.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from fedrobust.attacks.agr_tailored import (crafted_sq_distances,
                                            krum_scores, krum_selects)
from fedrobust.attacks.model_poisoning import (
    ModelAttack, benign_sq_distances, benign_stats, check_count,
    check_positive, invalid, line_distances, replace_malicious, usable_rows)

REFERENCES = ('global', 'benign_mean')


def trim_intervals(updates: jax.Array, benign: jax.Array, b: float):
  """Per-coordinate sampling intervals of the trimmed-mean/median attack.

  With w_max,j / w_min,j the benign maximum / minimum of coordinate j:
    s_j = -1 (push up):   between w_max,j and b w_max,j   if w_max,j > 0,
                          between w_max,j and w_max,j / b otherwise;
    s_j >= 0 (push down): between w_min,j and w_min,j / b if w_min,j > 0,
                          between w_min,j and b w_min,j   otherwise.
  (s_j = 0 is treated as +1.)

  Args:
    updates: float[C, D].
    benign: bool[C], at least one True for a meaningful result.
    b: > 1.

  Returns:
    (lo, hi), float[D] each: the crafted value is lo + u (hi - lo), u in
    [0, 1); hi >= lo when pushing up, hi <= lo when pushing down.
  """
  rows = benign[:, None]
  w_max = jnp.max(jnp.where(rows, updates, -jnp.inf), axis=0)
  w_min = jnp.min(jnp.where(rows, updates, jnp.inf), axis=0)
  nb = jnp.sum(benign)
  mean = jnp.sum(jnp.where(rows, updates, 0.0), axis=0) / jnp.maximum(nb, 1)
  up = jnp.sign(mean) < 0
  lo = jnp.where(up, w_max, w_min)
  hi = jnp.where(up, jnp.where(w_max > 0, b * w_max, w_max / b),
                 jnp.where(w_min > 0, w_min / b, b * w_min))
  finite = nb > 0
  return jnp.where(finite, lo, 0.0), jnp.where(finite, hi, 0.0)


def fang_trim(*, b: float = 2.0) -> ModelAttack:
  """Fang et al.'s full-knowledge attack on trimmed mean and median.

  Each attacker c and coordinate j independently draws
    Delta_mal_{c,j} ~ U[interval_j]   (see `trim_intervals`),
  just beyond the benign extreme on the side opposite to s_j, so the
  attackers' values survive trimming yet drag the coordinate the wrong way.
  The same attack serves trimmed mean and coordinate-wise median.

  Args:
    b: > 1, how far past the benign extreme the interval reaches.

  Returns:
    A ModelAttack with needs_benign=True.

  References:
    Fang, Cao, Jia, Gong. "Local Model Poisoning Attacks to Byzantine-Robust
    Federated Learning", USENIX Security 2020, attacking trimmed mean (full
    knowledge; also used against median).
  """
  check_positive('fang_trim', 'b', b)
  if b <= 1:
    raise invalid('fang_trim', 'b', f'must be > 1, got {b!r}')

  def apply(updates, is_malicious, mask, key):
    benign = mask & ~is_malicious & usable_rows(updates)
    lo, hi = trim_intervals(updates, benign, b)
    u = jax.random.uniform(key, updates.shape, updates.dtype)
    crafted = lo[None, :] + u * (hi - lo)[None, :]
    return replace_malicious(updates, mask & is_malicious, crafted)

  return ModelAttack('fang_trim', True, apply)


def krum_lambda_bound(pair: jax.Array, origin_sq: jax.Array,
                      benign: jax.Array, n: jax.Array, m: jax.Array,
                      dim: int) -> jax.Array:
  """Fang et al.'s upper bound on lambda for the Krum attack.

    lambda <= 1 / ((n - 2m - 1) sqrt(d)) min_{benign i}
                  sum_{l in Gamma_i} ||w_l - w_i||
              + 1 / sqrt(d) max_{benign i} ||w_i - w_Re||,

  Gamma_i the n - m - 2 benign updates closest to w_i (Euclidean distances,
  not squared). Deviation: n - 2m - 1 is floored at 1 and the neighbour
  count clamped to [1, #benign - 1] so the bound stays finite when the
  attackers are too many for Krum's guarantee.

  Args:
    pair: float[C, C], benign squared distances.
    origin_sq: float[C], ||w_i - w_Re||^2 (0 off benign).
    benign: bool[C].
    n: float[], real clients.
    m: float[], real attackers.
    dim: D.

  Returns:
    float[].
  """
  c = benign.shape[0]
  nb = jnp.sum(benign).astype(jnp.int32)
  real = benign[:, None] & benign[None, :] & ~jnp.eye(c, dtype=bool)
  dist = jnp.sort(jnp.where(real, jnp.sqrt(pair), jnp.inf), axis=1)
  k = jnp.clip((n - m - 2).astype(jnp.int32), 1, jnp.maximum(nb - 1, 1))
  near = jnp.sum(jnp.where(jnp.arange(c)[None, :] < k, dist, 0.0), axis=1)
  near = jnp.min(jnp.where(benign, near, jnp.inf))
  near = jnp.where(nb > 1, near, 0.0)
  far = jnp.sqrt(jnp.max(jnp.where(benign, origin_sq, 0.0)))
  root_d = math.sqrt(dim)
  return near / (jnp.maximum(n - 2.0 * m - 1.0, 1.0) * root_d) + far / root_d


def fang_krum(*, reference: str = 'global', num_byzantine: int | None = None,
              threshold: float = 1e-5, max_halvings: int = 64
              ) -> ModelAttack:
  """Fang et al.'s full-knowledge attack on Krum.

    Delta_mal = w_Re - lambda s,  sent by all m attackers,

  lambda starting at `krum_lambda_bound` and halved until Krum, run on the
  m copies plus the benign updates, selects Delta_mal, or until lambda <
  threshold (the last lambda is then used anyway).

  Args:
    reference: 'global': w_Re is the global model before the attack (delta
      0), as in the paper; 'benign_mean': w_Re = mu, as in the NDSS'21
      reimplementation of this attack.
    num_byzantine: f Krum is configured with (n - f - 2 neighbours); None
      uses m, the round's real attacker count.
    threshold: stop halving once lambda falls below it.
    max_halvings: hard cap on halvings.

  Returns:
    A ModelAttack with needs_benign=True.

  References:
    Fang, Cao, Jia, Gong. "Local Model Poisoning Attacks to Byzantine-Robust
    Federated Learning", USENIX Security 2020, attacking Krum (full
    knowledge).
  """
  name = 'fang_krum'
  if reference not in REFERENCES:
    raise invalid(name, 'reference', f'must be one of {REFERENCES}, got '
                  f'{reference!r}')
  check_positive(name, 'threshold', threshold)
  check_count(name, 'max_halvings', max_halvings, minimum=0)
  if num_byzantine is not None:
    check_count(name, 'num_byzantine', num_byzantine, minimum=0)

  def apply(updates, is_malicious, mask, key):
    del key
    stats = benign_stats(updates, is_malicious, mask)
    s = jnp.sign(stats.mean)
    origin = (jnp.zeros_like(stats.mean) if reference == 'global'
              else stats.mean)
    line = line_distances(updates, stats.benign, origin, -s)
    pair = benign_sq_distances(updates, stats)
    f = (stats.m.astype(jnp.int32) if num_byzantine is None
         else jnp.int32(num_byzantine))
    real = stats.benign | stats.attacker

    def selected(lam):
      sq = crafted_sq_distances(pair, line.at(lam), stats.benign,
                                stats.attacker)
      return krum_selects(krum_scores(sq, real, f), stats.benign,
                          stats.attacker)

    def cond(state):
      lam, ok, i = state
      return ~ok & (lam >= threshold) & (i < max_halvings)

    def body(state):
      lam, _, i = state
      lam = lam / 2.0
      return lam, selected(lam), i + 1

    lam0 = krum_lambda_bound(pair, line.origin_sq, stats.benign, stats.n,
                             stats.m, updates.shape[1])
    lam, _, _ = lax.while_loop(cond, body, (lam0, selected(lam0),
                                            jnp.int32(0)))
    return replace_malicious(updates, stats.attacker, origin - lam * s)

  return ModelAttack(name, True, apply)
