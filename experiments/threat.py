"""Host-side assembly of the threat model and the aggregator from a config.

Turns flag values into: the fixed malicious set, the data poison handed to
the method, the model attack handed to the round, the aggregation rule,
and the triggered test set used for the attack success rate.
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from experiments import config as config_lib
from fedrobust import aggregators, attacks
from fedrobust.attacks.data_poisoning import neurotoxin_mask
from fedrobust.data.sources import load_mnist5k_arrays
from fedrobust.errors import SettingError
from fedrobust.methods import METHODS
from fedrobust.engine import Threat


class ThreatSetup(NamedTuple):
  threat: Threat | None
  poison: Any                 # DataPoison or None
  aggregator: Any             # Aggregator (the resolved --aggregator)
  # (triggered x, target y, true y): triggered_test_set with its sources.
  triggered_test: tuple[np.ndarray, ...] | None
  num_malicious: int
  num_byzantine: int


def _kwargs(config: dict[str, Any], key: str) -> dict[str, Any]:
  try:
    value = json.loads(config.get(key) or '{}')
  except json.JSONDecodeError as err:
    raise ValueError(f'--{key} must be a JSON object, got '
                     f'{config.get(key)!r} ({err})') from None
  if not isinstance(value, dict):
    raise ValueError(f'--{key} must be a JSON object, got {value!r}')
  return value


def edge_case_images(input_shape: tuple[int, ...], digit: int
                     ) -> tuple[np.ndarray, np.ndarray]:
  """The edge-case backdoor's inputs: the MNIST 5k subset's images of
  `digit` (handwritten digits are out of distribution for Fashion-MNIST,
  as ARDIS 7s are for MNIST in Wang et al.), split in two: the attackers'
  half and the held-out half the attack success is measured on."""
  if tuple(input_shape) != (28, 28, 1):
    raise ValueError(f'--attack=edge_case draws 28x28 grey digits; the '
                     f'dataset has inputs of shape {tuple(input_shape)}')
  if not (isinstance(digit, int) and 0 <= digit <= 9):
    raise ValueError(f'--attack_kwargs edge_digit must be a digit 0-9, got '
                     f'{digit!r}')
  x, y = load_mnist5k_arrays()
  x = x[y == digit]
  return x[:len(x) // 2], x[len(x) // 2:]


def _trigger_and_target(config: dict[str, Any], num_classes: int):
  """The --trigger_* flags' Trigger and the checked backdoor target."""
  h, w = attacks.parse_trigger_size(config['trigger_size'])
  trigger = attacks.Trigger(h, w, config['trigger_location'],
                            config['trigger_value'],
                            pattern=config['trigger_pattern'])
  target = config['backdoor_target_label']
  if not 0 <= target < num_classes:
    raise ValueError(f'--backdoor_target_label={target} must be in '
                     f'[0, {num_classes})')
  return trigger, target


def _stateful_attack(config: dict[str, Any], attack: str,
                     kwargs: dict[str, Any], *, num_classes: int,
                     input_shape: tuple[int, ...], test_x: np.ndarray,
                     test_y: np.ndarray, cohorts: tuple, delayed: bool,
                     num_malicious: int):
  """3DFed: built with the model, the clients' local training settings and
  the BadNets trigger of the --trigger_* flags (its backdoor is measured
  like BadNets')."""
  if delayed or config.get('train_on_arrival'):
    raise ValueError(f'--attack={attack} reads its feedback from the next '
                     'round\'s global model: it needs synchronous rounds '
                     '(no --client_delay)')
  if len(cohorts) != 1 or cohorts[0].transform.name != 'identity':
    raise ValueError(f'--attack={attack} crafts full-model updates: it '
                     'needs one cohort and --transform=identity')
  if len(input_shape) == 1:
    raise ValueError(f'--attack={attack} stamps images; the dataset holds '
                     'token ids')
  if config.get('local_optimizer', 'sgd') != 'sgd':
    raise ValueError(f'--attack={attack} trains with SGD like the '
                     'release; it needs --local_optimizer=sgd')
  trigger, target = _trigger_and_target(config, num_classes)
  # The triggered clone of a whole batch (the release's MNIST poisoning
  # proportion is 1.0).
  stamp_all = attacks.badnets(image_shape=input_shape, target_label=target,
                              trigger=trigger, poison_fraction=1.0).apply

  def stamp(x, y):
    return stamp_all(x, y, jnp.zeros(y.shape, jnp.int32), jnp.int32(1), 0)

  try:
    built = attacks.STATEFUL_ATTACKS[attack](
        apply_fn=cohorts[0].model.apply, stamp=stamp,
        num_attackers=num_malicious, num_classes=num_classes,
        target_label=target, learning_rate=config['local_lr'],
        batch_size=config['batch_size'], local_epochs=config['local_epochs'],
        momentum=config['momentum'], weight_decay=config['weight_decay'],
        **kwargs)
  except TypeError as err:
    raise ValueError(f'--attack_kwargs for {attack}: {err}') from None
  triggered = attacks.triggered_test_set(
      test_x, test_y, 'badnets', target_label=target, trigger=trigger,
      exclude_target=config['backdoor_eval'] == 'exclude_target',
      with_sources=True)
  return built, triggered


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


def build_threat(config: dict[str, Any], *, num_classes: int,
                 input_shape: tuple[int, ...], test_x: np.ndarray,
                 test_y: np.ndarray, validation: tuple[np.ndarray,
                                                       np.ndarray],
                 cohorts: tuple = (), delayed: bool = False,
                 group_sizes: tuple[int, ...] = (),
                 client_steps: int = 0) -> ThreatSetup:
  """Validates the threat flags and builds the pieces (errors name flags).

  Args:
    config: the resolved run config (config['aggregator'] is a rule name).
    cohorts: the run's cohorts (fedrobust.cohort.Cohort); rules that track
      or train the global model need a single identity-transform cohort.
    delayed: client delays are on (rules with per-client history refuse).
    client_steps: the local SGD iterations a client runs per round (the
      server-trained rules run as many; 0: one pass per local epoch over
      the server's data).
    group_sizes: clients per round of each group the rule runs on (with
      several cohorts: the shared layers over all of them, and each
      cohort's own layers); the smallest must support the rule.
  """
  attack = config['attack']
  k = config['num_clients']
  c = config['clients_per_round']
  frac = config['malicious_fraction']
  if not (np.isfinite(frac) and 0.0 <= frac < 1.0):
    raise ValueError(f'--malicious_fraction must be in [0, 1), got {frac}')
  num_malicious = int(round(frac * k))
  if attack != 'none' and attack not in attacks.ATTACKS:
    raise ValueError(f'--attack={attack!r}; expected one of '
                     f"{['none'] + sorted(attacks.ATTACKS)}")
  if attack != 'none' and num_malicious == 0:
    raise ValueError(f'--attack={attack} needs --malicious_fraction > 0 '
                     f'(it gives {num_malicious} of {k} clients)')
  if attack == 'none' and num_malicious:
    raise ValueError('--malicious_fraction > 0 needs an --attack')
  if config['exclude_malicious'] and config['resample_malicious']:
    raise ValueError('--exclude_malicious needs a fixed malicious set; '
                     'drop --resample_malicious')
  if config['exclude_malicious'] and attack == 'none':
    raise ValueError('--exclude_malicious needs --attack and '
                     '--malicious_fraction to say who the attackers are')
  if config['attacker_every_round'] and (
      attack == 'none' or config['resample_malicious'] or
      config['exclude_malicious']):
    raise ValueError('--attacker_every_round needs --attack with a fixed, '
                     'participating malicious set (no --resample_malicious '
                     'or --exclude_malicious)')
  if config['attack_start_round'] < 1:
    raise ValueError('--attack_start_round must be >= 1')
  # f, the number of Byzantine clients an aggregator is told to tolerate:
  # by default the expected attackers among the C sampled clients.
  f = config['num_byzantine']
  if f < 0:
    f = int(round(frac * c))

  poison, model_attack, triggered = None, None, None
  kwargs = _kwargs(config, 'attack_kwargs')
  if attack in attacks.DATA_ATTACKS:
    trigger, target = _trigger_and_target(config, num_classes)
    text = len(input_shape) == 1
    if text != (attack == 'trigger_token') and attack != 'label_flip':
      raise ValueError(
          f'--attack={attack} ' + ('reads token ids: it needs a text '
                                   'dataset (e.g. --dataset=vader_movies)'
                                   if not text else
                                   'stamps images; on token ids use '
                                   '--attack=trigger_token or label_flip'))
    if attack == 'trigger_token':
      poison = attacks.trigger_token(
          target_label=target, poison_fraction=config['poison_fraction'],
          **kwargs)
    elif attack == 'label_flip':
      poison = attacks.label_flip(
          num_classes=num_classes, source_label=config['flip_source_label'],
          target_label=target, poison_fraction=config['poison_fraction'],
          **kwargs)
    elif attack == 'edge_case':
      edge_train, edge_test = edge_case_images(
          input_shape, kwargs.pop('edge_digit', 7))
      poison = attacks.edge_case(image_shape=input_shape,
                                 edge_images=edge_train, target_label=target,
                                 poison_fraction=config['poison_fraction'],
                                 **kwargs)
    elif attack == 'blended':
      poison = attacks.blended(image_shape=input_shape, target_label=target,
                               alpha=config['blend_alpha'],
                               poison_fraction=config['poison_fraction'],
                               seed=config['seed'], **kwargs)
    else:
      poison = attacks.DATA_ATTACKS[attack](
          image_shape=input_shape, target_label=target, trigger=trigger,
          poison_fraction=config['poison_fraction'], **kwargs)
    if attack in attacks.BACKDOORS:
      triggered = attacks.triggered_test_set(
          test_x, test_y, attack, target_label=target, trigger=trigger,
          alpha=config['blend_alpha'], seed=config['seed'],
          exclude_target=config['backdoor_eval'] == 'exclude_target',
          with_sources=True, dba_layout=kwargs.get('dba_layout', 'grid'),
          edge_images=edge_test if attack == 'edge_case' else None)
  ratio = config.get('neurotoxin_mask', 0.0)
  if ratio:
    if poison is None:
      raise ValueError(f'--neurotoxin_mask={ratio} masks the local gradients '
                       "of a data attack's clients: it needs --attack set "
                       f'to one of {sorted(attacks.DATA_ATTACKS)}')
    if not 0.0 < ratio < 1.0:
      raise ValueError(f'--neurotoxin_mask must be in [0, 1), got {ratio}')
    if poison.grad_mask is not None:
      raise ValueError(f'--attack={attack} masks its gradients already; '
                       'set its own top_ratio in --attack_kwargs instead of '
                       '--neurotoxin_mask')
    poison = poison._replace(grad_mask=functools.partial(
        neurotoxin_mask, top_ratio=float(ratio)))
  stateful = None
  if attack in attacks.STATEFUL_ATTACKS:
    stateful, triggered = _stateful_attack(
        config, attack, kwargs, num_classes=num_classes,
        input_shape=input_shape, test_x=test_x, test_y=test_y,
        cohorts=cohorts, delayed=delayed, num_malicious=num_malicious)
  # A model-space attack: --attack itself, or --model_attack on top of a
  # data attack (a backdoor boosted by scaling, say).
  second = config.get('model_attack', 'none')
  if second != 'none' and attack not in attacks.DATA_ATTACKS:
    raise ValueError(f'--model_attack={second} rewrites the updates of a '
                     'data attack\'s clients: it needs --attack set to one '
                     f'of {sorted(attacks.DATA_ATTACKS)}')
  model_name = attack if attack in attacks.MODEL_ATTACKS else second
  if model_name != 'none':
    flag = 'attack' if model_name == attack else 'model_attack'
    model_kwargs = (kwargs if flag == 'attack' else
                    _kwargs(config, 'model_attack_kwargs'))
    if model_name == 'model_replacement':
      model_kwargs = dict({'server_lr': config['server_lr']}, **model_kwargs)
    knowledge = config['attacker_knowledge']
    takes = inspect.signature(attacks.MODEL_ATTACKS[model_name]).parameters
    if knowledge == 'partial' and 'knowledge' in takes:
      model_kwargs = dict(model_kwargs, knowledge='partial')
    built = attacks.get_model_attack(model_name, **model_kwargs)
    if built.needs_benign and knowledge == 'own_updates_only':
      raise ValueError(
          f'--{flag}={model_name} needs benign statistics, but '
          f'--attacker_knowledge={knowledge} does not grant them')
    if (built.needs_benign and knowledge == 'partial' and
        'knowledge' not in takes):
      raise ValueError(
          f'--{flag}={model_name} simulates the aggregator on every benign '
          'update; --attacker_knowledge=partial is implemented for '
          + ', '.join(sorted(a for a, fn in attacks.MODEL_ATTACKS.items()
                             if 'knowledge' in
                             inspect.signature(fn).parameters)))
    model_attack = built.apply

  name = config['aggregator']
  # With several cohorts the rule runs once over the shared layers of all
  # of them and once per cohort with layers of its own: the smallest group
  # must support it.
  n = min(group_sizes, default=c)
  aggregators.check_num_clients(name, n, f)
  agg_kwargs = _kwargs(config, 'aggregator_kwargs')
  spec = METHODS[config['method']]
  for key, value in spec.aggregator_defaults(
      config_lib.settings_of(config['method'], config), name).items():
    agg_kwargs.setdefault(key, value)
  plain = len(cohorts) <= 1 and all(ch.transform.name == 'identity'
                                    for ch in cohorts)
  if (name in aggregators.SERVER_DATA_RULES or
      name in aggregators.GLOBAL_MODEL_RULES or
      name in aggregators.MODEL_EVAL_RULES) and not plain:
    raise ValueError(f'--aggregator={name} scores or trains the full global '
                     'model: it needs one cohort and --transform=identity')
  if name in aggregators.SERVER_DATA_RULES:
    if len(validation[1]) == 0:
      raise ValueError(f'--aggregator={name} needs server data: set '
                       '--validation_fraction and --validation_size > 0')
    agg_kwargs.update(server_data=validation, apply_fn=cohorts[0].model.apply)
  if name in ('fltrust', 'finetune'):
    # The server trains on U the way a client trains on its data: same
    # optimizer, batch size and number of local iterations R_l (FLTrust
    # Alg. 1 runs ModelUpdate(., D_0, b, beta, R_l) on both sides). With
    # a small U that is several passes over it; formerly the
    # server ran the clients' epochs instead (4 steps on 256 images
    # against about 27 client steps). client_steps is the typical client's
    # count (typical_client_steps), not the largest client's.
    v = len(validation[1])
    steps = client_steps or -(-v // config['batch_size']) * config[
        'local_epochs']
    for key, value in (('server_lr', config['local_lr']),
                       ('server_momentum', config['momentum']),
                       ('server_batch_size', config['batch_size']),
                       ('server_steps', steps)):
      agg_kwargs.setdefault(key, value)
  if name == 'auror':
    # Its threshold is in gradient units (FLPoison's FedSGD): a delta of
    # R_l local steps is about lr R_l / (1 - momentum) times the mean
    # gradient it followed.
    r_l = client_steps or 1
    agg_kwargs.setdefault('delta_scale', config['local_lr'] * r_l /
                          (1.0 - min(config['momentum'], 0.99)))
  if name in aggregators.MODEL_EVAL_RULES:
    agg_kwargs.setdefault('apply_fn', cohorts[0].model.apply)
    if name == 'deepsight':
      agg_kwargs.setdefault('input_shape', cohorts[0].model.input_shape)
  if name in aggregators.HEAD_RULES:
    # Their features are the output layer's (the model's head).
    head = (cohorts[0].model.roles or {}).get('head') if cohorts else None
    agg_kwargs.setdefault('output_path', head)
  if name in aggregators.FULL_PARTICIPATION_RULES and (c != k or delayed):
    raise ValueError(f'--aggregator={name} keeps per-client history and '
                     'needs every client every round and no --client_delay: '
                     'set --clients_per_round=0 (all)')
  if name in aggregators.SLOT_HISTORY_RULES:
    if len(cohorts) > 1:
      raise ValueError(f'--aggregator={name} keeps per-slot history: it '
                       'needs one cohort')
    agg_kwargs.setdefault('num_clients', c)
  if name in aggregators.CLIENT_ID_RULES:
    agg_kwargs.setdefault('num_clients', k)
  if (name in aggregators.MODEL_TRACKING_RULES and
      config['server_lr'] != 1.0):
    raise ValueError(f'--aggregator={name} tracks the global model and '
                     'needs --server_lr=1')
  malicious = None
  if attack != 'none' and not config['resample_malicious']:
    chosen = np.random.default_rng(config['seed'] + 7).choice(
        k, num_malicious, replace=False)
    malicious = jnp.zeros(k, bool).at[chosen].set(True)
  if name in aggregators.UNLEARNING_RULES or (
      name in aggregators.TOLD_RULES and agg_kwargs.get('unlearn_round')):
    if malicious is None:
      raise ValueError(f'--aggregator={name} forgets the attackers: it needs '
                       '--attack with a fixed malicious set (no '
                       '--resample_malicious)')
    agg_kwargs.setdefault('forget', np.asarray(malicious))
  aggregator = aggregators.get_aggregator(name, num_byzantine=f,
                                          **agg_kwargs)
  if config.get('pre_aggregator', 'none') != 'none':
    pre_name = config['pre_aggregator']
    if (name in aggregators.SLOT_HISTORY_RULES or
        name in aggregators.CLIENT_ID_RULES):
      raise ValueError(f'--pre_aggregator={pre_name} mixes client updates; '
                       f'--aggregator={name} keeps per-client history')
    pre = aggregators.get_pre_aggregator(
        pre_name, num_byzantine=f,
        **_kwargs(config, 'pre_aggregator_kwargs'))
    try:
      aggregators.check_num_clients(name, pre.slots(n), f)
    except SettingError as err:
      raise ValueError(f'--pre_aggregator={pre_name} hands the rule '
                       f'{pre.slots(n)} rows for {n} clients: {err}'
                       ) from None
    aggregator = aggregators.compose(pre, aggregator)

  threat = None
  if attack != 'none':
    threat = Threat(malicious=malicious, num_malicious=num_malicious,
                    start_round=config['attack_start_round'],
                    model_attack=model_attack,
                    absent=config['exclude_malicious'],
                    every_round=config['attacker_every_round'],
                    stateful_attack=stateful)
  return ThreatSetup(threat, poison, aggregator, triggered, num_malicious, f)
