"""Parameter transforms: what a client trains and sends (see base.py).

  t = TRANSFORMS[name](model, **settings)
  base, trainable = t.init(params, key)

identity: the full model (FedAvg); lora: frozen model plus LoRA factors on
chosen kernels, ranks may differ per client; select: the full parameters of
chosen layers, the rest frozen; width: HeteroFL/FedRolex width-sliced
submodels, ratios may differ per client.
"""

from __future__ import annotations

from typing import Callable

from fedrobust.errors import SettingError
from fedrobust.transforms.base import (Transform, get_path, identity, masked,
                                       module_paths, resolve_targets, select,
                                       set_path)
from fedrobust.transforms.lora import lora, lora_paths
from fedrobust.transforms.width import submodel_units, width

TRANSFORMS: dict[str, Callable[..., Transform]] = {
    'identity': identity,
    'lora': lora,
    'select': select,
    'width': width,
}


def get_transform(name: str, model, **kwargs) -> Transform:
  if name not in TRANSFORMS:
    raise SettingError('transform', f'{name!r} is not a known transform; '
                       f'expected one of {sorted(TRANSFORMS)}')
  return TRANSFORMS[name](model, **kwargs)


__all__ = ['TRANSFORMS', 'Transform', 'get_path', 'get_transform',
           'identity', 'lora', 'lora_paths', 'masked', 'module_paths',
           'resolve_targets', 'select', 'set_path', 'submodel_units',
           'width']
