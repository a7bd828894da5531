"""Method registry. Each entry builds a Method from keyword settings."""

from __future__ import annotations

from typing import Callable

from fedrobust.engine.round import Method
from fedrobust.methods.fedavg import fedavg
from fedrobust.methods.sdfc import sdfc

METHODS: dict[str, Callable[..., Method]] = {
    'fedavg': fedavg,
    'fedprox': fedavg,   # with proximal_mu > 0 (--fedprox_mu)
    'sdfc': sdfc,
}

# Flag defaults a bare --method=NAME uses (flags given explicitly win):
# the paper's Fashion-MNIST setting for SDFC (Sec. 4.1).
METHOD_DEFAULTS: dict[str, dict[str, object]] = {
    'sdfc': {
        'num_clients': 10, 'clients_per_round': 0, 'partition': 'dirichlet',
        'dirichlet_alpha': 0.5, 'attack': 'badnets',
        'malicious_fraction': 0.3, 'trigger_size': '2x6',
        'trigger_location': 'top_left', 'backdoor_target_label': 2,
        'poison_fraction': 0.5, 'validation_fraction': 0.1,
        'validation_size': 256, 'local_test_fraction': 0.0,
        'num_rounds': 50, 'local_epochs': 10, 'local_lr': 0.01,
        'momentum': 0.9, 'weight_decay': 1e-5, 'batch_size': 64,
        'sdfc_lambda': 5.0,
    },
}


def get_method(name: str, **kwargs) -> Method:
  """Builds METHODS[name]; ValueError naming --method for unknown names."""
  if name not in METHODS:
    raise ValueError(f'--method={name!r} is not a known method; expected one '
                     f'of {sorted(METHODS)}')
  return METHODS[name](**kwargs)


__all__ = ['METHODS', 'METHOD_DEFAULTS', 'Method', 'get_method']
