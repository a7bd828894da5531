"""What every method shares: the registry entry, the server step, local
SGD through a parameter transform, and aggregation over cohorts.

A registry entry (`MethodSpec`) declares everything the experiment runner
needs to build the method without knowing it: its settings, the server-side
data it reads, and its default aggregator. Every method factory takes the
same core keywords

  build(*, cohorts, local, optimizer, server_lr, aggregator,
        num_clients, **settings) -> Method

plus its declared settings by their `kwarg`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedrobust.aggregators.base import Aggregator, call_aggregator
from fedrobust.cohort import (Cohort, align_stacked, aligned_shapes,
                              join_roles, pad_to, split_roles, trim_to)
from fedrobust.errors import SettingError
from fedrobust.local import LocalConfig, classification_loss, local_sgd
from fedrobust.settings import Setting
from fedrobust.transforms.base import masked
from fedrobust.tree import tree_sq_norm, tree_sub
from fedrobust.types import Arrivals, ClientOutput, EvalModel

Params = Any

# Server-side data a method may ask for (experiments/ builds each once):
#   'validation': the clean server sample U, batched (x uint8[T, B, ...],
#                 y int32[T, B], mask bool[T, B]) with the local batch size.
#   'anchors':    RFD-LoRA's public anchor inputs x[A, ...] (token ids),
#                 from the method's anchor_dataset, anchor_fraction of the
#                 training size.
SERVER_DATA = ('validation', 'anchors')


class MethodSpec(NamedTuple):
  """A METHODS entry: the factory and what it declares.

  default_aggregator: settings dict (kwarg -> value) -> the aggregator a
    bare run uses (FedAvg: weighted_mean; SDFC: fdagg).
  validate: (settings dict, aggregator name) -> None; raises SettingError
    for combinations the method refuses.
  aggregator_defaults: (settings dict, aggregator name) -> keyword
    defaults for the aggregator's factory (SDFC's 'weighting' reaches
    fdagg this way); explicit --aggregator_kwargs win.
  cohorts: whether the method accepts several cohorts and non-identity
    transforms.
  uses_aggregator: False for a method whose server combines something
    other than parameter updates (RFD-LoRA's logits): it is built with no
    aggregator and refuses --aggregator.
  preset: the command line's paper preset for a bare --method=NAME (a
    flagfile name in experiments/configs), '' for none.
  lora_communication: on a LoRA cohort, the run's summary reports the
    per-round bytes a client sends and receives
    (fedlora.communication_bytes, which knows the method's message).
  """
  build: Callable[..., Any]
  summary: str
  settings: tuple[Setting, ...] = ()
  server_data: tuple[str, ...] = ()
  default_aggregator: Callable[[dict], str] = lambda s: 'weighted_mean'
  validate: Callable[[dict, str], None] = lambda s, a: None
  aggregator_defaults: Callable[[dict, str], dict] = lambda s, a: {}
  cohorts: bool = True
  uses_aggregator: bool = True
  lora_communication: bool = False
  preset: str = ''


def server_step(params: Params, update: Params, server_lr: float) -> Params:
  """w <- w + eta * u (the server's step on the aggregated update)."""
  return jax.tree.map(lambda w, d: w + server_lr * d, params, update)


def aggregate_and_step(aggregation, params: tuple, arrivals, agg_state,
                       key, server_lr: float, **more):
  """A cohort method's server round: aggregate every cohort's arrivals,
  then take the server step per cohort. Returns (params, agg_state, info).
  `more`: further aggregator extras (the engine's 'retrain').
  """
  update, agg_state, info = aggregation.aggregate(params, arrivals,
                                                  agg_state, key, **more)
  return (tuple(server_step(p, u, server_lr) for p, u in zip(params, update)),
          agg_state, info)


def extras_of(arrivals: Arrivals, **more) -> dict[str, Any]:
  """The aggregator keyword extras a cohort's arrivals carry (plus `more`,
  e.g. params or scores)."""
  extras = dict(weights=arrivals.outputs.weight, ids=arrivals.ids,
                coverage=arrivals.outputs.coverage,
                staleness=arrivals.staleness, **more)
  if 'train_loss' in arrivals.outputs.metrics:
    extras['losses'] = arrivals.outputs.metrics['train_loss']
  return extras


def transformed_sgd_update(cohort: Cohort, *, local: LocalConfig,
                           optimizer: optax.GradientTransformation,
                           proximal_mu: float = 0.0):
  """client_update body for ONE client of `cohort` running local SGD on the
  cohort transform's trainable tree.

  The client receives broadcast = (base, trainable, round) and its spec
  (LoRA rank / width ratio, or () for none), trains trainable * coverage
  for the plan's S steps (FedProx adds mu/2 ||v - w||^2), and returns the
  delta masked to its coverage, the coverage, and its example count as
  weight. Local training poisons the batches of malicious clients with
  `local.poison`.

  Returns:
    update(broadcast, spec, data, key) -> ClientOutput (client_state ()).
  """
  transform = cohort.transform

  redraw = jnp.asarray(cohort.redraw, jnp.float32) if cohort.redraw else None

  def update(broadcast, spec, data, key):
    base, trainable, round_number = broadcast
    spec = None if isinstance(spec, tuple) else spec
    if redraw is not None:     # this round's spec (key: client and round)
      spec = redraw[jax.random.randint(jax.random.fold_in(key, 0x5BEC), (),
                                       0, redraw.shape[0])]
    cov = transform.coverage(trainable, spec, round_number)
    start = masked(trainable, cov)

    def apply(t, x, *, train=False, key=None):
      return transform.apply(base, masked(t, cov), x, spec=spec,
                             train=train, key=key)

    base_loss = classification_loss(apply)

    def loss_fn(p, x, y, mask, k):
      loss, aux = base_loss(p, x, y, mask, k)
      if proximal_mu:
        loss = loss + 0.5 * proximal_mu * tree_sq_norm(tree_sub(p, start))
      return loss, aux

    new, metrics = local_sgd(loss_fn, start, data, key, optimizer=optimizer,
                             config=local)
    return ClientOutput(delta=masked(tree_sub(new, start), cov),
                        weight=data.count.astype(jnp.float32),
                        client_state=(), metrics=metrics, coverage=cov)

  return update


class CohortAggregation(NamedTuple):
  """How a cohort-aware method aggregates (built once per method).

  consistent(trainables) -> trainables whose shared layers are trimmed
  copies of one aligned tree (call it on the initial trainables).

  With one cohort there is one group: the whole trainable tree. With
  several, the subtrees of the `share` roles form one group aligned over
  all cohorts (zero-padded to the largest shape, coverage-masked), and each
  cohort's remaining subtree is its own group. The aggregator runs once per
  group, with one state per group.
  """
  init: Callable[[tuple[Params, ...]], Any]
  aggregate: Callable[..., tuple[tuple[Params, ...], Any, dict]]
  consistent: Callable[[tuple[Params, ...]], tuple[Params, ...]]


def _per_client(info: dict, slots: int) -> dict:
  """Moves the rule's per-slot vectors (e.g. Horus's 'hops') under
  info['per_client'], which the round logs per client."""
  per = {k: v for k, v in info.items()
         if k != 'weights' and jnp.ndim(v) == 1 and v.shape[0] == slots}
  out = {k: v for k, v in info.items() if k not in per}
  if per:
    out['per_client'] = per
  return out


def cohort_aggregation(aggregator: Aggregator, cohorts: tuple[Cohort, ...],
                       share: tuple[str, ...]) -> CohortAggregation:
  """Builds the per-group aggregation for `cohorts` (see CohortAggregation).

  aggregate(trainables, arrivals, agg_state, key, **more_extras) ->
    (updates per cohort, agg_state, info with 'weights' per cohort).
  """
  single = len(cohorts) == 1
  share = () if single else tuple(share)

  def group_templates(trainables):
    shared = [split_roles(t, c.model, share)[0] if share else {}
              for t, c in zip(trainables, cohorts)]
    private = [split_roles(t, c.model, share)[1] if share else t
               for t, c in zip(trainables, cohorts)]
    shapes = aligned_shapes(shared) if share else None
    return shared, private, shapes

  def aligned_global(trainables, shapes):
    """The shared layers' global values at the aligned shape: each cohort
    holds a trimmed copy of the same aligned tree, so a coordinate's value
    is any owner's (their average)."""
    shared = [split_roles(t, c.model, share)[0]
              for t, c in zip(trainables, cohorts)]
    ones = [jax.tree.map(lambda l: jnp.ones(l.shape, jnp.float32), t)
            for t in shared]
    total = functools.reduce(
        lambda x, y: jax.tree.map(jnp.add, x, y),
        [pad_to(t, shapes) for t in shared])
    owners = functools.reduce(
        lambda x, y: jax.tree.map(jnp.add, x, y),
        [pad_to(o, shapes) for o in ones])
    return jax.tree.map(lambda t, o: t / jnp.maximum(o, 1.0), total, owners)

  def consistent(trainables):
    """The shared layers start as ONE aligned tree: every coordinate takes
    its first owner's initial value (cohort order), and each cohort holds
    that tree trimmed to its own shapes (Horus broadcasts one global LoRA
    that clients trim)."""
    if single or not share:
      return tuple(trainables)
    shared = [split_roles(t, c.model, share) for t, c in zip(trainables,
                                                               cohorts)]
    shapes = aligned_shapes([s for s, _ in shared])
    merged = owned = None
    for s, _ in shared:
      value = pad_to(s, shapes)
      have = pad_to(jax.tree.map(lambda l: jnp.ones(l.shape, bool), s),
                    shapes)
      if merged is None:
        merged, owned = value, have
      else:
        merged = jax.tree.map(lambda m, o, v: jnp.where(o, m, v), merged,
                              owned, value)
        owned = jax.tree.map(jnp.logical_or, owned, have)
    return tuple(join_roles(p, trim_to(merged, s), c.model)
                 for (s, p), c in zip(shared, cohorts))

  def init(trainables):
    if single:
      return aggregator.init(trainables[0])
    _, private, shapes = group_templates(trainables)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return (aggregator.init(zeros) if share else (),
            tuple(aggregator.init(p) if jax.tree.leaves(p) else ()
                  for p in private))

  def aggregate(trainables, arrivals, state, key, **more):
    if single:
      a = arrivals[0]
      update, state, info = call_aggregator(
          aggregator, a.outputs.delta, a.mask, state, key,
          **extras_of(a, params=trainables[0], **more))
      info = _per_client(dict(info), a.mask.shape[0])
      weights = info.pop('weights', None)
      if weights is not None:
        info['weights'] = (weights,)
      return (update,), state, info
    shapes = group_templates(trainables)[2]
    parts = []
    for a, c in zip(arrivals, cohorts):
      d, cv = a.outputs.delta, a.outputs.coverage
      if share:
        ds, dp = split_roles(d, c.model, share)
        cs, cp = (split_roles(cv, c.model, share) if cv is not None
                  else (None, None))
      else:
        ds, dp, cs, cp = {}, d, None, cv
      parts.append((ds, dp, cs, cp))
    shared_state, private_states = state
    info, weights = {}, [None] * len(cohorts)
    shared_update = None
    if share:
      ups, cov = align_stacked([p[0] for p in parts], [p[2] for p in parts],
                               shapes)
      cat = lambda name: jnp.concatenate([getattr(a, name) for a in arrivals])
      extras = dict(
          weights=jnp.concatenate([a.outputs.weight for a in arrivals]),
          ids=cat('ids'), coverage=cov, staleness=cat('staleness'),
          params=aligned_global(trainables, shapes), **more)
      if all('train_loss' in a.outputs.metrics for a in arrivals):
        extras['losses'] = jnp.concatenate(
            [a.outputs.metrics['train_loss'] for a in arrivals])
      shared_update, shared_state, shared_info = call_aggregator(
          aggregator, ups, cat('mask'), shared_state,
          jax.random.fold_in(key, 0), **extras)
      sizes = [a.mask.shape[0] for a in arrivals]
      shared_info = _per_client(dict(shared_info), sum(sizes))
      info['per_client'] = shared_info.pop('per_client', {})
      w = shared_info.pop('weights', None)
      if w is not None:
        weights = [w[sum(sizes[:j]):sum(sizes[:j + 1])]
                   for j in range(len(sizes))]
      info.update({f'shared/{k}': v for k, v in shared_info.items()})
    updates, new_private = [], []
    for j, (a, c) in enumerate(zip(arrivals, cohorts)):
      private, private_cov = parts[j][1], parts[j][3]
      if jax.tree.leaves(private):
        extras = extras_of(a, params=split_roles(trainables[j], c.model,
                                                 share)[1] if share
                           else trainables[j], **more)
        extras['coverage'] = private_cov
        up, st, pinfo = call_aggregator(
            aggregator, private, a.mask, private_states[j],
            jax.random.fold_in(key, j + 1), **extras)
        pinfo = dict(pinfo)
        w = pinfo.pop('weights', None)
        if w is not None:
          weights[j] = w
        info.update({f'{c.name}/{k}': v for k, v in pinfo.items()})
      else:
        up, st = {}, private_states[j]
      new_private.append(st)
      if share:
        like = split_roles(trainables[j], c.model, share)[0]
        up = join_roles(up, trim_to(shared_update, like), c.model)
      updates.append(up)
    if all(w is not None for w in weights):
      info['weights'] = tuple(weights)
    return tuple(updates), (shared_state, tuple(new_private)), info

  return CohortAggregation(init, aggregate, consistent)


def check_cohorts(name: str, cohorts: tuple[Cohort, ...], *,
                  multi: bool) -> None:
  """Methods that take one cohort of the identity transform say so."""
  if not multi and (len(cohorts) != 1 or
                    cohorts[0].transform.name != 'identity'):
    raise SettingError('cohorts', f'method {name!r} trains one full model: '
                       'it takes one cohort and the identity transform')


def eval_models_of(cohorts: tuple[Cohort, ...], bases, trainables
                   ) -> tuple[EvalModel, ...]:
  """The models to evaluate: each cohort's merged global model; for a
  width-sliced cohort, every client's own submodel (the headline: the mean
  over clients, as heterogeneous-FL papers report), the full model
  ('full') and each distinct width's submodel ('w0.5', ...). Clients of
  one width share one submodel: the per-client model holds one row per
  distinct width and an index from client to row, so evaluating N
  clients costs as many models as there are widths."""
  out = []
  for j, c in enumerate(cohorts):
    label = '' if len(cohorts) == 1 else c.name
    sliced = c.transform.name == 'width' and c.transform.spec_values and (
        len(c.transform.spec_values) > 1 or c.transform.spec_values[0] != 1)
    full = c.transform.merge(bases[j], trainables[j], None)
    if not sliced:
      out.append(EvalModel(label, j, full))
      continue
    values = tuple(c.transform.spec_values)
    widths = jax.vmap(lambda v: c.transform.merge(bases[j], trainables[j],
                                                    v))(
        jnp.asarray(values, jnp.float32))
    # specs are stored as float32, the transform's values as given: match
    # each client to the nearest value.
    index = np.argmin(np.abs(np.asarray(values)[None] - np.asarray(
        [c.specs[i] for i in c.members])[:, None]), axis=1).astype(np.int32)
    out.append(EvalModel(label, j, widths, clients=c.members,
                         per_client=True, index=index))
    prefix = label + '/' if label else ''
    out.append(EvalModel(prefix + 'full', j, full, c.members))
    for r, v in enumerate(values):
      clients = tuple(i for i, k in zip(c.members, index) if k == r)
      out.append(EvalModel(f'{prefix}w{v:g}', j,
                           jax.tree.map(lambda leaf, r=r: leaf[r], widths),
                           clients))
  return tuple(out)
