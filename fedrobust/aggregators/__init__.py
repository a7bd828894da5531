"""Aggregator registry. Each entry builds an Aggregator from keyword settings.

  agg = AGGREGATORS[name](num_byzantine=f, **hparams)
  state = agg.init(params)
  update, state, info = call_aggregator(agg, updates, mask, state, key,
                                        weights=..., coverage=..., ...)

See base.py for the interface; every module docstring states the rule's
math, its info keys and the guarantees it cannot give.
"""

from __future__ import annotations

import importlib
from typing import Callable

from fedrobust.aggregators import auror as auror_lib
from fedrobust.aggregators import clustered
from fedrobust.aggregators import coordinatewise
from fedrobust.aggregators import crab as crab_lib
from fedrobust.aggregators import dnc as dnc_lib
from fedrobust.aggregators import federaser as federaser_lib
from fedrobust.aggregators import fedhan as fedhan_lib
from fedrobust.aggregators import fldetector_async as fldetector_async_lib
from fedrobust.aggregators import horus as horus_lib
from fedrobust.aggregators import krum as krum_lib
from fedrobust.aggregators import mean as mean_lib
from fedrobust.aggregators import robust_mean
from fedrobust.aggregators import subset as subset_lib
from fedrobust.aggregators.base import (EXTRAS, Aggregator, call_aggregator,
                                       check_provided, stateless_init)
from fedrobust.aggregators.mean import Requirement
from fedrobust.aggregators.pre import (PRE_AGGREGATORS, PreAggregator,
                                       compose, get_pre_aggregator)
from fedrobust.errors import SettingError

AGGREGATORS: dict[str, Callable[..., Aggregator]] = {
    'weighted_mean': mean_lib.weighted_mean,
    'fdagg': mean_lib.fdagg,
    'mean': mean_lib.mean,
    'twafl': mean_lib.twafl,
    'sasgd': mean_lib.sasgd,
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
    'horus': horus_lib.horus,
    'fedhan': fedhan_lib.fedhan,
    'federaser': federaser_lib.federaser,
    'crab': crab_lib.crab,
    'fldetector_async': fldetector_async_lib.fldetector_async,
    'meamed': clustered.meamed,
    'simple_clustering': clustered.simple_clustering,
    'clipped_clustering': clustered.clipped_clustering,
    'signguard': clustered.signguard,
    'flame': clustered.flame,
    'auror': auror_lib.auror,
    'mda': subset_lib.mda,
    'smea': subset_lib.smea,
    'monna': subset_lib.monna,
    'caf': subset_lib.caf,
}

# Minimum clients per round, per rule: (inequality, f -> min n).
_REQUIREMENTS: dict[str, Requirement] = {
    **mean_lib.REQUIREMENTS,
    **coordinatewise.REQUIREMENTS,
    **krum_lib.REQUIREMENTS,
    **robust_mean.REQUIREMENTS,
    **dnc_lib.REQUIREMENTS,
    **clustered.REQUIREMENTS,
    **subset_lib.REQUIREMENTS,
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


def _check_known(name: str) -> None:
  if name not in AGGREGATORS:
    raise SettingError('aggregator', f'{name!r} is not a known aggregator; '
                       f'expected one of {sorted(AGGREGATORS)}')


def get_aggregator(name: str, **kwargs) -> Aggregator:
  """Builds AGGREGATORS[name].

  Raises:
    SettingError: naming `aggregator` for an unknown name, or the rule's own
      argument for a bad or unknown hyperparameter.
  """
  _check_known(name)
  try:
    return AGGREGATORS[name](**kwargs)
  except TypeError as err:   # an unknown or missing keyword
    raise SettingError('aggregator_kwargs', f'aggregator {name!r}: {err}'
                       ) from None


def check_num_clients(name: str, n: int, f: int) -> None:
  """Fails fast when n clients per round cannot support rule `name` with f.

  Krum / Multi-Krum need n >= 2f+3, Bulyan n >= 4f+3, the trimmed mean
  2f < n, DnC n > f, the other rules n >= 1. The aggregate functions repeat
  this check against the static slot count C at trace time.

  Args:
    name: the aggregator's registry name.
    n: clients per round.
    f: num_byzantine.

  Raises:
    SettingError: naming the rule, num_byzantine and the inequality.
  """
  _check_known(name)
  mean_lib.check_num_byzantine(name, f)
  requirement = _REQUIREMENTS.get(name, ('n >= 1', lambda f: 1))
  mean_lib.require_clients(name, n, f, requirement)


__all__ = ['AGGREGATORS', 'Aggregator', 'EXTRAS', 'PRE_AGGREGATORS',
           'PreAggregator', 'SERVER_AIDED', 'call_aggregator',
           'check_num_clients', 'check_provided', 'compose',
           'get_aggregator', 'get_pre_aggregator', 'stateless_init']


# Rules that read the server's clean data (factory args server_data, apply_fn).
SERVER_DATA_RULES = ('fltrust', 'sageflow', 'finetune', 'flare')
# Rules that run the clients' full models (params + update) through the
# model's apply: one cohort and the identity transform (factory args
# apply_fn, output_path; deepsight also input_shape).
MODEL_EVAL_RULES = ('deepsight', 'flare')
# Rules that read the output layer (factory arg output_path, the model's
# head).
HEAD_RULES = ('foolsgold', 'foolsgold_ids', 'auror', 'deepsight', 'flare')
# Rules that read the full global model's values (server lr 1): they need
# one cohort and the identity transform.
GLOBAL_MODEL_RULES = ('fltrust', 'crfl', 'sageflow', 'finetune')
# Rules that track the global model in their state, assuming the server
# applies params + update with server lr 1. FLDetector uses only the
# model's changes (w_t - w_{t-1}), so it runs on any group of clients.
MODEL_TRACKING_RULES = GLOBAL_MODEL_RULES + ('fldetector', 'fedhan',
                                             'federaser', 'crab',
                                             'fldetector_async')
# Rules whose per-client history assumes consecutive rounds: every client
# every round, no client delays.
FULL_PARTICIPATION_RULES = ('foolsgold', 'fldetector')
# Per-client state indexed by slot: one cohort, the same slot order, and
# num_clients=C.
SLOT_HISTORY_RULES = ('foolsgold',)
# Per-client state indexed by client id (the `ids` extra, num_clients=K):
# any group of clients, e.g. the shared layers of several cohorts.
CLIENT_ID_RULES = ('fldetector', 'fedhan', 'foolsgold_ids', 'federaser',
                   'crab', 'fldetector_async')
# Unlearning baselines: told whom to forget (factory arg `forget`, bool[K]:
# the run's attackers, i.e. they presume perfect detection).
UNLEARNING_RULES = ('federaser', 'crab')
# Rules that may be told, with unlearn_round > 0 (FedHAN's recovery in the
# told mode of the recovery experiments); they detect by themselves
# otherwise.
TOLD_RULES = ('fedhan',)
