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
    {'accuracy', 'loss', 'count'} float32 scalars and 'confusion'
    float32[C, C]: counts of (true class, predicted class).
  """
  def batch_stats(batch):
    xb, yb, mb = batch
    logits = apply_fn(params, xb)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
    pred = jnp.argmax(logits, -1)
    c = logits.shape[-1]
    confusion = jnp.einsum(
        'bi,bj->ij', jax.nn.one_hot(yb, c) * mb[:, None],
        jax.nn.one_hot(pred, c))
    return (jnp.sum(jnp.where(mb, pred == yb, False)).astype(jnp.float32),
            jnp.sum(jnp.where(mb, ce, 0.0)), jnp.sum(mb).astype(jnp.float32),
            confusion)

  correct, loss, count, confusion = jax.lax.map(batch_stats, (x, y, mask))
  n = jnp.maximum(jnp.sum(count), 1.0)
  return {'accuracy': jnp.sum(correct) / n, 'loss': jnp.sum(loss) / n,
          'count': jnp.sum(count), 'confusion': jnp.sum(confusion, 0)}


def backdoor_rates(clean: np.ndarray, triggered: np.ndarray, target: int, *,
                   exclude_target: bool = True) -> dict[str, np.ndarray]:
  """Backdoor metrics from confusion matrices [..., C, C] (true, predicted).

  clean: the clean test set's; triggered: the triggered test set's, scored
  against the inputs' TRUE labels. Returns float arrays [...]:
    attack_success_rate  triggered inputs predicted as the target;
    robust_accuracy      triggered inputs predicted as their true class (RA);
    clean_target_rate    clean test inputs predicted as the target: the ASR
                         a model without any backdoor already has. It is
                         estimated on the clean test set's rows (the
                         runner's evaluation sample), which are a sample of
                         the inputs the triggered set is built from (the
                         whole test split), so no extra pass is needed.
  exclude_target drops true-target rows from the clean rate, as the
  triggered set does (attacks.triggered_test_set).
  """
  clean = np.asarray(clean, np.float64)
  triggered = np.asarray(triggered, np.float64)
  rows = np.ones(clean.shape[-1], bool)
  if exclude_target:
    rows[target] = False
  n_trig = np.maximum(triggered.sum((-2, -1)), 1.0)
  n_clean = np.maximum(clean[..., rows, :].sum((-2, -1)), 1.0)
  return {
      'attack_success_rate': triggered[..., :, target].sum(-1) / n_trig,
      'robust_accuracy': np.trace(triggered, axis1=-2, axis2=-1) / n_trig,
      'clean_target_rate': clean[..., rows, target].sum(-1) / n_clean}


def evaluate_clients(apply_fn: Callable, params: Params, x: jax.Array,
                     y: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
  """Per-client evaluation of one model on each client's local test split.

  Args:
    x: uint8[K, T, B, H, W, Ch]; y: int32[K, T, B]; mask: bool[K, T, B].

  Returns:
    {'accuracy': float[K], 'loss': float[K], 'count': float[K]}.
  """
  return jax.lax.map(lambda a: evaluate(apply_fn, params, *a), (x, y, mask))
