"""FedDPA: dual-personalising adapters (Yang et al., NeurIPS 2024).

A baseline of HiLoRA's tables (seeds/002, Sec. 5.1). Every client has a
global LoRA adapter G (aggregated, FedIT-style) and a local adapter L_i
(never sent). Training (after the authors' release, read through its
description; the paper is not in seeds/):

  FedDPA-T  round 1 trains G alone. From round 2 on a client first trains
            L_i for the round's local epochs with G frozen, on the mixed
            model W0 + w G + (1 - w) L_i (w = local_weight, 0.5), then
            trains its copy of G alone (W0 + G) for the same epochs and
            uploads G only.
  FedDPA-F  federated training of G alone for `global_rounds` rounds (FedIT);
            afterwards every client fine-tunes its L_i on the mixed model
            with G frozen, L_i starting as a copy of G, and uploads
            nothing (G stays as it was).

Test time (the instance-wise dynamic weighting): for a test input x the
client compares its representation with those of `anchors` random
training instances of its own, both under its local model W0 + L_i; with
s the mean cosine similarity, clipped to [0, 1], the prediction is that
of W0 + (w s) G + (1 - w s) L_i (the release's rule: the global weight
is the similarity times local_weight). Deviation: the representation is
the local model's logits, not the last hidden state (a model here exposes
only its logits); the anchors' logits are taken when the client last
trained. The personal models are evaluated instance by instance
(EvalModel.apply); the global model is W0 + G.

Notation: the paper's A ([r, d_in]) / B ([d_out, r]) are our `a`
([d_in, r]) / `b` ([r, d_out]); the mixture is taken over the adapters'
dense products s a b.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedrobust.errors import SettingError
from fedrobust.local import LocalConfig, classification_loss, local_sgd
from fedrobust.methods.base import (MethodSpec, aggregate_and_step,
                                    cohort_aggregation)
from fedrobust.methods.fedlora import _check_lora, add_dense, products
from fedrobust.methods.personal_lora import PROVIDES, broadcast_base, own_rows
from fedrobust.settings import Setting
from fedrobust.tree import scatter_clients, tree_sub
from fedrobust.types import ClientOutput, EvalModel, Method

Params = Any


class DPAState(NamedTuple):
  base: Any      # W0
  own: Any       # every client's local adapter L_i, leaves [N, ...]
  anchors: Any   # float32[N, anchors, classes]: its anchors' local logits
  agg: Any       # the aggregator's state (over G)


def similarity_weight(query: jax.Array, anchors: jax.Array,
                      local_weight: float) -> jax.Array:
  """The global adapter's weight per query row: local_weight times the
  mean cosine similarity (clipped to [0, 1]) of query [B, D] to the
  anchors [K, D]."""
  q = query / (jnp.linalg.norm(query, axis=-1, keepdims=True) + 1e-12)
  a = anchors / (jnp.linalg.norm(anchors, axis=-1, keepdims=True) + 1e-12)
  return local_weight * jnp.clip(jnp.mean(q @ a.T, axis=-1), 0.0, 1.0)


def feddpa(name: str, sequential: bool, *, cohorts, local: LocalConfig,
           optimizer: optax.GradientTransformation, aggregator=None,
           server_lr: float = 1.0, num_clients: int = 0,
           local_weight: float = 0.5, global_rounds: int = 10,
           anchors: int = 5) -> Method:
  """FedDPA-F (sequential=True) or FedDPA-T (module docstring).

  Args:
    local_weight: w, the mixing weight of G while L_i trains, and the cap
      of G's weight at test time.
    global_rounds: FedDPA-F's rounds of federated training of G before the
      local fine-tuning (unused by FedDPA-T).
    anchors: local training instances compared with a test input.
  """
  _check_lora(name, cohorts, single=True)
  if not 0.0 <= local_weight <= 1.0:
    raise SettingError('local_weight', f'must be in [0, 1], got '
                       f'{local_weight}', component=f'method {name}')
  if global_rounds < 1:
    raise SettingError('global_rounds', f'must be >= 1, got {global_rounds}',
                       component=f'method {name}')
  if anchors < 1:
    raise SettingError('anchors', f'must be >= 1, got {anchors}',
                       component=f'method {name}')
  cohort = cohorts[0]
  transform, model = cohort.transform, cohort.model
  scale = transform.factor_scale(None)
  n = num_clients or 1 + max(cohort.members)
  aggregation = cohort_aggregation(aggregator, cohorts, ())

  def mixed(base, g, l, wg, wl):
    """W0 + wg G + wl L as full params."""
    pg, pl = products(g, scale), products(l, scale)
    return add_dense(base, {p: wg * pg[p] + wl * pl[p] for p in pg})

  def alone(base, t):
    """W0 + one adapter as full params."""
    return add_dense(base, products(t, scale))

  def init(params, num_clients, key):
    del num_clients
    base, g = transform.init(params[0], jax.random.fold_in(key, 0))
    own = jax.vmap(lambda k: transform.init(params[0], k)[1])(
        jax.random.split(jax.random.fold_in(key, 1), n))
    return (g,), DPAState(base, own, jnp.zeros(
        (n, anchors, model.num_classes)), aggregation.init((g,)))

  def train(loss_of, start, data, key):
    """Local SGD of `start` under the loss of apply(t, x)."""
    def apply_loss(t, x, y, mask, k):
      return classification_loss(
          lambda t, x, *, train=False, key=None: model.apply(
              loss_of(t), x, train=train, key=key))(t, x, y, mask, k)
    return local_sgd(apply_loss, start, data, key, optimizer=optimizer,
                     config=local)

  def client_update(j, broadcast, own, data, key, server_data):
    del j, server_data
    base, g, round_number = broadcast
    local_key, global_key, anchor_key = jax.random.split(key, 3)
    if sequential:
      # The first fine-tuning round starts L_i as a copy of G.
      first = round_number == global_rounds + 1
      own = jax.tree.map(lambda o, gl: jnp.where(first, gl, o), own, g)

    def train_local():
      return train(lambda l: mixed(base, g, l, local_weight,
                                   1.0 - local_weight), own, data, local_key)

    def train_global():
      return train(lambda t: alone(base, t), g, data,
                   global_key)

    def global_only():
      new_g, metrics = train_global()
      return own, new_g, metrics

    def local_only():
      new_own, metrics = train_local()
      return new_own, g, metrics

    def both():
      new_own, _ = train_local()
      new_g, metrics = train_global()
      return new_own, new_g, metrics

    if sequential:    # FedDPA-F: G alone, then L_i alone
      uploads = round_number <= global_rounds
      new_own, new_g, metrics = jax.lax.cond(uploads, global_only,
                                             local_only)
    else:             # FedDPA-T: G alone in round 1, then L_i and G
      uploads = jnp.bool_(True)
      new_own, new_g, metrics = jax.lax.cond(round_number > 1, both,
                                             global_only)
    # Anchors: `anchors` random own training instances under W0 + L_i.
    pick = jax.random.randint(anchor_key, (anchors,), 0,
                              jnp.maximum(data.count, 1))
    logits = model.apply(alone(base, new_own),
                         data.x[data.row][pick])
    return ClientOutput(
        delta=tree_sub(new_g, g),
        weight=data.count.astype(jnp.float32) * uploads,
        client_state=(new_own, logits), metrics=metrics)

  def server_update(state, arrivals, key, server_data):
    del server_data
    ms = state.method_state
    (arr,) = arrivals
    new_own, logits = arr.outputs.client_state
    own = scatter_clients(ms.own, arr.ids, new_own, arr.mask)
    anchor_logits = scatter_clients(ms.anchors, arr.ids, logits, arr.mask)
    params, agg, info = aggregate_and_step(aggregation, state.params, (arr,),
                                           ms.agg, key, server_lr)
    # FedDPA-F's fine-tuning rounds upload nothing: G stays.
    moved = jnp.sum(jnp.where(arr.mask, arr.outputs.weight, 0.0)) > 0
    params = jax.tree.map(lambda a, b: jnp.where(moved, a, b), params,
                          state.params)
    return params, ms._replace(own=own, anchors=anchor_logits, agg=agg), info

  def personal_apply(p, x, *, train=False, key=None):
    """The instance-wise mixture for one client's p = (base, G, L_i,
    anchor logits)."""
    del train, key
    base, g, l, anchor_logits = p
    query = model.apply(alone(base, l), x)
    wg = similarity_weight(query, anchor_logits, local_weight)

    def one(args):
      w, xi = args
      return model.apply(mixed(base, g, l, w, 1.0 - w), xi[None])[0]
    return jax.lax.map(one, (wg, x))

  def eval_models(state):
    ms = state.method_state
    members = jnp.asarray(cohort.members)
    g = state.params[0]
    m = len(cohort.members)
    stack = lambda tree: jax.tree.map(
        lambda leaf: jnp.broadcast_to(leaf, (m, *leaf.shape)), tree)
    personal = (stack(ms.base), stack(g), own_rows(ms, 0, members),
                ms.anchors[members])
    return (EvalModel('', 0, alone(ms.base, g)),
            EvalModel('personal', 0, personal, clients=cohort.members,
                      per_client=True, apply=personal_apply))

  def newcomer(state, data, key):
    del data, key
    g = state.params[0]
    return alone(state.method_state.base, g), {}

  return Method(name, init, broadcast_base, own_rows, client_update,
                server_update, eval_models, provides=PROVIDES,
                newcomer=newcomer)


def feddpa_t(**kwargs) -> Method:
  return feddpa('feddpa_t', False, **kwargs)


def feddpa_f(**kwargs) -> Method:
  return feddpa('feddpa_f', True, **kwargs)


_SETTINGS = (
    Setting('local_weight', 0.5, "G's weight in the mixed model while L_i "
            "trains, and the cap of G's test-time weight."),
    Setting('anchors', 5, 'Own training instances a test input is compared '
            'with (the instance-wise weighting).'))

FEDDPA_T = MethodSpec(
    build=feddpa_t,
    summary='FedDPA-T: a global LoRA (aggregated) and a local LoRA per '
    'client trained in turn every round; instance-wise mixing at test '
    'time.', settings=_SETTINGS)

FEDDPA_F = MethodSpec(
    build=feddpa_f,
    summary='FedDPA-F: federated training of the global LoRA, then local '
    'fine-tuning of a local LoRA; instance-wise mixing at test time.',
    settings=_SETTINGS + (
        Setting('global_rounds', 10, 'Rounds of federated training of the '
                'global adapter before the local fine-tuning.'),))
