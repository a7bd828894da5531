"""Local training of ONE client as pure functions (batched by the caller).

Methods build their client_update from these; the engine (engine/) batches,
shards and sequences clients and never appears in a method.

A client's schedule has a static number of steps S = epochs * ceil(N / B),
where N is the largest client's size. A client with fewer examples gets
masked steps (params and optimizer state pass through unchanged) and a
masked tail in its last partial batch (those examples do not count in the
loss). Under `lax.map` a masked step is skipped by `lax.cond`; under `vmap`
the same code becomes a select, so the result is identical either way.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedrobust.tree import tree_sq_norm, tree_sub
from fedrobust.types import BatchPlan, LocalData

Params = Any
# loss_fn(params, x float[B, ...], y int32[B], example_mask bool[B], key)
#   -> (scalar loss, aux dict of float32[] metrics)
LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


class LocalConfig(NamedTuple):
  """Static hyperparameters of local training.

  `poison` is the run's data poison (attacks.data_poisoning.DataPoison, or
  None): local training applies it to the batches of malicious clients
  (`data.is_malicious`), so every method's clients are poisoned the same
  way without the method knowing of it.
  """
  batch_size: int
  num_epochs: int
  steps_per_epoch: int   # ceil(N / B) for the padded client size N
  unroll: int = 1        # lax.scan unroll factor over local steps
  poison: Any = None

  @property
  def num_steps(self) -> int:
    return self.num_epochs * self.steps_per_epoch


def sgd(*, learning_rate: float, momentum: float = 0.0,
        weight_decay: float = 0.0) -> optax.GradientTransformation:
  """PyTorch-style SGD: g + wd * w, then (heavy-ball) momentum, then -lr."""
  return optax.chain(
      optax.add_decayed_weights(weight_decay) if weight_decay else
      optax.identity(),
      optax.sgd(learning_rate, momentum=momentum or None))


def adamw(*, learning_rate: float, weight_decay: float = 0.01,
          warmup_steps: int = 0) -> optax.GradientTransformation:
  """AdamW (decoupled weight decay) with a linear warm-up from 0 to
  `learning_rate` over the first `warmup_steps` steps, then constant.

  The optimizer state starts afresh every round (the engine initialises it
  per local run), so the warm-up covers the first steps of each round's
  local training (RFD-LoRA, App. G: 10% of the local steps).
  """
  lr = (optax.linear_schedule(0.0, learning_rate, warmup_steps)
        if warmup_steps > 0 else learning_rate)
  return optax.adamw(lr, weight_decay=weight_decay)


LOCAL_OPTIMIZERS = ('sgd', 'adamw')


def make_batch_plan(key: jax.Array, count: jax.Array, *,
                    config: LocalConfig) -> BatchPlan:
  """Shuffled mini-batches over the first `count` rows, per epoch.

  Each epoch is a fresh permutation of the client's real examples; padding
  rows (>= count) are ordered last and never reach a real batch slot.

  Args:
    key: PRNG key.
    count: int32[], real examples of this client.
    config: static batch size, epochs and steps per epoch.

  Returns:
    BatchPlan with index [S, B], example_mask [S, B], step_mask [S].
  """
  b, p, e = config.batch_size, config.steps_per_epoch, config.num_epochs
  n = b * p
  position = jnp.arange(n)
  valid = position < count

  def one_epoch(k):
    noise = jax.random.uniform(k, (n,))
    return jnp.argsort(jnp.where(valid, noise, 2.0)).astype(jnp.int32)

  perms = jax.vmap(one_epoch)(jax.random.split(key, e))     # [E, n]
  index = perms.reshape(e * p, b)
  example_mask = jnp.broadcast_to(valid.reshape(p, b), (e, p, b)).reshape(
      e * p, b)
  return BatchPlan(index, example_mask, example_mask[:, 0])


def gather_batch(data: LocalData, rows: jax.Array) -> tuple[jax.Array,
                                                            jax.Array]:
  """Rows of one client's data: uint8[B, H, W, Ch], int32[B]."""
  rows = jnp.minimum(rows, data.x.shape[1] - 1)
  return data.x[data.row, rows], data.y[data.row, rows]


def masked_cross_entropy(logits: jax.Array, labels: jax.Array,
                         mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Mean CE and accuracy over the unmasked examples (0 if none)."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  m = mask.astype(jnp.float32)
  denom = jnp.maximum(jnp.sum(m), 1.0)
  return jnp.sum(ce * m) / denom, jnp.sum(correct * m) / denom


def classification_loss(apply_fn: Callable) -> LossFn:
  """Masked cross-entropy of `apply_fn` on uint8 image batches.

  apply_fn(params, x_uint8, *, train, key) is Model.apply's signature: the
  model's input pipeline preprocesses the stored images, and train=True and
  the step's key reach train-time behaviour (random crops, dropout).
  """
  def loss_fn(params, x, y, example_mask, key):
    logits = apply_fn(params, x, train=True, key=key)
    loss, acc = masked_cross_entropy(logits, y, example_mask)
    return loss, {'train_loss': loss, 'train_accuracy': acc}
  return loss_fn


def poisoned_batch(data: LocalData, rows: jax.Array,
                   poison: Any | None) -> tuple[jax.Array, jax.Array]:
  """gather_batch, then the data poison if this client is malicious."""
  x, y = gather_batch(data, rows)
  if poison is None:
    return x, y
  px, py = poison.apply(x, y, rows, data.count, data.attacker_rank)
  return (jnp.where(data.is_malicious, px, x),
          jnp.where(data.is_malicious, py, y))


def train_steps(loss_fn: LossFn, params: Params, data: LocalData,
                plan: BatchPlan, key: jax.Array, *,
                optimizer: optax.GradientTransformation,
                config: LocalConfig
                ) -> tuple[Params, dict[str, jax.Array]]:
  """Runs the plan's S steps of `optimizer` on ONE client.

  Args:
    loss_fn: see LossFn; it may close over anchors (FedProx, FDReg).
    params: starting params (the global model, usually).
    data: the client's LocalData.
    plan: from make_batch_plan.
    key: PRNG key passed to loss_fn, split per step.
    optimizer: a fresh optimizer state is created from `params`.
    config: static settings (unroll; the data poison applied to the
      batches when data.is_malicious).

  Returns:
    (final params, metrics averaged over the real steps).
  """
  poison = config.poison
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  opt_state = optimizer.init(params)
  step_keys = jax.random.split(key, config.num_steps)
  _, aux_shape = jax.eval_shape(
      loss_fn, params, *gather_batch(data, plan.index[0]),
      plan.example_mask[0], step_keys[0])
  zero_aux = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape)
  mask = None
  if poison is not None and getattr(poison, 'grad_mask', None) is not None:
    # The attacker's projection (Neurotoxin): from its clean gradient at
    # the start model on its first batch; benign clients keep every
    # coordinate.
    (_, _), clean = grad_fn(params, *gather_batch(data, plan.index[0]),
                            plan.example_mask[0], step_keys[0])
    mask = jax.tree.map(lambda m: jnp.where(data.is_malicious, m, 1.0),
                        poison.grad_mask(clean))

  alternating = getattr(poison, 'alternating', None)
  start = params

  def step(carry, inputs):
    p, o, sums = carry
    rows, ex_mask, live, k = inputs

    def run(p, o):
      x, y = poisoned_batch(data, rows, poison)
      (_, aux), grads = grad_fn(p, x, y, ex_mask, k)
      if mask is not None:
        grads = jax.tree.map(lambda g, m: g * m.astype(g.dtype), grads, mask)
      if alternating is not None and alternating.rho > 0:
        grads = _add_stealth(grads, p, start, alternating.rho,
                             data.is_malicious)
      updates, o2 = optimizer.update(grads, o, p)
      return optax.apply_updates(p, updates), o2, aux

    def skip(p, o):
      return p, o, zero_aux

    p2, o2, aux = jax.lax.cond(live, run, skip, p, o)
    sums = jax.tree.map(jnp.add, sums, aux)
    return (p2, o2, sums), None

  (params, _, sums), _ = jax.lax.scan(
      step, (params, opt_state, zero_aux),
      (plan.index, plan.example_mask, plan.step_mask, step_keys),
      unroll=config.unroll)
  if alternating is not None:
    params = _malicious_phase(grad_fn, params, data, plan, step_keys,
                              optimizer, alternating)
  live_steps = jnp.maximum(jnp.sum(plan.step_mask), 1).astype(jnp.float32)
  return params, jax.tree.map(lambda s: s / live_steps, sums)


def _add_stealth(grads: Params, p: Params, start: Params, rho: float,
                 is_malicious: jax.Array) -> Params:
  """grads + rho * d||p - start||_2 / dp for an attacker (alternating
  minimization's stealth objective); 0 at p = start; benign: unchanged."""
  diff = tree_sub(p, start)
  norm = jnp.sqrt(tree_sq_norm(jax.tree.map(
      lambda d: d.astype(jnp.float32), diff)))
  coef = jnp.where(is_malicious & (norm > 0),
                   rho / jnp.where(norm > 0, norm, 1.0), 0.0)
  return jax.tree.map(lambda g, d: g + (coef * d).astype(g.dtype), grads,
                      diff)


def _malicious_phase(grad_fn, params: Params, data: LocalData,
                     plan: BatchPlan, step_keys: jax.Array,
                     optimizer: optax.GradientTransformation,
                     alternating: Any) -> Params:
  """Alternating minimization's boosted malicious steps (an attacker only).

  `alternating.steps` steps of `optimizer` (fresh state) on the plan's
  real batches in order (cycling), poisoned by `alternating.apply`; the weight change
  is multiplied by `alternating.boost`. A benign client's params come back
  bit-identical.
  """
  live = jnp.sum(plan.step_mask)
  real = jnp.argsort(~plan.step_mask, stable=True)   # real steps first

  def step(carry, j):
    p, o = carry
    s = real[j % jnp.maximum(live, 1)]
    rows, ex_mask = plan.index[s], plan.example_mask[s]
    x, y = gather_batch(data, rows)
    x, y = alternating.apply(x, y, rows, data.count, data.attacker_rank)
    _, grads = grad_fn(p, x, y, ex_mask, step_keys[s])
    updates, o2 = optimizer.update(grads, o, p)
    return (optax.apply_updates(p, updates), o2), None

  (post, _), _ = jax.lax.scan(step, (params, optimizer.init(params)),
                              jnp.arange(alternating.steps))
  boosted = jax.tree.map(lambda a, b: a + alternating.boost * (b - a),
                         params, post)
  use = data.is_malicious & (live > 0)
  return jax.tree.map(lambda b, a: jnp.where(use, b, a), boosted, params)



def local_sgd(loss_fn: LossFn, params: Params, data: LocalData,
              key: jax.Array, *, optimizer: optax.GradientTransformation,
              config: LocalConfig
              ) -> tuple[Params, dict[str, jax.Array]]:
  """A client's local training: a fresh batch plan, then train_steps.

  The key is split into the plan's and the steps' keys (as every method
  has always done, so results are unchanged).
  """
  plan_key, train_key = jax.random.split(key)
  plan = make_batch_plan(plan_key, data.count, config=config)
  return train_steps(loss_fn, params, data, plan, train_key,
                     optimizer=optimizer, config=config)
