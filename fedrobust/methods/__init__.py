"""Method registry. Each entry builds a Method from keyword settings."""

from __future__ import annotations

from typing import Callable

from fedrobust.engine.round import Method
from fedrobust.methods.fedavg import fedavg

METHODS: dict[str, Callable[..., Method]] = {
    'fedavg': fedavg,
    'fedprox': fedavg,   # with proximal_mu > 0 (--fedprox_mu)
}


def get_method(name: str, **kwargs) -> Method:
  """Builds METHODS[name]; ValueError naming --method for unknown names."""
  if name not in METHODS:
    raise ValueError(f'--method={name!r} is not a known method; expected one '
                     f'of {sorted(METHODS)}')
  return METHODS[name](**kwargs)


__all__ = ['METHODS', 'Method', 'get_method']
