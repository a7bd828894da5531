"""Newcomers: adapting a trained federation to clients that never took part.

The unseen-client protocol of the personalised-LoRA papers (HiLoRA Sec.
3.4 and 5.1): a newcomer u receives the model the method gives a new client
(`Method.newcomer`; by default the headline global model), puts a fresh
adapter of its cohort's transform on it (a LoRA leaf; the whole model
under the identity transform) and trains that for a few local epochs on
its own data. The result is evaluated on u's own test split.

Pure functions: `adapt_newcomers` runs every newcomer in one program
(lax.map over them, so memory holds one newcomer's training at a time).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedrobust.cohort import Cohort
from fedrobust.errors import SettingError
from fedrobust.local import LocalConfig, classification_loss, local_sgd
from fedrobust.transforms.base import Transform
from fedrobust.types import FederatedData, LocalData, Method, ServerState

Params = Any


def headline_model(method: Method, state: ServerState) -> Params:
  """The headline global model of cohort 0 (what a newcomer gets from a
  method without its own `newcomer`)."""
  for m in method.eval_models(state):
    if m.cohort == 0 and not m.per_client and not m.label:
      return m.params
  raise SettingError('unseen_clients', f'method {method.name} reports no '
                     'global model to give a newcomer')


def train_adapter(transform: Transform, params: Params, data: LocalData,
                  key: jax.Array, *, local: LocalConfig,
                  optimizer: optax.GradientTransformation
                  ) -> tuple[Params, Params, dict[str, jax.Array]]:
  """A fresh adapter of `transform` on `params` (frozen), trained by local
  SGD on one client's data: (base, trained adapter, metrics)."""
  init_key, train_key = jax.random.split(key)
  base, trainable = transform.init(params, init_key)

  def apply(t, x, *, train=False, key=None):
    return transform.apply(base, t, x, train=train, key=key)

  new, metrics = local_sgd(classification_loss(apply), trainable, data,
                           train_key, optimizer=optimizer, config=local)
  return base, new, metrics


def fine_tune(cohort: Cohort, params: Params, data: LocalData, key: jax.Array,
              *, local: LocalConfig, optimizer: optax.GradientTransformation
              ) -> tuple[Params, dict[str, jax.Array]]:
  """`train_adapter` with the cohort's transform; returns the merged full
  model and the training metrics."""
  base, new, metrics = train_adapter(cohort.transform, params, data, key,
                                     local=local, optimizer=optimizer)
  return cohort.transform.merge(base, new, None), metrics


def adapt_newcomers(method: Method, cohorts: tuple[Cohort, ...],
                    state: ServerState, data: FederatedData, key: jax.Array,
                    *, local: LocalConfig,
                    optimizer: optax.GradientTransformation
                    ) -> tuple[Params, dict[str, jax.Array]]:
  """Every newcomer's adapted model (jittable).

  Args:
    method, cohorts, state: the trained federation; newcomers join cohort 0.
    data: the newcomers' training data, leaves [U, N, ...] (count [U]).
    key: PRNG key (newcomer u uses fold_in(key, u)).
    local: local training of a newcomer (num_epochs: its epochs).
    optimizer: the clients' optimizer.

  Returns:
    (params with leaves [U, ...], info: the newcomer hook's entries [U]
    and the final local loss [U]).
  """
  if len(cohorts) != 1:
    raise SettingError('unseen_clients', 'newcomers join a single-cohort '
                       f'federation; this one has {len(cohorts)} cohorts')
  shared = None if method.newcomer else headline_model(method, state)

  def one(u):
    k = jax.random.fold_in(key, u)
    view = LocalData(x=data.x, y=data.y, client_id=u, count=data.count[u])
    if method.newcomer is None:
      start, info = shared, {}
    else:
      start, info = method.newcomer(state, view, jax.random.fold_in(k, 1))
    params, metrics = fine_tune(cohorts[0], start, view,
                                jax.random.fold_in(k, 2), local=local,
                                optimizer=optimizer)
    return params, dict(info, loss=metrics.get('loss', jnp.float32(0)))

  return jax.lax.map(one, jnp.arange(data.count.shape[0], dtype=jnp.int32))
