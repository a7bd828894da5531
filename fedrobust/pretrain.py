"""Central pretraining on a public split (the frozen base of FedAvg-LoRA).

A stand-in for the pretrained backbones the LoRA papers start from, where
none can be downloaded: the server trains the model for a few epochs on
public examples that no client holds, with the same masked local-SGD
kernel a client uses (fedrobust.local).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedrobust.errors import SettingError
from fedrobust.local import LocalConfig, classification_loss, local_sgd
from fedrobust.types import LocalData

Params = Any


def pretrain(apply_fn, params: Params, x: np.ndarray, y: np.ndarray, *,
             epochs: int, batch_size: int,
             optimizer: optax.GradientTransformation, key: jax.Array
             ) -> tuple[Params, dict[str, jax.Array]]:
  """`epochs` epochs of SGD on (x uint8[P, ...], y int[P]).

  Returns:
    (params, metrics averaged over the steps: train_loss, train_accuracy).

  Raises:
    SettingError: naming `public_size` when there is no example.
  """
  n = int(len(y))
  if n == 0:
    raise SettingError('public_size', 'central pretraining needs public '
                       'examples (public_size > 0)')
  local = LocalConfig(batch_size=batch_size, num_epochs=epochs,
                      steps_per_epoch=-(-n // batch_size))
  data = LocalData(jnp.asarray(x)[None], jnp.asarray(y, jnp.int32)[None],
                   jnp.int32(0), jnp.int32(n))

  @jax.jit
  def run(params, data, key):
    return local_sgd(classification_loss(apply_fn), params, data, key,
                     optimizer=optimizer, config=local)

  return run(params, data, key)
