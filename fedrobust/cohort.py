"""Cohorts: groups of clients that share an architecture and a transform.

A federation may mix architectures (Horus: CNN and row-LSTM clients) or
LoRA ranks (RFD-LoRA). Each cohort has its own Model, Transform, member
clients and clients-per-round; the engine batches each cohort's clients on
its own, inside the same compiled round, and the method's server step sees
every cohort's updates and decides what is shared.

Sharing across cohorts goes by *role*: the model declares which module
plays 'first' (feature-first layer) or 'head' (classifier), and the
trainable subtree under that module (full weights, or its LoRA factors) is
what cohorts exchange. Shapes may differ across cohorts (a CNN's 256-unit
penultimate layer against an LSTM's 128); they are aligned by zero-padding
every leaf to the largest shape, with a coverage mask that is 1 only where
the client's own tree has the coordinate (Horus Sec. V-C.1), and the
aggregate is trimmed back to each cohort's shape.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.errors import SettingError
from fedrobust.transforms.base import Transform, get_path

Params = Any


class Cohort(NamedTuple):
  """One cohort of the federation (static: closed over by the method).

  specs: float per client of the federation (length K; only members'
  entries matter): the client's transform setting (LoRA rank, width ratio).
  redraw: if non-empty, a client's spec is instead drawn uniformly from
  these values afresh every round (keyed by client and round; FedHAN's
  per-round width d_{t,i}); `specs` then only say who evaluates which
  submodel.
  """
  name: str
  model: Any                    # fedrobust.models.Model
  transform: Transform
  members: tuple[int, ...]      # sorted client ids
  clients_per_round: int        # C_j
  specs: tuple[float, ...] = ()
  redraw: tuple[float, ...] = ()


def single_cohort(model, transform: Transform, num_clients: int,
                  clients_per_round: int, specs=()) -> tuple[Cohort, ...]:
  """The common case: every client in one cohort."""
  return (Cohort(model.name, model, transform, tuple(range(num_clients)),
                 clients_per_round, tuple(specs)),)


def member_positions(cohorts: tuple[Cohort, ...]) -> list[jax.Array]:
  """Per cohort, int32[K]: a client id's row in that cohort's per-client
  stacks (its index in `members`; 0 for non-members)."""
  k = max(max(c.members) for c in cohorts) + 1
  out = []
  for c in cohorts:
    pos = np.zeros(k, np.int32)
    pos[list(c.members)] = np.arange(len(c.members))
    out.append(jnp.asarray(pos))
  return out


def split_roles(tree: dict, model, roles: tuple[str, ...]
                ) -> tuple[dict, dict]:
  """(shared {role: subtree}, private tree without those subtrees).

  Raises:
    SettingError: naming `share` when a role is missing from the model or
      from the tree (e.g. LoRA that does not target the shared layer).
  """
  shared, private = {}, tree
  for role in roles:
    path = (model.roles or {}).get(role)
    if path is None:
      raise SettingError('share', f'model {model.name!r} declares no role '
                         f'{role!r} (roles: {sorted(model.roles or {})})')
    try:
      shared[role] = get_path(tree, path)
    except (KeyError, TypeError):
      raise SettingError('share', f'role {role!r} ({path}) of model '
                         f'{model.name!r} is not in what its clients train '
                         '(e.g. LoRA does not target that layer)') from None
    private = _without(private, path.split('/'))
  return shared, private


def _without(tree: dict, keys: list[str]) -> dict:
  out = dict(tree)
  if len(keys) == 1:
    del out[keys[0]]
    return out
  inner = _without(out[keys[0]], keys[1:])
  if inner:
    out[keys[0]] = inner
  else:
    del out[keys[0]]
  return out


def join_roles(private: dict, shared: dict, model) -> dict:
  """Inverse of split_roles."""
  out = private
  for role, subtree in shared.items():
    out = _with(out, model.roles[role].split('/'), subtree)
  return out


def _with(tree: dict, keys: list[str], value) -> dict:
  out = dict(tree)
  if len(keys) == 1:
    out[keys[0]] = value
  else:
    out[keys[0]] = _with(out.get(keys[0], {}), keys[1:], value)
  return out


def matrix_view(shape: tuple[int, ...], ndim: int) -> tuple[int, ...]:
  """`shape` with its leading axes merged so that it has `ndim` axes, e.g.
  a conv kernel (5, 5, 1, 6) -> (25, 6) for ndim 2 (its [fan-in, out]
  matrix, the view HOPS and the projection weights read)."""
  shape = tuple(shape)
  if len(shape) <= ndim:
    return shape
  keep = shape[len(shape) - ndim + 1:]
  return (int(np.prod(shape[:len(shape) - ndim + 1])),) + keep


def aligned_shapes(trees: list[Params]) -> Params:
  """Elementwise largest leaf shape over trees of one structure (no leading
  client axis). Leaves of different ranks (a conv kernel shared with a dense
  or recurrent kernel) are aligned as their matrix views: leading axes
  merged down to the smallest rank (Horus Sec. V-C.1 pads [d_in, d_out]
  matrices).

  Raises:
    SettingError: naming `share` when structures differ.
  """
  structures = {jax.tree.structure(t) for t in trees}
  if len(structures) != 1:
    raise SettingError('share', 'the shared layers have different '
                       f'structures across cohorts: {structures}')
  def biggest(*leaves):
    ndim = min(len(np.shape(l)) for l in leaves)
    views = [matrix_view(np.shape(l), ndim) for l in leaves]
    return jax.ShapeDtypeStruct(tuple(np.max(views, axis=0)), jnp.float32)
  return jax.tree.map(biggest, *trees)


def pad_to(tree: Params, shapes: Params, *, lead: int = 0) -> Params:
  """Zero-pads every leaf (after `lead` leading axes, in its matrix view
  when `shapes` has fewer axes) to `shapes`."""
  def pad(leaf, like):
    if leaf.ndim - lead != len(like.shape):
      leaf = leaf.reshape(leaf.shape[:lead] + matrix_view(
          leaf.shape[lead:], len(like.shape)))
    widths = [(0, 0)] * lead + [(0, t - s) for s, t in
                                zip(leaf.shape[lead:], like.shape)]
    return jnp.pad(leaf, widths)
  return jax.tree.map(pad, tree, shapes)


def trim_to(tree: Params, shapes: Params) -> Params:
  """The leading corner of every leaf with the shape of `shapes`' leaf (of
  its matrix view, reshaped back, when the leaf has fewer axes)."""
  def trim(leaf, like):
    target = tuple(np.shape(like))
    view = matrix_view(target, np.ndim(leaf))
    out = leaf[tuple(slice(0, s) for s in view)]
    return out.reshape(target) if view != target else out
  return jax.tree.map(trim, tree, shapes)


def align_stacked(stacked: list[Params], coverage: list[Params | None],
                  shapes: Params) -> tuple[Params, Params]:
  """Concatenates cohorts' stacked trees [P_j, ...] padded to `shapes`.

  Returns:
    (updates [sum P_j, ...], coverage [sum P_j, ...] in {0, 1}): 1 where the
    coordinate exists in the client's own tree and its own coverage is 1.
  """
  ups, covs = [], []
  for tree, cov in zip(stacked, coverage):
    if cov is None:
      cov = jax.tree.map(lambda l: jnp.ones(l.shape, jnp.float32), tree)
    ups.append(pad_to(tree, shapes, lead=1))
    covs.append(pad_to(jax.tree.map(lambda c: c.astype(jnp.float32), cov),
                       shapes, lead=1))
  cat = lambda *leaves: jnp.concatenate(leaves, axis=0)
  return jax.tree.map(cat, *ups), jax.tree.map(cat, *covs)
