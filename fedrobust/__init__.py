"""fedrobust: robust federated learning under heterogeneity, in JAX.

The public API:

  import fedrobust

  fed = fedrobust.Federation(aggregator='median', attack='lie',
                             malicious_fraction=0.2, num_rounds=3)
  state, history = fed.run()

- `Federation`: a federation built from settings (`config.defaults()` lists
  every setting); `init`, `step`, `evaluate`, `run`.
- `Replicas`: `num_seeds` seeds of a federation as one compiled program;
  its rows carry each seed's values, their mean and std.
- `register_rule`, `register_attack`, `register_method`: add your own
  component, so that a Federation, the runner and sweeps take it by name.
- `Needs`, `AttackNeeds`: what a rule or attack declares it needs from the
  run; `MethodSpec`: a method's registry entry.
- `fedrobust.testing.check_rule`: the conformance checks for a rule.
- `SettingError`: every bad setting raises it, naming the setting.
"""

from fedrobust import config
from fedrobust.aggregators import (AGGREGATORS, Aggregator, Needs,
                                   register_rule)
from fedrobust.attacks import ATTACKS, AttackNeeds, register_attack
from fedrobust.errors import SettingError
from fedrobust.federation import Federation, Replicas
from fedrobust.methods import METHODS, MethodSpec, register_method

__all__ = ['AGGREGATORS', 'ATTACKS', 'Aggregator', 'AttackNeeds',
           'Federation', 'METHODS', 'MethodSpec', 'Needs', 'Replicas',
           'SettingError',
           'config', 'register_attack', 'register_method', 'register_rule']
