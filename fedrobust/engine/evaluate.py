"""Evaluation of a model on padded, masked example sets."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax


Params = Any


def pad_to_batches(x: np.ndarray, y: np.ndarray, batch_size: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Host-side: [M, ...] -> [T, B, ...] plus mask [T, B]."""
  m = len(y)
  t = max(1, -(-m // batch_size))
  pad = t * batch_size - m
  xs = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)])
  ys = np.concatenate([y, np.zeros(pad, y.dtype)])
  mask = np.arange(t * batch_size) < m
  return (xs.reshape(t, batch_size, *x.shape[1:]),
          ys.reshape(t, batch_size), mask.reshape(t, batch_size))


def evaluate(apply_fn: Callable, params: Params, x: jax.Array, y: jax.Array,
             mask: jax.Array) -> dict[str, jax.Array]:
  """Accuracy and mean CE over the unmasked examples.

  Args:
    apply_fn: model apply.
    params: one model.
    x: uint8[T, B, H, W, Ch] batches.
    y: int32[T, B].
    mask: bool[T, B].

  Returns:
    {'accuracy', 'loss', 'count'} float32 scalars.
  """
  def batch_stats(batch):
    xb, yb, mb = batch
    logits = apply_fn(params, xb)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
    correct = jnp.argmax(logits, -1) == yb
    return (jnp.sum(jnp.where(mb, correct, False)).astype(jnp.float32),
            jnp.sum(jnp.where(mb, ce, 0.0)), jnp.sum(mb).astype(jnp.float32))

  correct, loss, count = jax.lax.map(batch_stats, (x, y, mask))
  n = jnp.maximum(jnp.sum(count), 1.0)
  return {'accuracy': jnp.sum(correct) / n, 'loss': jnp.sum(loss) / n,
          'count': jnp.sum(count)}


def evaluate_clients(apply_fn: Callable, params: Params, x: jax.Array,
                     y: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
  """Per-client evaluation of one model on each client's local test split.

  Args:
    x: uint8[K, T, B, H, W, Ch]; y: int32[K, T, B]; mask: bool[K, T, B].

  Returns:
    {'accuracy': float[K], 'loss': float[K], 'count': float[K]}.
  """
  return jax.lax.map(lambda a: evaluate(apply_fn, params, *a), (x, y, mask))
