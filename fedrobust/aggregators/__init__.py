"""Aggregator registry. Each entry builds an Aggregator from keyword settings.

  agg = AGGREGATORS[name](num_byzantine=f, **hparams)
  state = agg.init(params)
  update, state, info = call_aggregator(agg, updates, mask, state, key,
                                        weights=..., coverage=..., ...)

See base.py for the interface; every module docstring states the rule's
math, its info keys and the guarantees it cannot give.
"""

from __future__ import annotations

from typing import Callable

from fedrobust.aggregators import auror as auror_lib
from fedrobust.aggregators import clustered
from fedrobust.aggregators import coordinatewise
from fedrobust.aggregators import crab as crab_lib
from fedrobust.aggregators import dnc as dnc_lib
from fedrobust.aggregators import federaser as federaser_lib
from fedrobust.aggregators import fldetector_async as fldetector_async_lib
from fedrobust.aggregators import horus as horus_lib
from fedrobust.aggregators import krum as krum_lib
from fedrobust.aggregators import mean as mean_lib
from fedrobust.aggregators import needs as needs_lib
from fedrobust.aggregators import robust_mean
from fedrobust.aggregators import server_aided
from fedrobust.aggregators import subset as subset_lib
from fedrobust.aggregators.base import (EXTRAS, Aggregator, call_aggregator,
                                       check_provided, stateless_init)
from fedrobust.aggregators.needs import Needs, RuleEntry, RunFacts
from fedrobust.aggregators.pre import (PRE_AGGREGATORS, PreAggregator,
                                       compose, get_pre_aggregator)
from fedrobust.errors import SettingError, check_registration

_N = needs_lib.Needs
_WHOLE = dict(whole_model=True, tracks_model=True)
_BY_ID = dict(tracks_model=True, per_client='id')

# name -> RuleEntry(factory, Needs): each rule with what it requires of the
# run and the run facts its factory takes (fedrobust/aggregators/needs.py).
RULES: dict[str, RuleEntry] = {
    'weighted_mean': RuleEntry(mean_lib.weighted_mean),
    'fdagg': RuleEntry(mean_lib.fdagg),
    'mean': RuleEntry(mean_lib.mean),
    'twafl': RuleEntry(mean_lib.twafl),
    'sasgd': RuleEntry(mean_lib.sasgd),
    'median': RuleEntry(coordinatewise.median),
    'trimmed_mean': RuleEntry(coordinatewise.trimmed_mean),
    'krum': RuleEntry(krum_lib.krum),
    'multi_krum': RuleEntry(krum_lib.multi_krum),
    'bulyan': RuleEntry(krum_lib.bulyan),
    'geometric_median': RuleEntry(robust_mean.geometric_median),
    'rfa': RuleEntry(robust_mean.geometric_median),
    'centered_clipping': RuleEntry(robust_mean.centered_clipping),
    'norm_bounding': RuleEntry(robust_mean.norm_bounding),
    'dnc': RuleEntry(dnc_lib.dnc),
    'horus': RuleEntry(horus_lib.horus),
    'federaser': RuleEntry(federaser_lib.federaser, _N(
        **_BY_ID, provides=('forget',))),
    'crab': RuleEntry(crab_lib.crab, _N(**_BY_ID, provides=('forget',))),
    'fldetector_async': RuleEntry(fldetector_async_lib.fldetector_async,
                                  _N(**_BY_ID)),
    'meamed': RuleEntry(clustered.meamed),
    'simple_clustering': RuleEntry(clustered.simple_clustering),
    'clipped_clustering': RuleEntry(clustered.clipped_clustering),
    'signguard': RuleEntry(clustered.signguard),
    'flame': RuleEntry(clustered.flame),
    'auror': RuleEntry(auror_lib.auror, _N(
        provides=('output_path',), derive=needs_lib.gradient_scale)),
    'mda': RuleEntry(subset_lib.mda),
    'smea': RuleEntry(subset_lib.smea),
    'monna': RuleEntry(subset_lib.monna),
    'caf': RuleEntry(subset_lib.caf),
    # Rules that read the server's clean data, the model or its head.
    'fltrust': RuleEntry(server_aided.fltrust, _N(
        **_WHOLE, provides=('server_data', 'apply_fn'),
        derive=needs_lib.server_training)),
    'foolsgold': RuleEntry(server_aided.foolsgold, _N(
        full_participation=True, per_client='slot',
        provides=('output_path',))),
    'foolsgold_ids': RuleEntry(server_aided.SERVER_AIDED['foolsgold_ids'],
                               _N(per_client='id', provides=('output_path',))),
    'rlr': RuleEntry(server_aided.rlr),
    'crfl': RuleEntry(server_aided.crfl, _N(**_WHOLE)),
    'fldetector': RuleEntry(server_aided.fldetector, _N(
        tracks_model=True, full_participation=True, per_client='id')),
    'lasa': RuleEntry(server_aided.lasa),
    'sageflow': RuleEntry(server_aided.sageflow, _N(
        **_WHOLE, provides=('server_data', 'apply_fn'))),
    'finetune': RuleEntry(server_aided.finetune, _N(
        **_WHOLE, provides=('server_data', 'apply_fn'),
        derive=needs_lib.server_training)),
    'deepsight': RuleEntry(server_aided.INSPECTION['deepsight'], _N(
        whole_model=True, provides=('apply_fn', 'input_shape',
                                    'output_path'))),
    'flare': RuleEntry(server_aided.INSPECTION['flare'], _N(
        whole_model=True,
        provides=('server_data', 'apply_fn', 'output_path'))),
}

# Minimum clients per round, per rule: (inequality, f -> min n).
for _module in (mean_lib, coordinatewise, krum_lib, robust_mean, dnc_lib,
                clustered, subset_lib):
  for _name, _requirement in _module.REQUIREMENTS.items():
    RULES[_name] = RULES[_name]._replace(
        needs=RULES[_name].needs._replace(min_clients=_requirement))

# name -> factory: the factories of RULES (kept in step by register_rule).
AGGREGATORS: dict[str, Callable[..., Aggregator]] = {
    name: entry.factory for name, entry in RULES.items()}
SERVER_AIDED: dict[str, Callable[..., Aggregator]] = dict(
    server_aided.SERVER_AIDED)


def register_rule(name: str, factory: Callable[..., Aggregator], *,
                  needs: Needs = Needs(), replace: bool = False) -> None:
  """Adds a rule to the registry, so that runs and sweeps take it by name.

  Args:
    name: the registry key (the `aggregator` setting's value).
    factory: keyword-only factory returning an Aggregator; it takes
      `num_byzantine` and whatever `needs.provides` lists.
    needs: what the rule requires of the run (fedrobust.aggregators.needs).
    replace: allow replacing an existing entry of that name.

  Raises:
    ValueError: the name is taken (and not `replace`), or not a plain name.
  """
  check_registration('rule', name, RULES, replace=replace,
                     provides=needs.provides, provided=needs_lib.PROVIDED)
  RULES[name] = RuleEntry(factory, needs)
  AGGREGATORS[name] = factory


def needs_of(name: str) -> Needs:
  """The declared needs of rule `name`."""
  _check_known(name)
  return RULES[name].needs


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
  mean_lib.require_clients(name, n, f, RULES[name].needs.min_clients)


__all__ = ['AGGREGATORS', 'Aggregator', 'EXTRAS', 'Needs', 'PRE_AGGREGATORS',
           'PreAggregator', 'RULES', 'RuleEntry', 'RunFacts', 'SERVER_AIDED',
           'call_aggregator', 'check_num_clients', 'check_provided',
           'compose', 'get_aggregator', 'get_pre_aggregator', 'needs_of',
           'register_rule', 'stateless_init']

