"""What an attack needs from the run, declared with its registry entry.

An `AttackEntry` pairs the factory with `AttackNeeds`: the attack's kind
(data poisoning inside local training, a model-space rewrite of the
updates, or a stateful attack that sees the global model), the inputs it
reads (images, token ids, or either), whether it plants a backdoor (and
how its success is measured), the run facts its factory takes, and
defaults derived from the run. `attack_kwargs` is the one generic reader.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from fedrobust.errors import SettingError

KINDS = ('data', 'model', 'stateful')
INPUTS = ('image', 'text', 'any')
# The run facts a factory may take, by factory argument name.
PROVIDED = ('image_shape', 'target_label', 'trigger', 'poison_fraction',
            'num_classes', 'source_label', 'alpha', 'seed', 'server_lr')


class AttackNeeds(NamedTuple):
  """An attack's declared kind, inputs and the run facts it takes.

  kind: 'data' (poisons malicious clients' batches in local training),
    'model' (rewrites malicious updates, ModelAttack) or 'stateful'
    (StatefulAttack: sees the global model and keeps state; needs
    synchronous rounds, one identity-transform cohort and local SGD).
  inputs: 'image', 'text' (token ids) or 'any'.
  backdoor: '' for an untargeted attack; else the trigger kind its attack
    success rate is measured with (`triggered_test_set`'s `attack`).
  provides: run facts passed to the factory (names from PROVIDED).
  derive: (facts dict, kwargs) -> (factory keyword defaults, keyword
    arguments of the triggered test set); explicit kwargs win. It may pop
    keys of kwargs that configure the run rather than the factory.
  """
  kind: str = 'model'
  inputs: str = 'any'
  backdoor: str = ''
  provides: tuple[str, ...] = ()
  derive: Callable[[dict, dict], tuple[dict, dict]] | None = None


class AttackEntry(NamedTuple):
  """An attack registry entry: the factory and its declared needs."""
  factory: Callable[..., Any]
  needs: AttackNeeds = AttackNeeds()


def check_inputs(name: str, needs: AttackNeeds, text: bool) -> None:
  """Raises SettingError when the dataset's inputs do not fit the attack."""
  if needs.inputs == 'image' and text:
    from fedrobust.attacks import ATTACK_ENTRIES  # pylint: disable=g-import-not-at-top
    fits = sorted(n for n, e in ATTACK_ENTRIES.items()
                  if e.needs.kind == 'data' and e.needs.inputs != 'image')
    raise SettingError('attack', f'{name!r} stamps images; the dataset holds '
                       f'token ids (data attacks on token ids: {fits})')
  if needs.inputs == 'text' and not text:
    raise SettingError('attack', f'{name!r} reads token ids: it needs a text '
                       'dataset (e.g. dataset=vader_movies)')


def attack_kwargs(name: str, needs: AttackNeeds, facts: dict[str, Any],
                  kwargs: dict[str, Any]) -> tuple[dict, dict]:
  """(factory keywords, triggered-test-set keywords) of attack `name`."""
  kwargs = dict(kwargs)
  derived, triggered = ({}, {}) if needs.derive is None else needs.derive(
      facts, kwargs)
  out = {p: facts[p] for p in needs.provides}
  out.update(derived)
  out.update(kwargs)
  return out, triggered
