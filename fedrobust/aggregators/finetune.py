"""Server-side fine-tuning, and the helpers the server-aided rules share.

The "fine-tuning" baseline (a model-refinement defence, see SDFC Sec. 4.1)
averages the round's updates and then re-optimises the aggregated model on
the server's small clean set U for a few SGD steps:

  w' = w_t + (1/n) sum_{i valid} Delta_i
  w'' = SGD_U^S(w')               (S = server_steps mini-batch steps)
  returned update: u_t = w'' - w_t

This module also holds what the other server-aided rules reuse: the
server-data check and SGD on the server set (FLTrust's root-data update),
and the numerics that keep every rule finite under NaN / Inf / 1e30 clients
(finite-client masks, overflow-safe norms, masked median and mean). See
server_aided.py for the global-model state contract.

References:
  W. Huang, M. Ye, Z. Shi, B. Du, D. Tao. "Fisher Calibration for
  Backdoor-Robust Heterogeneous Federated Learning" (SDFC, seed paper),
  Sec. 4.1: baseline "Finetuning: directly optimizes the aggregated global
  model on validation".
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.aggregators.base import Aggregator
from fedrobust.aggregators.mean import setting
from fedrobust.local import (LocalConfig, classification_loss,
                                    make_batch_plan, sgd, train_steps)
from fedrobust.tree import ravel_clients, tree_add, unravel_like
from fedrobust.types import BatchPlan, LocalData

Params = Any
# Model.apply: (params, x float[N, ...], *, train=False, key=None) -> logits
ApplyFn = Callable[..., jax.Array]


# --------------------------------------------------------------------------
# Numerics shared by the server-aided rules.
# --------------------------------------------------------------------------


def finite_clients(flat: jax.Array, mask: jax.Array) -> jax.Array:
  """bool[C]: real slots whose update is entirely finite (no NaN / Inf)."""
  return mask & jnp.all(jnp.isfinite(flat), axis=1)


def select_rows(flat: jax.Array, keep: jax.Array) -> jax.Array:
  """Rows of float[C, D] where keep[c]; zeros elsewhere (NaN never leaks)."""
  return jnp.where(keep[:, None], flat, 0.0)


def safe_norm(x: jax.Array, axis: int = -1) -> jax.Array:
  """L2 norm along `axis` that does not overflow for entries up to ~1e38.

  ||x|| = m * ||x / m|| with m = max |x| / 8; 0 for an all-zero vector,
  inf when the norm itself exceeds the float32 range. The 1/8 keeps 1 / m
  a normal number: XLA divides by multiplying with the reciprocal, and
  1 / max|x| is subnormal (flushed to 0 on CPU) once max|x| > 8.5e37,
  which made the norm of a 1e38 row 0. Scaling by a power of two is
  exact, so the result is bit-identical to m = max |x| elsewhere.
  """
  scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) * 0.125
  ratio = x / jnp.where(scale > 0, scale, 1.0)
  return (jnp.squeeze(scale, axis) *
          jnp.sqrt(jnp.sum(jnp.square(ratio), axis=axis)))


def clip_factors(norms: jax.Array, tau: jax.Array) -> jax.Array:
  """float32[C]: min(1, tau / norm) per row norm (`safe_norm` of the rows:
  1 for a zero row, 0 for a row whose norm overflows to inf)."""
  return jnp.where(norms > tau, tau / jnp.where(norms > 0, norms, 1.0), 1.0)


def unit_rows(flat: jax.Array) -> jax.Array:
  """Each row of float[C, D] scaled to unit L2 norm (zero rows stay 0)."""
  norm = safe_norm(flat, axis=1)[:, None]
  ok = (norm > 0) & jnp.isfinite(norm)
  return jnp.where(ok, flat / jnp.where(ok, norm, 1.0), 0.0)


def client_models(params: Params, updates: Params,
                  valid: jax.Array) -> Params:
  """Stacked models w + u_c (just w for the slots where valid is False,
  so a NaN in an excluded update never reaches a model)."""
  return jax.tree.map(
      lambda p, u: p[None] + jnp.where(
          valid.reshape((-1,) + (1,) * (u.ndim - 1)), u, 0).astype(p.dtype),
      params, updates)


def masked_median(x: jax.Array, keep: jax.Array) -> jax.Array:
  """Median over axis 0 of x[C, ...] among rows where keep[c]; 0 if none.

  Excluded rows are sorted last (+inf); the two middle order statistics of
  the n kept rows are averaged (a/2 + b/2, which cannot overflow).
  """
  shape = (-1,) + (1,) * (x.ndim - 1)
  n = jnp.sum(keep.astype(jnp.int32))
  s = jnp.sort(jnp.where(keep.reshape(shape), x, jnp.inf), axis=0)
  lo = jax.lax.dynamic_index_in_dim(s, jnp.maximum((n - 1) // 2, 0), 0,
                                    keepdims=False)
  hi = jax.lax.dynamic_index_in_dim(s, jnp.maximum(n // 2, 0), 0,
                                    keepdims=False)
  return jnp.where(n > 0, 0.5 * lo + 0.5 * hi, 0.0)


def masked_mean_rows(flat: jax.Array, keep: jax.Array) -> jax.Array:
  """(1/n) sum_{c: keep} flat[c] over float[C, D]; zeros if n == 0.

  Summed as sum_c (flat[c] / n), which cannot overflow for finite rows.
  """
  n = jnp.maximum(jnp.sum(keep.astype(jnp.float32)), 1.0)
  return jnp.sum(select_rows(flat, keep) / n, axis=0)


def ravel_one(tree: Params) -> jax.Array:
  """ONE client's tree -> float32[D] (same order as tree.ravel_clients)."""
  return ravel_clients(jax.tree.map(lambda leaf: leaf[None], tree))[0].astype(
      jnp.float32)


def first_client(updates: Params) -> Params:
  """Slot 0 of a stacked tree: ONE client's shapes, for unravel_like."""
  return jax.tree.map(lambda leaf: leaf[0], updates)


def all_finite(tree: Params) -> jax.Array:
  """bool[]: every leaf of `tree` is finite."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf))
                            for leaf in jax.tree.leaves(tree)]))


# --------------------------------------------------------------------------
# Server data: training and evaluation on the clean set U.
# --------------------------------------------------------------------------


def check_server_data(server_data: Any, rule: str) -> tuple[jax.Array,
                                                            jax.Array]:
  """Validates server_data = (x uint8[V, H, W, Ch], y int32[V]), V >= 1."""
  if server_data is None:
    raise setting(rule, 'server_data', 'needs server_data=(x uint8[V, H, '
                  'W, Ch], y int32[V]) and apply_fn')
  x, y = server_data
  x, y = jnp.asarray(x), jnp.asarray(y, jnp.int32)
  if x.ndim < 2 or y.ndim != 1 or x.shape[0] != y.shape[0] or not y.shape[0]:
    raise setting(rule, 'server_data', f'must be (x[V, ...], y[V]) with '
                  f'V >= 1, got shapes {x.shape} and {y.shape}')
  return x, y


def make_server_sgd(server_data: Any, apply_fn: ApplyFn, *, rule: str,
                    learning_rate: float, steps: int, batch_size: int,
                    momentum: float = 0.0
                    ) -> Callable[[Params, jax.Array], Params]:
  """train(params, key) -> params after `steps` SGD steps on U.

  Batches are drawn as in client training (fedrobust.local.make_batch_plan):
  fresh permutations of U, B = min(batch_size, V), the last partial batch
  masked; the loss is fedrobust.local.classification_loss(apply_fn). The
  schedule is cut to exactly `steps` steps.

  Args:
    server_data: (x uint8[V, H, W, Ch], y int32[V]).
    apply_fn: (params, x float[N, H, W, Ch]) -> logits float[N, classes].
    rule: name used in error messages.
    learning_rate: SGD step size.
    steps: S >= 1.
    batch_size: B >= 1.
    momentum: heavy-ball momentum (0: plain SGD).

  Returns:
    A pure, jittable function.
  """
  x, y = check_server_data(server_data, rule)
  if steps < 1:
    raise setting(rule, 'server_steps', f'must be >= 1, got {steps}')
  if batch_size < 1:
    raise setting(rule, 'server_batch_size', f'must be >= 1, got '
                  f'{batch_size}')
  if learning_rate <= 0:
    raise setting(rule, 'server_lr', f'must be > 0, got {learning_rate}')
  v = int(x.shape[0])
  b = min(batch_size, v)
  per_epoch = -(-v // b)
  plan_config = LocalConfig(batch_size=b, num_epochs=-(-steps // per_epoch),
                            steps_per_epoch=per_epoch)
  run_config = LocalConfig(batch_size=b, num_epochs=1, steps_per_epoch=steps)
  data = LocalData(x=x[None], y=y[None], client_id=jnp.int32(0),
                   count=jnp.int32(v))
  loss_fn = classification_loss(apply_fn)
  optimizer = sgd(learning_rate=learning_rate, momentum=momentum)

  def train(params: Params, key: jax.Array) -> Params:
    plan_key, step_key = jax.random.split(key)
    plan = make_batch_plan(plan_key, data.count, config=plan_config)
    plan = BatchPlan(*(a[:steps] for a in plan))
    new_params, _ = train_steps(loss_fn, params, data, plan, step_key,
                                optimizer=optimizer, config=run_config)
    return new_params

  return train


# --------------------------------------------------------------------------
# The fine-tuning baseline.
# --------------------------------------------------------------------------


class FinetuneState(NamedTuple):
  params: Params   # the current global model w_t (one client's shapes)


def finetune(*, num_byzantine: int, server_data: Any, apply_fn: ApplyFn,
             server_lr: float = 0.01, server_steps: int = 10,
             server_batch_size: int = 32,
             server_momentum: float = 0.0) -> Aggregator:
  """Mean aggregation followed by S SGD steps on the server's clean set.

  Clients with a non-finite update get weight 0. If fine-tuning produces a
  non-finite model (e.g. a 1e30 client blew up the mean of a deep model)
  the plain mean update is returned instead.

  Cannot guarantee: robustness of the mean itself. A finite but huge
  update (1e30) moves the mean arbitrarily far; fine-tuning on a small U
  does not undo it. The defence only helps against backdoors whose effect
  a few clean steps can erase.

  Args:
    num_byzantine: unused (the baseline has no f).
    server_data: (x uint8[V, H, W, Ch], y int32[V]), the clean set U.
    apply_fn: the model's apply function.
    server_lr: SGD step size on U.
    server_steps: S, mini-batch steps on U (default 10, about three
      epochs of a 100-example set at B = 32).
    server_batch_size: B.
    server_momentum: SGD momentum of the server's training (0: plain SGD).

  Returns:
    Aggregator whose state is FinetuneState (params tracked as in
    server_aided.py).
  """
  del num_byzantine
  train = make_server_sgd(server_data, apply_fn, rule='finetune',
                          learning_rate=server_lr, steps=server_steps,
                          batch_size=server_batch_size,
                          momentum=server_momentum)

  def init(params):
    return FinetuneState(params=params)

  def aggregate(updates, mask, state, key):
    params = state.params
    flat = ravel_clients(updates).astype(jnp.float32)
    valid = finite_clients(flat, mask)
    mean = unravel_like(masked_mean_rows(flat, valid), params)
    tuned = train(tree_add(params, mean), key)
    tuned_update = jax.tree.map(jnp.subtract, tuned, params)
    ok = all_finite(tuned_update)
    update = jax.tree.map(lambda a, b: jnp.where(ok, a, b), tuned_update,
                          mean)
    n = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
    weights = jnp.where(valid, 1.0 / n, 0.0).astype(jnp.float32)
    return update, FinetuneState(tree_add(params, update)), {
        'weights': weights}

  return Aggregator(init, aggregate)
