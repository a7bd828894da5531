"""Federated-LoRA baselines (RFD-LoRA's Table 1; HiLoRA reuses them).

Every method here trains the LoRA transform's trainable tree (the factors
a: [d_in, r] and b: [r, d_out] of each targeted module, ours = the papers'
A^T and B^T, so a module's update is s a b with s = alpha / r) and differs
only in what the server does with the factors. Client ranks may differ
(`--lora_ranks`): a client of rank r_k owns the first r_k columns of a and
rows of b (the transform's coverage) and uses s_k = alpha / r_k.

  fedit     FedIT (Zhang et al. 2024): the weighted mean of a and b,
            separately. FedAvg on the LoRA transform is the same rule
            (head included: the presets put LoRA on the 2-class head, whose
            rank >= 2 update can reach any head). The product of the means
            is not the mean of the products: RFD-LoRA Eq. 1-2's
            aggregation bias.
  ffa_lora  FFA-LoRA (Sun et al. 2024): a stays at its random
            initialisation on every module but the head (its optimizer
            update is set to zero); only b is trained and averaged, so
            s b_mean a = mean(s b_k a) exactly.
  flora     FLoRA (Wang et al. 2024): stacking. The server merges the exact
            weighted sum of the clients' products, sum_k p_k s_k a_k b_k,
            into the frozen base every round, and every client starts the
            next round from fresh factors (a random, b = 0), at its own
            rank.
  flexlora  FlexLoRA (Bai et al. 2024): the server keeps the full product
            W_g = sum_k p_k s_k a_k b_k and sends each client the rank-r_k
            truncated SVD of W_g: a = U_r (orthonormal), b = S_r V_r^T /
            s_k (every singular value goes into b). The global model is
            W0 + W_g, untruncated.
  lora_fair LoRA-FAIR (Bian et al. 2025): FedIT's means (a_bar, b_bar),
            then a server-side residual db on b minimising
            (1 - cos(dW, s a_bar (b_bar + db))) + lam ||db||^2 / ||b_bar||^2
            with dW = sum_k p_k s_k a_k b_k the ideal update (their Eq. 6-8).

FLoRA and FlexLoRA aggregate in product space: each client's update is
handed to the aggregator as the change of its product against the global
product, {module: [d_in, d_out]}, so `--aggregator` (weighted mean by
default, or a robust rule) runs on the matrices the papers average. The
client computes its product from the factors it would upload (the same
numbers the server would form); `communication_bytes` counts what is sent.

Sources: the FLoRA (ATP-1010/FederatedLLM) and FlexLoRA
(alibaba/FederatedScope, branch FlexLoRA) releases for their server rules
and scales; LoRA-FAIR's solver settings are not public (ours: Adam on db,
see `lora_fair`). BUILD_NOTES §3e has the deviations.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedrobust.cohort import Cohort
from fedrobust.errors import SettingError
from fedrobust.local import LocalConfig
from fedrobust.methods.base import (MethodSpec, cohort_aggregation,
                                    eval_models_of, transformed_sgd_update)
from fedrobust.methods.fedavg import SHARE, fedavg
from fedrobust.settings import Setting
from fedrobust.transforms.base import get_path, masked, set_path
from fedrobust.types import Method

Params = Any


# ----------------------------------------------------------------------------
# Factor and product helpers (pure; one client's tree unless said).
# ----------------------------------------------------------------------------


def lora_modules(trainable: Params) -> tuple[str, ...]:
  """'/'-joined paths of the LoRA modules ({'a', 'b'} dicts), sorted."""
  out = []

  def walk(node, prefix):
    if isinstance(node, dict):
      if set(node) == {'a', 'b'}:
        out.append('/'.join(prefix))
        return
      for key in sorted(node):
        walk(node[key], prefix + [key])

  walk(trainable, [])
  return tuple(out)


def products(trainable: Params, scale) -> dict[str, jax.Array]:
  """{module path: s a b} ([d_in, d_out]) for one client's factors."""
  return {p: scale * (get_path(trainable, p)['a'] @ get_path(trainable, p)['b'])
          for p in lora_modules(trainable)}


def add_dense(base: Params, dense: dict[str, jax.Array]) -> Params:
  """The base params with each module's kernel plus its dense product."""
  out = base
  for path, w in dense.items():
    module = get_path(out, path)
    kernel = module['kernel']
    out = set_path(out, path, dict(
        module, kernel=kernel + w.reshape(kernel.shape).astype(kernel.dtype)))
  return out


def svd_factors(dense: dict[str, jax.Array], rank: int, scale) -> Params:
  """Rank-`rank` factors with s a b = the truncated SVD of each product:
  a = U_r (orthonormal columns), b = S_r V_r^T / s (FlexLoRA's split: all
  singular values in b). Products of rank below `rank` get zero columns."""
  out = {}
  for path, w in dense.items():
    u, sv, vt = jnp.linalg.svd(w, full_matrices=False)
    k = min(rank, sv.shape[0])
    a = jnp.zeros((w.shape[0], rank), w.dtype).at[:, :k].set(u[:, :k])
    b = jnp.zeros((rank, w.shape[1]), w.dtype).at[:k].set(
        sv[:k, None] * vt[:k] / scale)
    out = set_path(out, path, {'a': a, 'b': b})
  return out


def _check_lora(name: str, cohorts: tuple[Cohort, ...], *, single: bool):
  if any(c.transform.name != 'lora' for c in cohorts):
    raise SettingError('transform', f'{name} aggregates LoRA factors: it '
                       'needs --transform=lora')
  if single and len(cohorts) != 1:
    raise SettingError('cohorts', f'{name} takes one LoRA cohort, got '
                       f'{len(cohorts)}')


# ----------------------------------------------------------------------------
# FedIT and FFA-LoRA: FedAvg's pipeline on the factors.
# ----------------------------------------------------------------------------


def fedit(**kwargs):
  """FedAvg of LoRA factors (FedIT); see the module docstring."""
  _check_lora('fedit', kwargs['cohorts'], single=False)
  return fedavg(**kwargs)._replace(name='fedit')


def frozen_a_labels(cohorts: tuple[Cohort, ...]):
  """trainable tree -> 'freeze' on every LoRA `a` outside the models' head
  modules, 'train' elsewhere (optax.multi_transform labels)."""
  heads = {c.model.roles.get('head') for c in cohorts if c.model.roles}

  def labels(tree):
    def label(path, _):
      keys = [getattr(k, 'key', getattr(k, 'name', None)) for k in path]
      module = '/'.join(str(k) for k in keys[:-1])
      return 'freeze' if keys[-1] == 'a' and module not in heads else 'train'
    return jax.tree_util.tree_map_with_path(label, tree)

  return labels


def ffa_lora(**kwargs):
  """FFA-LoRA: FedAvg with a frozen at its initialisation (head excepted)."""
  _check_lora('ffa_lora', kwargs['cohorts'], single=False)
  kwargs['optimizer'] = optax.multi_transform(
      {'train': kwargs['optimizer'], 'freeze': optax.set_to_zero()},
      frozen_a_labels(kwargs['cohorts']))
  return fedavg(**kwargs)._replace(name='ffa_lora')


# ----------------------------------------------------------------------------
# FLoRA and FlexLoRA: aggregation in product space.
# ----------------------------------------------------------------------------


class ProductState(NamedTuple):
  base: Any     # W0 (FLoRA: with every round's aggregate merged in)
  dense: Any    # {module: [d_in, d_out]}: FlexLoRA's W_g (FLoRA: zeros)
  agg: Any      # the aggregator's state


def _product_method(name: str, *, restack: bool, cohorts, local: LocalConfig,
                    optimizer, aggregator, server_lr: float = 1.0,
                    num_clients: int = 0) -> Method:
  """FLoRA (restack=True) or FlexLoRA (False) on one LoRA cohort."""
  del num_clients
  _check_lora(name, cohorts, single=True)
  cohort = cohorts[0]
  transform = cohort.transform
  scale = transform.factor_scale
  specs = (jnp.asarray(cohort.specs, jnp.float32)
           if transform.spec_name and len(cohort.specs) else None)
  update = transformed_sgd_update(cohort, local=local, optimizer=optimizer)
  aggregation = cohort_aggregation(aggregator, cohorts, ())

  def init(params, num_clients, key):
    del num_clients
    base, trainable = transform.init(params[0], jax.random.fold_in(key, 0))
    dense = jax.tree.map(jnp.zeros_like, products(trainable, 1.0))
    return (trainable,), ProductState(base, dense,
                                      aggregation.init((dense,)))

  def broadcast(state, j):
    del j
    ms = state.method_state
    return (ms.base, state.params[0], state.round + 1, ms.dense)

  def client_state(method_state, j, ids):
    del method_state, j
    return () if specs is None else specs[ids]

  def client_update(j, broadcast, state, data, key, server_data):
    del j, server_data
    base, trainable, round_number, dense = broadcast
    spec = None if isinstance(state, tuple) else state
    # The global factors carry the global scale; client k's b is rescaled
    # so that s_k a b is the same product (FlexLoRA: b = S V^T / s_k).
    ratio = scale(None) / scale(spec)
    start = nest_paths({p: {'a': get_path(trainable, p)['a'],
                       'b': get_path(trainable, p)['b'] * ratio}
                   for p in lora_modules(trainable)})
    out = update((base, start, round_number), state, data, key)
    cov = transform.coverage(start, spec, round_number)
    final = jax.tree.map(jnp.add, masked(start, cov), out.delta)
    delta = jax.tree.map(jnp.subtract, products(final, scale(spec)), dense)
    return out._replace(delta=delta, coverage=None)

  def server_update(state, arrivals, key, server_data):
    del server_data
    ms = state.method_state
    (update_w,), agg, info = aggregation.aggregate((ms.dense,), arrivals,
                                                   ms.agg, key)
    dense = jax.tree.map(lambda w, u: w + server_lr * u, ms.dense, update_w)
    if restack:     # FLoRA: merge into W0, fresh factors next round
      base = add_dense(ms.base, dense)
      trainable = transform.init(base, jax.random.fold_in(key, 0x5AC))[1]
      dense = jax.tree.map(jnp.zeros_like, dense)
    else:           # FlexLoRA: W_g kept, its truncated SVD broadcast
      base = ms.base
      trainable = nest_paths(svd_factors(dense, _rank(state.params[0]),
                                    scale(None)))
    return (trainable,), ProductState(base, dense, agg), info

  def eval_models(state):
    ms = state.method_state
    zero = jax.tree.map(jnp.zeros_like, state.params[0])
    return eval_models_of(cohorts, (add_dense(ms.base, ms.dense),), (zero,))

  return Method(name, init, broadcast, client_state, client_update,
                server_update, eval_models,
                provides=frozenset({'weights', 'ids', 'coverage', 'staleness',
                                    'params'}))


def _rank(trainable: Params) -> int:
  path = lora_modules(trainable)[0]
  return int(get_path(trainable, path)['a'].shape[-1])


def nest_paths(flat: dict[str, Any]) -> dict:
  """{'x/y': v} -> {'x': {'y': v}}."""
  out: dict = {}
  for path, value in flat.items():
    out = set_path(out, path, value)
  return out


def flora(**kwargs):
  """FLoRA: stacking (exact sum of products) merged into W0 each round."""
  return _product_method('flora', restack=True, **kwargs)


def flexlora(**kwargs):
  """FlexLoRA: product-space mean, truncated SVD back to each rank."""
  return _product_method('flexlora', restack=False, **kwargs)


# ----------------------------------------------------------------------------
# LoRA-FAIR: FedIT plus a server-side residual on b.
# ----------------------------------------------------------------------------


def fair_residual(ideal: jax.Array, a: jax.Array, b: jax.Array, scale, *,
                  lam: float, steps: int, lr: float) -> jax.Array:
  """LoRA-FAIR Eq. 8 for one module: db minimising
  (1 - cos(ideal, s a (b + db))) + lam ||db||^2 / ||b||^2, from db = 0 by
  `steps` Adam steps of lr * rms(b). Returns b + db.

  The normalisations are ours (the paper's solver settings are not
  public): both terms are invariant to the scale of b, so one lam and lr
  serve every module and round.
  """
  b_sq = jnp.sum(b * b)
  step = lr * jnp.sqrt(b_sq / b.size)
  flat = ideal.reshape(-1)

  def loss(db):
    w = (scale * (a @ (b + db))).reshape(-1)
    cos = jnp.dot(flat, w) / (jnp.linalg.norm(flat) * jnp.linalg.norm(w)
                              + 1e-12)
    return 1.0 - cos + lam * jnp.sum(db * db) / (b_sq + 1e-30)

  opt = optax.adam(1.0)

  def body(_, carry):
    db, opt_state = carry
    g, opt_state = opt.update(jax.grad(loss)(db), opt_state, db)
    return db + step * g, opt_state

  db0 = jnp.zeros_like(b)
  db, _ = jax.lax.fori_loop(0, steps, body, (db0, opt.init(db0)))
  # Nothing to correct (b = 0, e.g. before any training): keep b.
  return jnp.where(b_sq > 0, b + db, b)


def lora_fair(*, lam: float = 0.01, steps: int = 100, lr: float = 0.01,
              **kwargs):
  """LoRA-FAIR (see the module docstring); settings lam, steps, lr."""
  _check_lora('lora_fair', kwargs['cohorts'], single=True)
  for name, value, ok in (('lam', lam, lam >= 0), ('steps', steps,
                                                     steps >= 0),
                          ('lr', lr, lr > 0)):
    if not ok:
      raise SettingError(name, f'out of range: {value!r}',
                         component='method lora_fair')
  cohort = kwargs['cohorts'][0]
  transform = cohort.transform
  scale = transform.factor_scale
  specs = (jnp.asarray(cohort.specs, jnp.float32)
           if transform.spec_name and len(cohort.specs) else None)
  method = fedavg(**kwargs)

  def server_update(state, arrivals, key, server_data):
    params, ms, info = method.server_update(state, arrivals, key,
                                            server_data)
    arr = arrivals[0]
    # Each arrival's final factors (its start is the global factors within
    # its coverage) and its product at its own scale.
    start = jax.tree.map(lambda s, d: jnp.broadcast_to(s, d.shape),
                         state.params[0], arr.outputs.delta)
    final = jax.tree.map(jnp.add, masked(start, arr.outputs.coverage),
                         arr.outputs.delta)
    # One scale per arrival (the transform returns a scalar when every
    # client has the same rank).
    client_scale = jnp.broadcast_to(
        scale(specs[arr.ids]) if specs is not None else scale(None),
        arr.ids.shape)
    per = jax.vmap(products)(final, client_scale)
    # Masked slots hold anything (NaN included): select, never multiply.
    w = jnp.where(arr.mask, info['weights'][0] if 'weights' in info
                  else arr.outputs.weight, 0.0)
    w = w / jnp.maximum(jnp.sum(w), 1e-12)
    ideal = jax.tree.map(
        lambda p: jnp.tensordot(w, jnp.where(
            arr.mask.reshape((-1,) + (1,) * (p.ndim - 1)), p, 0.0), 1), per)
    trainable = params[0]
    out = trainable
    for path, target in ideal.items():
      f = get_path(trainable, path)
      b = fair_residual(target, f['a'], f['b'], scale(None), lam=lam,
                        steps=steps, lr=lr)
      out = set_path(out, path, {'a': f['a'], 'b': b})
    return (out,) + tuple(params[1:]), ms, info

  # Its own server step takes no client-retraining hook.
  return method._replace(name='lora_fair', server_update=server_update,
                         provides=method.provides - {'retrain'})


# ----------------------------------------------------------------------------
# Communication (RFD-LoRA Table 2).
# ----------------------------------------------------------------------------


def communication_bytes(method: str, modules: dict[str, tuple[int, int]], *,
                        rank: int, round_ranks: tuple[int, ...] = (),
                        head: str | None = 'head', anchors: int = 0,
                        classes: int = 0, bytes_per_value: int = 4
                        ) -> tuple[int, int]:
  """(upload, download) bytes of ONE client of rank `rank` in one round.

  modules: LoRA module path -> (d_in, d_out). round_ranks: the ranks of the
  round's clients (FLoRA's download is the stack of all of them). FFA-LoRA
  sends only b, except on the `head` module, whose a is trained too.
  RFD-LoRA uploads its clipped logits on the anchors ([anchors, classes])
  and downloads the global student's adapter at its largest rank.
  """
  full = lambda r: sum(r * (i + o) for i, o in modules.values())
  if method in ('fedavg', 'fedit', 'flexlora', 'lora_fair'):
    up = down = full(rank)
  elif method == 'ffa_lora':
    up = down = sum(rank * (o + (i if p == head else 0))
                    for p, (i, o) in modules.items())
  elif method == 'flora':
    up = full(rank)
    down = sum(full(r) for r in (round_ranks or (rank,)))
  elif method == 'rfd_lora':
    up = anchors * classes
    down = full(max(round_ranks or (rank,)))
  else:
    raise ValueError(f'communication_bytes: unknown method {method!r}')
  return up * bytes_per_value, down * bytes_per_value


FEDIT = MethodSpec(
    build=fedit,
    lora_communication=True,
    summary='FedIT: FedAvg of the LoRA factors A and B (weighted mean).',
    settings=(SHARE,))

FFA_LORA = MethodSpec(
    build=ffa_lora,
    lora_communication=True,
    summary='FFA-LoRA: A frozen at its initialisation, only B trained and '
    'averaged.',
    settings=(SHARE,))

FLORA = MethodSpec(
    build=flora,
    lora_communication=True,
    summary='FLoRA: the exact sum of the clients\' LoRA products merged into '
    'the base each round; fresh adapters at every client rank.')

FLEXLORA = MethodSpec(
    build=flexlora,
    lora_communication=True,
    summary='FlexLoRA: product-space mean, truncated SVD back to each '
    'client\'s rank.')

LORA_FAIR = MethodSpec(
    build=lora_fair,
    lora_communication=True,
    summary='LoRA-FAIR: FedIT plus a server residual on B matching the ideal '
    'product (cosine + regulariser).',
    settings=(Setting('lambda', 0.01, 'Residual regulariser lambda (Eq. 8).',
                      arg='lam'),
              Setting('steps', 100, 'Server Adam steps on the residual.'),
              Setting('lr', 0.01, 'Residual step, relative to rms(B).')))
