"""Model registry: flax modules exposed as pure init/apply functions."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.models import zoo
from fedrobust.models.layers import (COMPUTE_DTYPES, CONV_IMPLS,
                                     default_compute_dtype, default_conv_impl)

Params = Any

MODELS: dict[str, type] = {
    'simple_cnn': zoo.SimpleCNN,
    'cnn': zoo.CNN,
    'vgg_small': zoo.VGGSmall,
    'row_lstm': zoo.RowLSTM,
    'mlp': zoo.MLP,
}


class Model(NamedTuple):
  """A model as two pure functions.

  init: key -> params (one client's pytree).
  apply: (params, x float[N, H, W, Ch]) -> logits float32[N, classes].
  """
  name: str
  init: Callable[[jax.Array], Params]
  apply: Callable[[Params, jax.Array], jax.Array]
  input_shape: tuple[int, ...]
  num_classes: int


def get_model(name: str, *, num_classes: int, input_shape: tuple[int, ...],
              conv_impl: str | None = None,
              dtype: jnp.dtype | None = None, **kwargs) -> Model:
  """Builds a registered model.

  Args:
    name: a key of MODELS.
    num_classes: output classes.
    input_shape: one example's (H, W, Ch).
    conv_impl: 'xla', 'im2col' or None for the backend default.
    dtype: compute dtype (params stay float32); None for float32.
    **kwargs: architecture overrides (e.g. width for 'cnn').

  Raises:
    ValueError: naming `--model` and the valid choices.
  """
  if name not in MODELS:
    raise ValueError(f'--model={name!r} is not a known model; expected one of '
                     f'{sorted(MODELS)}')
  conv_impl = conv_impl or default_conv_impl()
  if conv_impl not in CONV_IMPLS:
    raise ValueError(f'--conv_impl={conv_impl!r}; expected one of {CONV_IMPLS}')
  module = MODELS[name](num_classes=num_classes, conv_impl=conv_impl,
                        dtype=dtype, **kwargs)
  dummy = jnp.zeros((1, *input_shape), jnp.float32)

  def init(key: jax.Array) -> Params:
    return module.init(key, dummy)['params']

  def apply(params: Params, x: jax.Array) -> jax.Array:
    return module.apply({'params': params}, x)

  return Model(name, init, apply, tuple(input_shape), num_classes)


__all__ = ['MODELS', 'Model', 'get_model', 'default_conv_impl', 'CONV_IMPLS',
           'COMPUTE_DTYPES', 'default_compute_dtype']
