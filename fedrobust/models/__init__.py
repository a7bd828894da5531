"""Model registry: flax modules exposed as pure init/apply functions."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.errors import SettingError
from fedrobust.models import vit, zoo
from fedrobust.models.pipelines import PIPELINES, get_pipeline
from fedrobust.models.layers import (COMPUTE_DTYPES, CONV_IMPLS,
                                     PROBE_INPUTS, PROBE_OUTPUTS,
                                     default_compute_dtype, default_conv_impl)

Params = Any

# Marks a MODELS entry that is not a zoo module (see _text_model).
TEXT_MODEL = object()

MODELS: dict[str, type] = {
    'simple_cnn': zoo.SimpleCNN,
    'simple_cnn_release': functools.partial(zoo.SimpleCNN, release=True),
    'cnn': zoo.CNN,
    'vgg_small': zoo.VGGSmall,
    'row_lstm': zoo.RowLSTM,
    # Pretrained all-MiniLM-L6-v2 (fedrobust.models.bert; ./setup.sh
    # --text) on int32 token ids [L]: built by _text_model.
    'minilm': TEXT_MODEL,
    'mlp': zoo.MLP,
    # A small ViT (fedrobust.models.vit) for the LoRA methods' vision
    # variants, trained in the project (no pretrained checkpoint).
    'vit': vit.ViT,
}


class Model(NamedTuple):
  """A model as pure functions plus what other components need to know.

  init: key -> params (one client's pytree).
  apply: (params, x [N, H, W, Ch] as stored (uint8 images), *, train=False,
      key=None, lora=None) -> logits float32[N, classes]. The model's input
      pipeline (models/pipelines.py) turns the stored examples into what
      the network computes on, so every caller preprocesses alike. `train`
      is True inside local training, `key` feeds train-time randomness
      (random crops, dropout), `lora` is an optional tree of LoRA factors
      read by the layers at their own paths (see models/layers.py); it
      needs `lora_native`.
  input_shape: one stored example's shape (before the pipeline).
  roles: role name ('first', 'head') -> '/'-joined module path.
  width_units: per parameter leaf, per axis, the hidden units the axis
      indexes (0: not sliced); see models/zoo.py.
  lora_native: apply() honours `lora` factors (every zoo model does).
  probe: None, or (params, x as stored) -> (forward, zeros):
      forward(perturbations) gives (logits, inputs): the logits with each
      Dense / Conv output shifted by its perturbation, and each layer's
      input (module path -> {'x': (float[N, ...],)}), from one forward
      pass; `zeros` is the perturbation tree at zero (module path ->
      {'out': float[N, ...]}; a conv fused with its pool, conv_impl
      'block', has float[N, Ho/2, Wo/2, 4, Cout]); eval mode. The
      gradient of a loss with respect to the perturbations is every
      layer's per-example output gradient (methods/sdfc/fisher.py).
  """
  name: str
  init: Callable[[jax.Array], Params]
  apply: Callable[..., jax.Array]
  input_shape: tuple[int, ...]
  num_classes: int
  roles: dict[str, str] | None = None
  width_units: Any = None
  lora_native: bool = False
  pipeline: str = 'native'
  probe: Callable[..., Any] | None = None


def get_model(name: str, *, num_classes: int, input_shape: tuple[int, ...],
              conv_impl: str | None = None,
              dtype: jnp.dtype | None = None, pipeline: str = 'native',
              **kwargs) -> Model:
  """Builds a registered model.

  Args:
    name: a key of MODELS.
    num_classes: output classes.
    input_shape: one stored example's (H, W, Ch).
    conv_impl: 'xla', 'im2col', 'block' or None for the backend default.
    pipeline: the input pipeline (models/pipelines.PIPELINES).
    dtype: compute dtype (params stay float32); None for float32.
    **kwargs: architecture overrides (e.g. width for 'cnn').

  Raises:
    SettingError: naming `model` (or `conv_impl`) and the valid choices.
  """
  if name not in MODELS:
    raise SettingError('model', f'{name!r} is not a known model; expected '
                       f'one of {sorted(MODELS)}')
  if MODELS[name] is TEXT_MODEL:
    return _text_model(name, num_classes=num_classes,
                       input_shape=input_shape, dtype=dtype,
                       pipeline=pipeline, **kwargs)
  conv_impl = conv_impl or default_conv_impl()
  if conv_impl not in CONV_IMPLS:
    raise SettingError('conv_impl', f'got {conv_impl!r}; expected one of '
                       f'{CONV_IMPLS}')
  module = MODELS[name](num_classes=num_classes, conv_impl=conv_impl,
                        dtype=dtype, **kwargs)
  pipe = get_pipeline(pipeline)
  dummy = jnp.zeros((1, *pipe.output_shape(tuple(input_shape))),
                    jnp.float32)

  def init(key: jax.Array) -> Params:
    return module.init(key, dummy)['params']

  def apply(params: Params, x: jax.Array, *, train: bool = False,
            key: jax.Array | None = None, lora: Params | None = None
            ) -> jax.Array:
    pipe_key = None
    if train and key is not None and pipe.random:
      pipe_key, key = jax.random.split(key)
    x = pipe.prepare(x, train=train, key=pipe_key)
    variables = {'params': params}
    if lora is not None:
      variables['lora'] = lora
    rngs = {'dropout': key} if (train and key is not None) else None
    return module.apply(variables, x, train=train, rngs=rngs)

  def probe(params: Params, x: jax.Array):
    x = pipe.prepare(x, train=False, key=None)

    def forward(perturbations):
      # One forward gives the logits and every probed layer's input, so a
      # gradient through it (methods/sdfc/fisher.py, has_aux) reuses the
      # activations it saved: a separate pass for the inputs cost 14-18%
      # of the factored Fisher (BUILD_NOTES §4).
      logits, probed = module.apply(
          {'params': params, PROBE_OUTPUTS: perturbations}, x,
          mutable=[PROBE_INPUTS])
      return logits, probed[PROBE_INPUTS]

    out_shapes = jax.eval_shape(
        lambda: module.apply({'params': params}, x,
                             mutable=[PROBE_OUTPUTS])[1][PROBE_OUTPUTS])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes)
    return forward, zeros

  shapes = jax.eval_shape(init, jax.random.key(0))
  return Model(name, init, apply, tuple(input_shape), num_classes,
               roles=dict(module.roles()),
               width_units=module.width_units(shapes), lora_native=True,
               pipeline=pipeline, probe=probe)


def _text_model(name: str, *, num_classes: int,
                input_shape: tuple[int, ...], dtype, pipeline: str,
                **kwargs) -> 'Model':
  """The pretrained MiniLM encoder with a fresh head on [L] token ids."""
  from fedrobust.models import bert  # pylint: disable=g-import-not-at-top
  if len(input_shape) != 1:
    raise SettingError('model', f'{name!r} reads int32 token ids [L]; the '
                       f'dataset stores examples of shape {input_shape} '
                       '(use a text dataset, e.g. --dataset=vader_movies)')
  if pipeline not in ('native', 'tokens'):
    raise SettingError('input_pipeline', f'{name!r} reads token ids as '
                       f'stored; got {pipeline!r}')
  return bert.bert_model(num_classes=num_classes, max_len=input_shape[0],
                         dtype=dtype, name=name, **kwargs)


__all__ = ['MODELS', 'Model', 'PIPELINES', 'get_model', 'default_conv_impl',
           'CONV_IMPLS', 'COMPUTE_DTYPES', 'default_compute_dtype']
