"""The threat model and the aggregation rule of a run, built from settings.

`build_threat(settings, ...)` turns a run's settings (a config dict, one key
per setting of `fedrobust.config`) into the fixed malicious set, the data
poison local training applies, the model-space attack the round applies,
the aggregation rule, and the triggered test set the attack success rate
is measured on.

It is generic: what a rule or an attack needs from the run is declared in
its registry entry (`fedrobust.aggregators.needs`, `fedrobust.attacks.needs`)
and read here; no component is named. Errors are `SettingError`s naming
the setting to change.
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from fedrobust import aggregators, attacks
from fedrobust.aggregators.needs import RunFacts, rule_kwargs
from fedrobust.attacks.data_poisoning import neurotoxin_mask
from fedrobust.attacks.needs import attack_kwargs, check_inputs
from fedrobust.config import settings_of
from fedrobust.engine import Threat
from fedrobust.errors import SettingError
from fedrobust.methods import METHODS


class ThreatSetup(NamedTuple):
  threat: Threat | None
  poison: Any                 # DataPoison or None
  aggregator: Any             # Aggregator (the resolved aggregator)
  # (triggered x, target y, true y): triggered_test_set with its sources.
  triggered_test: tuple[np.ndarray, ...] | None
  num_malicious: int
  num_byzantine: int


def keyword_settings(settings: dict[str, Any], key: str) -> dict[str, Any]:
  """settings[key] as a dict: a JSON object string, a dict, or empty."""
  value = settings.get(key) or {}
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except json.JSONDecodeError as err:
      raise SettingError(key, f'must be a JSON object, got {value!r} '
                         f'({err})') from None
  if not isinstance(value, dict):
    raise SettingError(key, f'must be a JSON object, got {value!r}')
  return dict(value)


def typical_client_steps(counts, batch_size: int, epochs: int) -> int:
  """The local iterations R_l a typical client runs in a round: the mean,
  over clients, of epochs x ceil(n_k / B) (a client's padded batches past
  its n_k examples are skipped), rounded, at least 1.

  FLTrust's Alg. 1 (and the fine-tuning defense) train the server's model
  for the clients' R_l; the engine's static step count is the LARGEST
  client's, about twice the typical one under Dirichlet splits.
  """
  counts = np.asarray(counts, np.float64)
  steps = epochs * np.ceil(counts[counts > 0] / batch_size)
  return max(1, int(round(float(np.mean(steps))))) if steps.size else 1


def trigger_and_target(settings: dict[str, Any], num_classes: int):
  """The trigger_* settings' Trigger and the checked backdoor target."""
  h, w = attacks.parse_trigger_size(settings['trigger_size'])
  trigger = attacks.Trigger(h, w, settings['trigger_location'],
                            settings['trigger_value'],
                            pattern=settings['trigger_pattern'])
  target = settings['backdoor_target_label']
  if not 0 <= target < num_classes:
    raise SettingError('backdoor_target_label', f'must be in [0, '
                       f'{num_classes}), got {target}')
  return trigger, target


def check_threat_settings(settings: dict[str, Any]) -> int:
  """Checks the attacker settings; returns the number of attackers."""
  attack = settings['attack']
  k = settings['num_clients']
  frac = settings['malicious_fraction']
  if not (np.isfinite(frac) and 0.0 <= frac < 1.0):
    raise SettingError('malicious_fraction', f'must be in [0, 1), got {frac}')
  num_malicious = int(round(frac * k))
  if attack != 'none' and attack not in attacks.ATTACKS:
    raise SettingError('attack', f'{attack!r}; expected one of '
                       f"{['none'] + sorted(attacks.ATTACKS)}")
  if attack != 'none' and num_malicious == 0:
    raise SettingError('malicious_fraction', f'must be > 0 for attack='
                       f'{attack} (it gives {num_malicious} of {k} clients)')
  if attack == 'none' and num_malicious:
    raise SettingError('malicious_fraction', '> 0 needs an attack')
  fixed = not settings['resample_malicious']
  if settings['exclude_malicious'] and not fixed:
    raise SettingError('exclude_malicious', 'needs a fixed malicious set; '
                       'drop resample_malicious')
  if settings['exclude_malicious'] and attack == 'none':
    raise SettingError('exclude_malicious', 'needs an attack and '
                       'malicious_fraction to say who the attackers are')
  if settings['attacker_every_round'] and (
      attack == 'none' or not fixed or settings['exclude_malicious']):
    raise SettingError('attacker_every_round', 'needs an attack with a '
                       'fixed, participating malicious set (no '
                       'resample_malicious or exclude_malicious)')
  if settings['attack_start_round'] < 1:
    raise SettingError('attack_start_round', 'must be >= 1')
  return num_malicious


def attack_facts(settings: dict[str, Any], *, num_classes: int,
                 input_shape: tuple[int, ...]) -> dict[str, Any]:
  """The run facts an attack factory may take (attacks.needs.PROVIDED)."""
  trigger, target = trigger_and_target(settings, num_classes)
  return {'image_shape': input_shape, 'target_label': target,
          'trigger': trigger, 'poison_fraction': settings['poison_fraction'],
          'num_classes': num_classes,
          'source_label': settings['flip_source_label'],
          'alpha': settings['blend_alpha'], 'seed': settings['seed'],
          'server_lr': settings['server_lr']}


def data_poison(settings: dict[str, Any], name: str, kwargs: dict, facts,
                *, text: bool, test_x, test_y):
  """(DataPoison, triggered test set or None) of data attack `name`."""
  entry = attacks.ATTACK_ENTRIES[name]
  check_inputs(name, entry.needs, text)
  factory_kwargs, triggered_kwargs = attack_kwargs(name, entry.needs, facts,
                                                   kwargs)
  try:
    poison = entry.factory(**factory_kwargs)
  except TypeError as err:
    raise SettingError('attack_kwargs', f'attack {name!r}: {err}') from None
  triggered = None
  if entry.needs.backdoor:
    triggered = attacks.triggered_test_set(
        test_x, test_y, entry.needs.backdoor,
        target_label=facts['target_label'], trigger=facts['trigger'],
        alpha=facts['alpha'], seed=facts['seed'],
        exclude_target=settings['backdoor_eval'] == 'exclude_target',
        with_sources=True, **triggered_kwargs)
  ratio = settings.get('neurotoxin_mask', 0.0)
  if ratio:
    if not 0.0 < ratio < 1.0:
      raise SettingError('neurotoxin_mask', f'must be in [0, 1), got {ratio}')
    if poison.grad_mask is not None:
      raise SettingError('neurotoxin_mask', f'attack {name!r} masks its '
                         'gradients already; set its own top_ratio in '
                         'attack_kwargs instead')
    poison = poison._replace(grad_mask=functools.partial(
        neurotoxin_mask, top_ratio=float(ratio)))
  return poison, triggered


def stateful_attack(settings: dict[str, Any], name: str, kwargs: dict,
                    facts, *, num_malicious: int, cohorts: tuple,
                    delayed: bool, text: bool, test_x, test_y):
  """(StatefulAttack, triggered test set) of stateful attack `name`: it
  crafts full-model updates from the next round's global model, training
  like the clients (SGD, their batch size, epochs and learning rate)."""
  entry = attacks.ATTACK_ENTRIES[name]
  check_inputs(name, entry.needs, text)
  if delayed:
    raise SettingError('client_delay', f'attack {name!r} reads its feedback '
                       "from the next round's global model: it needs "
                       'synchronous rounds (no client_delay or '
                       'train_on_arrival)')
  if len(cohorts) != 1 or cohorts[0].transform.name != 'identity':
    raise SettingError('attack', f'{name!r} crafts full-model updates: it '
                       'needs one cohort and transform=identity')
  if settings.get('local_optimizer', 'sgd') != 'sgd':
    raise SettingError('local_optimizer', f'attack {name!r} trains with '
                       'SGD; it needs local_optimizer=sgd')
  stamp_all = attacks.badnets(
      image_shape=facts['image_shape'], target_label=facts['target_label'],
      trigger=facts['trigger'], poison_fraction=1.0).apply

  def stamp(x, y):
    """The triggered clone of a whole batch."""
    return stamp_all(x, y, jnp.zeros(y.shape, jnp.int32), jnp.int32(1), 0)

  try:
    built = entry.factory(
        apply_fn=cohorts[0].model.apply, stamp=stamp,
        num_attackers=num_malicious, num_classes=facts['num_classes'],
        target_label=facts['target_label'],
        learning_rate=settings['local_lr'],
        batch_size=settings['batch_size'],
        local_epochs=settings['local_epochs'],
        momentum=settings['momentum'],
        weight_decay=settings['weight_decay'], **kwargs)
  except TypeError as err:
    raise SettingError('attack_kwargs', f'attack {name!r}: {err}') from None
  triggered = attacks.triggered_test_set(
      test_x, test_y, entry.needs.backdoor,
      target_label=facts['target_label'], trigger=facts['trigger'],
      exclude_target=settings['backdoor_eval'] == 'exclude_target',
      with_sources=True)
  return built, triggered


def model_attack(settings: dict[str, Any], name: str, argument: str,
                 kwargs: dict, facts):
  """The ModelAttack `name`, set by setting `argument` (attack or
  model_attack), with the attacker knowledge the settings grant."""
  entry = attacks.ATTACK_ENTRIES[name]
  kwargs = dict({p: facts[p] for p in entry.needs.provides}, **kwargs)
  knowledge = settings['attacker_knowledge']
  takes = inspect.signature(entry.factory).parameters
  if knowledge == 'partial' and 'knowledge' in takes:
    kwargs = dict(kwargs, knowledge='partial')
  built = attacks.get_model_attack(name, **kwargs)
  if built.needs_benign and knowledge == 'own_updates_only':
    raise SettingError('attacker_knowledge', f'{argument}={name} needs '
                       f'benign statistics, but attacker_knowledge='
                       f'{knowledge} does not grant them')
  if built.needs_benign and knowledge == 'partial' and 'knowledge' not in \
      takes:
    partial = sorted(a for a, fn in attacks.MODEL_ATTACKS.items()
                     if 'knowledge' in inspect.signature(fn).parameters)
    raise SettingError('attacker_knowledge', f'{argument}={name} simulates '
                       'the aggregator on every benign update; '
                       'attacker_knowledge=partial is implemented for '
                       + ', '.join(partial))
  return built.apply


def malicious_set(settings: dict[str, Any], num_malicious: int):
  """bool[K] fixed attackers (drawn from the seed), or None."""
  if settings['attack'] == 'none' or settings['resample_malicious']:
    return None
  k = settings['num_clients']
  chosen = np.random.default_rng(settings['seed'] + 7).choice(
      k, num_malicious, replace=False)
  return jnp.zeros(k, bool).at[chosen].set(True)


def build_rule(settings: dict[str, Any], facts: RunFacts, f: int):
  """The aggregation rule: the method's defaults for it, the settings'
  aggregator_kwargs, the run facts and derived defaults its entry
  declares, and the pre-aggregator if one is set."""
  name = settings['aggregator']
  n = min(facts.group_sizes, default=facts.clients_per_round)
  aggregators.check_num_clients(name, n, f)
  kwargs = keyword_settings(settings, 'aggregator_kwargs')
  spec = METHODS[settings['method']]
  for key, value in spec.aggregator_defaults(
      settings_of(settings['method'], settings), name).items():
    kwargs.setdefault(key, value)
  kwargs = rule_kwargs(name, aggregators.needs_of(name), facts, kwargs)
  aggregator = aggregators.get_aggregator(name, num_byzantine=f, **kwargs)
  pre_name = settings.get('pre_aggregator', 'none')
  if pre_name == 'none':
    return aggregator
  pre = aggregators.get_pre_aggregator(
      pre_name, num_byzantine=f,
      **keyword_settings(settings, 'pre_aggregator_kwargs'))
  try:
    aggregators.check_num_clients(name, pre.slots(n), f)
  except SettingError as err:
    raise SettingError('pre_aggregator', f'{pre_name!r} hands the rule '
                       f'{pre.slots(n)} rows for {n} clients: {err}'
                       ) from None
  return aggregators.compose(pre, aggregator)


def build_threat(settings: dict[str, Any], *, num_classes: int,
                 input_shape: tuple[int, ...], test_x, test_y,
                 validation: tuple[np.ndarray, np.ndarray],
                 cohorts: tuple = (), delayed: bool = False,
                 group_sizes: tuple[int, ...] = (),
                 client_steps: int = 0) -> ThreatSetup:
  """Checks the threat settings and builds the pieces.

  Args:
    settings: the resolved run config (settings['aggregator'] is a rule).
    num_classes, input_shape: the dataset's.
    test_x, test_y: the global test set (backdoors are measured on its
      triggered copy).
    validation: (x, y) the server's clean sample (may be empty).
    cohorts: the run's cohorts (fedrobust.cohort.Cohort).
    delayed: client delays or train-on-arrival are on.
    group_sizes: clients per round of each group the rule runs on; the
      smallest must support the rule.
    client_steps: local SGD iterations of a typical client per round.

  Raises:
    SettingError: naming the setting to change.
  """
  attack = settings['attack']
  num_malicious = check_threat_settings(settings)
  # f, the number of Byzantine clients an aggregator is told to tolerate:
  # by default the expected attackers among the C sampled clients.
  f = settings['num_byzantine']
  if f < 0:
    f = int(round(settings['malicious_fraction'] *
                  settings['clients_per_round']))
  kwargs = keyword_settings(settings, 'attack_kwargs')
  kind = (attacks.ATTACK_ENTRIES[attack].needs.kind if attack != 'none'
          else 'none')
  text = len(input_shape) == 1
  facts = (attack_facts(settings, num_classes=num_classes,
                        input_shape=input_shape)
           if kind in ('data', 'stateful') else
           {'server_lr': settings['server_lr'], 'num_classes': num_classes,
            'image_shape': input_shape, 'seed': settings['seed']})
  poison = stateful = triggered = None
  if kind == 'data':
    poison, triggered = data_poison(settings, attack, kwargs, facts,
                                    text=text, test_x=test_x, test_y=test_y)
  elif settings.get('neurotoxin_mask', 0.0):
    raise SettingError('neurotoxin_mask', f"{settings['neurotoxin_mask']} "
                       "masks the local gradients of a data attack's "
                       'clients: it needs attack= one of '
                       f'{sorted(attacks.DATA_ATTACKS)}')
  if kind == 'stateful':
    stateful, triggered = stateful_attack(
        settings, attack, kwargs, facts, num_malicious=num_malicious,
        cohorts=cohorts, delayed=delayed or bool(
            settings.get('train_on_arrival')), text=text, test_x=test_x,
        test_y=test_y)
  # A model-space attack: the attack itself, or model_attack on top of a
  # data attack (a backdoor boosted by scaling, say).
  second = settings.get('model_attack', 'none')
  if second != 'none' and kind != 'data':
    raise SettingError('model_attack', f'{second!r} rewrites the updates of '
                       "a data attack's clients: it needs attack= one of "
                       f'{sorted(attacks.DATA_ATTACKS)}')
  updates_attack = None
  if kind == 'model':
    updates_attack = model_attack(settings, attack, 'attack', kwargs, facts)
  elif second != 'none':
    updates_attack = model_attack(
        settings, second, 'model_attack',
        keyword_settings(settings, 'model_attack_kwargs'), facts)
  malicious = malicious_set(settings, num_malicious)
  local = {'lr': settings['local_lr'], 'momentum': settings['momentum'],
           'batch_size': settings['batch_size'],
           'epochs': settings['local_epochs']}
  run = RunFacts(
      num_clients=settings['num_clients'],
      clients_per_round=settings['clients_per_round'],
      group_sizes=tuple(group_sizes), cohorts=tuple(cohorts),
      delayed=delayed, server_lr=settings['server_lr'],
      server_data=validation, client_steps=client_steps, local=local,
      malicious=malicious,
      pre_aggregator=settings.get('pre_aggregator', 'none') != 'none')
  aggregator = build_rule(settings, run, f)
  threat = None
  if attack != 'none':
    threat = Threat(malicious=malicious, num_malicious=num_malicious,
                    start_round=settings['attack_start_round'],
                    model_attack=updates_attack,
                    absent=settings['exclude_malicious'],
                    every_round=settings['attacker_every_round'],
                    stateful_attack=stateful)
  return ThreatSetup(threat, poison, aggregator, triggered, num_malicious, f)
