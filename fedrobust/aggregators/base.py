"""The Aggregator interface shared by every aggregation rule.

  agg = AGGREGATORS[name](num_byzantine=f, **hparams)
  state = agg.init(params)                     # params: ONE client's tree
  update, state, info = agg.aggregate(updates, mask, state, key, **extras)
    updates: pytree, leaves [C, ...]; mask: bool[C] (False: absent slot)
    update: one client's shapes; info['weights']: float32[C], the weight
    each client got (0 for an excluded client; what detection metrics read).

Keyword extras. A rule declares in `reads` the extras it uses, and callers
pass them through `call_aggregator`, which hands a rule exactly what it
declared (a rule that reads nothing keeps the 4-argument form):
  weights   float32[C]  per-client weights from the method (example counts)
  ids       int32[C]    client ids of the slots
  coverage  tree like updates, leaves [C, ...] in {0, 1}, or None: which
            coordinates each client owns (width-sliced or lower-rank
            clients); None means every client owns every coordinate
  staleness int32[C]    rounds since the broadcast the update started from
  scores    float32[C]  method-side suspicion scores (SDFC's T_k)
  params    one client's tree: the current global values of what is being
            aggregated (Horus scores a client's values, params + update)
  losses    float32[C]  each client's mean training loss over its local
            steps (Crab's windows)
  retrain   callable (values, ids int32[S], mask bool[S], round int32[])
            -> (updates, coverage or None), stacked [S, ...]: the engine
            trains clients `ids` from `values` (a tree like `params`) as in
            round `round`: their own data, width window and, if attackers
            then, poisoning; keys folded with `round` (FedHAN's exact
            replay rounds); one cohort, replicated data
A rule that does not read `coverage` sees updates that are zero outside a
client's coverage (the aligned, zero-padded form Horus Sec. V-C uses).

Rules are pure and jittable on fixed shapes. A masked slot never changes a
result, whatever it holds (NaN, Inf, 1e30).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

from fedrobust.errors import SettingError

Updates = Any
AggState = Any
Info = dict[str, jax.Array]
EXTRAS = ('weights', 'ids', 'coverage', 'staleness', 'scores', 'params',
          'losses', 'retrain')


class Aggregator(NamedTuple):
  init: Callable[[Any], AggState]
  aggregate: Callable[..., tuple[Updates, AggState, Info]]
  reads: tuple[str, ...] = ()


def stateless_init(params: Any) -> AggState:
  del params
  return ()


def call_aggregator(agg: Aggregator, updates: Updates, mask: jax.Array,
                    state: AggState, key: jax.Array, **extras
                    ) -> tuple[Updates, AggState, Info]:
  """agg.aggregate with the extras it declared in `reads` (others dropped).

  Raises:
    SettingError: a declared extra is missing from `extras`.
  """
  missing = [name for name in agg.reads if name not in extras]
  if missing:
    raise SettingError('aggregator', f'the rule reads {missing}, which the '
                       'caller does not provide')
  return agg.aggregate(updates, mask, state, key,
                       **{name: extras[name] for name in agg.reads})


def check_provided(name: str, agg: Aggregator, provides) -> None:
  """Fails fast when a method cannot feed what rule `name` reads."""
  missing = sorted(set(agg.reads) - set(provides))
  if missing:
    raise SettingError('aggregator', f'{name!r} reads {missing}, which this '
                       f'method does not provide (it provides '
                       f'{sorted(provides)})')
