"""Aggregator registry. Each entry builds an Aggregator from keyword settings.

  agg = AGGREGATORS[name](num_byzantine=f, **hparams)
  state = agg.init(params)
  update, state, info = agg.aggregate(updates, mask, state, key)

See base.py for the interface; every module docstring states the rule's
math, its info keys and the guarantees it cannot give.
"""

from __future__ import annotations

import importlib
from typing import Callable

from fedrobust.aggregators import coordinatewise
from fedrobust.aggregators import dnc as dnc_lib
from fedrobust.aggregators import krum as krum_lib
from fedrobust.aggregators import mean as mean_lib
from fedrobust.aggregators import robust_mean
from fedrobust.aggregators.base import Aggregator, stateless_init
from fedrobust.aggregators.mean import Requirement

AGGREGATORS: dict[str, Callable[..., Aggregator]] = {
    'mean': mean_lib.mean,
    'median': coordinatewise.median,
    'trimmed_mean': coordinatewise.trimmed_mean,
    'krum': krum_lib.krum,
    'multi_krum': krum_lib.multi_krum,
    'bulyan': krum_lib.bulyan,
    'geometric_median': robust_mean.geometric_median,
    'rfa': robust_mean.geometric_median,
    'centered_clipping': robust_mean.centered_clipping,
    'norm_bounding': robust_mean.norm_bounding,
    'dnc': dnc_lib.dnc,
}

# Minimum clients per round, per rule: (inequality, f -> min n).
_REQUIREMENTS: dict[str, Requirement] = {
    **mean_lib.REQUIREMENTS,
    **coordinatewise.REQUIREMENTS,
    **krum_lib.REQUIREMENTS,
    **robust_mean.REQUIREMENTS,
    **dnc_lib.REQUIREMENTS,
}

# ---- Server-aided rules (merged from another module) -----------------------
# Only a missing server_aided module is tolerated; an error inside it raises.
# It may export REQUIREMENTS in the same form; rules without one need n >= 1.
try:
  _server_aided = importlib.import_module(
      'fedrobust.aggregators.server_aided')
except ModuleNotFoundError as e:
  if e.name != 'fedrobust.aggregators.server_aided':
    raise
  _server_aided = None
SERVER_AIDED: dict[str, Callable[..., Aggregator]] = dict(
    getattr(_server_aided, 'SERVER_AIDED', {}))
AGGREGATORS.update(SERVER_AIDED)
_REQUIREMENTS.update(getattr(_server_aided, 'REQUIREMENTS', {}))
# ---- end of server-aided rules ---------------------------------------------


def get_aggregator(name: str, **kwargs) -> Aggregator:
  """Builds AGGREGATORS[name]; ValueError naming --aggregator if unknown."""
  if name not in AGGREGATORS:
    raise ValueError(f'--aggregator={name!r} is not a known aggregator; '
                     f'expected one of {sorted(AGGREGATORS)}')
  return AGGREGATORS[name](**kwargs)


def check_num_clients(name: str, n: int, f: int) -> None:
  """Fails fast when n clients per round cannot support rule `name` with f.

  Krum / Multi-Krum need n >= 2f+3, Bulyan n >= 4f+3, the trimmed mean
  2f < n, DnC n > f, the other rules n >= 1. The aggregate functions repeat
  this check against the static slot count C at trace time.

  Args:
    name: the --aggregator value.
    n: clients per round.
    f: the --num_byzantine value.

  Raises:
    ValueError: naming --aggregator, --num_byzantine and the inequality.
  """
  if name not in AGGREGATORS:
    raise ValueError(f'--aggregator={name!r} is not a known aggregator; '
                     f'expected one of {sorted(AGGREGATORS)}')
  mean_lib.check_num_byzantine(name, f)
  requirement = _REQUIREMENTS.get(name, ('n >= 1', lambda f: 1))
  mean_lib.require_clients(name, n, f, requirement)


__all__ = ['AGGREGATORS', 'Aggregator', 'SERVER_AIDED', 'check_num_clients',
           'get_aggregator', 'stateless_init']


# Rules that read the server's clean data (factory args server_data, apply_fn).
SERVER_DATA_RULES = ('fltrust', 'sageflow', 'finetune')
# Rules whose history is indexed by slot: need every client every round, in
# the same order, and num_clients=C.
SLOT_HISTORY_RULES = ('foolsgold', 'fldetector')
# Rules that track the global model in their state, assuming the server
# applies params + update with server lr 1.
MODEL_TRACKING_RULES = ('fltrust', 'crfl', 'fldetector', 'sageflow',
                        'finetune')
