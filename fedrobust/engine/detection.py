"""Detection metrics: how a round's aggregation weights treat the attackers.

Aggregators report info['weights'] per cohort. On the device, a round turns
them into confusion counts of 'excluded' (zero weight) against 'malicious',
the mean weight share of malicious and benign clients, and the weight AUC
(how often a benign client outweighs a malicious one), which is meaningful
for soft-weighting rules that never exclude anyone. On the host,
`detection_rates` turns (accumulated) counts into rates.

Shapes: weights float[C], is_mal and mask bool[C] over the arrival slots.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# The confusion counts detection_counts reports, in (tp, fp, fn, tn) order.
DETECTION_KEYS = ('det_tp', 'det_fp', 'det_fn', 'det_tn')


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of values[c] over mask[c]; masked NaNs do not leak."""
  m = mask.astype(jnp.float32)
  return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(jnp.sum(m), 1.0)


def detection_counts(weights: jax.Array, is_mal: jax.Array,
                     mask: jax.Array) -> dict[str, jax.Array]:
  """Confusion counts of 'excluded' (weight 0) against 'malicious'.

  Returns:
    float32[] counts under DETECTION_KEYS: excluded attackers (tp), excluded
    benign clients (fp), kept attackers (fn) and kept benign clients (tn),
    over the slots in `mask`.
  """
  flagged = (weights <= 0) & mask
  f32 = lambda b: jnp.sum(b).astype(jnp.float32)
  return {'det_tp': f32(flagged & is_mal), 'det_fp': f32(flagged & ~is_mal &
                                                          mask),
          'det_fn': f32(~flagged & is_mal), 'det_tn': f32(~flagged & ~is_mal
                                                          & mask)}


def weight_auc(weights: jax.Array, is_mal: jax.Array,
               mask: jax.Array) -> jax.Array:
  """P(a benign client's weight > a malicious client's), ties count 1/2.

  1 is perfect down-weighting of attackers, 0.5 chance, 0 inverted; NaN
  when the round has no real benign or no real malicious client.
  """
  benign = mask & ~is_mal
  mal = mask & is_mal
  w = jnp.where(mask, weights, 0.0)
  diff = w[:, None] - w[None, :]
  pair = benign[:, None] & mal[None, :]
  score = jnp.where(diff > 0, 1.0, jnp.where(diff == 0, 0.5, 0.0))
  pairs = jnp.sum(pair).astype(jnp.float32)
  return jnp.where(pairs > 0, jnp.sum(jnp.where(pair, score, 0.0)) /
                   jnp.maximum(pairs, 1.0), jnp.nan)


def weight_metrics(weights: jax.Array, is_mal: jax.Array,
                   mask: jax.Array) -> dict[str, jax.Array]:
  """A round's detection metrics from its aggregation weights.

  Returns:
    detection_counts, plus 'weight_malicious' and 'weight_benign' (the mean
    share of the round's aggregation weight of an attacker and of a benign
    client) and 'detection_weight_auc' (weight_auc).
  """
  metrics = detection_counts(weights, is_mal, mask)
  # Mean share of the round's aggregation weight (shares sum to 1 over the
  # real clients; FedAvg's raw weights are example counts).
  total = jnp.sum(jnp.where(mask, weights, 0.0))
  share = weights / jnp.where(total > 0, total, 1.0)
  metrics['weight_malicious'] = masked_mean(share, is_mal)
  metrics['weight_benign'] = masked_mean(share, mask & ~is_mal)
  metrics['detection_weight_auc'] = weight_auc(weights, is_mal, mask)
  return metrics


def detection_rates(counts: dict[str, Any], prefix: str) -> dict[str, Any]:
  """Rates of 'excluded' against 'malicious' from confusion counts.

  Args:
    counts: host numbers under DETECTION_KEYS (one round's or summed).
    prefix: prepended to every returned name.

  Returns:
    Python floats: precision, recall, FPR, FNR and accuracy (FedHAN's
    DACC) under '<prefix>detection_<rate>'; NaN where a rate is 0/0.
  """
  tp, fp, fn, tn = (float(counts[k]) for k in DETECTION_KEYS)
  div = lambda a, b: a / b if b else float('nan')
  return {f'{prefix}detection_precision': div(tp, tp + fp),
          f'{prefix}detection_recall': div(tp, tp + fn),
          f'{prefix}detection_fpr': div(fp, fp + tn),
          f'{prefix}detection_fnr': div(fn, fn + tp),
          f'{prefix}detection_accuracy': div(tp + tn, tp + fp + fn + tn)}
