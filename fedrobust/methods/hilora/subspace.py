"""HiLoRA's LoRA-subspace clustering, routing and cross-tier penalties.

Pure kernels for HiLoRA (seeds/002, Sec. 3.2-3.4), written for a fixed
number of client slots N with a mask so that they run inside a jitted
round; a masked slot is never a neighbour, never moves sigma, the
spectrum's real part or a cluster centre, and gets label -1.

Notation. The paper writes a LoRA update as dW = B A with the basis
B in R^{p x r} (p = output width: "where to adapt") and A in R^{r x q}.
Our LoRA factors act on kernels [d_in, d_out] as a @ b, so the paper's
B is our b^T ([d_out, r]) and its A is our a^T. Every function below
takes the paper's B ([p, r]); `basis_of(b)` converts.

  Eq. 7   EMA of the Frobenius-normalised basis, renormalised:
          Bbar_t = normalise(lam Bbar_{t-1} + (1 - lam) B_t / ||B_t||_F).
  Eq. 8   d_ij = 1 - ||U_i^T U_j||_F^2 / r = 1 - mean_s cos^2(theta_s),
          U_i the top-r left singular vectors of Bbar_i; averaged over the
          LoRA modules when there are several.
  Eq. 9   the distance matrix D; affinity S_ij = exp(-d_ij^2 / (2 sigma^2)),
          S_ii = 1, sigma the median off-diagonal distance.
          Spectral clustering on S (Ng, Jordan and Weiss 2001: the
          normalised Laplacian L = I - D^-1/2 S D^-1/2, its K smallest
          eigenvectors, rows normalised, k-means), with K chosen in
          [K_min, K_max] as the largest eigengap lambda_{K+1} - lambda_K
          of L (von Luxburg 2007, the paper's [37]).
  Sec 3.4 an unseen client u goes to argmax_j mean cos^2 Theta(U_u, U_c,j).
  Eq. 11-12  the cross-tier penalty gamma ||B_frozen^T B||_F^2.
  Sec 3.3  the relative step-size stop rho_t = ||dW_{t+1} - dW_t||_F /
          (||dW_t||_F + eps) <= tau_rel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_EPS = 1e-12


def basis_of(b: jax.Array) -> jax.Array:
  """The paper's basis B [p, r] from our LoRA factor b [r, d_out]."""
  return jnp.swapaxes(b, -1, -2)


def _unit(x: jax.Array) -> jax.Array:
  return x / jnp.maximum(jnp.linalg.norm(x), _EPS)


def ema_basis(previous: jax.Array, basis: jax.Array, decay: float
              ) -> jax.Array:
  """Eq. 7 for one client and module: B [p, r] -> Bbar [p, r], unit norm.

  `previous` is the last Bbar (zeros before the first round, which makes
  the first Bbar the normalised basis itself)."""
  return _unit(decay * previous + (1.0 - decay) * _unit(basis))


def subspace(basis: jax.Array, rank: int | None = None) -> jax.Array:
  """The top-`rank` left singular vectors U [p, rank] of B [p, r]."""
  u, _, _ = jnp.linalg.svd(basis, full_matrices=False)
  return u[:, :rank or basis.shape[-1]]


def principal_cosines(u: jax.Array, v: jax.Array) -> jax.Array:
  """cos theta_s, s = 1..min(r_u, r_v), descending: the singular values of
  U^T V for orthonormal U [p, r_u] and V [p, r_v], clipped to [0, 1]."""
  return jnp.clip(jnp.linalg.svd(u.T @ v, compute_uv=False), 0.0, 1.0)


def subspace_distance(u: jax.Array, v: jax.Array) -> jax.Array:
  """Eq. 8: 1 - ||U^T V||_F^2 / r (r = U's rank; both orthonormal)."""
  return 1.0 - jnp.sum(jnp.square(u.T @ v)) / u.shape[-1]


def distance_matrix(subspaces: list[jax.Array]) -> jax.Array:
  """Eq. 8-9: D [N, N] from per-module stacks U [N, p_m, r], averaged over
  the modules."""
  total = 0.0
  for u in subspaces:
    overlap = jnp.einsum('ipr,jps->ijrs', u, u)
    total = total + 1.0 - jnp.sum(jnp.square(overlap), axis=(2, 3)) / (
        u.shape[-1])
  d = total / len(subspaces)
  n = d.shape[0]
  return jnp.where(jnp.eye(n, dtype=bool), 0.0, jnp.maximum(d, 0.0))


def affinity(dist: jax.Array, mask: jax.Array) -> jax.Array:
  """S [N, N]: the Gaussian kernel of Eq. 9 with sigma the median of the
  real clients' off-diagonal distances; zero on masked rows and columns."""
  n = dist.shape[0]
  pair = mask[:, None] & mask[None, :]
  off = pair & ~jnp.eye(n, dtype=bool)
  sigma = jnp.nanmedian(jnp.where(off, dist, jnp.nan))
  sigma = jnp.where(jnp.isfinite(sigma) & (sigma > 0), sigma, 1.0)
  s = jnp.exp(-jnp.square(dist) / (2.0 * jnp.square(sigma)))
  s = jnp.where(jnp.eye(n, dtype=bool), 1.0, s)
  return jnp.where(pair, s, 0.0)


def laplacian_spectrum(s: jax.Array, mask: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
  """Eigenvalues (ascending) and eigenvectors of L = I - D^-1/2 S D^-1/2.

  A masked slot is decoupled with eigenvalue 2, the top of a normalised
  Laplacian's range, so the real clients' eigenvalues come first and are
  exactly those of their own block."""
  deg = jnp.sum(s, axis=1)
  inv = jnp.where(mask, 1.0 / jnp.sqrt(jnp.maximum(deg, _EPS)), 0.0)
  lap = jnp.eye(s.shape[0]) - inv[:, None] * s * inv[None, :]
  lap = jnp.where(mask[:, None] & mask[None, :], lap, 0.0)
  lap = lap + jnp.diag(jnp.where(mask, 0.0, 2.0))
  return jnp.linalg.eigh(lap)


def eigengap_k(eigenvalues: jax.Array, mask: jax.Array, *, k_min: int,
               k_max: int) -> jax.Array:
  """int32 K in [k_min, k_max] maximising lambda_{K+1} - lambda_K (1-based,
  ascending) over the real clients; K < the number of real clients (a
  gap needs lambda_{K+1}). Ties go to the smaller K."""
  n_real = jnp.sum(mask.astype(jnp.int32))
  ks = jnp.arange(1, eigenvalues.shape[0])            # K = 1..N-1
  gaps = eigenvalues[1:] - eigenvalues[:-1]          # lambda_{K+1} - lambda_K
  valid = (ks >= k_min) & (ks <= k_max) & (ks < n_real)
  best = jnp.argmax(jnp.where(valid, gaps, -jnp.inf))
  k = ks[best]
  return jnp.where(jnp.any(valid), k, jnp.clip(n_real, 1, k_min)).astype(
      jnp.int32)


def kmeans(points: jax.Array, mask: jax.Array, k: jax.Array, *, k_max: int,
           iters: int = 50) -> jax.Array:
  """Lloyd's k-means with a traced k <= k_max on points [N, d] where mask.

  Deterministic farthest-point seeding: the first real point, then
  repeatedly the real point farthest from the centres so far. Returns
  int32 [N] labels in [0, k), -1 for masked slots."""
  big = jnp.float32(jnp.inf)

  def sqdist(centres):
    return jnp.sum(jnp.square(points[:, None, :] - centres[None]), -1)

  first = jnp.argmax(mask)
  centres = jnp.zeros((k_max, points.shape[1]), points.dtype)
  centres = centres.at[0].set(points[first])

  def seed(j, centres):
    active = jnp.arange(k_max) < j
    near = jnp.min(jnp.where(active[None], sqdist(centres), big), axis=1)
    far = jnp.argmax(jnp.where(mask, near, -1.0))
    return centres.at[j].set(jnp.where(j < k, points[far], centres[j]))

  centres = jax.lax.fori_loop(1, k_max, seed, centres)
  active = jnp.arange(k_max) < k

  def assign(centres):
    return jnp.argmin(jnp.where(active[None], sqdist(centres), big), axis=1)

  def step(centres, _):
    onehot = jax.nn.one_hot(assign(centres), k_max) * mask[:, None]
    count = jnp.sum(onehot, axis=0)
    mean = (onehot.T @ points) / jnp.maximum(count, 1.0)[:, None]
    return jnp.where((count > 0)[:, None], mean, centres), None

  centres, _ = jax.lax.scan(step, centres, None, length=iters)
  return jnp.where(mask, assign(centres), -1).astype(jnp.int32)


def spectral_clusters(dist: jax.Array, mask: jax.Array, *, k_min: int,
                      k_max: int, iters: int = 50
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sec. 3.2 end to end from D [N, N]: (labels int32[N], K, eigenvalues).

  Labels are in [0, K) for real clients and -1 for masked slots."""
  if not 1 <= k_min <= k_max:
    raise ValueError(f'k_min={k_min} and k_max={k_max} need '
                     '1 <= k_min <= k_max')
  k_max = min(k_max, dist.shape[0])
  s = affinity(dist, mask)
  eigenvalues, vectors = laplacian_spectrum(s, mask)
  k = eigengap_k(eigenvalues, mask, k_min=k_min, k_max=k_max)
  emb = vectors[:, :k_max] * (jnp.arange(k_max) < k)[None, :]
  emb = emb / jnp.maximum(jnp.linalg.norm(emb, axis=1, keepdims=True), _EPS)
  labels = kmeans(emb, mask, k, k_max=k_max, iters=iters)
  return labels, k, eigenvalues


def route(u: jax.Array, cluster_subspaces: jax.Array, valid: jax.Array
          ) -> jax.Array:
  """Sec. 3.4: the cluster j maximising mean cos^2 Theta(U_u, U_c,j).

  u: [p, r] orthonormal; cluster_subspaces: [K_max, p, r]; valid: bool
  [K_max] (clusters that exist). Returns int32[]."""
  return best_cluster(route_scores(u, cluster_subspaces), valid)


def route_scores(u: jax.Array, cluster_subspaces: jax.Array) -> jax.Array:
  """mean cos^2 of the principal angles between U_u [p, r] and every
  cluster's subspace [K_max, p, r]: float32[K_max] (1 - Eq. 8's distance).
  With several modules, average these over the modules before
  best_cluster, as Eq. 9 averages the distances."""
  overlap = jnp.einsum('pr,kps->krs', u, cluster_subspaces)
  return jnp.sum(jnp.square(overlap), axis=(1, 2)) / u.shape[-1]


def best_cluster(scores: jax.Array, valid: jax.Array) -> jax.Array:
  """argmax of scores [K_max] over the clusters that exist (valid)."""
  return jnp.argmax(jnp.where(valid, scores, -jnp.inf)).astype(jnp.int32)


def orthogonality_penalty(frozen: jax.Array, basis: jax.Array) -> jax.Array:
  """||B_frozen^T B||_F^2 (Eq. 11-12's cross-tier term, without gamma)."""
  return jnp.sum(jnp.square(frozen.T @ basis))


def relative_step(previous: jax.Array, current: jax.Array,
                  eps: float = 1e-8) -> jax.Array:
  """Sec. 3.3's stopping statistic ||W_new - W_old||_F / (||W_old||_F + eps)."""
  return jnp.linalg.norm(current - previous) / (
      jnp.linalg.norm(previous) + eps)


def adjusted_rand_index(truth: np.ndarray, pred: np.ndarray) -> float:
  """Hubert and Arabie's ARI of two labelings (host side, for reports).

  Slots with a negative label in either are left out."""
  truth, pred = np.asarray(truth), np.asarray(pred)
  keep = (truth >= 0) & (pred >= 0)
  truth, pred = truth[keep], pred[keep]
  n = truth.size
  if n < 2:
    raise ValueError(f'ARI needs at least 2 labelled points, got {n}')
  _, t = np.unique(truth, return_inverse=True)
  _, p = np.unique(pred, return_inverse=True)
  table = np.zeros((t.max() + 1, p.max() + 1), np.int64)
  np.add.at(table, (t, p), 1)
  pairs = lambda x: (x * (x - 1) / 2.0).sum()
  index = pairs(table)
  rows, cols = pairs(table.sum(1)), pairs(table.sum(0))
  expected = rows * cols / (n * (n - 1) / 2.0)
  top = (rows + cols) / 2.0
  if top == expected:            # both labelings trivial: identical
    return 1.0
  return float((index - expected) / (top - expected))


def gram_embedding(gram: jax.Array, mask: jax.Array) -> jax.Array:
  """Points [N, N] whose pairwise Euclidean distances are those of the
  vectors with Gram matrix `gram` (G = V L V^T, X = V sqrt(L)), so k-means
  on X is k-means on the vectors without holding them. Masked slots are
  zeroed."""
  g = jnp.where(mask[:, None] & mask[None, :], gram, 0.0)
  values, vectors = jnp.linalg.eigh(g)
  return vectors * jnp.sqrt(jnp.maximum(values, 0.0))[None, :]


def cosine_kmeans(gram: jax.Array, mask: jax.Array, k: int, *, iters: int = 50
                  ) -> jax.Array:
  """The ablation's vanilla clustering (HiLoRA Table 4, row 1): k-means on
  the clients' L2-normalised flattened updates (cosine geometry), from
  their Gram matrix [N, N]. Returns labels int32[N], -1 where masked."""
  norm = jnp.sqrt(jnp.maximum(jnp.diag(gram), _EPS))
  cos = gram / norm[:, None] / norm[None, :]
  return kmeans(gram_embedding(cos, mask), mask, jnp.int32(k),
                k_max=k, iters=iters)

