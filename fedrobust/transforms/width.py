"""Width-sliced submodels (HeteroFL, Diao et al. 2021; FedRolex, Alam et
al. 2022) as a parameter transform.

A client of width ratio p trains the first ceil(p * U) units of every
hidden layer of U units (HeteroFL), or a window of them that rolls by one
unit per round (FedRolex, `rolling=True`); input pixels and output classes
are never sliced. Which axis of which parameter indexes which layer's units
is declared by the model (`Model.width_units`): unit of index i is i mod U,
which covers plain channels, channels after an NHWC flatten, and the four
gate blocks of an LSTM kernel alike.

With static shapes the submodel is the full tree times a 0/1 mask: a unit
whose incoming weights and bias are zero outputs relu(0) = 0 (LSTM: its
cell and hidden state stay 0), and its outgoing weights are masked too, so
the masked full model computes exactly the narrow model's function and the
masked coordinates get zero gradient. The client's update carries the mask
as its coverage; the server averages each coordinate over the clients that
own it (HeteroFL Sec. 3.1).

Fjord (Horvath et al. 2021), `ordered_dropout=True`: a client of ratio p
trains, at each local step, the prefix submodel of a width drawn uniformly
from the cohort's ratios up to p, so every nested submodel learns; its
update covers its largest (p) submodel.

Not modelled: HeteroFL's per-width "scaler" (dividing a layer's output by
p during training) and static batch norm; the zoo models have no batch
norm, and we measured nothing that needs the scaler yet (BUILD_NOTES).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.errors import SettingError
from fedrobust.transforms.base import Transform, masked


def _units_for(units_tree, path: tuple[str, ...], ndim: int
               ) -> tuple[int, ...]:
  node = units_tree
  for key in path:
    if not isinstance(node, dict) or key not in node:
      return (0,) * ndim
    node = node[key]
  if not isinstance(node, tuple) or len(node) != ndim:
    raise SettingError('model', f'width_units of {"/".join(path)} is '
                       f'{node!r}, expected {ndim} entries')
  return node


def width(model, *, ratios: tuple[float, ...] = (1.0,),
          rolling: bool = False, ordered_dropout: bool = False
          ) -> Transform:
  """Width slicing of `model`'s hidden layers.

  Args:
    model: a fedrobust.models.Model with width_units.
    ratios: the distinct client width ratios p in (0, 1] of this cohort.
    rolling: FedRolex's rolling window instead of HeteroFL's prefix.
    ordered_dropout: Fjord's per-step width draw (see the module docstring).

  Returns:
    A Transform whose spec is the client's ratio (float32[]).
  """
  ratios = tuple(float(r) for r in ratios)
  if not ratios or min(ratios) <= 0 or max(ratios) > 1:
    raise SettingError('width_ratios', f'must be in (0, 1], got {ratios}')
  if model.width_units is None:
    raise SettingError('model', f'{model.name!r} declares no width_units')
  if rolling and ordered_dropout:
    raise SettingError('width_variant', 'fedrolex and fjord exclude each '
                       'other')
  full = (len(set(ratios)) == 1 and ratios[0] == 1.0 and not rolling and
          not ordered_dropout)
  allowed = jnp.asarray(sorted(set(ratios)), jnp.float32)
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  units = [_units_for(model.width_units, tuple(k.key for k in path),
                      len(leaf.shape)) for path, leaf in flat]

  def init(params, key):
    del key
    return (), params

  def leaf_mask(shape, leaf_units, ratio, round_number):
    mask = jnp.ones(shape, jnp.float32)
    for axis, u in enumerate(leaf_units):
      if not u:
        continue
      keep = jnp.maximum(jnp.ceil(ratio * u - 1e-4), 1.0)
      unit = jnp.arange(shape[axis]) % u
      offset = (round_number % u) if rolling else 0
      owned = ((unit - offset) % u < keep).astype(jnp.float32)
      view = [1] * len(shape)
      view[axis] = shape[axis]
      mask = mask * owned.reshape(view)
    return mask

  def coverage(trainable, spec, round_number):
    if full:
      return None
    ratio = jnp.asarray(spec, jnp.float32)
    leaves = jax.tree.leaves(trainable)
    return jax.tree.unflatten(treedef, [
        leaf_mask(leaf.shape, u, ratio, round_number)
        for leaf, u in zip(leaves, units)])

  def apply(base, trainable, x, *, spec=None, train=False, key=None):
    del base           # the client trains trainable * coverage already
    if ordered_dropout and train and key is not None and spec is not None:
      logits = jnp.where(allowed <= jnp.asarray(spec, jnp.float32) + 1e-6,
                         0.0, -jnp.inf)
      p = allowed[jax.random.categorical(jax.random.fold_in(key, 0x0D),
                                         logits)]
      trainable = masked(trainable, coverage(trainable, p, jnp.int32(0)))
    return model.apply(trainable, x, train=train, key=key)

  def merge(base, trainable, spec=None):
    del base
    if spec is None or full:
      return trainable
    return masked(trainable, coverage(trainable, spec, jnp.int32(0)))

  return Transform('width', init, coverage, apply, merge,
                   spec_values=tuple(sorted(set(ratios))), spec_name='ratio')


def submodel_units(model, ratio: float) -> dict:
  """Units each hidden layer keeps at `ratio` (for reporting)."""
  out = {}
  flat, _ = jax.tree_util.tree_flatten_with_path(
      jax.eval_shape(model.init, jax.random.key(0)))
  for path, leaf in flat:
    u = _units_for(model.width_units, tuple(k.key for k in path),
                   len(leaf.shape))
    if u and u[-1]:
      out['/'.join(k.key for k in path)] = int(max(1, np.ceil(ratio * u[-1]
                                                              - 1e-4)))
  return out
