"""SDFC: Self-Driven Fisher Calibration (the SDFC paper, Sec. 3.2).

After local training a client k with model w_k takes the diagonal Fisher on
its own data D_k and on the server's clean validation sample U (Eq. 7a/7b):

  H_k = |M_k(D_k) - M_k(U)|                                   (Eq. 8b)

FDReg (Eq. 9): the next time k trains, its loss is
  CE + lambda * sum_v H_{k,v} (w_v - w^{t-1}_{k,v})^2
with H_k from its previous participation and w^{t-1}_k its previous local
model, as in the paper and its reference code. A client that has not
participated before has no H_k yet. first_round='none' (default): its
penalty is zero (plain CE). first_round='anchor_init' (the released code):
the penalty applies from the first round, with H_k taken at the model the
client starts from (its data and U) and that model as the anchor.

FDAgg (Eq. 10): T_k = sum_v H_{k,v}; min-max normalised over the round's
real clients; alpha_k = sigmoid(-T^_k) / sum sigmoid(-T^). The server takes
w <- w + server_lr * sum_k alpha_k (w_k - w). FDAgg is the registered
aggregator 'fdagg' (aggregators/mean.py), fed T_k as its `scores`; any
other rule composes with FDReg the same way (SDFC with the median rule is
FDReg training plus the median).

Per-client state (w^{t-1}_k, H_k, seen_k) lives in the method state as
leaves [K, ...] indexed by client id, so it is checkpointed with the
server state and survives resume.

Ablations: components in {both, fdreg, fdagg} (Table 3; 'fdreg' keeps
FDReg and aggregates by FedAvg's data sizes, i.e. weighted_mean; 'fdagg'
drops FDReg), importance in {fisher, abs_grad}
(Table 2), stiffness in {diff, local, validation} (Table 4: H = |M(D)-M(U)|,
M(D) or M(U)), fisher mode in {per_example, released} (fisher.py), FDAgg
weighting in {sigmoid, softmax} (paper, release).

Diagnostics: every client's T_k is its `fisher_discrepancy` metric, which
the round logs per client with its FDAgg weight and whether it attacked.
With diagnostics=True each client also reports T taken at the incoming
global model, before local training (`fisher_discrepancy_incoming`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedrobust.aggregators.base import Aggregator, call_aggregator
from fedrobust.aggregators.mean import FDAGG_WEIGHTINGS
from fedrobust.cohort import Cohort
from fedrobust.errors import SettingError, check_choice
from fedrobust.local import (LocalConfig, classification_loss, local_sgd,
                             poisoned_batch)
from fedrobust.methods.base import (MethodSpec, check_cohorts,
                                    eval_models_of, extras_of, server_step)
from fedrobust.methods.sdfc.fisher import (FISHER_IMPLS, FISHER_MODES,
                                      IMPORTANCES,
                                      fisher_diagonal)
from fedrobust.settings import Setting
from fedrobust.tree import gather_clients, scatter_clients, tree_sub
from fedrobust.types import ClientOutput, Method

COMPONENTS = ('both', 'fdreg', 'fdagg')
STIFFNESS = ('diff', 'local', 'validation')
FIRST_ROUNDS = ('none', 'anchor_init')


class SDFCClientState(NamedTuple):
  """One client's memory; stacked as leaves [K, ...] in the method state."""
  prev_params: object   # w^{t-1}_k, the client's last local model
  stiffness: object     # H_k from its last participation
  seen: jax.Array       # bool[], participated before


class SDFCState(NamedTuple):
  clients: SDFCClientState   # leaves [K, ...]
  agg: Any                   # the aggregator's state


def sdfc(*, cohorts: tuple[Cohort, ...], local: LocalConfig,
         optimizer: optax.GradientTransformation, aggregator: Aggregator,
         server_lr: float = 1.0, num_clients: int = 0,
         lam: float = 5.0, components: str = 'both',
         importance: str = 'fisher', stiffness: str = 'diff',
         fisher_mode: str = 'per_example', first_round: str = 'none',
         weighting: str = 'sigmoid', diagnostics: bool = False,
         fisher_impl: str = 'factored', fisher_batch: int = 0) -> Method:
  """Builds SDFC. server_data must be the batched validation set U:
  (x uint8[T, B, ...], y int32[T, B], mask bool[T, B]).

  Args:
    cohorts: one cohort, identity transform (SDFC trains the full model).
    local: static local-training settings.
    optimizer: client optimizer (fresh state each round).
    aggregator: the server rule; 'fdagg' is the paper's FDAgg (Eq. 10). It
      gets T_k as `scores`, plus weights, ids and staleness.
    server_lr: server step on the aggregated delta.
    num_clients: K (unused; uniform factory interface).
    lam: lambda of Eq. 9 (paper 5, released config 1).
    components: 'both', 'fdreg' or 'fdagg' (Table 3).
    importance: 'fisher' or 'abs_grad'.
    stiffness: 'diff', 'local' or 'validation'.
    fisher_mode: 'per_example' or 'released'.
    first_round: 'none' or 'anchor_init' (see the module docstring).
    weighting: FDAgg's 'sigmoid' or 'softmax'; passed to the fdagg rule by
      the experiment runner (MethodSpec.aggregator_defaults).
    diagnostics: also report T at the incoming global model.
    fisher_impl: 'factored' (one backward pass per batch, per-layer
      products; methods/sdfc/fisher.py) or 'vmap' (per-example gradients); the
      same math, summed in another order.
    fisher_batch: examples per batch of the Fisher passes (0: automatic,
      fisher.fisher_batch_size); a multiple of the local batch size. The
      passes over D_k and U have no sequential dependency, so their batch
      is free of the training batch; same sums, in another order.

  Returns:
    A Method.
  """
  del num_clients
  component = 'method sdfc'
  check_cohorts('sdfc', cohorts, multi=False)
  check_choice('components', components, COMPONENTS, component=component)
  check_choice('stiffness', stiffness, STIFFNESS, component=component)
  check_choice('importance', importance, IMPORTANCES, component=component)
  check_choice('fisher_mode', fisher_mode, FISHER_MODES, component=component)
  check_choice('fisher_impl', fisher_impl, FISHER_IMPLS, component=component)
  check_choice('first_round', first_round, FIRST_ROUNDS, component=component)
  check_choice('weighting', weighting, FDAGG_WEIGHTINGS, component=component)
  if fisher_batch < 0 or fisher_batch % local.batch_size:
    raise SettingError('fisher_batch', 'must be 0 (automatic) or a '
                       f'positive multiple of the local batch size '
                       f'{local.batch_size}, got {fisher_batch}',
                       component=component)
  if fisher_batch and fisher_mode != 'per_example':
    raise SettingError('fisher_batch', f"applies to fisher 'per_example'; "
                       f"the {fisher_mode!r} estimator is defined per local "
                       'batch', component=component)
  if not (lam >= 0 and jnp.isfinite(lam)):
    raise SettingError('lam', f'must be >= 0 and finite, got {lam}',
                       component=component)
  model = cohorts[0].model
  use_reg = components in ('both', 'fdreg') and lam > 0
  base_loss = classification_loss(model.apply)

  def init(params, num_clients, key):
    del key
    params = params[0]
    stack = lambda t: jax.tree.map(
        lambda p: jnp.zeros((num_clients, *p.shape), p.dtype), t)
    clients = SDFCClientState(prev_params=stack(params),
                              stiffness=stack(params),
                              seen=jnp.zeros((num_clients,), bool))
    return (params,), SDFCState(clients, aggregator.init(params))

  def broadcast(state, j):
    del j
    return state.params[0]

  def client_state(method_state, j, ids):
    del j
    return gather_clients(method_state.clients, ids)

  def stiffness_at(w, data, server_data):
    """H_k (Eq. 8b, or the Table 4 variant) of model w on the client's
    (possibly poisoned) data, one pass in order, and on U. A malicious
    client's local data is its poisoned data (`local.poison`)."""
    val_x, val_y, val_mask = server_data['validation']
    b, p = local.batch_size, local.steps_per_epoch
    rows = jnp.arange(p * b, dtype=jnp.int32).reshape(p, b)
    xs, ys = jax.vmap(lambda r: poisoned_batch(data, r, local.poison))(rows)
    fisher = lambda x, y, m: fisher_diagonal(
        model.apply, w, x, y, m, importance=importance, mode=fisher_mode,
        impl=fisher_impl, probe_fn=model.probe, batch_size=fisher_batch)
    if stiffness == 'validation':
      return fisher(val_x, val_y, val_mask)
    m_local = fisher(xs, ys, rows < data.count)
    if stiffness == 'local':
      return m_local
    m_val = fisher(val_x, val_y, val_mask)
    return jax.tree.map(lambda a, v: jnp.abs(a - v), m_local, m_val)

  total_of = lambda h: sum(jnp.sum(leaf) for leaf in jax.tree.leaves(h))

  def client_update(j, params, state, data, key, server_data):
    del j
    incoming = None
    if first_round == 'anchor_init' and use_reg:
      # The release's round 0: H and the anchor at the starting model. Under
      # lax.map a client that participated before skips the extra Fisher.
      reg, anchor = jax.lax.cond(
          state.seen, lambda: (state.stiffness, state.prev_params),
          lambda: (stiffness_at(params, data, server_data), params))
    else:
      anchor = jax.tree.map(lambda a, g: jnp.where(state.seen, a, g),
                            state.prev_params, params)
      reg = jax.tree.map(lambda h: jnp.where(state.seen, h, 0.0),
                         state.stiffness)
    if diagnostics:
      incoming = total_of(stiffness_at(params, data, server_data))

    def loss_fn(p, x, y, mask, k):
      loss, aux = base_loss(p, x, y, mask, k)
      if use_reg:
        penalty = sum(jnp.sum(h * jnp.square(w - a)) for h, w, a in zip(
            jax.tree.leaves(reg), jax.tree.leaves(p),
            jax.tree.leaves(anchor)))
        loss = loss + lam * penalty
        aux = dict(aux, fdreg_penalty=penalty)
      return loss, aux

    new_params, metrics = local_sgd(loss_fn, params, data, key,
                                    optimizer=optimizer, config=local)
    h = stiffness_at(new_params, data, server_data)
    metrics = dict(metrics, fisher_discrepancy=total_of(h))
    if incoming is not None:
      metrics['fisher_discrepancy_incoming'] = incoming
    return ClientOutput(
        delta=tree_sub(new_params, params),
        weight=data.count.astype(jnp.float32),
        client_state=SDFCClientState(new_params, h, jnp.bool_(True)),
        metrics=metrics)

  def server_update(state, arrivals, key, server_data):
    del server_data
    a = arrivals[0]
    outputs = a.outputs
    totals = sum(jnp.sum(leaf.reshape(leaf.shape[0], -1), axis=1)
                 for leaf in jax.tree.leaves(outputs.client_state.stiffness))
    update, agg_state, info = call_aggregator(
        aggregator, outputs.delta, a.mask, state.method_state.agg, key,
        **extras_of(a, scores=totals))
    params = server_step(state.params[0], update, server_lr)
    clients = scatter_clients(state.method_state.clients, a.ids,
                              outputs.client_state, a.mask)
    info = dict(info)
    if 'weights' in info:
      info['weights'] = (info['weights'],)
    return (params,), SDFCState(clients, agg_state), info

  def eval_models(state):
    return eval_models_of(cohorts, ((),), state.params)

  return Method('sdfc', init, broadcast, client_state, client_update,
                server_update, eval_models,
                provides=frozenset({'weights', 'ids', 'coverage',
                                    'staleness', 'scores'}))


def default_aggregator(settings: dict) -> str:
  """FDAgg unless the Table 3 ablation drops it."""
  return 'weighted_mean' if settings.get('components') == 'fdreg' else 'fdagg'


def check_aggregator(settings: dict, aggregator: str) -> None:
  """components='fdagg' / 'fdreg' fix the aggregation; refuse a clash."""
  components = settings.get('components', 'both')
  if components == 'fdagg' and aggregator != 'fdagg':
    raise SettingError('components', "'fdagg' (FDAgg without FDReg) "
                       f'aggregates by FDAgg; got aggregator {aggregator!r}',
                       component='method sdfc')
  if components == 'fdreg' and aggregator == 'fdagg':
    raise SettingError('components', "'fdreg' (FDReg without FDAgg) "
                       "cannot use aggregator 'fdagg'",
                       component='method sdfc')


SDFC = MethodSpec(
    build=sdfc,
    preset='sdfc_fmnist_paper.flags',
    summary='SDFC: Fisher-calibrated local training (FDReg) and '
    'aggregation (FDAgg).',
    settings=(
        Setting('lambda', 5.0, 'lambda of FDReg (Eq. 9); the released '
                'config uses 1.', arg='lam'),
        Setting('components', 'both', 'Table 3 ablation: both, FDReg only '
                '(weighted-mean aggregation) or FDAgg only.',
                choices=COMPONENTS),
        Setting('importance', 'fisher', 'Table 2 ablation: squared or '
                'absolute gradients.', choices=IMPORTANCES),
        Setting('stiffness', 'diff', 'Table 4 ablation: H = |M(D)-M(U)|, '
                'M(D) or M(U).', choices=STIFFNESS),
        Setting('fisher', 'per_example', 'Fisher estimator: per_example '
                "(Eq. 5-6) or released (the release's cross-label batch "
                'gradient, squared after averaging the batches).',
                choices=FISHER_MODES, arg='fisher_mode'),
        Setting('first_round', 'none', 'none: no penalty at a client\'s '
                'first participation; anchor_init: the release\'s penalty '
                'from round 1, H and anchor at the starting model.',
                choices=FIRST_ROUNDS),
        Setting('weighting', 'sigmoid', 'FDAgg weights: sigmoid(-T^) '
                '(paper Eq. 10) or softmax(-T^) (release).',
                choices=FDAGG_WEIGHTINGS),
        Setting('diagnostics', False, 'Also report each client\'s T taken '
                'at the incoming global model (two extra Fisher passes).'),
        Setting('fisher_impl', 'factored', 'How per-example Fisher terms '
                'are computed: factored (one backward pass, per-layer '
                'products) or vmap (per-example gradients); same math.',
                choices=FISHER_IMPLS, execution=True),
        Setting('fisher_batch', 0, 'Examples per batch of the Fisher '
                'passes, a multiple of the local batch (0: automatic: for '
                'the factored Fisher on CPU the largest multiple up to '
                '128, else the local batch); '
                'same sums in another order.', execution=True),
    ),
    server_data=('validation',),
    default_aggregator=default_aggregator,
    validate=check_aggregator,
    aggregator_defaults=lambda s, name: ({'weighting': s['weighting']}
                                         if name == 'fdagg' else {}),
    cohorts=False)
