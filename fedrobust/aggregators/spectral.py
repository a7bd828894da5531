"""Spectral scores of per-client update matrices (Horus's HOPS, Sec. V-B).

For each client c with a matrix A_c (Horus: the LoRA-A factor, [r, d]) and
its singular values s_1 >= ... >= s_r:

  spectral entropy   H_c = -sum_i p_i log p_i,  p_i = s_i / sum_j s_j  (Eq. 2)
  top-k energy ratio R_c = sum_{i<=k} s_i / sum_j s_j                  (Eq. 3)
  HOPS               S_c = lam |(1 - R_c) - mu_R|
                           + (1 - lam) |(H_c - mu_H) / sigma_H|        (Eq. 4)

with mu_R the round mean of 1 - R and mu_H, sigma_H the round mean and
standard deviation of H, all over the round's real clients (mask). Masked
slots get score 0 and do not enter the statistics.

Singular values of all clients are taken in one batched call on GPU/TPU;
on CPU `per_matrix` loops over the clients instead (see there). For a wide
[r, d] matrix (r << d) the eigenvalues of the r x r Gram matrix A A^T give
s_i^2 at a fraction of the SVD's cost ('gram'); 'svd' uses
jnp.linalg.svd(compute_uv=False). The Gram route squares the condition
number, so singular values below ~1e-3 * s_1 lose relative precision in
float32; they carry a negligible share of sum_j s_j, which is all that H
and R use. BUILD_NOTES times both at C in {10, 100, 1000}.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

SV_METHODS = ('gram', 'svd')
SV_CHOICES = ('auto',) + SV_METHODS


def default_sv_method(backend: str | None = None) -> str:
  """'svd' on CPU, 'gram' on GPU/TPU. On one H100 (BUILD_NOTES §4b)
  Horus's server step at C = 100 took 141 ms by per-matrix
  SVDs and 2.1 ms by the Gram route (1,337 ms and 3.0 ms at C = 1000); on
  CPU both are under 1% of the round, and 'svd' keeps the CPU results."""
  backend = backend or jax.default_backend()
  return 'svd' if backend == 'cpu' else 'gram'


def resolve_sv_method(method: str) -> str:
  """'auto' -> default_sv_method(); a named method is returned as is."""
  return default_sv_method() if method == 'auto' else method


def per_matrix(fn, mats: jax.Array):
  """fn over the leading (client) axis of `mats`: batched, except on CPU.

  On CPU jaxlib's batched LAPACK kernels (gesdd, syevd) split the batch
  over XLA's intra-op thread pool and block until it is done. With one XLA
  device per core, each device's kernel can occupy one of the pool's
  threads while waiting for tasks that only the pool can run: the process
  deadlocks (native stacks of the hung round: both `tf_XLAEigen` threads in
  `jax::ParallelBatchMap` -> `BlockingCounter::Wait`). One matrix per call
  (lax.map) never posts tasks. On GPU/TPU the batched call is kept.
  """
  if jax.default_backend() == 'cpu':
    return lax.map(fn, mats)
  return jax.vmap(fn)(mats)


def singular_values(mats: jax.Array, method: str = 'gram') -> jax.Array:
  """float[C, m, n] -> float32[C, min(m, n)], descending."""
  if method not in SV_METHODS:
    raise ValueError(f'singular value method {method!r}; expected one of '
                     f'{SV_METHODS}')
  mats = mats.astype(jnp.float32)
  if method == 'svd':
    return per_matrix(lambda m: jnp.linalg.svd(m, compute_uv=False), mats)
  if mats.shape[-2] > mats.shape[-1]:
    mats = jnp.swapaxes(mats, -1, -2)
  gram = jnp.einsum('cij,ckj->cik', mats, mats,
                    precision=lax.Precision.HIGHEST)
  eig = per_matrix(jnp.linalg.eigvalsh, gram)      # ascending
  return jnp.sqrt(jnp.maximum(eig[..., ::-1], 0.0))


def first_left_singular(mats: jax.Array, method: str = 'svd') -> jax.Array:
  """float[C, m, n] -> float32[C, m]: each matrix's first left singular
  vector u_1 (unit norm; its sign is arbitrary, as the SVD's is).

  'svd' takes it from jnp.linalg.svd. 'gram' works on the smaller side:
  for m <= n, u_1 is the top eigenvector of M M^T [m, m]; for m > n,
  u_1 = M v_1 / s_1 with v_1 the top eigenvector of M^T M [n, n]. A
  min(m, n)-sized batched eigh replaces an m x n SVD per client. A zero
  matrix gives u_1 = 0 under 'gram' (the SVD returns some unit vector).
  """
  if method not in SV_METHODS:
    raise ValueError(f'singular vector method {method!r}; expected one of '
                     f'{SV_METHODS}')
  mats = mats.astype(jnp.float32)
  if method == 'svd':
    return per_matrix(
        lambda m: jnp.linalg.svd(m, full_matrices=False)[0][:, 0], mats)
  hi = lax.Precision.HIGHEST
  if mats.shape[-2] <= mats.shape[-1]:
    gram = jnp.einsum('cij,ckj->cik', mats, mats, precision=hi)
    return per_matrix(lambda g: jnp.linalg.eigh(g)[1][:, -1], gram)
  gram = jnp.einsum('cji,cjk->cik', mats, mats, precision=hi)
  v1 = per_matrix(lambda g: jnp.linalg.eigh(g)[1][:, -1], gram)
  u = jnp.einsum('cij,cj->ci', mats, v1, precision=hi)
  norm = jnp.linalg.norm(u, axis=-1, keepdims=True)
  return u / jnp.where(norm > 0, norm, 1.0)


def _energy(sv: jax.Array) -> jax.Array:
  total = jnp.sum(sv, axis=-1, keepdims=True)
  return sv / jnp.where(total > 0, total, 1.0)


def spectral_entropy(sv: jax.Array) -> jax.Array:
  """Eq. 2 over the last axis (0 log 0 = 0)."""
  p = _energy(sv)
  return -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)),
                            0.0), axis=-1)


def topk_energy_ratio(sv: jax.Array, k: int) -> jax.Array:
  """Eq. 3: the share of sum_j s_j in the k largest singular values."""
  return jnp.sum(_energy(sv)[..., :k], axis=-1)


def hops_scores(sv: jax.Array, mask: jax.Array, *, k: int = 1,
                lam: float = 0.5) -> jax.Array:
  """Eq. 4 for the real clients of a round; 0 on masked slots.

  Args:
    sv: float32[C, r] singular values, descending.
    mask: bool[C].
    k: top-k of Eq. 3 (k << r).
    lam: the weight lambda in [0, 1].
  """
  if not 0.0 <= lam <= 1.0:
    raise ValueError(f'HOPS lambda={lam}; expected a value in [0, 1]')
  n = jnp.maximum(jnp.sum(mask), 1)
  one_minus_r = 1.0 - topk_energy_ratio(sv, k)
  h = spectral_entropy(sv)
  mean = lambda v: jnp.sum(jnp.where(mask, v, 0.0)) / n
  mu_r, mu_h = mean(one_minus_r), mean(h)
  sigma_h = jnp.sqrt(mean(jnp.square(h - mu_h)))
  z = jnp.abs(h - mu_h) / jnp.where(sigma_h > 0, sigma_h, 1.0)
  score = lam * jnp.abs(one_minus_r - mu_r) + (1.0 - lam) * z
  return jnp.where(mask, score, 0.0)
