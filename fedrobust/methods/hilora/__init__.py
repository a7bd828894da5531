"""HiLoRA: hierarchical root / cluster / leaf LoRA (seeds/002, Sec. 3).

Every client's update of a targeted kernel is the sum of three LoRA tiers
(Eq. 5), trained in cascade, one tier per stage, with the earlier tiers
frozen (merged into the base) and the cross-tier orthogonality penalties:

  root stage     all clients train (a_r, b_r) from the global root; the
                 server takes the weighted mean of the products in product
                 space and its rank-r truncated SVD (Eq. 10). Each client's
                 trained basis feeds an EMA of its LoRA subspace (Eq. 7).
                 The stage ends when the relative step of the root product
                 is <= tau_rel or after root_rounds rounds; the server then
                 clusters the clients by their subspaces (Eq. 8-9, spectral
                 clustering, K by the eigengap; methods/hilora/subspace.py).
  cluster stage  client i trains its cluster's adapter over W0 + root with
                 gamma_c ||B_r^T B_c||^2 (Eq. 11); each cluster's product
                 mean is truncated back to rank r; a cluster freezes by the
                 same relative-step rule; the stage ends when every cluster
                 with members is frozen or after cluster_rounds rounds.
  leaf stage     client i trains its own adapter over W0 + root + cluster
                 with gamma_c ||B_r^T B_l||^2 + gamma_l ||B_c^T B_l||^2
                 (Eq. 12); the server keeps it (no aggregation) for the
                 rest of the run (T_leaf = num_rounds - root - cluster).

Each client's model (Sec. 3.4's personalised path) is W0 + root + its
cluster + its leaf; `eval_models` evaluates those per client, and the
root-only model as the global one.

Notation: the paper's basis B ([p, r], output side) is our factor b^T
(b: [r, d_out]); the penalties use the frozen tier's orthonormal basis
(the paper sets B := U_r after the SVD; our SVD split puts the singular
values in b, see fedlora.svd_factors), so they do not depend on how the
product's scale is split between the factors.

Without the cascade (cascade=False, the issue's ablation of Sec. 3.3):
the root stage and the clustering are as above (the clustering needs the
root stage's subspaces), then for the rest of the budget every client
trains its root, cluster and leaf adapters jointly, nothing frozen: the
root and its cluster enter as dense products of the trained factors, the
leaf as the factored adapter, with the same penalties against the
round's broadcast root and cluster bases. The server aggregates the root
over all clients and each cluster over its members (product means,
truncated SVDs, no per-cluster freezing) and keeps the leaves.

Deviations (BUILD_NOTES §3f): the leaf stage runs to the end of the budget
(no per-client stop), a client that joins after clustering has no cluster
(its cluster term is zero) until routed, and all three tiers use the
transform's one rank r.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedrobust import adapt
from fedrobust.aggregators.spectral import per_matrix
from fedrobust.cohort import Cohort
from fedrobust.errors import SettingError
from fedrobust.local import LocalConfig, classification_loss, local_sgd
from fedrobust.methods.hilora import subspace as hs
from fedrobust.methods.base import MethodSpec
from fedrobust.methods.fedlora import (add_dense, lora_modules, products,
                                       svd_factors, nest_paths)
from fedrobust.settings import Setting
from fedrobust.transforms.base import get_path
from fedrobust.tree import scatter_clients, tree_sub
from fedrobust.types import ClientOutput, EvalModel, Method

Params = Any

ROOT, CLUSTER, LEAF = 0, 1, 2


class HiLoRAState(NamedTuple):
  base: Params              # W0 (frozen pretrained params)
  clusters: Params          # cluster factors, leaves [K_max, ...]
  leaves: Params            # leaf factors, leaves [N, ...]
  assign: jax.Array         # int32[N] cluster of each client, -1: none
  ema: dict                 # path -> Bbar float32[N, d_out, r] (d_in: input_update)
  seen: jax.Array           # bool[N] trained in the root stage
  root_dense: dict          # module path -> s a_r b_r [d_in, d_out]
  cluster_dense: dict       # module path -> s a_c b_c [K_max, d_in, d_out]
  cluster_frozen: jax.Array  # bool[K_max]
  num_clusters: jax.Array   # int32[], 0 before clustering
  stage: jax.Array          # int32[]: 0 root, 1 cluster, 2 leaf
  stage_round: jax.Array    # int32[] rounds done in this stage


def _select(flag, on, off):
  return jax.tree.map(lambda a, b: jnp.where(flag, a, b), on, off)


def _row(tree, i):
  return jax.tree.map(lambda leaf: leaf[i], tree)


def _rows_where(flags, on, off):
  """Per-row select of stacked trees [R, ...] by flags bool[R]."""
  return jax.tree.map(
      lambda a, b: jnp.where(flags.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
      on, off)


CLUSTER_BASES = ('factor', 'update', 'input_update')


def hilora(*, cohorts: tuple[Cohort, ...], local: LocalConfig,
           optimizer: optax.GradientTransformation, aggregator=None,
           server_lr: float = 1.0, num_clients: int = 0,
           root_rounds: int = 20, cluster_rounds: int = 20,
           tau_rel: float = 0.01, gamma_c: float = 0.1,
           gamma_l: float = 0.1, ema_decay: float = 0.9, k_min: int = 2,
           k_max: int = 8, cluster_basis: str = 'factor',
           probe_epochs: int = 1, clustering: str = 'subspace',
           cascade: bool = True) -> Method:
  """HiLoRA on one LoRA cohort of a single rank.

  Args:
    cohorts, local, optimizer: as for FedAvg (no aggregator: the
      tiers are product-space means, Eq. 10-11; server_lr is unused).
    root_rounds, cluster_rounds: T_root and T_cluster (the leaf stage has
      the rest of the rounds).
    tau_rel: the relative step-size stopping threshold (Sec. 3.3).
    gamma_c, gamma_l: cross-tier orthogonality weights (Eq. 11-12).
    ema_decay: lambda of the subspace EMA (Eq. 7).
    k_min, k_max: the eigengap's range of cluster counts (Sec. 3.2).
    cluster_basis: what the EMA tracks, 'factor' (the client's trained
      basis B_i, the paper) or 'update' (B_i - B_root, its local change),
      or 'input_update' (not in the paper: the change of the input-side
      factor, A_i - A_root transposed to [d_in, r], whose columns lie in
      the span of the client's layer inputs, where a domain shows; B's
      columns lie in the span of its output gradients, which a shared task
      shares). Routing (Sec. 3.4) compares B bases in every case.
    probe_epochs: a newcomer's probe training before routing (Sec. 3.4's
      "few local gradient steps").
    clustering: 'subspace' (Sec. 3.2) or 'cosine_kmeans', Table 4's
      vanilla clustering: k-means with K = k_max on the clients' last
      root-round updates in product space, L2-normalised (cosine).
    cascade: False for the ablation without the cascade (module doc).
  """
  del aggregator, server_lr
  if len(cohorts) != 1 or cohorts[0].transform.name != 'lora':
    raise SettingError('transform', 'hilora trains LoRA tiers on one '
                       'cohort: it needs --transform=lora and one model')
  cohort = cohorts[0]
  transform = cohort.transform
  if len(transform.spec_values) > 1:
    raise SettingError('lora_ranks', 'hilora gives every tier one rank r; '
                       f'got ranks {transform.spec_values}')
  if root_rounds < 1 or cluster_rounds < 0:
    raise SettingError('root_rounds', f'root_rounds must be >= 1 and '
                       f'cluster_rounds >= 0, got {root_rounds}, '
                       f'{cluster_rounds}', component='method hilora')
  if not 1 <= k_min <= k_max:
    raise SettingError('k_min', f'need 1 <= k_min <= k_max, got {k_min}, '
                       f'{k_max}', component='method hilora')
  if cluster_basis not in CLUSTER_BASES:
    raise SettingError('cluster_basis', f'must be one of {CLUSTER_BASES}, '
                       f'got {cluster_basis!r}', component='method hilora')
  for name, value in (('tau_rel', tau_rel), ('gamma_c', gamma_c),
                      ('gamma_l', gamma_l)):
    if value < 0:
      raise SettingError(name, f'must be >= 0, got {value}',
                         component='method hilora')
  if clustering not in ('subspace', 'cosine_kmeans'):
    raise SettingError('clustering', "must be 'subspace' or "
                       f"'cosine_kmeans', got {clustering!r}",
                       component='method hilora')
  if probe_epochs < 1:
    raise SettingError('probe_epochs', f'must be >= 1, got {probe_epochs}',
                       component='method hilora')
  if not 0 <= ema_decay < 1:
    raise SettingError('ema_decay', f'must be in [0, 1), got {ema_decay}',
                       component='method hilora')
  scale = transform.factor_scale(None)
  n = num_clients or 1 + max(cohort.members)
  k_max = min(k_max, n)

  # Modules whose output width exceeds r carry a subspace to compare (a
  # 2-class head's rank-r basis spans its whole output space).
  shapes = jax.eval_shape(lambda k: transform.init(
      jax.eval_shape(cohort.model.init, k), k)[1], jax.random.key(0))
  rank = get_path(shapes, lora_modules(shapes)[0])['a'].shape[-1]
  cluster_paths = [p for p in lora_modules(shapes)
                   if get_path(shapes, p)['b'].shape[-1] > rank
                   ] or list(lora_modules(shapes))

  def init(params, num_clients, key):
    del num_clients
    base, root = transform.init(params[0], jax.random.fold_in(key, 0))
    fresh = lambda k: transform.init(params[0], k)[1]
    clusters = jax.vmap(fresh)(jax.random.split(jax.random.fold_in(key, 1),
                                                k_max))
    leaves = jax.vmap(fresh)(jax.random.split(jax.random.fold_in(key, 2), n))
    dense = products(root, scale)
    ema = {p: jnp.zeros((n, get_path(root, p)['a'].shape[0]
                         if cluster_basis == 'input_update'
                         else get_path(root, p)['b'].shape[-1], rank))
           for p in lora_modules(root)}
    state = HiLoRAState(
        base=base, clusters=clusters, leaves=leaves,
        assign=jnp.full((n,), -1, jnp.int32), ema=ema,
        seen=jnp.zeros((n,), bool), root_dense=dense,
        cluster_dense={p: jnp.zeros((k_max, *w.shape)) for p, w in
                       dense.items()},
        cluster_frozen=jnp.zeros((k_max,), bool),
        num_clusters=jnp.int32(0), stage=jnp.int32(ROOT),
        stage_round=jnp.int32(0))
    return (root,), state

  def frozen_bases(root, clusters):
    """Orthonormal bases of the frozen tiers, per module: the root's
    [d_out, r] and every cluster's [K_max, d_out, r]. Computed once on the
    server (one matrix per LAPACK call on CPU: spectral.per_matrix), so
    the clients' penalties need no decomposition."""
    ur, uc = {}, {}
    for p in lora_modules(root):
      ur[p] = hs.subspace(hs.basis_of(get_path(root, p)['b']))
      uc[p] = per_matrix(lambda b: hs.subspace(hs.basis_of(b)),
                         get_path(clusters, p)['b'])
    return ur, uc

  def broadcast(state, j):
    del j
    ms = state.method_state
    root = state.params[0]
    return (ms.base, root, ms.clusters, ms.root_dense, ms.cluster_dense,
            ms.stage, frozen_bases(root, ms.clusters))

  def client_state(method_state, j, ids):
    del j
    return (_row(method_state.leaves, ids), method_state.assign[ids])

  def joint_loss(frozen_base, stage, has, slot, bases):
    """cascade=False: the loss of a (root, cluster, leaf) triple. Before
    the clusters exist the root alone trains over W0; after, the root and
    the client's cluster enter as dense products and the leaf as the
    adapter, all trained at once."""
    joint = stage >= LEAF
    ur, uc = bases
    uc = {p: v[slot] for p, v in uc.items()}

    def loss_fn(t, x, y, mask, k):
      rt, ct, lt = t
      pr, pc = products(rt, scale), products(ct, scale)
      params = add_dense(frozen_base, {
          p: joint * (pr[p] + has * pc[p]) for p in pr})
      adapter = _select(joint, lt, rt)
      loss, aux = classification_loss(
          lambda a, x, *, train=False, key=None: transform.apply(
              params, a, x, train=train, key=key))(adapter, x, y, mask, k)
      reg = joint * (has * penalty(ct, ur, uc, CLUSTER, has)
                     + penalty(lt, ur, uc, LEAF, has))
      return loss + reg, aux
    return loss_fn

  def penalty(trainable, ur, uc, stage, has_cluster):
    """Eq. 11-12: gamma_c ||B_r^T B||^2 (+ gamma_l ||B_c^T B||^2 in the
    leaf stage) summed over the modules, with orthonormal frozen bases
    ur[p], uc[p] ([d_out, r])."""
    total = 0.0
    for p in lora_modules(trainable):
      basis = hs.basis_of(get_path(trainable, p)['b'])
      total = total + gamma_c * (stage >= CLUSTER) * hs.orthogonality_penalty(
          jax.lax.stop_gradient(ur[p]), basis)
      total = total + gamma_l * ((stage >= LEAF) & has_cluster) * (
          hs.orthogonality_penalty(jax.lax.stop_gradient(uc[p]), basis))
    return total

  def client_update(j, broadcast, state, data, key, server_data):
    del j, server_data
    base, root, clusters, root_dense, cluster_dense, stage, bases = broadcast
    leaf, cid = state
    has = cid >= 0
    slot = jnp.maximum(cid, 0)
    cluster = _row(clusters, slot)
    if not cascade:
      start = (root, cluster, leaf)
      new, metrics = local_sgd(joint_loss(base, stage, has, slot, bases),
                               start, data, key, optimizer=optimizer,
                               config=local)
      return ClientOutput(delta=tree_sub(new, start),
                          weight=data.count.astype(jnp.float32),
                          client_state=(), metrics=metrics)
    frozen = add_dense(base, {
        p: root_dense[p] * (stage >= CLUSTER)
        + cluster_dense[p][slot] * ((stage >= LEAF) & has)
        for p in root_dense})
    start = _select(stage == ROOT, root, _select(stage == CLUSTER, cluster,
                                                 leaf))
    base_loss = classification_loss(
        lambda t, x, *, train=False, key=None: transform.apply(
            frozen, t, x, train=train, key=key))

    def loss_fn(t, x, y, mask, k):
      loss, aux = base_loss(t, x, y, mask, k)
      ur, uc = bases
      return loss + penalty(t, ur, {p: v[slot] for p, v in uc.items()},
                            stage, has), aux

    new, metrics = local_sgd(loss_fn, start, data, key, optimizer=optimizer,
                             config=local)
    # In the cluster stage a client without a cluster trains nothing.
    active = (stage != CLUSTER) | has
    weight = data.count.astype(jnp.float32) * active
    return ClientOutput(delta=tree_sub(new, start), weight=weight,
                        client_state=(), metrics=metrics)

  def server_update(state, arrivals, key, server_data):
    del key, server_data
    ms = state.method_state
    (arr,) = arrivals
    ids, mask = arr.ids, arr.mask
    stage = ms.stage
    w = jnp.where(mask, arr.outputs.weight, 0.0)
    cid = jnp.where(mask, ms.assign[ids], -1)
    root = state.params[0]
    c = ids.shape[0]
    tiers = (jax.tree.map(lambda l: jnp.broadcast_to(l, (c, *l.shape)),
                          root),
             _row(ms.clusters, jnp.maximum(cid, 0)), _row(ms.leaves, ids))
    delta = jax.tree.map(lambda d: jnp.where(
        mask.reshape((-1,) + (1,) * (d.ndim - 1)), d, 0.0), arr.outputs.delta)
    if cascade:     # one tree: the active stage's tier
      starts = _select(stage == ROOT, tiers[0],
                       _select(stage == CLUSTER, tiers[1], tiers[2]))
      new = new_c = new_l = jax.tree.map(jnp.add, starts, delta)
    else:           # (root, cluster, leaf), trained jointly after clustering
      new, new_c, new_l = (jax.tree.map(jnp.add, t, d)
                           for t, d in zip(tiers, delta))
    prods = jax.vmap(lambda t: products(t, scale))(new)
    joint = (not cascade) & (stage == LEAF)

    # Root stage (Eq. 10): product-space mean, truncated SVD, EMA (Eq. 7).
    in_root = stage == ROOT
    train_root = in_root | joint
    root_w = w / jnp.maximum(jnp.sum(w), 1e-12)
    root_dense = {p: jnp.einsum('c,c...->...', root_w, v)
                  for p, v in prods.items()}
    root_new = nest_paths(svd_factors(root_dense, rank, scale))
    root_dense = products(root_new, scale)     # B_r A_r after truncation
    root_step = _relative(ms.root_dense, root_dense)
    ema = {}
    for p in ms.ema:
      if cluster_basis == 'input_update':     # A_i - A_root: [C, d_in, r]
        basis = get_path(new, p)['a'] - get_path(root, p)['a'][None]
      else:
        b_new = get_path(new, p)['b']
        if cluster_basis == 'update':
          b_new = b_new - get_path(root, p)['b'][None]
        basis = hs.basis_of(b_new)
      bar = jax.vmap(lambda prev, b: hs.ema_basis(prev, b, ema_decay))(
          ms.ema[p][ids], basis)
      ema[p] = jnp.where(in_root, scatter_clients(ms.ema[p], ids, bar, mask),
                         ms.ema[p])
    seen = scatter_clients(ms.seen, ids, jnp.ones_like(mask), mask & in_root)
    root_count = ms.stage_round + 1
    root_done = in_root & ((root_step <= tau_rel) | (root_count >= root_rounds))
    # Sec. 3.2, once: at the end of the root stage.
    def cluster_clients():
      if clustering == 'cosine_kmeans':     # Table 4's vanilla clustering
        gram = sum(jnp.einsum('c...,d...->cd', v - ms.root_dense[p][None],
                              v - ms.root_dense[p][None])
                   for p, v in prods.items())
        labels = hs.cosine_kmeans(gram, mask, k_max)
        return (scatter_clients(jnp.full((n,), -1, jnp.int32), ids, labels,
                                mask), jnp.int32(k_max))
      subspaces = [per_matrix(hs.subspace, ema[p]) for p in cluster_paths]
      labels, k, _ = hs.spectral_clusters(hs.distance_matrix(subspaces),
                                          seen, k_min=k_min, k_max=k_max)
      return labels, k

    assign, num_clusters = jax.lax.cond(
        root_done, cluster_clients, lambda: (ms.assign, ms.num_clusters))

    # Cluster stage (Eq. 11): per-cluster product means, truncated SVDs.
    in_cluster = (stage == CLUSTER) | joint
    prods_c = prods if cascade else jax.vmap(
        lambda t: products(t, scale))(new_c)
    member = jax.nn.one_hot(cid, k_max) * w[:, None]     # [C, K]
    total = jnp.sum(member, axis=0)
    norm = member / jnp.maximum(total, 1e-12)[None]

    def truncate_clusters():
      dense = {p: jnp.einsum('ck,c...->k...', norm, v)
               for p, v in prods_c.items()}
      factors = per_matrix(
          lambda d: nest_paths(svd_factors(d, rank, scale)), dense)
      return factors, jax.vmap(lambda t: products(t, scale))(factors)

    # The SVDs run in the cluster stage only.
    cl_new, cl_dense = jax.lax.cond(
        in_cluster, truncate_clusters,
        lambda: (ms.clusters, ms.cluster_dense))
    cl_step = jax.vmap(_relative)(ms.cluster_dense, cl_dense)
    update = in_cluster & (total > 0) & (~ms.cluster_frozen | joint)
    clusters = _rows_where(update, cl_new, ms.clusters)
    cluster_dense = _rows_where(update, cl_dense, ms.cluster_dense)
    frozen = ms.cluster_frozen | (update & (cl_step <= tau_rel))
    populated = jnp.arange(k_max) < num_clusters
    cluster_done = (stage == CLUSTER) & (
        jnp.all(frozen | ~populated) | (ms.stage_round + 1 >= cluster_rounds))

    # Leaf stage (Eq. 12): each client keeps its own leaf.
    leaves = jax.tree.map(
        lambda l, v: jnp.where(stage == LEAF, v, l), ms.leaves,
        scatter_clients(ms.leaves, ids, new_l, mask))

    advance = root_done | cluster_done
    # A zero-round cluster stage (or no cascade) goes straight to the leaves.
    next_stage = stage + advance + (root_done & ((cluster_rounds == 0)
                                                 | (not cascade)))
    new_state = HiLoRAState(
        base=ms.base, clusters=clusters, leaves=leaves, assign=assign,
        ema=ema, seen=seen,
        root_dense=_select(train_root, root_dense, ms.root_dense),
        cluster_dense=cluster_dense, cluster_frozen=frozen,
        num_clusters=num_clusters, stage=next_stage.astype(jnp.int32),
        stage_round=jnp.where(advance, 0, ms.stage_round + 1).astype(
            jnp.int32))
    info = {'stage': stage.astype(jnp.float32),
            'num_clusters': num_clusters.astype(jnp.float32),
            'root_step': root_step,
            'clusters_frozen': jnp.sum(frozen & populated).astype(jnp.float32)}
    return ((_select(train_root, root_new, root),), new_state, info)

  def personal_dense(ms):
    """Per client i: root + cluster_j(i) + leaf_i products, [N, ...]."""
    has = ms.assign >= 0
    slot = jnp.maximum(ms.assign, 0)
    after_cluster = ms.stage >= CLUSTER
    after_leaf = ms.stage >= LEAF
    leaf_dense = jax.vmap(lambda t: products(t, scale))(ms.leaves)
    return {p: ms.root_dense[p][None]
            + (ms.cluster_dense[p][slot] * (has & after_cluster)[:, None, None])
            + leaf_dense[p] * after_leaf
            for p in ms.root_dense}

  def eval_models(state):
    """The root model (headline), every client's personal model
    ('personal', last) and, for Table 3's stage gains, root + its cluster
    ('root_cluster': one row per cluster and a root-only row for clients
    without one, so it costs K_max + 1 models)."""
    ms = state.method_state
    members = jnp.asarray(cohort.members)
    dense = {p: v[members] for p, v in personal_dense(ms).items()}
    own = jax.vmap(lambda d: add_dense(ms.base, d))(dense)
    after = (ms.stage >= CLUSTER).astype(jnp.float32)
    tiers = {p: ms.root_dense[p][None] + jnp.concatenate(
        [ms.cluster_dense[p] * after, jnp.zeros_like(ms.cluster_dense[p][:1])])
             for p in ms.root_dense}
    assign = ms.assign[members]
    index = jnp.where(assign >= 0, assign, k_max)
    # The personal model last: it is each client's own model in the
    # evaluator's cross-method personal_accuracy.
    return (EvalModel('', 0, add_dense(ms.base, ms.root_dense)),
            EvalModel('root_cluster', 0,
                      jax.vmap(lambda d: add_dense(ms.base, d))(tiers),
                      clients=cohort.members, per_client=True, index=index),
            EvalModel('personal', 0, own, clients=cohort.members,
                      per_client=True))

  probe_local = local._replace(num_epochs=probe_epochs, unroll=1)

  def newcomer(state, data, key):
    """Sec. 3.4: a newcomer's probe basis B_u (a fresh adapter trained
    for probe_epochs over W0 + root), routed to the cluster whose
    subspace it overlaps most (mean cos^2 of the principal angles,
    averaged over the clustered modules); it starts from W0 + root + that
    cluster. Before clustering it gets W0 + root."""
    ms = state.method_state
    _, probe, _ = adapt.train_adapter(
        transform, add_dense(ms.base, ms.root_dense), data, key,
        local=probe_local, optimizer=optimizer)
    _, uc = frozen_bases(state.params[0], ms.clusters)
    scores = sum(
        hs.route_scores(hs.subspace(hs.basis_of(get_path(probe, p)['b'])),
                        uc[p])
        for p in cluster_paths) / len(cluster_paths)
    has = ms.num_clusters > 0
    j = hs.best_cluster(scores, jnp.arange(k_max) < ms.num_clusters)
    start = add_dense(ms.base, {
        p: ms.root_dense[p] + ms.cluster_dense[p][j] * has
        for p in ms.root_dense})
    return start, {'cluster': jnp.where(has, j, -1)}

  return Method('hilora', init, broadcast, client_state, client_update,
                server_update, eval_models,
                provides=frozenset({'weights', 'ids'}), newcomer=newcomer,
                describe=describe_clusters)


def describe_clusters(method_state, client_groups) -> dict[str, Any]:
  """The clusters for the run's summary: `num_clusters` (0 before it
  clustered), `cluster_assignment` per client (-1: none) and, when the
  partition knows the true groups, `true_clusters` and `cluster_ari`
  (adjusted Rand index of the assignment against them)."""
  assign = np.asarray(jax.device_get(method_state.assign))
  out = {'num_clusters': int(jax.device_get(method_state.num_clusters)),
         'cluster_assignment': assign.tolist()}
  if client_groups is not None and out['num_clusters'] > 0:
    truth = np.asarray(client_groups)[:len(assign)]
    out['true_clusters'] = int(len(set(truth[truth >= 0].tolist())))
    out['cluster_ari'] = hs.adjusted_rand_index(truth, assign)
  return out


def _relative(old: dict, new: dict) -> jax.Array:
  """Sec. 3.3's relative step over all modules' products together."""
  diff = sum(jnp.sum(jnp.square(new[p] - old[p])) for p in new)
  ref = sum(jnp.sum(jnp.square(old[p])) for p in new)
  return jnp.sqrt(diff) / (jnp.sqrt(ref) + 1e-8)


HILORA = MethodSpec(
    build=hilora,
    summary='HiLoRA: root / cluster / leaf LoRA in cascade, clusters from '
    'the clients\' LoRA subspaces (eigengap K).',
    settings=(
        Setting('root_rounds', 20, 'T_root: most rounds of the root stage.'),
        Setting('cluster_rounds', 20, 'T_cluster: most rounds of the cluster '
                'stage (the leaf stage has the rest).'),
        Setting('tau_rel', 0.01, 'Relative step-size stop (Sec. 3.3).'),
        Setting('gamma_c', 0.1, 'Orthogonality to the root (Eq. 11-12).'),
        Setting('gamma_l', 0.1, 'Leaf orthogonality to its cluster '
                '(Eq. 12).'),
        Setting('ema_decay', 0.9, 'Subspace EMA decay lambda (Eq. 7).'),
        Setting('k_min', 2, 'Smallest cluster count the eigengap may pick.'),
        Setting('k_max', 8, 'Largest cluster count the eigengap may pick.'),
        Setting('cluster_basis', 'factor', "The EMA's basis: 'factor' "
                "(B_i, the paper), 'update' (B_i - B_root) or "
                "'input_update' (A_i - A_root, the input side; not in the "
                'paper).'),
        Setting('probe_epochs', 1, "A newcomer's probe training (epochs) "
                'before it is routed to a cluster (Sec. 3.4).'),
        Setting('clustering', 'subspace', "'subspace' (Sec. 3.2: LoRA "
                "subspaces, eigengap K) or 'cosine_kmeans' (Table 4's "
                'vanilla ablation: k-means, K = k_max, on the normalised '
                'product-space updates of the last root round).'),
        Setting('cascade', True, 'Train the tiers in cascade (Sec. 3.3); '
                'False: the ablation that trains root, cluster and leaf '
                'jointly after the clustering, nothing frozen.')),
    uses_aggregator=False)
