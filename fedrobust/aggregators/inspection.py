"""Defenses that run the clients' models: DeepSight and FLARE.

Both read the global model (`params` extra: the full model, so one cohort
and the identity transform) and the model's pure apply function, and look
at the output layer (`output_path`, the model's head; None: the module of
the last 'kernel' leaf). A head is a module with a 2-D weight ('kernel'
[in, out], or 'w') and a bias ('bias' or 'b').

deepsight (Rieger et al., NDSS 2022; FLPoison's DeepSight)
  per client, from the head's update (weights dW [in, P], bias db [P]):
    energy_k = |db_k| + sum_j |dW_jk|;  NEUP = energy^2 / sum(energy^2)
    TE       = #{k: NEUP_k > max(threshold_factor, 1/P) * max NEUP}
    suspicious: TE <= median(TE) / 2
  DDif_s[c, k] = mean over num_samples random inputs x (seed s, fixed
    every round) of p_k(x; w + u_c) / (p_k(x; w) + epsilon), with p the
    softmax (the paper's Eq.; FLPoison divides the raw outputs:
    `ddif_outputs='raw'`)
  clusterings: HDBSCAN (min_samples 3, min_cluster_size 5, the package's
    defaults as FLPoison calls it) of the cosine distances of db, of the
    NEUPs and of each seed's DDifs; each gives a 0/1 different-cluster
    matrix (noise counts as one cluster, as in FLPoison); their mean
    (DDif seeds averaged first) is clustered once more with
    allow_single_cluster;
  a cluster is accepted when fewer than tau of its members are suspicious
  (noise is never accepted); the accepted updates, clipped to the median
  norm of all updates, are averaged. None accepted: a zero update.
  Random inputs: uniform uint8 images of the stored shape, through the
  model's own input pipeline (FLPoison feeds uniform [0, 1) tensors past
  its normalisation). Cost per round: num_seeds * num_samples forward
  passes per client (the paper's 3 x 20000); `num_samples` sets it.

flare (Wang et al., AsiaCCS 2022; the authors' TF code as FLPoison
  transcribes it)
  PLR_c = the head's inputs (penultimate-layer representations) of model
    w + u_c on the auxiliary set: the first aux_data_num server examples
    of class selected_class (all classes if it has none);
  MMD_ij = max(0, unbiased MMD^2 of PLR_i and PLR_j), RBF kernel with
    gamma = 1 / (PLR width) (scikit-learn's default) unless given;
  each client's int(n / 2) - 1 nearest others by MMD (ties by slot);
  count_c = how often c is someone's neighbour;
  trust = softmax(count / (tau * mean count)) over the real clients;
  update = sum_c trust_c u_c.
  The PLR is read without changing the model: per example, the gradient
  of the first logit with respect to the head's weights is the PLR in
  column 0 (logits = PLR @ W + b).

A non-finite or masked client takes no part and gets weight 0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.aggregators.base import Aggregator, stateless_init
from fedrobust.aggregators.clustered import (clean_rows, cosine_distances,
                                             euclidean_distances,
                                             weighted_update)
from fedrobust.aggregators.finetune import (check_server_data, clip_factors,
                                            client_models, masked_median,
                                            safe_norm)
from fedrobust.aggregators.hdbscan import hdbscan
from fedrobust.aggregators.mean import check_int, setting
from fedrobust.tree import leaf_names

Params = Any
_WEIGHT_NAMES = ('kernel', 'w')
_BIAS_NAMES = ('bias', 'b')
DDIF_OUTPUTS = ('probabilities', 'raw')


def head_leaves(tree: Params, output_path: str | None,
                rule: str) -> tuple[int, int]:
  """(weight, bias) positions among jax.tree.leaves(tree) of the head."""
  leaves = jax.tree.leaves(tree)
  names = leaf_names(tree)
  if output_path is None:
    kernels = [n for n in names if n.rsplit('/', 1)[-1] == 'kernel']
    output_path = kernels[-1].rpartition('/')[0] if kernels else ''
  found = {}
  for i, name in enumerate(names):
    module, _, last = name.rpartition('/')
    if module == output_path:
      if last in _WEIGHT_NAMES and leaves[i].ndim == 2:
        found['weight'] = i
      elif last in _BIAS_NAMES and leaves[i].ndim == 1:
        found['bias'] = i
  if set(found) != {'weight', 'bias'}:
    raise setting(rule, 'output_path', f'{output_path!r} names no module '
                  f'with a 2-D weight and a bias; leaves: {names}')
  return found['weight'], found['bias']


# --------------------------------------------------------------------------
# DeepSight.
# --------------------------------------------------------------------------


def _same_cluster_distance(labels: jax.Array) -> jax.Array:
  """float32[C, C]: 0 where two points share a label (noise included)."""
  return (labels[:, None] != labels[None, :]).astype(jnp.float32)


def neups(dw: jax.Array, db: jax.Array,
          threshold_factor: float) -> tuple[jax.Array, jax.Array]:
  """(NEUP float32[C, P], threshold exceedings float32[C]) of the head
  updates dw float32[C, in, P], db float32[C, P]."""
  num_classes = db.shape[1]
  energy = jnp.abs(db) + jnp.sum(jnp.abs(dw), axis=1)       # [C, P]
  # Scaled by the row maximum first (the ratio is unchanged), so 1e30
  # updates do not overflow the squares.
  top = jnp.max(energy, axis=1, keepdims=True)
  e2 = jnp.square(energy / jnp.where(top > 0, top, 1.0))
  total = jnp.sum(e2, axis=1, keepdims=True)
  neup = jnp.where(total > 0, e2 / jnp.where(total > 0, total, 1.0),
                   1.0 / num_classes)
  factor = max(threshold_factor, 1.0 / num_classes)
  te = jnp.sum(neup > factor * jnp.max(neup, axis=1, keepdims=True),
               axis=1).astype(jnp.float32)
  return neup, te


def deepsight(*, num_byzantine: int = 0, apply_fn=None,
              input_shape: tuple[int, ...] | None = None,
              output_path: str | None = None, num_seeds: int = 3,
              num_samples: int = 20000, sample_batch: int = 500,
              threshold_factor: float = 0.01, tau: float = 1 / 3,
              epsilon: float = 1e-6, min_cluster_size: int = 5,
              min_samples: int = 3,
              ddif_outputs: str = 'probabilities') -> Aggregator:
  """DeepSight; see the module docstring.

  Args:
    apply_fn: the model's apply (params, x stored uint8) -> logits.
    input_shape: one stored example's shape (the random inputs').
    num_seeds, num_samples: DDif seeds and inputs per seed.
    sample_batch: inputs per forward pass (memory: C models at once).
  """
  del num_byzantine
  if apply_fn is None or input_shape is None:
    raise setting('deepsight', 'apply_fn', 'needs apply_fn and input_shape '
                  '(the model runs on random inputs)')
  for name, value in (('num_seeds', num_seeds), ('num_samples', num_samples),
                      ('sample_batch', sample_batch),
                      ('min_samples', min_samples)):
    check_int('deepsight', name, value)
  check_int('deepsight', 'min_cluster_size', min_cluster_size, minimum=2)
  if not 0 < tau <= 1:
    raise setting('deepsight', 'tau', f'must be in (0, 1], got {tau}')
  if not epsilon > 0:
    raise setting('deepsight', 'epsilon', f'must be > 0, got {epsilon}')
  if ddif_outputs not in DDIF_OUTPUTS:
    raise setting('deepsight', 'ddif_outputs', f'{ddif_outputs!r}; '
                  f'expected one of {DDIF_OUTPUTS}')
  batch = min(sample_batch, num_samples)
  chunks = -(-num_samples // batch)
  shape = tuple(input_shape)
  cluster = lambda d, valid, single=False: hdbscan(
      d, valid, min_cluster_size=min_cluster_size, min_samples=min_samples,
      allow_single_cluster=single)

  def outputs(model, x):
    logits = apply_fn(model, x).astype(jnp.float32)
    return jax.nn.softmax(logits) if ddif_outputs == 'probabilities' \
        else logits

  def ddifs(params, models):
    """float32[seeds, C, P]."""

    def per_seed(seed):
      def per_chunk(total, index):
        key = jax.random.fold_in(jax.random.fold_in(
            jax.random.key(0), seed), index)
        x = jax.random.randint(key, (batch,) + shape, 0, 256,
                               jnp.int32).astype(jnp.uint8)
        live = (index * batch + jnp.arange(batch)) < num_samples
        base = outputs(params, x)
        each = jax.vmap(outputs, in_axes=(0, None))(models, x)
        ratio = each / (base[None] + epsilon)
        return total + jnp.sum(jnp.where(live[None, :, None], ratio, 0.0),
                               axis=1), None

      c = jax.tree.leaves(models)[0].shape[0]
      p = jax.eval_shape(outputs, params,
                         jax.ShapeDtypeStruct((1,) + shape, jnp.uint8)
                         ).shape[-1]
      total, _ = jax.lax.scan(per_chunk, jnp.zeros((c, p), jnp.float32),
                              jnp.arange(chunks))
      return total / num_samples

    return jnp.stack([per_seed(s) for s in range(num_seeds)])

  def aggregate(updates, mask, state, key, params):
    del key
    x, valid = clean_rows(updates, mask)
    w_at, b_at = head_leaves(params, output_path, 'deepsight')
    leaves = jax.tree.leaves(updates)
    dw = jnp.where(valid[:, None, None], leaves[w_at], 0.0).astype(
        jnp.float32)                                          # [C, in, P]
    db = jnp.where(valid[:, None], leaves[b_at], 0.0).astype(jnp.float32)
    neup, te = neups(dw, db, threshold_factor)
    suspicious = te <= masked_median(te, valid) / 2

    models = client_models(params, updates, valid)
    ddif = ddifs(params, models)                              # [S, C, P]
    ddif = jnp.where(jnp.isfinite(ddif), ddif, 0.0)
    cos_labels = cluster(cosine_distances(db), valid)
    neup_labels = cluster(euclidean_distances(neup), valid)
    ddif_dist = jnp.mean(jnp.stack([
        _same_cluster_distance(cluster(euclidean_distances(ddif[s]), valid))
        for s in range(num_seeds)]), axis=0)
    merged = jnp.mean(jnp.stack([ddif_dist,
                                 _same_cluster_distance(neup_labels),
                                 _same_cluster_distance(cos_labels)]), 0)
    labels = cluster(merged, valid, True)
    c = x.shape[0]
    member = (labels[None, :] == jnp.arange(c)[:, None]) & valid[None, :]
    size = jnp.sum(member, axis=1).astype(jnp.float32)
    bad = jnp.sum(member & suspicious[None, :], axis=1).astype(jnp.float32)
    accept = (size > 0) & (bad < tau * size)
    accepted = valid & (labels >= 0) & accept[jnp.maximum(labels, 0)]
    norms = safe_norm(x, axis=1)
    clip = masked_median(norms, valid)
    scale = clip_factors(norms, clip)
    k = jnp.maximum(jnp.sum(accepted), 1).astype(jnp.float32)
    weights = jnp.where(accepted, scale / k, 0.0).astype(jnp.float32)
    info = {'weights': weights,
            'suspicious': (valid & suspicious).astype(jnp.float32),
            'threshold_exceedings': jnp.where(valid, te, 0.0),
            'clip_norm': clip.astype(jnp.float32)}
    return weighted_update(updates, x, weights), state, info

  return Aggregator(stateless_init, aggregate, reads=('params',))


# --------------------------------------------------------------------------
# FLARE.
# --------------------------------------------------------------------------


def auxiliary_set(server_data, aux_data_num: int, selected_class: int,
                  rule: str = 'flare') -> np.ndarray:
  """The first aux_data_num server inputs of class selected_class (the
  first aux_data_num of any class if it has none), as the authors pick
  them from their test set."""
  x, y = check_server_data(server_data, rule)
  x, y = np.asarray(x), np.asarray(y)
  picked = np.flatnonzero(y == selected_class)
  if not len(picked):
    picked = np.arange(len(y))
  return x[picked[:aux_data_num]]


def mmd_matrix(plr: jax.Array, gamma: float | None) -> jax.Array:
  """float32[C, C]: max(0, unbiased MMD^2) between the clients' PLR sets
  (plr float32[C, V, F]), RBF kernel exp(-gamma |a - b|^2), gamma = 1/F
  when None; 0 on the diagonal."""
  c, v, f = plr.shape
  g = 1.0 / f if gamma is None else gamma
  sq = jnp.sum(jnp.square(plr), axis=-1)                       # [C, V]

  def against(i):
    """Sum over pairs of exp(-g |a - b|^2), PLR set i against every set."""
    cross = jnp.einsum('vf,cwf->cvw', plr[i], plr, precision='highest')
    d2 = jnp.maximum(sq[i][None, :, None] + sq[:, None, :] - 2 * cross, 0)
    return jnp.sum(jnp.exp(-g * d2), axis=(1, 2))               # [C]

  k = jax.lax.map(against, jnp.arange(c))                       # [C, C]
  # Within a set: the diagonal terms of the sum are exp(0) = 1.
  own = (jnp.diagonal(k) - v) / (v * (v - 1.0)) if v > 1 else \
      jnp.zeros((c,), jnp.float32)
  mmd = own[:, None] + own[None, :] - 2.0 * k / (v * v)
  return jnp.where(jnp.eye(c, dtype=bool), 0.0, jnp.maximum(mmd, 0.0))


def flare(*, num_byzantine: int = 0, server_data=None, apply_fn=None,
          output_path: str | None = None, aux_data_num: int = 200,
          selected_class: int = 1, tau: float = 1.0,
          gamma: float | None = None) -> Aggregator:
  """FLARE; see the module docstring.

  Args:
    server_data: (x uint8[V, ...], y int32[V]); the auxiliary set is
      drawn from it.
    apply_fn: the model's apply (params, x) -> logits.
    aux_data_num: auxiliary examples (the authors' 200).
    selected_class: their class (the authors' 1).
    tau: the trust softmax's temperature factor.
    gamma: the RBF kernel's gamma; None: 1 / PLR width.
  """
  del num_byzantine
  if apply_fn is None:
    raise setting('flare', 'apply_fn', 'needs apply_fn and server_data')
  check_int('flare', 'aux_data_num', aux_data_num)
  if not tau > 0:
    raise setting('flare', 'tau', f'must be > 0, got {tau}')
  if gamma is not None and not gamma > 0:
    raise setting('flare', 'gamma', f'must be > 0 or None, got {gamma}')
  aux = auxiliary_set(server_data, aux_data_num, selected_class)

  def plrs(params, models):
    """float32[C, V, F]: each model's head inputs on the auxiliary set."""
    w_at, _ = head_leaves(params, output_path, 'flare')

    def one_model(model):
      leaves, treedef = jax.tree.flatten(model)

      def first_logit(weight, example):
        new = list(leaves)
        new[w_at] = weight
        return apply_fn(jax.tree.unflatten(treedef, new),
                        example[None])[0, 0].astype(jnp.float32)

      grads = jax.vmap(jax.grad(first_logit), in_axes=(None, 0))(
          leaves[w_at], jnp.asarray(aux))                   # [V, F, P]
      return grads[:, :, 0].astype(jnp.float32)

    return jax.lax.map(one_model, models)

  def aggregate(updates, mask, state, key, params):
    del key
    x, valid = clean_rows(updates, mask)
    c = x.shape[0]
    plr = plrs(params, client_models(params, updates, valid))
    plr = jnp.where(valid[:, None, None] & jnp.isfinite(plr), plr, 0.0)
    mmd = mmd_matrix(plr, gamma)
    n = jnp.sum(valid)
    neighbours = jnp.maximum(n // 2 - 1, 0)
    # Rank the other real clients by MMD (self and absent slots last).
    others = valid[None, :] & valid[:, None] & ~jnp.eye(c, dtype=bool)
    order = jnp.argsort(jnp.where(others, mmd, jnp.inf), axis=1,
                        stable=True)
    rank = jnp.argsort(order, axis=1)
    chosen = others & (rank < neighbours)
    count = jnp.sum(chosen, axis=0).astype(jnp.float32)       # [C]
    mean_count = jnp.sum(jnp.where(valid, count, 0.0)) / jnp.maximum(n, 1)
    logits = jnp.where(valid, count / (tau * jnp.where(mean_count > 0,
                                                       mean_count, 1.0)),
                       -jnp.inf)
    trust = jnp.where(valid & (n > 0), jax.nn.softmax(
        jnp.where(n > 0, logits, 0.0)), 0.0).astype(jnp.float32)
    info = {'weights': trust, 'neighbour_count': jnp.where(valid, count, 0.0)}
    return weighted_update(updates, x, trust), state, info

  return Aggregator(stateless_init, aggregate, reads=('params',))


INSPECTION = {'deepsight': deepsight, 'flare': flare}
