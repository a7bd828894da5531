"""The Aggregator interface shared by every robust aggregation rule.

  agg = AGGREGATORS[name](num_byzantine=f, **hparams)
  state = agg.init(params)                     # params: ONE client's tree
  update, state, info = agg.aggregate(updates, mask, state, key)
    updates: pytree, leaves [C, ...]; mask: bool[C] (False: absent slot)
    update: one client's shapes; info['weights']: float32[C], 0 for an
    excluded client (what detection metrics read).

Rules are pure and jittable on fixed shapes. A masked slot never changes a
result, whatever it holds (NaN, Inf, 1e30).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

Updates = Any
AggState = Any
Info = dict[str, jax.Array]


class Aggregator(NamedTuple):
  init: Callable[[Any], AggState]
  aggregate: Callable[[Updates, jax.Array, AggState, jax.Array],
                      tuple[Updates, AggState, Info]]


def stateless_init(params: Any) -> AggState:
  del params
  return ()
