"""Attack registry. Each entry builds an attack from keyword settings.

  attack = get_model_attack('min_max', direction='sign')
  updates = attack.apply(updates, is_malicious, mask, key)  # float[C, D]
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from fedrobust.errors import SettingError, check_registration
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
from fedrobust.attacks.edge import edge_case_images
from fedrobust.attacks.needs import (INPUTS, KINDS, PROVIDED, AttackEntry,
                                     AttackNeeds)
from fedrobust.attacks.model_poisoning import (ModelAttack, gaussian, inf,
                                               ipm, lie, min_max, min_sum,
                                               mimic, model_replacement,
                                               scaling, sign_flip)

_IMAGE_BACKDOOR = ('image_shape', 'target_label', 'trigger',
                   'poison_fraction')


def _edge_case_digits(facts: dict, kwargs: dict) -> tuple[dict, dict]:
  """The edge-case backdoor's inputs: the MNIST 5k subset's images of
  kwargs['edge_digit'] (default 7), split in two: the attackers' half and
  the held-out half its success is measured on."""
  train, test = edge_case_images(facts['image_shape'],
                                 kwargs.pop('edge_digit', 7))
  return {'edge_images': train}, {'edge_images': test}


def _dba_layout(facts: dict, kwargs: dict) -> tuple[dict, dict]:
  del facts
  return {}, {'dba_layout': kwargs.get('dba_layout', 'grid')}


_M = AttackNeeds
# name -> AttackEntry(factory, AttackNeeds).
ATTACK_ENTRIES: dict[str, AttackEntry] = {
    'sign_flip': AttackEntry(sign_flip),
    'gaussian': AttackEntry(gaussian),
    'scaling': AttackEntry(scaling),
    'ipm': AttackEntry(ipm),
    'lie': AttackEntry(lie),
    'min_max': AttackEntry(min_max),
    'min_sum': AttackEntry(min_sum),
    'agr_tailored': AttackEntry(agr_tailored),
    'fang_trim': AttackEntry(fang_trim),
    'fang_krum': AttackEntry(fang_krum),
    'inf': AttackEntry(inf),
    'mimic': AttackEntry(mimic),
    'model_replacement': AttackEntry(model_replacement,
                                     _M(provides=('server_lr',))),
    'optimal_ipm': AttackEntry(optimal_ipm),
    'optimal_alie': AttackEntry(optimal_alie),
    'signguard_adaptive': AttackEntry(signguard_adaptive),
    'clippedclustering_adaptive': AttackEntry(clippedclustering_adaptive),
    # Data poisoning: acts inside malicious clients' local training.
    'label_flip': AttackEntry(label_flip, _M(
        kind='data', provides=('num_classes', 'source_label',
                               'target_label', 'poison_fraction'))),
    'badnets': AttackEntry(badnets, _M(kind='data', inputs='image',
                                       backdoor='badnets',
                                       provides=_IMAGE_BACKDOOR)),
    'blended': AttackEntry(blended, _M(
        kind='data', inputs='image', backdoor='blended',
        provides=('image_shape', 'target_label', 'alpha', 'poison_fraction',
                  'seed'))),
    'dba': AttackEntry(functools.partial(badnets, dba_pieces=4), _M(
        kind='data', inputs='image', backdoor='dba',
        provides=_IMAGE_BACKDOOR, derive=_dba_layout)),
    'trigger_token': AttackEntry(trigger_token, _M(
        kind='data', inputs='text', backdoor='trigger_token',
        provides=('target_label', 'poison_fraction'))),
    'edge_case': AttackEntry(edge_case, _M(
        kind='data', inputs='image', backdoor='edge_case',
        provides=('image_shape', 'target_label', 'poison_fraction'),
        derive=_edge_case_digits)),
    'neurotoxin': AttackEntry(neurotoxin, _M(
        kind='data', inputs='image', backdoor='neurotoxin',
        provides=_IMAGE_BACKDOOR)),
    'alternating_min': AttackEntry(alternating_min, _M(
        kind='data', inputs='image', backdoor='alternating_min',
        provides=_IMAGE_BACKDOOR)),
    # Sees the global model and keeps state across rounds; its backdoor is
    # BadNets' trigger.
    '3dfed': AttackEntry(thrdfed, _M(kind='stateful', inputs='image',
                                     backdoor='badnets')),
}


def _of_kind(kind: str) -> dict[str, Callable[..., Any]]:
  return {n: e.factory for n, e in ATTACK_ENTRIES.items()
          if e.needs.kind == kind}


# Views by kind (kept in step by register_attack).
MODEL_ATTACKS: dict[str, Callable[..., ModelAttack]] = _of_kind('model')
DATA_ATTACKS: dict[str, Callable[..., DataPoison]] = _of_kind('data')
STATEFUL_ATTACKS: dict[str, Callable[..., StatefulAttack]] = _of_kind(
    'stateful')
# Every value the 'attack' setting accepts.
ATTACKS = {n: e.factory for n, e in ATTACK_ENTRIES.items()}
_VIEWS = {'model': MODEL_ATTACKS, 'data': DATA_ATTACKS,
          'stateful': STATEFUL_ATTACKS}


def register_attack(name: str, factory: Callable[..., Any], *,
                    needs: AttackNeeds = AttackNeeds(),
                    replace: bool = False) -> None:
  """Adds an attack to the registry, so that runs and sweeps take it by
  name.

  Args:
    name: the registry key (the `attack` setting's value).
    factory: keyword factory returning a ModelAttack (kind 'model'), a
      DataPoison ('data') or a StatefulAttack ('stateful').
    needs: its kind, inputs and the run facts it takes.
    replace: allow replacing an existing entry of that name.
  """
  check_registration('attack', name, ATTACK_ENTRIES, replace=replace,
                     provides=needs.provides, provided=PROVIDED)
  if needs.kind not in KINDS or needs.inputs not in INPUTS:
    raise ValueError(f'attack {name!r}: kind must be one of {KINDS} and '
                     f'inputs one of {INPUTS}')
  for view in _VIEWS.values():
    view.pop(name, None)
  ATTACK_ENTRIES[name] = AttackEntry(factory, needs)
  _VIEWS[needs.kind][name] = factory
  ATTACKS[name] = factory


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


__all__ = ['ATTACKS', 'ATTACK_ENTRIES', 'AttackEntry', 'AttackNeeds',
           'DATA_ATTACKS', 'MODEL_ATTACKS', 'ModelAttack', 'STATEFUL_ATTACKS',
           'register_attack',
           'StatefulAttack', 'get_model_attack']
