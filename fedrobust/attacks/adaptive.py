"""Adaptive attacks written against one defense (Blades' adversaries).

  signguard_adaptive: against SignGuard's sign-share clustering.
  clippedclustering_adaptive: against ClippedClustering's linkage step.

Both follow the ModelAttack contract of `model_poisoning.py`: only the
rows with `mask & is_malicious` change, benign statistics come from the
rows with `mask & ~is_malicious`, and shapes are static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fedrobust.aggregators.clustered import cosine_distances, linkage_two
from fedrobust.aggregators.finetune import safe_norm
from fedrobust.attacks.model_poisoning import (ModelAttack, benign_stats,
                                               check_positive,
                                               replace_malicious)


def signguard_sample(mean: jax.Array, key: jax.Array) -> jax.Array:
  """One draw of the SignGuard-adaptive update for the benign mean.

  With P positive, N negative and Z zero coordinates in `mean`, the update
  is the vector [U(0,1) x P, -U(0,1) x N, 0 x Z] shuffled by a uniform
  random permutation: its sign shares equal the benign mean's exactly, its
  magnitudes carry nothing of the mean.

  Args:
    mean: float[D], the benign mean update.
    key: PRNG key.

  Returns:
    float[D].
  """
  d = mean.shape[0]
  k_noise, k_perm = jax.random.split(key)
  pos = jnp.sum(mean > 0)
  neg = jnp.sum(mean < 0)
  rank = jnp.arange(d)
  u = jax.random.uniform(k_noise, (d,), mean.dtype)
  noise = jnp.where(rank < pos, u, jnp.where(rank < pos + neg, -u, 0.0))
  return noise[jax.random.permutation(k_perm, d)]


def signguard_adaptive() -> ModelAttack:
  """Blades' adaptive attack on SignGuard (`SignGuardAdversary`).

  SignGuard keeps the clients whose shares of positive, zero and negative
  coordinates cluster with the majority. Every attacker sends the same
  `signguard_sample` of the benign mean: the sign shares match the benign
  mean's (so the update joins the majority cluster) while the coordinates
  are random in sign position and size, and the update's norm (about
  sqrt(D / 3)) passes the norm filter when benign norms are of that order.

  Returns:
    A ModelAttack with needs_benign=True.

  References:
    Xu et al., "SignGuard: Byzantine-robust federated learning through
    collaborative malicious gradient filtering", ICDCS 2022; Li et al.,
    "Blades: A unified benchmark suite for Byzantine attacks and defenses
    in federated learning" (blades/adversaries/signguard_adversary.py).
  """

  def apply(updates, is_malicious, mask, key):
    stats = benign_stats(updates, is_malicious, mask)
    return replace_malicious(updates, stats.attacker,
                             signguard_sample(stats.mean, key))

  return ModelAttack('signguard_adaptive', True, apply)


def _cosine_distances(x: jax.Array, valid: jax.Array) -> jax.Array:
  """1 - cos(x_i, x_j) over valid rows; a zero row is at distance 2 (the
  reference maps NaN cosine distances to 2)."""
  ok = valid & (safe_norm(x, axis=1) > 0)
  both = ok[:, None] & ok[None, :]
  return jnp.where(both, jnp.clip(cosine_distances(x), 0.0, 2.0), 2.0)


def clippedclustering_adaptive(*, scale: float = 10.0, margin: float = 0.1,
                               eps: float = 1e-4) -> ModelAttack:
  """Blades' chain attack on ClippedClustering
  (`AttackclippedclusteringAdversary`).

  ClippedClustering clips every update to the median norm, splits the
  clients into two clusters by agglomerative clustering on cosine distance
  and averages the larger one. The attack builds a chain of updates that
  single linkage keeps attached to the benign majority while it turns away
  from the benign mean:

    theta_c = arccos(1 - min_{i != j benign} d_cos(i, j)) - margin
    larger  = the larger of the two single-linkage clusters of the benign
              updates;
    v_0     = the unit update of the member of `larger` farthest (in
              cosine distance) from the benign mean mu, at angle theta
              from it.
  For each attacker in slot order, with phi = theta + theta_c - eps:
    if theta + theta_c >= pi:  send -scale mu;
    else: v = a mu / ||mu|| + b v_prev,
          a = cos(phi) - sin(phi) / tan(theta),
          b = cos(theta_c - eps) + sin(theta_c - eps) / tan(theta),
          send scale v;  theta <- phi.
  v is the unit vector at angle phi from mu in the plane of mu and v_prev,
  so consecutive attackers sit theta_c apart in angle, just closer than the
  two closest benign updates, and each links to the last.

  Departures from the reference code, both where it contradicts its own
  geometry: it takes the farthest member by its index inside `larger` but
  reads that index from all benign updates; here it is the member itself.
  It chains from the previous attacker's scaled update (norm `scale`), so
  from the second attacker on the formula no longer gives angle phi; here
  v_prev is the previous unit vector. The two coincide for one attacker.
  The clusters' tie (equal sizes) goes to the one holding the lowest slot
  (the reference: to scikit-learn's label 0).

  Args:
    scale: > 0, the norm of each malicious update (ClippedClustering clips
      it to the median norm anyway).
    margin: > 0, radians subtracted from the closest benign angle.
    eps: > 0, the reference's small angle that keeps the chain strictly
      inside.

  Returns:
    A ModelAttack with needs_benign=True.

  References:
    Li, Ngai, Voigt, "An experimental study of Byzantine-robust
    aggregation schemes in federated learning", IEEE TBD 2023 (the
    ClippedClustering paper and its adaptive attack); Blades,
    blades/adversaries/attackclippedclustering_adversary.py.
  """
  check_positive('clippedclustering_adaptive', 'scale', scale)
  check_positive('clippedclustering_adaptive', 'margin', margin)
  check_positive('clippedclustering_adaptive', 'eps', eps)

  def apply(updates, is_malicious, mask, key):
    del key
    stats = benign_stats(updates, is_malicious, mask)
    benign = stats.benign
    c = updates.shape[0]
    x = jnp.where(benign[:, None], updates, 0.0)
    dist = _cosine_distances(x, benign)
    off_diag = benign[:, None] & benign[None, :] & ~jnp.eye(c, dtype=bool)
    closest = jnp.min(jnp.where(off_diag, dist, jnp.inf))
    theta_c = jnp.arccos(jnp.clip(1.0 - closest, -1.0, 1.0)) - margin
    labels = linkage_two(dist, benign, 'single')
    sizes = jnp.sum(labels[None, :] == jnp.arange(c)[:, None], axis=1)
    big = jnp.argmax(sizes)              # ties: the lowest slot's cluster
    larger = benign & (labels == big)
    mu = stats.mean
    mu_norm = safe_norm(mu)
    mu_unit = mu / jnp.where(mu_norm > 0, mu_norm, 1.0)
    norms = safe_norm(x, axis=1)
    cos_mu = jnp.matmul(x, mu_unit, precision='highest') / jnp.where(
        norms > 0, norms, 1.0)
    to_mean = jnp.where(larger, 1.0 - cos_mu, -jnp.inf)
    far = jnp.argmax(to_mean)
    theta0 = jnp.arccos(jnp.clip(cos_mu[far], -1.0, 1.0))
    v0 = x[far] / jnp.where(norms[far] > 0, norms[far], 1.0)

    def step(carry, is_attacker):
      v, theta = carry
      phi = theta + theta_c - eps
      tan = jnp.tan(theta)
      tan = jnp.where(jnp.abs(tan) > 1e-12, tan, 1e-12)
      a = jnp.cos(phi) - jnp.sin(phi) / tan
      b = jnp.cos(theta_c - eps) + jnp.sin(theta_c - eps) / tan
      rotated = a * mu_unit + b * v
      wrap = theta + theta_c >= jnp.pi
      sent = jnp.where(wrap, -scale * mu, scale * rotated)
      new_v = jnp.where(wrap, v, rotated)
      new_theta = jnp.where(wrap, theta, phi)
      keep = lambda new, old: jnp.where(is_attacker, new, old)
      return (keep(new_v, v), keep(new_theta, theta)), sent

    _, rows = lax.scan(step, (v0, theta0), stats.attacker)
    usable = (stats.num_benign >= 2) & jnp.all(jnp.isfinite(rows), axis=1)
    rows = jnp.where(usable[:, None], rows, -scale * mu[None, :])
    return replace_malicious(updates, stats.attacker, rows)

  return ModelAttack('clippedclustering_adaptive', True, apply)
