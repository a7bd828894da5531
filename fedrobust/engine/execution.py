"""How the round's clients are executed: vmap, chunked vmap or lax.map.

The client function is written for ONE client. The strategy is a compile
choice and never changes a result beyond float reassociation:

- 'vmap': all C clients batched. Best on GPU/TPU.
- 'chunked': lax.map over chunks of `chunk_size` vmapped clients; bounds
  memory at large C.
- 'sequential': lax.map over clients. On XLA:CPU it avoids the grouped
  convolutions that vmap makes of per-client conv weights, and a client's
  padded steps are skipped by lax.cond instead of computed and discarded.

With a `jax.sharding.Mesh`, the client axis is split over the mesh's
'clients' axis with `jax.shard_map`; each device runs the strategy on its
own clients, and reductions over clients in the server update become
all-reduces. On CPU the experiment runner splits the host into up to one
XLA device per core (experiments/devices.py), so the same path runs
clients side by side there too.

The server update runs on replicated arrays: every device computes all of
it. A server step with batch work of its own (RFD-LoRA's distillation over
the anchors) marks that batch with `spread_batch`; the round traces the
server update under its mesh (`on_mesh`), so GSPMD splits the batch over
the devices and all-reduces what is summed over it.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from fedrobust.errors import SettingError

PyTree = Any
STRATEGIES = ('vmap', 'chunked', 'sequential')
CLIENT_AXIS = 'clients'
# Where the clients' training data lives on the mesh (RoundConfig.client_data).
CLIENT_DATA = ('replicated', 'sharded')


def default_strategy(backend: str | None = None) -> str:
  """'sequential' on CPU, 'vmap' on GPU/TPU (see BUILD_NOTES.md)."""
  backend = backend or jax.default_backend()
  return 'sequential' if backend == 'cpu' else 'vmap'


def validate_strategy(strategy: str, chunk_size: int) -> None:
  if strategy not in STRATEGIES:
    raise SettingError('client_execution', f'got {strategy!r}; expected '
                       f'one of {("auto",) + STRATEGIES}')
  if strategy == 'chunked' and chunk_size < 1:
    raise SettingError('chunk_size', 'client_execution=chunked needs '
                       f'chunk_size >= 1, got {chunk_size}')


def map_clients(fn: Callable[[PyTree], PyTree], per_client: PyTree, *,
                strategy: str, chunk_size: int = 0) -> PyTree:
  """Applies `fn` (ONE client) over leaves [C, ...] of `per_client`."""
  validate_strategy(strategy, chunk_size)
  if strategy == 'vmap':
    return jax.vmap(fn)(per_client)
  if strategy == 'sequential':
    return jax.lax.map(fn, per_client)
  c = jax.tree.leaves(per_client)[0].shape[0]
  k = min(chunk_size, c)
  padded = -(-c // k) * k

  def pad_and_split(leaf):
    if padded != c:  # repeat slot 0; the copies are sliced off below
      fill = jnp.broadcast_to(leaf[:1], (padded - c, *leaf.shape[1:]))
      leaf = jnp.concatenate([leaf, fill])
    return leaf.reshape(padded // k, k, *leaf.shape[1:])

  out = jax.lax.map(jax.vmap(fn), jax.tree.map(pad_and_split, per_client))
  return jax.tree.map(lambda leaf: leaf.reshape(padded, *leaf.shape[2:])[:c],
                      out)


def on_mesh(fn: Callable, mesh: Mesh | None) -> Callable:
  """fn traced with `mesh` as the ambient (abstract) mesh, so the
  `spread_batch` hints inside it split over the mesh's devices. Its
  outputs are constrained to be replicated, whatever the hints split
  inside it, so the round's state keeps one layout from round to round.
  Without a mesh, or on one device, fn itself."""
  if mesh is None or mesh.size == 1:
    return fn
  replicated = jax.sharding.NamedSharding(mesh, P())

  def traced_on_mesh(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      out = fn(*args, **kwargs)
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, replicated)
        if isinstance(x, jax.Array) else x, out)
  return traced_on_mesh


def spread_batch(x: jax.Array, axis: int = 0) -> jax.Array:
  """x, hinted to GSPMD as split over the devices along `axis`.

  The values are unchanged; reductions over the axis become per-device
  partial sums and an all-reduce (float reassociation only). It applies
  under `on_mesh` when the ambient mesh has an automatic 'clients' axis and
  that axis's size divides x.shape[axis]; otherwise (no mesh, inside the
  clients' shard_map, an indivisible batch) x is returned as is.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or CLIENT_AXIS not in mesh.axis_names:
    return x
  if CLIENT_AXIS in getattr(mesh, 'manual_axes', ()):
    return x
  n = mesh.shape[CLIENT_AXIS]
  if n == 1 or x.shape[axis] % n:
    return x
  spec = [None] * x.ndim
  spec[axis] = CLIENT_AXIS
  return jax.lax.with_sharding_constraint(x, P(*spec))


def client_mesh(num_devices: int | None = None) -> Mesh:
  """A 1-D mesh named 'clients' over the first `num_devices` devices."""
  devices = jax.devices()
  if num_devices is not None:
    if not 1 <= num_devices <= len(devices):
      raise SettingError('num_devices', f'got {num_devices}; this host '
                         f'sees {len(devices)} device(s)')
    devices = devices[:num_devices]
  return Mesh(np.array(devices), (CLIENT_AXIS,))


def run_clients(fn: Callable[[PyTree, PyTree], PyTree], per_client: PyTree,
                shared: PyTree, *, strategy: str, chunk_size: int = 0,
                mesh: Mesh | None = None,
                shared_specs: PyTree | None = None) -> PyTree:
  """Runs fn(one_client_slice, shared) for every client slot.

  Args:
    fn: ONE client's computation.
    per_client: leaves [C, ...]; C must be a multiple of the mesh size.
    shared: replicated inputs (global params, the data arrays, ...).
    strategy: one of STRATEGIES.
    chunk_size: clients per vmapped chunk for 'chunked'.
    mesh: optional mesh with a 'clients' axis.
    shared_specs: with a mesh, PartitionSpecs for `shared` (a prefix of
      its tree; None: all replicated). A leaf split over 'clients' reaches
      fn as the device's own block, e.g. client data sharded by id range.

  Returns:
    fn's outputs stacked over clients, leaves [C, ...].
  """
  def local(per_client, shared):
    return map_clients(lambda one: fn(one, shared), per_client,
                       strategy=strategy, chunk_size=chunk_size)

  if mesh is None or mesh.size == 1:
    return local(per_client, shared)
  c = jax.tree.leaves(per_client)[0].shape[0]
  if c % mesh.size:
    raise ValueError(f'{c} client slots do not split over {mesh.size} '
                     'devices; pad the round (engine.round does)')
  specs = P() if shared_specs is None else shared_specs
  return jax.shard_map(local, mesh=mesh, in_specs=(P(CLIENT_AXIS), specs),
                       out_specs=P(CLIENT_AXIS), check_vma=False)(
                           per_client, shared)


def _rows(leaf, lo: int, hi: int) -> np.ndarray:
  """Rows lo .. hi - 1 of a host leaf; a lazy one (data.ClientRows, with
  a `block` method) builds only those."""
  block = getattr(leaf, 'block', None)
  return block(lo, hi) if block is not None else np.asarray(leaf[lo:hi])


def place_clients(tree: PyTree, mesh: Mesh | None, layout: str) -> PyTree:
  """Host arrays with a leading client axis [K, ...] onto the mesh.

  layout 'replicated': every device holds every row. 'sharded': the rows
  split over the mesh's 'clients' axis in order, device d holding rows
  d K / N .. (d + 1) K / N - 1. Each device's block is built and sent on
  its own, so a lazy leaf (data.ClientRows) never builds the whole array
  on the host. Under several processes (jax.distributed) each process
  builds and contributes only the rows of its own devices
  (`jax.make_array_from_process_local_data`), so no host reads or sends
  another's rows.

  Raises:
    SettingError naming `client_data` when K does not split evenly.
  """
  if layout not in CLIENT_DATA:
    raise SettingError('client_data', f'got {layout!r}; expected one of '
                       f'{CLIENT_DATA}')
  if mesh is None:
    return jax.tree.map(jnp.asarray, tree)
  if layout == 'replicated' or mesh.size == 1:
    host = lambda a: a if isinstance(a, jax.Array) else np.asarray(a)
    return jax.device_put(jax.tree.map(host, tree),
                          jax.sharding.NamedSharding(mesh, P()))
  sharding = jax.sharding.NamedSharding(mesh, P(CLIENT_AXIS))

  def place(leaf):
    shape = tuple(leaf.shape)
    if shape[0] % mesh.size:
      raise SettingError('client_data', f'{shape[0]} clients do not '
                         f'split evenly over {mesh.size} devices')
    if jax.process_count() == 1:
      return jax.make_array_from_callback(
          shape, sharding, lambda index: _rows(leaf, index[0].start,
                                               index[0].stop))
    spans = sorted({(index[0].start, index[0].stop) for index in
                    sharding.addressable_devices_indices_map(
                        shape).values()})
    if not spans:
      raise SettingError('client_data', f'process {jax.process_index()} '
                         f'holds none of the mesh\'s {mesh.size} devices, '
                         'so it has no client block to place; build the '
                         'mesh over every process\'s devices (num_devices '
                         f'= {jax.device_count()}, all of them)')
    lo, hi = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != hi - lo:
      raise SettingError('client_data', 'this process\'s devices hold '
                         f'client blocks {spans}, not contiguous on the '
                         'mesh; order the mesh devices by process')
    return jax.make_array_from_process_local_data(sharding,
                                                  _rows(leaf, lo, hi), shape)
  return jax.tree.map(place, tree)
