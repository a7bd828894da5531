"""RFD-LoRA's server side: robust logit consensus and the distillation loss.

Clients upload logits z_k(x) on a public anchor set, clipped to [-c, c]
(Sec. 3.1, Eq. 4; Algorithm 1). Per anchor x the server

  1. partitions the present clients at random into M groups of (nearly)
     equal size (Median-of-Means; Algorithm 1 draws a partition per
     anchor) and takes the group means zbar_m(x) and second moments
     zbar2_m(x);
  2. consensus  z~(x) = median_m zbar_m(x)             (coordinate-wise)
     moments    mu^(x) = median_m zbar_m(x),
                s2^(x) = median_m zbar2_m(x) - mu^(x)^2  (App. G; Alg. 1)
  3. DIS        v(x) = sum_i Var_m(zbar_m^(i)(x)),  w(x) = 1 / (1 + rho v(x))
                                                         (Eq. 9, on logits
     as in Algorithm 1 and App. G; Sec. 4.3 writes it on probabilities)
  4. CAT        T(x) = T0 (1 + kappa [max_i softmax(z~(x))_i - tau]_+)
                                                         (Eq. 5)
and the student (global) model with logits z_W(x) minimises

  L_KD(x)  = CE(softmax(z~(x)/T(x)), softmax(z_W(x)/T(x)))
  L_MMD(x) = lambda (||z_W(x) - mu^(x)||^2
                     + ||(z_W(x) - mu^(x))^2 - s2^(x)||^2)  (Eq. 7, App. G)
  L_RFD    = mean_x w(x) (L_KD(x) + L_MMD(x))            (Alg. 1)

The aggregator ablation of Table 3 falls out of M: 'mean' is one group
(the plain mean and variance; v = 0, w = 1), 'median' is one client per
group (the coordinate-wise median; DIS then uses the client variance,
Table 4c's "Client-var"), 'mom' is M groups. Module switches give the
ablations of Tables 3-4: cat=False keeps T = T0, mmd='mean' drops the
variance term, mmd='none' and dis=False drop the modules.

Every function works on ONE anchor's [K, C] logits or is vmapped over
anchors by `consensus`; absent clients (mask False) never change a
result, whatever their logits hold.

References:
  RFD-LoRA: Robust Federated Distillation for LoRA Fine-Tuning under
  Heterogeneous and Adversarial Clients (under review), Sec. 3-4,
  Algorithm 1, Eq. 4-9, Appendix G.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.aggregators.finetune import masked_median
from fedrobust.errors import SettingError

AGGREGATORS = ('mom', 'mean', 'median')
MMD_MODES = ('mean_var', 'mean', 'none')


class Consensus(NamedTuple):
  """Per-anchor targets for the student, leaves [A, ...]."""
  logits: jax.Array       # float32[A, C], z~(x), which is also mu^(x)
  var: jax.Array          # float32[A, C], s2^(x) (>= 0)
  weight: jax.Array       # float32[A], w(x) (DIS; 1 when off)
  temperature: jax.Array  # float32[A], T(x) (CAT; T0 when off)
  spread: jax.Array       # float32[A], v(x)


def check_settings(*, aggregator: str, groups: int, mmd: str,
                   temperature: float, kappa: float, tau: float,
                   rho: float, lam: float, clip: float) -> None:
  """Raises SettingError naming the first bad argument."""
  for name, value, ok in (
      ('aggregator', aggregator, aggregator in AGGREGATORS),
      ('groups', groups, groups >= 1),
      ('mmd', mmd, mmd in MMD_MODES),
      ('temperature', temperature, temperature > 0),
      ('kappa', kappa, kappa >= 0),
      ('tau', tau, 0.0 <= tau <= 1.0),
      ('rho', rho, rho >= 0),
      ('lam', lam, lam >= 0),
      ('clip', clip, clip > 0)):
    if not ok:
      raise SettingError(name, f'out of range: {value!r}'
                         + (f'; expected one of {AGGREGATORS}'
                            if name == 'aggregator' else '')
                         + (f'; expected one of {MMD_MODES}'
                            if name == 'mmd' else ''))


def group_of(key: jax.Array, mask: jax.Array, groups: int) -> jax.Array:
  """A random partition of the present clients into `groups` groups.

  Args:
    key: PRNG key.
    mask: bool[K], present clients.
    groups: M (static). With n present clients, group sizes differ by at
      most one; with n < M some groups are empty.

  Returns:
    int32[K]: each present client's group in [0, M); absent clients get M.
  """
  k = mask.shape[0]
  # Present clients first in a random order: rank r -> group r * M // n.
  # A client's draw is keyed by its rank among the present ones, so absent
  # slots (and how many there are) never change the partition.
  present_rank = jnp.cumsum(mask.astype(jnp.int32)) - 1
  u = jax.vmap(lambda r: jax.random.uniform(jax.random.fold_in(key, r)))(
      present_rank)
  order = jnp.argsort(jnp.where(mask, u, 2.0))
  rank = jnp.zeros((k,), jnp.int32).at[order].set(jnp.arange(k))
  n = jnp.maximum(jnp.sum(mask.astype(jnp.int32)), 1)
  return jnp.where(mask, (rank * groups) // n, groups).astype(jnp.int32)


def anchor_consensus(z: jax.Array, mask: jax.Array, group: jax.Array, *,
                     groups: int, temperature: float, kappa: float,
                     tau: float, rho: float, cat: bool = True,
                     dis: bool = True) -> Consensus:
  """Consensus, moments, DIS weight and CAT temperature for ONE anchor.

  Args:
    z: float[K, C], the clients' clipped logits on this anchor.
    mask: bool[K], present clients.
    group: int32[K], from `group_of` (absent: >= groups).
    groups: M.
    temperature, kappa, tau: CAT's T0, kappa, tau (Eq. 5).
    rho: DIS strength (Eq. 9).
    cat, dis: module switches.

  Returns:
    Consensus with leaves of one anchor ([C] and scalars).
  """
  z = jnp.where(mask[:, None], z.astype(jnp.float32), 0.0)
  onehot = (group[:, None] == jnp.arange(groups)[None, :]) & mask[:, None]
  count = jnp.sum(onehot.astype(jnp.float32), axis=0)             # [M]
  present = count > 0
  denom = jnp.maximum(count, 1.0)[:, None]
  hot = onehot.astype(jnp.float32)
  mean = jnp.einsum('km,kc->mc', hot, z, precision='highest') / denom
  sq = jnp.einsum('km,kc->mc', hot, z * z, precision='highest') / denom
  logits = masked_median(mean, present)
  var = jnp.maximum(masked_median(sq, present) - logits * logits, 0.0)
  # v(x): the population variance over the non-empty groups, summed over
  # classes.
  m = jnp.maximum(jnp.sum(present.astype(jnp.float32)), 1.0)
  centre = jnp.sum(jnp.where(present[:, None], mean, 0.0), axis=0) / m
  centred = jnp.where(present[:, None], mean - centre[None, :], 0.0)
  spread = jnp.sum(centred * centred) / m
  weight = jnp.where(dis, 1.0 / (1.0 + rho * spread), 1.0)
  confidence = jnp.max(jax.nn.softmax(logits))
  temp = temperature * (1.0 + jnp.where(cat, kappa, 0.0) *
                        jnp.maximum(confidence - tau, 0.0))
  return Consensus(logits, var, weight, temp, spread)


def consensus(key: jax.Array, z: jax.Array, mask: jax.Array, *,
              aggregator: str = 'mom', groups: int = 5, clip: float = 10.0,
              temperature: float = 2.0, kappa: float = 2.0,
              tau: float = 0.7, rho: float = 1.0, cat: bool = True,
              dis: bool = True) -> Consensus:
  """The server's per-anchor targets from all clients' anchor logits.

  Args:
    key: PRNG key (one partition per anchor, Algorithm 1).
    z: float[K, A, C], client logits on the A anchors (clipped here to
      [-clip, clip] as the clients do, Sec. 3.1, so an unclipped upload
      cannot exceed the radius).
    mask: bool[K], present clients.
    aggregator: 'mom' (M = groups), 'mean' (M = 1) or 'median' (one
      client per group).
    groups, clip, temperature, kappa, tau, rho, cat, dis: App. G's
      M = 5, c = 10, T0 = 2, kappa = 2, tau = 0.7, rho = 1.

  Returns:
    Consensus with leaves [A, ...].
  """
  check_settings(aggregator=aggregator, groups=groups, mmd='mean_var',
                 temperature=temperature, kappa=kappa, tau=tau, rho=rho,
                 lam=0.0, clip=clip)
  k, a = z.shape[0], z.shape[1]
  mask = jnp.asarray(mask, bool)
  z = jnp.clip(jnp.nan_to_num(z.astype(jnp.float32), nan=0.0), -clip, clip)
  if aggregator == 'mean':
    m = 1
  elif aggregator == 'median':
    m = k
  else:
    m = groups
  keys = jax.random.split(key, a)
  if aggregator == 'median':      # one client per group, no randomness
    rank = jnp.cumsum(mask.astype(jnp.int32)) - 1
    part = jnp.broadcast_to(jnp.where(mask, rank, m), (a, k))
  else:
    part = jax.vmap(lambda kk: group_of(kk, mask, m))(keys)
  one = lambda za, g: anchor_consensus(
      za, mask, g, groups=m, temperature=temperature, kappa=kappa,
      tau=tau, rho=rho, cat=cat, dis=dis)
  return jax.vmap(one, in_axes=(1, 0))(z, part)


def anchor_loss(student: jax.Array, target: Consensus, *, lam: float = 0.1,
                mmd: str = 'mean_var') -> jax.Array:
  """w(x) (L_KD(x) + L_MMD(x)) for ONE anchor (Algorithm 1).

  Args:
    student: float[C], z_W(x).
    target: Consensus of this anchor (leaves [C] and scalars).
    lam: lambda of Eq. 7.
    mmd: 'mean_var' (Eq. 7 with App. G's variance term), 'mean' (Table
      4b's mean-only) or 'none'.

  Returns:
    float32 scalar.
  """
  student = student.astype(jnp.float32)
  t = target.temperature
  teacher = jax.nn.softmax(target.logits / t)
  kd = -jnp.sum(teacher * jax.nn.log_softmax(student / t))
  diff = student - target.logits      # z_W - mu^
  mmd_value = jnp.sum(diff * diff)
  if mmd == 'mean_var':
    gap = diff * diff - target.var
    mmd_value = mmd_value + jnp.sum(gap * gap)
  if mmd == 'none':
    mmd_value = 0.0
  return target.weight * (kd + lam * mmd_value)


def rfd_loss(student: jax.Array, target: Consensus, *, lam: float = 0.1,
             mmd: str = 'mean_var') -> jax.Array:
  """L_RFD: the anchors' mean of `anchor_loss` (student float[A, C])."""
  if mmd not in MMD_MODES:
    raise SettingError('mmd', f'{mmd!r}; expected one of {MMD_MODES}')
  per = jax.vmap(lambda s, tg: anchor_loss(s, tg, lam=lam, mmd=mmd))(
      student, target)
  return jnp.mean(per)
