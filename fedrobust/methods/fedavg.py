"""FedAvg (McMahan et al. 2017) and FedProx (Li et al. 2020) over cohorts.

Client: S masked SGD steps on its cohort transform's trainable tree (the
full model, LoRA factors, or a width-sliced submodel), starting from the
broadcast; FedProx adds mu/2 ||v - w||^2 to the local loss. Server: the
aggregator (by default the weighted mean w <- w + eta * sum_c n_c delta_c /
sum_c n_c over the round's real clients, n_c the client's example count)
and the server step.

Several cohorts (different architectures): each cohort averages its own
trainable tree; the subtrees of the `share` roles (default: the 'head',
the classifier) are aggregated across all cohorts after zero-padding to a
common shape (see fedrobust.cohort), which is how CNN and LSTM clients
learn together. Settings: FedProx's `mu` and the shared roles
(`cohort_share`, declared shared by both methods).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedrobust.aggregators.base import Aggregator
from fedrobust.cohort import Cohort, member_positions
from fedrobust.errors import SettingError
from fedrobust.local import LocalConfig, classification_loss, local_sgd
from fedrobust.methods.base import (MethodSpec, aggregate_and_step,
                                    cohort_aggregation, eval_models_of,
                                    transformed_sgd_update)
from fedrobust.settings import Setting
from fedrobust.types import EvalModel, Method

SHARE = Setting('cohort_share', 'head', 'Roles whose trainable parameters '
                'all cohorts aggregate together (comma-separated: head, '
                'first; "none" shares nothing). Used with several '
                'cohorts.', arg='share', shared=True)


WARMUP = Setting('warmup_epochs', 0, 'Private backbones: before round 1 '
                 'every client trains the full model locally for this many '
                 'epochs and keeps it as its own frozen base; the transform '
                 "(LoRA, selected layers) trains on top of it (Horus's "
                 'warm-up). 0: one shared base.', shared=True)


class FedAvgState(NamedTuple):
  base: tuple       # each cohort's frozen base (() for the identity transform)
  agg: Any          # the aggregator's state (per group with several cohorts)
  backbones: tuple = ()   # with warm-up: per cohort, leaves [K_j, ...]


def parse_share(share: str | tuple) -> tuple[str, ...]:
  if isinstance(share, tuple):
    return share
  roles = tuple(r.strip() for r in share.split(',') if r.strip())
  return () if roles == ('none',) else roles


def fedavg(*, cohorts: tuple[Cohort, ...], local: LocalConfig,
           optimizer: optax.GradientTransformation, aggregator: Aggregator,
           server_lr: float = 1.0, num_clients: int = 0,
           mu: float = 0.0, share: str | tuple = 'head',
           warmup_epochs: int = 0) -> Method:
  """FedAvg (mu == 0) or FedProx (mu > 0).

  Args:
    cohorts: the federation's cohorts (fedrobust.cohort).
    local: static local-training settings.
    optimizer: the client optimizer (fresh state every round).
    aggregator: the server rule (aggregators.AGGREGATORS; FedAvg's is
      weighted_mean); it gets weights, ids, coverage and staleness.
    server_lr: eta, the server step on the aggregated update.
    num_clients: K (unused; uniform factory interface).
    mu: FedProx's proximal weight; 0 gives FedAvg.
    share: roles aggregated across cohorts ('head', 'first', 'none').
    warmup_epochs: > 0 gives every client a private backbone: its own
      model after this many local epochs before round 1 (Horus Sec. VI-A),
      frozen, under the cohort's transform; evaluation then reports every
      client's own model.

  Returns:
    A Method.
  """
  del num_clients
  if not (mu >= 0 and jnp.isfinite(mu)):
    raise SettingError('mu', f'must be >= 0 and finite, got {mu}',
                       component='method fedprox')
  if isinstance(warmup_epochs, bool) or not isinstance(
      warmup_epochs, int) or warmup_epochs < 0:
    raise SettingError('warmup_epochs', f'must be an int >= 0, got '
                       f'{warmup_epochs!r}')
  private = warmup_epochs > 0
  if private and any(c.transform.name not in ('lora', 'select')
                     for c in cohorts):
    raise SettingError('warmup_epochs', 'private backbones need a transform '
                       'that freezes them (lora or select), not '
                       f'{sorted({c.transform.name for c in cohorts})}')
  share = parse_share(share)
  aggregation = cohort_aggregation(aggregator, cohorts, share)
  updates = [transformed_sgd_update(c, local=local, optimizer=optimizer,
                                    proximal_mu=mu)
             for c in cohorts]
  specs = [jnp.asarray(c.specs, jnp.float32)
           if c.transform.spec_name and len(c.specs) else None
           for c in cohorts]
  # A client's row in its cohort's backbone stack.
  positions = member_positions(cohorts)
  # The warm-up trains on clean data.
  warmup = (local._replace(num_epochs=warmup_epochs, poison=None)
            if private else None)

  def init(params, num_clients, key):
    del num_clients
    split = [c.transform.init(p, jax.random.fold_in(key, j))
             for j, (c, p) in enumerate(zip(cohorts, params))]
    trainables = aggregation.consistent(tuple(t for _, t in split))
    backbones = ()
    if private:       # filled by the setup step (client warm-up)
      backbones = tuple(jax.tree.map(
          lambda leaf, n=len(c.members): jnp.broadcast_to(
              leaf, (n, *leaf.shape)), c.transform.merge(b, t, None))
                        for c, (b, t) in zip(cohorts, split))
    return trainables, FedAvgState(base=tuple(b for b, _ in split),
                                   agg=aggregation.init(trainables),
                                   backbones=backbones)

  def broadcast(state, j):
    return (state.method_state.base[j], state.params[j], state.round + 1)

  def client_state(method_state, j, ids):
    spec = () if specs[j] is None else specs[j][ids]
    if not private:
      return spec
    return spec, jax.tree.map(lambda leaf: leaf[positions[j][ids]],
                              method_state.backbones[j])

  def client_update(j, broadcast, state, data, key, server_data):
    del server_data
    if private:         # the client's own frozen backbone is its base
      spec, backbone = state
      broadcast = (backbone,) + tuple(broadcast[1:])
    else:
      spec = state
    return updates[j](broadcast, spec, data, key)

  def client_setup(j, broadcast, state, data, key, server_data):
    """Warm-up: the full model, trained locally for warmup_epochs."""
    del state, server_data
    base, trainable, _ = broadcast
    full = cohorts[j].transform.merge(base, trainable, None)
    loss = classification_loss(cohorts[j].model.apply)
    trained, _ = local_sgd(loss, full, data, key, optimizer=optimizer,
                           config=warmup)
    return trained

  def server_setup(state, results):
    backbones = tuple(jax.tree.map(lambda leaf, n=len(c.members): leaf[:n],
                                   outputs)
                      for c, (_, _, outputs) in zip(cohorts, results))
    return state.method_state._replace(backbones=backbones)

  def server_update(state, arrivals, key, server_data, retrain=None):
    del server_data
    more = {} if retrain is None else {'retrain': retrain}
    params, agg_state, info = aggregate_and_step(
        aggregation, state.params, arrivals, state.method_state.agg, key,
        server_lr, **more)
    return params, state.method_state._replace(agg=agg_state), info

  def eval_models(state):
    if not private:
      return eval_models_of(cohorts, state.method_state.base, state.params)
    out = []
    for j, c in enumerate(cohorts):
      merge = lambda b, t=state.params[j], tr=c.transform: tr.merge(b, t,
                                                                    None)
      out.append(EvalModel('' if len(cohorts) == 1 else c.name, j,
                           jax.vmap(merge)(state.method_state.backbones[j]),
                           clients=c.members, per_client=True))
    return tuple(out)

  name = 'fedprox' if mu else 'fedavg'
  return Method(name, init, broadcast, client_state, client_update,
                server_update, eval_models,
                provides=frozenset({'weights', 'ids', 'coverage',
                                    'staleness', 'params', 'losses',
                                    'retrain'}),
                client_setup=client_setup if private else None,
                server_setup=server_setup if private else None)


FEDAVG = MethodSpec(
    build=fedavg,
    lora_communication=True,
    summary='FedAvg: local SGD, the weighted mean of the updates.',
    settings=(SHARE, WARMUP))

FEDPROX = MethodSpec(
    build=fedavg,
    summary='FedProx: FedAvg with a proximal term mu/2 ||v - w||^2.',
    settings=(Setting('mu', 0.01, 'FedProx proximal weight mu (> 0).'),
              SHARE, WARMUP))


def fedavg_with_rule(name: str, rule: str, rule_settings: tuple[Setting, ...],
                     summary: str):
  """(build, MethodSpec) of a method that is FedAvg's pipeline with `rule`
  as its default server rule (Horus, FedHAN). `rule_settings` are declared
  by the method (flags --<name>_<setting>) and reach `rule` as its keyword
  arguments; another --aggregator runs on the same pipeline without them.
  """
  def build(**kwargs):
    for s in rule_settings:
      kwargs.pop(s.kwarg, None)
    return fedavg(**kwargs)._replace(name=name)

  build.__name__ = name
  build.__doc__ = f"FedAvg's pipeline; the {name} settings go to the " \
                  f"{rule!r} rule."
  spec = MethodSpec(
      build=build, summary=summary, settings=rule_settings + (SHARE, WARMUP),
      default_aggregator=lambda s: rule,
      aggregator_defaults=lambda s, agg: (
          {x.kwarg: s[x.kwarg] for x in rule_settings} if agg == rule
          else {}))
  return build, spec
