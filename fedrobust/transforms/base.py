"""The parameter-transform contract: what a client trains and sends.

A transform splits a model's full parameters into a frozen `base` and a
`trainable` tree, and says how the two combine:

  t = TRANSFORMS[name](model, **settings)      # bound to one Model
  base, trainable = t.init(params, key)        # server side, once
  cov = t.coverage(trainable, spec, round)     # ONE client's ownership
  logits = t.apply(base, trainable, x, spec=spec, train=..., key=...)
  full = t.merge(base, trainable, spec)        # full params (evaluation)

`spec` is the client's traced per-client setting (its LoRA rank, its width
ratio); clients of one cohort may differ in it inside the same round.
`trainable` always has the cohort's largest shapes (every client's tree is
zero-padded to them, Horus Sec. V-C), and `coverage` says which coordinates
the client owns: 1.0 inside, 0.0 outside, or None when every client owns
everything (then no mask is built or multiplied at all). A client trains
`trainable * coverage` so that coordinates outside its coverage stay zero
and get zero gradient; the server averages each coordinate over its owners.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.errors import SettingError

Params = Any


class Transform(NamedTuple):
  name: str
  init: Callable[[Params, jax.Array], tuple[Params, Params]]
  coverage: Callable[[Params, jax.Array, jax.Array], Params | None]
  apply: Callable[..., jax.Array]
  merge: Callable[[Params, Params, jax.Array], Params]
  spec_values: tuple[float, ...] = ()   # the distinct per-client specs
  spec_name: str = ''                   # 'rank', 'ratio' or ''
  # LoRA only: spec (a client's rank, or None for the global adapter) ->
  # the scale s with W' = W + s a b (alpha / r).
  factor_scale: Callable[[Any], Any] | None = None


def masked(tree: Params, coverage: Params | None) -> Params:
  """tree * coverage leafwise (tree itself when coverage is None)."""
  if coverage is None:
    return tree
  return jax.tree.map(lambda t, c: t * c.astype(t.dtype), tree, coverage)


def module_paths(params: Params) -> list[str]:
  """'/'-joined paths of every module that owns a 'kernel' leaf."""
  out = []

  def walk(node, prefix):
    if not isinstance(node, dict):
      return
    if 'kernel' in node and not isinstance(node['kernel'], dict):
      out.append('/'.join(prefix))
    for key in sorted(node):
      walk(node[key], prefix + [key])

  walk(params, [])
  return out


def get_path(tree: Params, path: str) -> Params:
  node = tree
  for key in path.split('/'):
    node = node[key]
  return node


def set_path(tree: dict, path: str, value: Any) -> dict:
  """A copy of nested dict `tree` with `value` at `path` (dicts created)."""
  keys = path.split('/')
  out = dict(tree)
  node = out
  for key in keys[:-1]:
    node[key] = dict(node.get(key, {}))
    node = node[key]
  node[keys[-1]] = value
  return out


def resolve_targets(targets: tuple[str, ...], paths: list[str],
                    roles: dict[str, str] | None, *,
                    argument: str = 'lora_targets') -> list[str]:
  """Module paths selected by `targets`.

  Each target is a role name of the model ('first', 'head'), 'all',
  'random2' (two middle layers, neither 'first' nor 'head', drawn with a
  fixed seed, so every client and every run of this architecture gets the
  same two; fewer if the model has fewer: Horus's r_lora), or a glob over
  module paths ('Dense_*', 'encoder/*/query').

  Raises:
    SettingError: naming `lora_targets` when a target selects nothing.
  """
  roles = roles or {}
  chosen = []
  for target in targets:
    if target == 'all':
      hits = list(paths)
    elif target == 'random2':
      middle = [p for p in paths if p not in roles.values()]
      picks = np.random.default_rng(0).permutation(len(middle))[:2]
      hits = [middle[i] for i in sorted(picks)]
    elif target in roles:
      hits = [roles[target]]
    else:
      hits = [p for p in paths if fnmatch.fnmatchcase(p, target)]
    if not hits or any(h not in paths for h in hits):
      raise SettingError(argument, f'{target!r} selects no layer with '
                         f'a kernel; layers: {paths}, roles: '
                         f'{sorted(roles)}')
    chosen += [h for h in hits if h not in chosen]
  return chosen


def identity(model) -> Transform:
  """Every parameter is trainable and every client owns every coordinate
  (plain FedAvg-style training of the full model)."""

  def init(params, key):
    del key
    return (), params

  def coverage(trainable, spec, round_number):
    del trainable, spec, round_number
    return None

  def apply(base, trainable, x, *, spec=None, train=False, key=None):
    del base, spec
    return model.apply(trainable, x, train=train, key=key)

  def merge(base, trainable, spec=None):
    del base, spec
    return trainable

  return Transform('identity', init, coverage, apply, merge)


def ones_like_f32(tree: Params) -> Params:
  return jax.tree.map(lambda t: jnp.ones(t.shape, jnp.float32), tree)


def select(model, *, targets: tuple[str, ...] = ('first', 'head')
           ) -> Transform:
  """The full parameters of the `targets` layers are trainable, the rest of
  the model frozen (Horus's s_all with targets first,head; a_all is the
  identity transform). The trainable tree mirrors the params tree down to
  the selected modules."""
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  paths = resolve_targets(tuple(targets), module_paths(shapes), model.roles,
                          argument='select_targets')

  def init(params, key):
    del key
    trainable = {}
    for path in paths:
      trainable = set_path(trainable, path, get_path(params, path))
    return params, trainable

  def coverage(trainable, spec, round_number):
    del trainable, spec, round_number
    return None

  def merge(base, trainable, spec=None):
    del spec
    full = base
    for path in paths:
      full = set_path(full, path, get_path(trainable, path))
    return full

  def apply(base, trainable, x, *, spec=None, train=False, key=None):
    return model.apply(merge(base, trainable, spec), x, train=train, key=key)

  return Transform('select', init, coverage, apply, merge)
