"""What an aggregation rule needs from the run, declared with its entry.

A rule's registry entry (`RuleEntry`) pairs its factory with a `Needs`:
the requirements the run must meet (one identity-transform cohort, full
participation, server learning rate 1, ...) and the facts of the run its
factory takes (server data, the model's apply function, its head, the
told attackers, client counts), plus a `derive` function for defaults that
follow from the run (FLTrust's server steps, Auror's gradient scale).

`rule_kwargs` is the one generic reader of these declarations: it checks
the requirements against a `RunFacts` and returns the factory's keyword
defaults. Nothing in it, or in its callers, names a rule.

  needs = Needs(whole_model=True, provides=('server_data', 'apply_fn'))
  kwargs = rule_kwargs('my_rule', needs, facts, user_kwargs)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from fedrobust.errors import SettingError

# Requirement on n (clients in a round) as a function of f: (text, min n).
Requirement = tuple[str, Callable[[int], int]]
ANY_N: Requirement = ('n >= 1', lambda f: 1)

# The run facts a factory may take, by factory argument name.
PROVIDED = ('server_data', 'apply_fn', 'input_shape', 'output_path',
            'forget')


class RunFacts(NamedTuple):
  """What the generic builder knows about the run when it builds a rule.

  num_clients: K, clients in the federation.
  clients_per_round: C, slots per round.
  group_sizes: clients per round of each group the rule runs on (with
    several cohorts: the shared layers of all, and each cohort's own).
  cohorts: the run's cohorts (fedrobust.cohort.Cohort).
  delayed: client delays or train-on-arrival are on.
  server_lr: the server's step size on the aggregated update.
  server_data: (x, y) clean server sample, possibly empty.
  client_steps: local SGD iterations of a typical client per round (0: one
    pass per local epoch over the server's data).
  local: {'lr', 'momentum', 'batch_size', 'epochs'} of the clients' local
    training.
  malicious: bool[K] fixed attacker set, or None (no attack, or a set
    redrawn every round).
  pre_aggregator: True when a pre-aggregator mixes the updates first.
  """
  num_clients: int
  clients_per_round: int
  group_sizes: tuple[int, ...] = ()
  cohorts: tuple = ()
  delayed: bool = False
  server_lr: float = 1.0
  server_data: tuple = ((), ())
  client_steps: int = 0
  local: dict[str, Any] = {}
  malicious: Any = None
  pre_aggregator: bool = False

  @property
  def whole_model(self) -> bool:
    """One cohort (or none yet) and the identity transform."""
    return len(self.cohorts) <= 1 and all(
        c.transform.name == 'identity' for c in self.cohorts)


class Needs(NamedTuple):
  """A rule's declared requirements and the run facts it takes.

  min_clients: clients per round it needs, as a function of f.
  whole_model: it scores, trains or evaluates the full global model: one
    cohort and the identity transform.
  tracks_model: its state follows the global model assuming the server
    applies params + update with server_lr 1.
  full_participation: its per-client history assumes every client every
    round and no client delays.
  per_client: '' (no per-client state), 'slot' (state per slot: one
    cohort, the same slot order, num_clients=C) or 'id' (state per client
    id: num_clients=K, any group of clients). Either refuses a
    pre-aggregator, which mixes clients.
  provides: run facts passed to the factory (names from PROVIDED):
    server_data (needs a non-empty server sample), apply_fn, input_shape
    and output_path (the single cohort's model and head), forget (the
    fixed attacker set, bool[K]: the rule is told whom to forget).
  derive: (RunFacts, kwargs so far) -> further keyword defaults (explicit
    user kwargs win); may raise SettingError.
  """
  min_clients: Requirement = ANY_N
  whole_model: bool = False
  tracks_model: bool = False
  full_participation: bool = False
  per_client: str = ''
  provides: tuple[str, ...] = ()
  derive: Callable[[RunFacts, dict], dict] | None = None


class RuleEntry(NamedTuple):
  """An aggregator registry entry: the factory and its declared needs."""
  factory: Callable[..., Any]
  needs: Needs = Needs()


def _refuse(name: str, message: str, argument: str = 'aggregator'):
  return SettingError(argument, f'{name!r} {message}')


def check_requirements(name: str, needs: Needs, facts: RunFacts) -> None:
  """Raises SettingError when the run cannot host rule `name`."""
  if needs.whole_model and not facts.whole_model:
    raise _refuse(name, 'scores or trains the full global model: it needs '
                  'one cohort and transform=identity')
  if needs.full_participation and (
      facts.clients_per_round != facts.num_clients or facts.delayed):
    raise _refuse(name, 'keeps per-client history and needs every client '
                  'every round and no client_delay: set '
                  'clients_per_round=0 (all)')
  if needs.per_client == 'slot' and len(facts.cohorts) > 1:
    raise _refuse(name, 'keeps per-slot history: it needs one cohort')
  if needs.tracks_model and facts.server_lr != 1.0:
    raise _refuse(name, 'tracks the global model and needs server_lr=1')
  if needs.per_client and facts.pre_aggregator:
    raise SettingError('pre_aggregator', f'mixes client updates; aggregator '
                       f'{name!r} keeps per-client history')


def _provided(name: str, what: str, facts: RunFacts) -> Any:
  """The run fact `what` for rule `name`."""
  model = facts.cohorts[0].model if facts.cohorts else None
  if what == 'server_data':
    if len(facts.server_data[1]) == 0:
      raise SettingError('validation_size', f'aggregator {name!r} needs '
                         'server data: set validation_fraction and '
                         'validation_size > 0')
    return facts.server_data
  if what == 'apply_fn':
    return model.apply
  if what == 'input_shape':
    return model.input_shape
  if what == 'output_path':
    return (model.roles or {}).get('head') if model is not None else None
  if what == 'forget':
    if facts.malicious is None:
      raise _refuse(name, 'forgets the attackers: it needs an attack with '
                    'a fixed malicious set (no resample_malicious)')
    return np.asarray(facts.malicious)
  raise ValueError(f'rule {name!r} declares provides={what!r}; expected '
                   f'names from {PROVIDED}')


def rule_kwargs(name: str, needs: Needs, facts: RunFacts,
                kwargs: dict[str, Any]) -> dict[str, Any]:
  """The factory keywords of rule `name` for this run.

  Checks the declared requirements, then fills (without overriding the
  explicit `kwargs`) the provided run facts, the per-client row count and
  the derived defaults.

  Raises:
    SettingError: naming the argument the run must change.
  """
  check_requirements(name, needs, facts)
  out = dict(kwargs)
  for what in needs.provides:
    out.setdefault(what, _provided(name, what, facts))
  if needs.per_client:
    out.setdefault('num_clients', facts.clients_per_round
                   if needs.per_client == 'slot' else facts.num_clients)
  if needs.derive is not None:
    for key, value in needs.derive(facts, out).items():
      out.setdefault(key, value)
  return out


# ---- Derived defaults shared by several rules ------------------------------


def server_training(facts: RunFacts, kwargs: dict) -> dict[str, Any]:
  """The server trains on its data U the way a client trains on its own:
  same optimizer, batch size and number of local iterations R_l (FLTrust
  Alg. 1 runs ModelUpdate(., D_0, b, beta, R_l) on both sides). With a
  small U that is several passes over it. R_l is the typical client's
  count (`RunFacts.client_steps`), not the largest client's."""
  del kwargs
  local = facts.local
  v = len(facts.server_data[1])
  steps = facts.client_steps or -(-v // local['batch_size']) * local[
      'epochs']
  return {'server_lr': local['lr'], 'server_momentum': local['momentum'],
          'server_batch_size': local['batch_size'], 'server_steps': steps}


def gradient_scale(facts: RunFacts, kwargs: dict) -> dict[str, Any]:
  """A threshold in gradient units (FedSGD) applied to local-training
  deltas: a delta of R_l local steps is about lr R_l / (1 - momentum)
  times the mean gradient it followed."""
  del kwargs
  r_l = facts.client_steps or 1
  return {'delta_scale': facts.local['lr'] * r_l /
          (1.0 - min(facts.local['momentum'], 0.99))}


def told_when_unlearning(facts: RunFacts, kwargs: dict) -> dict[str, Any]:
  """A rule that detects by itself, and is told the attackers only when
  asked to unlearn them (unlearn_round > 0)."""
  if not kwargs.get('unlearn_round'):
    return {}
  if facts.malicious is None:
    raise SettingError('aggregator', 'is told whom to forget when '
                       'unlearn_round > 0: it needs an attack with a fixed '
                       'malicious set (no resample_malicious)')
  return {'forget': np.asarray(facts.malicious)}
