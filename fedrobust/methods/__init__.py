"""Method registry: each entry is a MethodSpec (methods/base.py) declaring
its factory, settings, server data and default aggregator."""

from __future__ import annotations

from fedrobust.errors import SettingError, check_registration
from fedrobust.methods.base import SERVER_DATA, MethodSpec
from fedrobust.methods.fedala import FEDALA, fedala
from fedrobust.methods.fedalt import FEDALT
from fedrobust.methods.fedavg import FEDAVG, FEDPROX, fedavg
from fedrobust.methods.dual_lora import FDLORA, PF2LORA
from fedrobust.methods.feddpa import FEDDPA_F, FEDDPA_T
from fedrobust.methods.fedhan import FEDHAN, fedhan
from fedrobust.methods.fedlora import (FEDIT, FFA_LORA, FLEXLORA, FLORA,
                                      LORA_FAIR, fedit)
from fedrobust.methods.hilora import HILORA, hilora
from fedrobust.methods.horus import HORUS, horus
from fedrobust.methods.personal_lora import FEDSA_LORA, LOCAL_LORA
from fedrobust.methods.rfd_lora import RFD_LORA, rfd_lora
from fedrobust.methods.sdfc import SDFC, sdfc
from fedrobust.types import Method

METHODS: dict[str, MethodSpec] = {
    'fdlora': FDLORA,
    'fedala': FEDALA,
    'fedalt': FEDALT,
    'fedavg': FEDAVG,
    'feddpa_f': FEDDPA_F,
    'feddpa_t': FEDDPA_T,
    'fedhan': FEDHAN,
    'fedit': FEDIT,
    'fedprox': FEDPROX,
    'fedsa_lora': FEDSA_LORA,
    'ffa_lora': FFA_LORA,
    'flexlora': FLEXLORA,
    'flora': FLORA,
    'hilora': HILORA,
    'horus': HORUS,
    'local_lora': LOCAL_LORA,
    'pf2lora': PF2LORA,
    'lora_fair': LORA_FAIR,
    'rfd_lora': RFD_LORA,
    'sdfc': SDFC,
}


def register_method(name: str, spec: MethodSpec, *,
                    replace: bool = False) -> None:
  """Adds a method to the registry, so that runs and sweeps take it by
  name; its declared settings become config keys `<name>_<setting>`.

  Raises:
    ValueError: the name is taken (and not `replace`), or not a plain name.
  """
  check_registration('method', name, METHODS, replace=replace)
  METHODS[name] = spec


def get_method_spec(name: str) -> MethodSpec:
  """METHODS[name]; SettingError naming `method` for unknown names."""
  if name not in METHODS:
    raise SettingError('method', f'{name!r} is not a known method; expected '
                       f'one of {sorted(METHODS)}')
  return METHODS[name]


def get_method(name: str, **kwargs) -> Method:
  """Builds METHODS[name] with its declared settings' defaults, overridden
  by `kwargs` (core keywords: cohorts, local, optimizer, aggregator, ...).
  An unset aggregator is the method's default rule, given the settings it
  takes from the method (and, for a per-client cache, one row per client
  of the cohorts)."""
  from fedrobust import aggregators  # pylint: disable=g-import-not-at-top
  spec = get_method_spec(name)
  settings = {s.kwarg: s.default for s in spec.settings}
  settings.update({k: v for k, v in kwargs.items() if k in settings})
  core = {k: v for k, v in kwargs.items() if k not in settings}
  if core.get('aggregator') is None and spec.uses_aggregator:
    rule = spec.default_aggregator(settings)
    extra = dict(spec.aggregator_defaults(settings, rule))
    if aggregators.needs_of(rule).per_client == 'id':   # a row per id
      extra['num_clients'] = core.get('num_clients') or 1 + max(
          m for c in core['cohorts'] for m in c.members)
    core['aggregator'] = aggregators.get_aggregator(rule, num_byzantine=0,
                                                    **extra)
  return spec.build(**core, **settings)


__all__ = ['METHODS', 'SERVER_DATA', 'Method', 'MethodSpec', 'fedavg', 'fedit',
           'fedhan', 'get_method', 'get_method_spec', 'register_method', 'hilora', 'horus',
           'rfd_lora',
           'sdfc']
