"""Attack registry. Each entry builds an attack from keyword settings.

  attack = get_model_attack('min_max', direction='sign')
  updates = attack.apply(updates, is_malicious, mask, key)  # float[C, D]
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

from fedrobust.errors import SettingError
from fedrobust.attacks.adaptive import (clippedclustering_adaptive,
                                        signguard_adaptive)
from fedrobust.attacks.data_poisoning import (DataPoison, Trigger,
                                              alternating_min, badnets,
                                              blended, edge_case, label_flip,
                                              neurotoxin,
                                              parse_trigger_size,
                                              trigger_token,
                                              triggered_test_set)

from fedrobust.attacks.agr_tailored import (agr_tailored, optimal_alie,
                                            optimal_ipm)
from fedrobust.attacks.fang import fang_krum, fang_trim
from fedrobust.attacks.threedfed import StatefulAttack, thrdfed
from fedrobust.attacks.model_poisoning import (ModelAttack, gaussian, inf,
                                               ipm, lie, min_max, min_sum,
                                               mimic, model_replacement,
                                               scaling, sign_flip)

MODEL_ATTACKS: dict[str, Callable[..., ModelAttack]] = {
    'sign_flip': sign_flip,
    'gaussian': gaussian,
    'scaling': scaling,
    'ipm': ipm,
    'lie': lie,
    'min_max': min_max,
    'min_sum': min_sum,
    'agr_tailored': agr_tailored,
    'fang_trim': fang_trim,
    'fang_krum': fang_krum,
    'inf': inf,
    'mimic': mimic,
    'model_replacement': model_replacement,
    'optimal_ipm': optimal_ipm,
    'optimal_alie': optimal_alie,
    'signguard_adaptive': signguard_adaptive,
    'clippedclustering_adaptive': clippedclustering_adaptive,
}

# Data-poisoning attacks act inside malicious clients' local training.
DATA_ATTACKS: dict[str, Callable[..., DataPoison]] = {
    'label_flip': label_flip,
    'badnets': badnets,
    'blended': blended,
    'dba': functools.partial(badnets, dba_pieces=4),
    'trigger_token': trigger_token,
    'edge_case': edge_case,
    'neurotoxin': neurotoxin,
    'alternating_min': alternating_min,
}
BACKDOORS = ('badnets', 'blended', 'dba', 'trigger_token', 'edge_case',
             'neurotoxin', 'alternating_min')
# Attacks on token ids (text datasets); the others read images.
TEXT_ATTACKS = ('trigger_token', 'label_flip')

# Model attacks that keep state across rounds and see the global model and
# the data (the engine's Threat.stateful_attack); the runner builds them.
STATEFUL_ATTACKS: dict[str, Callable[..., StatefulAttack]] = {
    '3dfed': thrdfed,
}

# Every value the 'attack' setting accepts.
ATTACKS = {**MODEL_ATTACKS, **DATA_ATTACKS, **STATEFUL_ATTACKS}


def get_model_attack(name: str, **kwargs) -> ModelAttack:
  """Builds MODEL_ATTACKS[name]; SettingError naming the argument if not.

  Args:
    name: a key of MODEL_ATTACKS.
    **kwargs: the factory's keyword settings.

  Returns:
    A ModelAttack.

  Raises:
    ValueError: unknown name, a setting the attack does not take, or a bad
      value (raised by the factory).
  """
  if name not in MODEL_ATTACKS:
    raise SettingError('attack', f'{name!r} is not a known model-poisoning '
                       f'attack; expected one of {sorted(MODEL_ATTACKS)}')
  factory = MODEL_ATTACKS[name]
  accepted = inspect.signature(factory).parameters
  unknown = sorted(set(kwargs) - set(accepted))
  if unknown:
    raise SettingError('attack_kwargs', f'attack {name!r} takes no '
                       f'setting(s) {unknown}; its settings are '
                       f'{sorted(accepted)}')
  return factory(**kwargs)


__all__ = ['ATTACKS', 'MODEL_ATTACKS', 'ModelAttack', 'STATEFUL_ATTACKS',
           'StatefulAttack', 'get_model_attack']
