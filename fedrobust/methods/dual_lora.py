"""Two-adapter personalised LoRA baselines of HiLoRA's tables: PF2LoRA and
FDLoRA (seeds/002, Sec. 5.1).

Neither paper is in seeds/ and neither has released code that could be
read here. What follows was rebuilt from secondary descriptions of their
algorithms (BUILD_NOTES §3f lists the sources and every
assumption). Notation: a LoRA factor pair is our (a [d_in, r], b
[r, d_out]), the paper's (A, B) transposed; s = alpha / r is the cohort
transform's scale.

PF2LoRA (Hao et al., 2025): two levels of LoRA on the same kernels,
  W_k = W0 + s (a b + c_k d_k),
a common adapter x = (a, b) of rank r, aggregated by the server, and a
client adapter y_k = (c_k, d_k) of rank r_tilde < r that never leaves
client k. Training is the bilevel problem min_x (1/M) sum_k
f_k(x, y_k*(x)) with y_k*(x) = argmin_y f_k(x, y). Each local step on a
batch takes
  (line 5)  y <- y - beta grad_y f(x, y)                   (SGD)
  (line 6)  x <- AdamW(x, hypergradient at the new y)
The hypergradient estimator was not recovered: 'first_order' (default) is
grad_x f(x, y') at y' = the updated y (Danskin's theorem: exact at a
lower-level optimum); 'unrolled' differentiates through the step,
grad_x f(x, y - beta grad_y f(x, y)) (a Hessian-vector product);
'joint' is the single-level ablation, grad_x f(x, y) at the old y. Both
steps use the same batch. The combined step is one call of the engine's
local loop: a surrogate loss whose gradient in y is grad_y f(x, y) and in
x the chosen hypergradient, under an optimiser that applies SGD(beta) to y
and the configured optimiser to x.

FDLoRA (Qi et al., 2024): every client keeps a personalised LoRA theta_p
and trains a copy of the global LoRA theta_s; only theta_s goes to the
server. Algorithm 1, as read by its re-implementers:
  stage 1 (round 1)  every client trains theta_p from the shared start
                     for the local epochs; the server sets the global
                     theta_s to the aggregate of the theta_p (line 7).
  round t >= 2       the client trains its copy of theta_s alone (W0 +
                     theta_s) for the local epochs (line 12) and uploads
                     it; every H rounds (t % H == 0) it overwrites theta_p
                     with that trained copy (lines 9, 14). The server
                     aggregates the deltas (its rule) into u and takes an
                     outer SGD step with Nesterov momentum mu on the
                     pseudo-gradient g = -u (lines 17-18, torch's form:
                     buf = mu buf + g, theta_s -= eta (g + mu buf)).
  AdaFusion          the deployed model of client i is W0 + the factor-
                     wise blend (w_p a_p + w_s a_s, w_p b_p + w_s b_s) with
                     two weights found without gradients: the client
                     minimises its loss on `fusion_examples` of its own
                     training rows plus l1 * mean|w| over a grid of
                     `fusion_grid` x `fusion_grid` points in
                     [-bound, bound]^2 (LoraHub's bounds and l1; the
                     re-implementations use Nevergrad or Nelder-Mead with
                     5 evaluations). It runs in every client round against
                     the global adapter the client received, and the
                     weights are kept for evaluation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedrobust.errors import SettingError
from fedrobust.local import (LocalConfig, classification_loss, local_sgd,
                             masked_cross_entropy)
from fedrobust.methods.base import (MethodSpec, aggregate_and_step,
                                    cohort_aggregation)
from fedrobust.methods.fedlora import (_check_lora, add_dense, lora_modules,
                                      nest_paths, products)
from fedrobust.methods.personal_lora import PROVIDES, broadcast_base, own_rows
from fedrobust.settings import Setting
from fedrobust.transforms.base import get_path
from fedrobust.tree import scatter_clients, tree_sub
from fedrobust.types import ClientOutput, EvalModel, LocalData, Method

Params = Any

HYPERGRADIENTS = ('first_order', 'unrolled', 'joint')


def _split_rank(trainable: Params, rank: int) -> Params:
  """The first `rank` rank-columns of every module's factors."""
  return nest_paths({p: {'a': get_path(trainable, p)['a'][:, :rank],
                         'b': get_path(trainable, p)['b'][:rank]}
                     for p in lora_modules(trainable)})


def _concat(x: Params, y: Params) -> Params:
  """LoRA tree with a = [a_x | a_y] and b = [b_x ; b_y]."""
  return nest_paths({p: {'a': jnp.concatenate([get_path(x, p)['a'],
                                               get_path(y, p)['a']], axis=-1),
                         'b': jnp.concatenate([get_path(x, p)['b'],
                                               get_path(y, p)['b']], axis=0)}
                     for p in lora_modules(x)})


def _with_personal_models(name, cohort, init, client_update, server_update,
                          adapter) -> Method:
  """The Method, with every client's model W0 + adapter(state, its row of
  method_state.own, its id) evaluated as 'personal' and W0 + the global
  adapter as the global model and a newcomer's start."""
  scale = cohort.transform.factor_scale(None)

  def global_model(state):
    return add_dense(state.method_state.base,
                     products(state.params[0], scale))

  def eval_models(state):
    ms = state.method_state
    members = jnp.asarray(cohort.members)
    personal = jax.vmap(lambda own, k: add_dense(
        ms.base, products(adapter(state, own, k), scale)))(
            own_rows(ms, 0, members), members)
    return (EvalModel('', 0, global_model(state)),
            EvalModel('personal', 0, personal, clients=cohort.members,
                      per_client=True))

  def newcomer(state, data, key):
    del data, key
    return global_model(state), {}

  return Method(name, init, broadcast_base, own_rows, client_update,
                server_update, eval_models, provides=PROVIDES,
                newcomer=newcomer)


class TwoLevelState(NamedTuple):
  base: Any   # W0
  own: Any    # every client's second-level adapter y_k, leaves [N, ...]
  agg: Any    # the aggregator's state (over x)


def pf2lora(*, cohorts, local: LocalConfig,
            optimizer: optax.GradientTransformation, aggregator=None,
            server_lr: float = 1.0, num_clients: int = 0,
            client_rank: int = 2, lower_lr: float = 0.05,
            hypergradient: str = 'first_order') -> Method:
  """PF2LoRA (module docstring).

  Args:
    client_rank: r_tilde, the rank of every client's own adapter (< r).
    lower_lr: beta, the lower level's SGD step.
    hypergradient: 'first_order', 'unrolled' or 'joint' (module docstring).
  """
  name = 'pf2lora'
  _check_lora(name, cohorts, single=True)
  cohort = cohorts[0]
  transform = cohort.transform
  if hypergradient not in HYPERGRADIENTS:
    raise SettingError('hypergradient', f'must be one of {HYPERGRADIENTS}, '
                       f'got {hypergradient!r}', component=f'method {name}')
  if not lower_lr > 0:
    raise SettingError('lower_lr', f'must be > 0, got {lower_lr}',
                       component=f'method {name}')
  rank = int(transform.spec_values[-1]) if transform.spec_values else 0
  if len(transform.spec_values) > 1:
    raise SettingError('lora_ranks', f'{name} takes one LoRA rank for '
                       f'every client, got {transform.spec_values}',
                       component=f'method {name}')
  if not 1 <= client_rank < rank:
    raise SettingError('client_rank', f'must be in [1, r) with r = {rank} '
                       f'(--lora_ranks), got {client_rank}',
                       component=f'method {name}')
  n = num_clients or 1 + max(cohort.members)
  aggregation = cohort_aggregation(aggregator, cohorts, ())
  tx = optax.multi_transform(
      {'upper': optimizer, 'lower': optax.sgd(lower_lr)},
      lambda t: (jax.tree.map(lambda _: 'upper', t[0]),
                 jax.tree.map(lambda _: 'lower', t[1])))

  def init(params, num_clients, key):
    del num_clients
    base, x = transform.init(params[0], jax.random.fold_in(key, 0))
    # Every client's y starts as a fresh LoRA (c random, d = 0): its
    # product is 0 and it still receives a gradient through d.
    own = jax.vmap(lambda k: _split_rank(transform.init(params[0], k)[1],
                                         client_rank))(
        jax.random.split(jax.random.fold_in(key, 1), n))
    return (x,), TwoLevelState(base, own, aggregation.init((x,)))

  def f_loss(base):
    def apply(t, inputs, *, train=False, key=None):
      x, y = t
      return transform.apply(base, _concat(x, y), inputs, train=train,
                             key=key)
    return classification_loss(apply)

  def client_update(j, broadcast, own, data, key, server_data):
    del j, server_data
    base, x0, _ = broadcast
    f = f_loss(base)

    def surrogate(t, inputs, labels, mask, k):
      x, y = t
      # grad_y f(x, y), a function of x only (y enters as a constant).
      (loss, aux), gy = jax.value_and_grad(
          lambda yy: f((x, yy), inputs, labels, mask, k), has_aux=True)(
              jax.lax.stop_gradient(y))
      gy_const = jax.lax.stop_gradient(gy)
      if hypergradient == 'joint':
        upper = f((x, jax.lax.stop_gradient(y)), inputs, labels, mask, k)[0]
      else:
        if hypergradient == 'first_order':
          gy = gy_const
        y_new = jax.tree.map(lambda v, g: jax.lax.stop_gradient(v)
                             - lower_lr * g, y, gy)
        upper = f((x, y_new), inputs, labels, mask, k)[0]
      # d/dy: grad_y f(x, y) (line 5); d/dx: the hypergradient (line 6).
      lower = sum(jnp.vdot(g, v) for g, v in zip(
          jax.tree.leaves(gy_const), jax.tree.leaves(y)))
      return (upper + lower - jax.lax.stop_gradient(upper + lower)
              + jax.lax.stop_gradient(loss)), aux

    (x, y), metrics = local_sgd(surrogate, (x0, own), data, key,
                                optimizer=tx, config=local)
    return ClientOutput(delta=tree_sub(x, x0),
                        weight=data.count.astype(jnp.float32),
                        client_state=y, metrics=metrics)

  def server_update(state, arrivals, key, server_data):
    del server_data
    ms = state.method_state
    (arr,) = arrivals
    own = scatter_clients(ms.own, arr.ids, arr.outputs.client_state,
                          arr.mask)
    params, agg, info = aggregate_and_step(aggregation, state.params, (arr,),
                                           ms.agg, key, server_lr)
    return params, ms._replace(own=own, agg=agg), info

  return _with_personal_models(
      name, cohort, init, client_update, server_update,
      lambda state, y, k: _concat(state.params[0], y))


class DualState(NamedTuple):
  base: Any       # W0
  own: Any        # every client's personalised LoRA theta_p, leaves [N, ...]
  fusion: Any     # float32[N, 2]: every client's (w_p, w_s)
  momentum: Any   # the outer Nesterov optimiser's state (its buffer)
  agg: Any        # the aggregator's state (over theta_s)


def fusion_grid(points: int, bound: float) -> np.ndarray:
  """float32[points^2, 2]: the AdaFusion search grid over [-bound, bound]^2."""
  axis = np.linspace(-bound, bound, points, dtype=np.float32)
  return np.stack(np.meshgrid(axis, axis, indexing='ij'), -1).reshape(-1, 2)


def holdout_order(client_id: jax.Array, count: jax.Array,
                  rows: int) -> jax.Array:
  """int32[rows]: a fixed random order of one client's first `count` rows
  (the same every round), then the padding rows; AdaFusion holds out the
  last rows of the real part."""
  u = jax.random.uniform(jax.random.fold_in(jax.random.key(0xF05E),
                                            client_id), (rows,))
  idx = jnp.arange(rows)
  return jnp.argsort(jnp.where(idx < count, u, 2.0 + idx)).astype(jnp.int32)


def fuse(w: jax.Array, personal: Params, shared: Params) -> Params:
  """The factor-wise blend w[0] * personal + w[1] * shared."""
  return jax.tree.map(lambda p, s: w[0] * p + w[1] * s, personal, shared)


def fdlora(*, cohorts, local: LocalConfig,
           optimizer: optax.GradientTransformation, aggregator=None,
           server_lr: float = 1.0, num_clients: int = 0,
           sync_every: int = 5, outer_momentum: float = 0.5,
           fusion_examples: int = 16, fusion_points: int = 7,
           fusion_bound: float = 1.5, fusion_l1: float = 0.05,
           fusion_holdout: bool = False) -> Method:
  """FDLoRA (module docstring). server_lr is the outer step eta.

  Args:
    sync_every: H: theta_p <- the trained copy of theta_s when the round
      is a multiple of H (0: never).
    outer_momentum: mu of the server's Nesterov step.
    fusion_examples: own training rows AdaFusion scores the blends on.
    fusion_points, fusion_bound: the grid, points per axis over
      [-bound, bound].
    fusion_l1: the weight of mean|w| in AdaFusion's objective.
    fusion_holdout: hold min(fusion_examples, count // 5) of each client's
      rows (a fixed random subset per client) out of its local training
      and score the blends on them; False scores them on training rows.
  """
  name = 'fdlora'
  _check_lora(name, cohorts, single=True)
  component = f'method {name}'
  if sync_every < 0:
    raise SettingError('sync_every', f'must be >= 0, got {sync_every}',
                       component=component)
  if not 0 <= outer_momentum < 1:
    raise SettingError('outer_momentum', f'must be in [0, 1), got '
                       f'{outer_momentum}', component=component)
  if fusion_examples < 1 or fusion_points < 2 or not fusion_bound > 0:
    raise SettingError('fusion_examples', 'AdaFusion needs fusion_examples '
                       '>= 1, fusion_points >= 2 and fusion_bound > 0, got '
                       f'{fusion_examples}, {fusion_points}, {fusion_bound}',
                       component=component)
  cohort = cohorts[0]
  transform = cohort.transform
  n = num_clients or 1 + max(cohort.members)
  aggregation = cohort_aggregation(aggregator, cohorts, ())
  grid = jnp.asarray(fusion_grid(fusion_points, fusion_bound))
  # torch's Nesterov SGD: buf = mu buf + g; theta -= eta (g + mu buf).
  outer_opt = optax.sgd(server_lr, momentum=outer_momentum, nesterov=True)

  def init(params, num_clients, key):
    del num_clients
    base, theta = transform.init(params[0], jax.random.fold_in(key, 0))
    # Stage 1 starts every theta_p at the shared initialisation.
    own = jax.tree.map(lambda l: jnp.broadcast_to(l, (n, *l.shape)), theta)
    start = jnp.broadcast_to(jnp.asarray([1.0, 0.0], jnp.float32), (n, 2))
    return (theta,), DualState(base, own, start, outer_opt.init(theta),
                               aggregation.init((theta,)))

  def loss_of(base):
    return classification_loss(
        lambda t, x, *, train=False, key=None: transform.apply(
            base, t, x, train=train, key=key))

  def search(base, personal, shared, data, key, held):
    """AdaFusion: the grid point of least few-shot loss + l1 mean|w|,
    scored on the last `held` rows of `data` (all its rows if 0)."""
    lo = jnp.where(held > 0, data.count - held, 0)
    rows = lo + jax.random.randint(key, (fusion_examples,), 0,
                                   jnp.maximum(data.count - lo, 1))
    x = data.x[data.row][rows]
    y = data.y[data.row][rows]
    ones = jnp.ones((fusion_examples,), bool)

    def objective(w):
      logits = transform.apply(base, fuse(w, personal, shared), x)
      ce, _ = masked_cross_entropy(logits, y, ones)
      return ce + fusion_l1 * jnp.mean(jnp.abs(w))
    return grid[jnp.argmin(jax.lax.map(objective, grid))]

  def split(data):
    """(the client's rows in its fixed held-out order, rows held out)."""
    if not fusion_holdout:
      return data, jnp.int32(0)
    order = holdout_order(data.client_id, data.count, data.x.shape[1])
    mine = LocalData(data.x[data.row][order][None],
                     data.y[data.row][order][None], jnp.int32(0),
                     data.count, data.is_malicious, data.attacker_rank)
    return mine, jnp.minimum(fusion_examples, data.count // 5)

  def client_update(j, broadcast, own, data, key, server_data):
    del j, server_data
    base, shared, round_number = broadcast
    train_key, fusion_key = jax.random.split(key)
    stage1 = round_number == 1
    # Stage 1 trains theta_p; later rounds train the copy of theta_s.
    start = jax.tree.map(lambda p, s: jnp.where(stage1, p, s), own, shared)
    data, held = split(data)
    trained, metrics = local_sgd(loss_of(base), start,
                                 data._replace(count=data.count - held),
                                 train_key, optimizer=optimizer,
                                 config=local)
    sync = stage1 | ((sync_every > 0)
                     & (round_number % max(sync_every, 1) == 0))
    personal = jax.tree.map(lambda t, p: jnp.where(sync, t, p), trained,
                            own)
    w = search(base, personal, shared, data, fusion_key, held)
    return ClientOutput(delta=tree_sub(trained, shared),
                        weight=data.count.astype(jnp.float32),
                        client_state=(personal, w), metrics=metrics)

  def server_update(state, arrivals, key, server_data):
    del server_data
    ms = state.method_state
    (arr,) = arrivals
    personal, w = arr.outputs.client_state
    own = scatter_clients(ms.own, arr.ids, personal, arr.mask)
    fusion = scatter_clients(ms.fusion, arr.ids, w, arr.mask)
    (plain,), agg, info = aggregate_and_step(
        aggregation, state.params, (arr,), ms.agg, key, 1.0)
    theta = state.params[0]
    # Round 1 (line 7): theta_s is the aggregate of the theta_p. Later
    # rounds (lines 17-18): Nesterov SGD on g = -(aggregated delta).
    g = tree_sub(theta, plain)
    step, opt = outer_opt.update(g, ms.momentum, theta)
    first = state.round == 0
    new = jax.tree.map(lambda p, o: jnp.where(first, p, o), plain,
                       optax.apply_updates(theta, step))
    opt = jax.tree.map(lambda z, o: jnp.where(first, z, o),
                       outer_opt.init(theta), opt)
    return ((new,), ms._replace(own=own, fusion=fusion, momentum=opt,
                                agg=agg), info)

  return _with_personal_models(
      name, cohort, init, client_update, server_update,
      lambda state, p, k: fuse(state.method_state.fusion[k], p,
                               state.params[0]))


PF2LORA = MethodSpec(
    build=pf2lora,
    summary='PF2LoRA: a common LoRA (aggregated) plus a lower-rank LoRA per '
    'client, trained as a bilevel problem (SGD on the client level, the '
    'local optimiser on the common level at each step).',
    settings=(
        Setting('client_rank', 2, 'r_tilde: the rank of every client\'s own '
                'adapter (below --lora_ranks).'),
        Setting('lower_lr', 0.05, 'beta: the SGD step of the client-level '
                'adapter (line 5).'),
        Setting('hypergradient', 'first_order', "'first_order' (grad_x f at "
                "the updated client adapter), 'unrolled' (through the SGD "
                "step) or 'joint' (single-level ablation).")))

FDLORA = MethodSpec(
    build=fdlora,
    summary='FDLoRA: a personalised LoRA per client and a global LoRA '
    'trained by the clients with a Nesterov outer step; AdaFusion blends '
    'the two per client.',
    settings=(
        Setting('sync_every', 5, 'H: the personalised LoRA takes the '
                'client\'s trained global copy every H rounds (0: never).'),
        Setting('outer_momentum', 0.5, 'mu of the server\'s Nesterov step '
                '(--server_lr is its step size).'),
        Setting('fusion_examples', 16, 'Own training rows AdaFusion scores '
                'each blend on.'),
        Setting('fusion_points', 7, 'AdaFusion grid points per weight.'),
        Setting('fusion_bound', 1.5, 'AdaFusion searches each weight in '
                '[-bound, bound].'),
        Setting('fusion_l1', 0.05, 'Weight of mean|w| in AdaFusion\'s '
                'objective.'),
        Setting('fusion_holdout', False, 'Hold min(fusion_examples, '
                'count // 5) of each client\'s rows out of its training and '
                'score the blends on them (the re-implementations hold out '
                'a split); false scores them on training rows.')))
