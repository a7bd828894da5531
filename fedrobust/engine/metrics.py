"""The metrics stage: what a round reports.

Every round reports the mean of each per-client training metric over the
trained slots, 'examples', 'num_attacking', 'clients_trained', the arrival
mode's metrics (arrivals and staleness with client delays), the stateful
attack's metrics, the detection metrics of the aggregation weights
(engine.detection) when the aggregator reports info['weights'], the
aggregator's scalar info and, with log_clients, the per-client rows
metrics['clients'].

Shapes: C trained slots of a cohort, P arrival rows, all cohorts
concatenated.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedrobust.engine.detection import masked_mean, weight_metrics
from fedrobust.engine.pipeline import CohortRound, Flight


def training_metrics(cohorts: list[CohortRound]) -> dict[str, jax.Array]:
  """Per-client training metrics averaged over the trained slots.

  Returns:
    Each ClientOutput metric's masked mean (over the cohorts that report
    it), then 'examples' (the trained examples, ClientOutput.weight),
    'num_attacking' and 'clients_trained'.
  """
  computed = [(c.attacked.outputs, c.attacked.slots.mask) for c in cohorts]
  metrics = {}
  names = sorted(set().union(*(o.metrics for o, _ in computed)))
  for name in names:
    values = [(o.metrics[name], m) for o, m in computed
              if name in o.metrics]
    metrics[name] = masked_mean(jnp.concatenate([v for v, _ in values]),
                                jnp.concatenate([m for _, m in values]))
  metrics['examples'] = sum(jnp.sum(jnp.where(m, o.weight, 0.0))
                            for o, m in computed)
  metrics['num_attacking'] = sum((c.attacked.attacking for c in cohorts),
                                 jnp.float32(0.0))
  return metrics


def stateful_attack_metrics(threat: Any, cohorts: list[CohortRound],
                            attack_state: Any) -> dict[str, jax.Array]:
  """'attack_decoys' and the stateful attack's own 'attack_<name>' metrics.

  Returns:
    {} without a stateful attack.
  """
  decoys = [c.attacked.decoys for c in cohorts
            if c.attacked.decoys is not None]
  if not decoys:
    return {}
  metrics = {'attack_decoys': jnp.sum(decoys[-1]).astype(jnp.float32)}
  metrics.update({f'attack_{name}': value for name, value in
                  threat.stateful_attack.metrics(attack_state).items()})
  return metrics


def client_rows(cohorts: list[CohortRound], weights: Any,
                per_client_info: dict[str, jax.Array]
                ) -> dict[str, jax.Array]:
  """metrics['clients']: per arrival row of every cohort, concatenated.

  Returns:
    'id', 'mask' (arrived), 'malicious', the aggregation 'weight' (when
    reported), every per-client metric all cohorts' arrivals hold, and the
    aggregator's info['per_client'] values of shape [P].
  """
  arrivals = [c.arrived.arrivals for c in cohorts]
  cat = lambda values: jnp.concatenate(list(values))
  per = {'id': cat(a.ids for a in arrivals),
         'mask': cat(a.mask for a in arrivals),
         'malicious': cat(c.arrived.malicious for c in cohorts)}
  if weights is not None:
    per['weight'] = cat(weights)
  shared = set.intersection(*(set(a.outputs.metrics) for a in arrivals))
  for name in sorted(shared):
    per[name] = cat(a.outputs.metrics[name] for a in arrivals)
  for name, values in per_client_info.items():
    if values.shape == per['id'].shape:
      per[name] = values
  return per


def round_metrics(mode: Any, threat: Any, cohorts: list[CohortRound],
                  flight: Flight, info: dict[str, Any], attack_state: Any,
                  log_clients: bool) -> dict[str, Any]:
  """The metrics stage: a round's metrics from its cohorts' records.

  Args:
    mode: the arrival mode (its metrics).
    threat: the step's threat, or None.
    cohorts: every cohort's records of the round.
    flight: the round's delay bookkeeping.
    info: the server update's info; 'weights' (a float[P] per cohort) and
      'per_client' are consumed, its scalars reported.
    attack_state: the stateful attack's new state.
    log_clients: also report metrics['clients'] (client_rows).

  Returns:
    {name: float32[]}, and metrics['clients'] with log_clients.
  """
  metrics = training_metrics(cohorts)
  metrics.update(stateful_attack_metrics(threat, cohorts, attack_state))
  metrics['clients_trained'] = sum(
      jnp.sum(c.attacked.slots.mask).astype(jnp.float32) for c in cohorts)
  metrics.update(mode.metrics([c.arrived for c in cohorts], flight))
  info = dict(info)
  weights = info.pop('weights', None)
  per_client_info = info.pop('per_client', {})
  if weights is not None:
    metrics.update(weight_metrics(
        jnp.concatenate(weights),
        jnp.concatenate([c.arrived.malicious for c in cohorts]),
        jnp.concatenate([c.arrived.arrivals.mask for c in cohorts])))
  if log_clients:
    metrics['clients'] = client_rows(cohorts, weights, per_client_info)
  metrics.update({k: v for k, v in info.items() if jnp.ndim(v) == 0})
  return metrics
