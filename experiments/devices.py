"""How many XLA devices this host's CPU is split into.

On XLA:CPU one device runs the round's clients one after another, and the
small GEMMs of a client step keep two cores only partly busy. Splitting the
host into several CPU devices and sharding the client axis over them (the
same `jax.sharding.Mesh` path used for GPUs and TPUs) runs clients side by
side instead: on the 2-core development box the simple-CNN round is about
1.8x faster with 2 devices than with 1 (BUILD_NOTES §4). The count must be
set before JAX starts its CPU backend, so this lives with the host code.
"""

from __future__ import annotations

import os

import jax

_XLA_FLAG = '--xla_force_host_platform_device_count'


def available_cores() -> int:
  """Cores this process may run on (its affinity mask, not the machine)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:   # not Linux
    return os.cpu_count() or 1


def auto_cpu_devices(clients_per_round: int, cores: int | None = None) -> int:
  """The fewest CPU devices (at most one per core) for the shortest round.

  With one device per core, the busiest device trains ceil(C / cores)
  clients. Fewer devices reach the same per-device load with less slot
  padding (a padded slot still trains): C = 20 on 16 cores gives 10
  devices of 2 clients, not 16 devices holding 12 padded slots.
  """
  cores = max(1, available_cores() if cores is None else cores)
  clients = max(1, clients_per_round)
  per_device = -(-clients // cores)
  return -(-clients // per_device)


def configure_cpu_devices(cpu_devices: int, clients_per_round: int) -> int:
  """Sets JAX's CPU device count; call before any JAX computation.

  Args:
    cpu_devices: the --cpu_devices flag; 0 picks auto_cpu_devices.
    clients_per_round: C, the clients each round trains.

  Returns:
    The CPU device count JAX will use. An explicit
    --xla_force_host_platform_device_count in XLA_FLAGS wins (the tests
    set one). In auto mode, a CPU backend that has already started keeps
    its count.

  Raises:
    ValueError: naming --cpu_devices, for a negative count, or when an
      explicit count comes after the CPU backend has started.
  """
  if cpu_devices < 0:
    raise ValueError(f'--cpu_devices must be >= 0, got {cpu_devices}')
  for flag in reversed(os.environ.get('XLA_FLAGS', '').split()):
    if flag.startswith(_XLA_FLAG + '='):    # XLA reads the last one
      return int(flag.split('=', 1)[1])
  wanted = cpu_devices or auto_cpu_devices(clients_per_round)
  if jax.config.jax_num_cpu_devices == wanted:
    return wanted
  try:
    jax.config.update('jax_num_cpu_devices', wanted)
  except RuntimeError as err:
    if cpu_devices:
      raise ValueError(f'--cpu_devices={cpu_devices}: JAX has already '
                       f'started its CPU backend ({err})') from err
    return jax.local_device_count('cpu')
  return wanted
