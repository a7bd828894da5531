"""FedALT: individual LoRA plus a rest-of-the-world LoRA, mixed by a router
(Bian, Wang, Zhang, Xu, AAAI 2026; arXiv 2503.11880).

A baseline of HiLoRA's tables (seeds/002, Sec. 5.1). Every client k keeps
an individual adapter (a1_k, b1_k) and, on every targeted Dense layer, a
router W_route,k ([d_in, 2], no bias). A layer computes, per token x,

  y = x W0 + g0 (x a0_k)(s b0_k) + g1 (x a1_k)(s b1_k),  g = softmax(x W_route,k)

(models/layers.Dense's routed LoRA), where (a0_k, b0_k) is the
rest-of-the-world (RoW) adapter: the unweighted mean of the OTHER clients'
individual adapters, a and b averaged separately. The RoW adapter is frozen
in local training; the client trains its individual adapter and its router,
which are never reset and never aggregated (the release's
`route_aggregation=False`). The server only stores the uploads and forms
the RoW adapters. Round 1 has no upload yet: the RoW adapter is zero and
contributes nothing (the release starts with B0 = 0).

Partial participation (the release assumes every client every round): the
RoW adapter of k averages the latest stored individual adapters of the
clients other than k that have trained at least once. Evaluation: client k's
own routed model (`personal`). The global row and a newcomer's start are
W0 + the mean of all stored individual adapters (the RoW adapter of a
client that never took part), merged; a newcomer then trains a fresh
adapter on it (fedrobust.adapt), without a router.

Notation: the paper's A ([r, d_in]) / B ([d_out, r]) are our `a`
([d_in, r]) / `b` ([r, d_out]). Source: the authors' release
(github.com/jmbian/FedALT: client.py, server.py, peft/tuners/lora.py);
its defaults are r = 8, alpha = 32, AdamW lr 3e-4, 5 local epochs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedrobust.errors import SettingError
from fedrobust.local import LocalConfig, classification_loss, local_sgd
from fedrobust.methods.base import MethodSpec
from fedrobust.methods.fedlora import (_check_lora, add_dense, lora_modules,
                                       products)
from fedrobust.methods.personal_lora import (PROVIDES, broadcast_base,
                                             own_rows)
from fedrobust.models.layers import ROUTE
from fedrobust.transforms.base import get_path, set_path
from fedrobust.tree import scatter_clients, tree_sub
from fedrobust.types import ClientOutput, EvalModel, Method

Params = Any


class ALTState(NamedTuple):
  base: Any   # W0
  own: Any    # {'lora': individual adapters, 'route': routers}, leaves [N, ...]
  seen: Any   # bool[N]: the client has uploaded at least once


def rest_of_world(adapters: Params, seen: jax.Array, ids: jax.Array
                  ) -> Params:
  """Rows [len(ids), ...]: for each id k the mean of adapters[j] over
  seen clients j != k (zero when there is none)."""
  w = seen.astype(jnp.float32)

  def one(leaf):
    flat = leaf.reshape(leaf.shape[0], -1)
    mine = w[ids][:, None] * flat[ids]
    count = jnp.sum(w) - w[ids]
    rows = ((w @ flat)[None] - mine) / jnp.maximum(count, 1.0)[:, None]
    return rows.reshape((len(ids), *leaf.shape[1:]))
  return jax.tree.map(one, adapters)


def mean_adapter(adapters: Params, seen: jax.Array) -> Params:
  """The mean of adapters[j] over seen clients j (zero when none is)."""
  w = seen.astype(jnp.float32)
  return jax.tree.map(
      lambda leaf: jnp.tensordot(w, leaf, 1) / jnp.maximum(jnp.sum(w), 1.0),
      adapters)


def fedalt(*, cohorts, local: LocalConfig,
           optimizer: optax.GradientTransformation, aggregator=None,
           server_lr: float = 1.0,
           num_clients: int = 0) -> Method:
  """FedALT (module docstring). It aggregates nothing through an
  aggregator (the server only forms the rest-of-the-world means)."""
  del aggregator, server_lr
  name = 'fedalt'
  _check_lora(name, cohorts, single=True)
  cohort = cohorts[0]
  transform, model = cohort.transform, cohort.model
  if not model.lora_native:
    raise SettingError('model', 'fedalt routes two LoRA adapters inside '
                       'the layers: it needs a model that applies LoRA '
                       'factored (lora_native)', component=f'method {name}')
  scale = transform.factor_scale(None)
  n = num_clients or 1 + max(cohort.members)

  def init(params, num_clients, key):
    del num_clients
    base, t = transform.init(params[0], jax.random.fold_in(key, 0))
    paths = lora_modules(t)
    for path in paths:
      if get_path(base, path)['kernel'].ndim != 2:
        raise SettingError('lora_targets', f'fedalt routes per token on '
                           f'Dense layers; {path} is not one',
                           component=f'method {name}')

    def client(k):
      own = transform.init(params[0], k)[1]
      route = {}
      for i, path in enumerate(paths):
        d_in = get_path(own, path)['a'].shape[0]
        # Kaiming-uniform (a = sqrt(5)), torch.nn.Linear's default.
        bound = 1.0 / np.sqrt(d_in)
        route = set_path(route, path, jax.random.uniform(
            jax.random.fold_in(k, 1000 + i), (d_in, 2), jnp.float32,
            -bound, bound))
      return {'lora': own, 'route': route}
    own = jax.vmap(client)(jax.random.split(jax.random.fold_in(key, 1), n))
    return (t,), ALTState(base, own, jnp.zeros((n,), bool))

  def client_rows(ms, j, ids):
    del j
    return (own_rows(ms, 0, ids),
            rest_of_world(ms.own['lora'], ms.seen, ids))

  def routed(own, row):
    """The 'lora' collection of one client: individual, RoW and router."""
    out = {}
    for path in lora_modules(own['lora']):
      f, r = get_path(own['lora'], path), get_path(row, path)
      out = set_path(out, path, {
          'a': f['a'], 'b': scale * f['b'], 'a0': r['a'],
          'b0': scale * r['b'], ROUTE: get_path(own['route'], path)})
    return out

  def forward(base, own, row, x, *, train=False, key=None):
    return model.apply(base, x, train=train, key=key,
                       lora=routed(own, jax.lax.stop_gradient(row)))

  def client_update(j, broadcast, rows, data, key, server_data):
    del j, server_data
    base, _, _ = broadcast
    own, row = rows

    def apply(t, x, *, train=False, key=None):
      return forward(base, t, row, x, train=train, key=key)
    new, metrics = local_sgd(classification_loss(apply), own, data, key,
                             optimizer=optimizer, config=local)
    return ClientOutput(delta=tree_sub(new, own),
                        weight=data.count.astype(jnp.float32),
                        client_state=(), metrics=metrics)

  def server_update(state, arrivals, key, server_data):
    del key, server_data
    ms = state.method_state
    (arr,) = arrivals
    start = own_rows(ms, 0, arr.ids)
    trained = jax.tree.map(jnp.add, start, arr.outputs.delta)
    own = scatter_clients(ms.own, arr.ids, trained, arr.mask)
    seen = ms.seen.at[arr.ids].max(arr.mask)
    ms = ms._replace(own=own, seen=seen)
    return (mean_adapter(own['lora'], seen),), ms, {}

  def global_model(ms):
    """W0 + the mean stored individual adapter (what a newcomer gets)."""
    return add_dense(ms.base, products(mean_adapter(ms.own['lora'], ms.seen),
                                       scale))

  def personal_apply(p, x, *, train=False, key=None):
    base, own, row = p
    return forward(base, own, row, x, train=train, key=key)

  def eval_models(state):
    ms = state.method_state
    members = jnp.asarray(cohort.members)
    m = len(cohort.members)
    own, row = client_rows(ms, 0, members)
    base = jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (m, *leaf.shape)),
                        ms.base)
    return (EvalModel('', 0, global_model(ms)),
            EvalModel('personal', 0, (base, own, row),
                      clients=cohort.members, per_client=True,
                      apply=personal_apply))

  def newcomer(state, data, key):
    del data, key
    return global_model(state.method_state), {}

  return Method(name, init, broadcast_base, client_rows, client_update,
                server_update, eval_models, provides=PROVIDES,
                newcomer=newcomer)


FEDALT = MethodSpec(
    build=fedalt,
    summary='FedALT: an individual LoRA per client, mixed per token by a '
    'trained router with the frozen mean of the other clients\' adapters '
    '(rest of the world).', uses_aggregator=False)
