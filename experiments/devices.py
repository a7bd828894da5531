"""How many XLA devices this host's CPU is split into.

On XLA:CPU one device runs the round's clients one after another, and the
small GEMMs of a client step keep two cores only partly busy. Splitting the
host into several CPU devices and sharding the client axis over them (the
same `jax.sharding.Mesh` path used for GPUs and TPUs) runs clients side by
side instead: on the 2-core development box the simple-CNN round is about
1.8x faster with 2 devices than with 1 (BUILD_NOTES §4). The count must be
set before JAX starts its CPU backend, so this lives with the host code.

Several CPU devices meet at every cross-device collective, and XLA:CPU
aborts the whole process (SIGABRT, 'Termination timeout ... of 40 seconds
exceeded') when one device thread reaches a rendezvous more than 40 s
after another. On an oversubscribed host (several runs sharing 2 cores),
or when a run is paused with SIGSTOP, one thread can lag that long, and a
finished-looking sweep cell dies (BUILD_NOTES §1). So the
termination timeout is raised to an hour before the backend starts.
"""

from __future__ import annotations

import importlib.util
import os

import jax

_XLA_FLAG = '--xla_force_host_platform_device_count'
_TIMEOUT_FLAG = '--xla_cpu_collective_call_terminate_timeout_seconds'
COLLECTIVE_TIMEOUT_S = 3600
# The first jaxlib this flag was checked on (0.10.2). XLA aborts a process
# whose XLA_FLAGS name a flag it does not know, so older ones are left alone.
_TIMEOUT_FLAG_SINCE = (0, 10)


def _version(text: str) -> tuple[int, ...]:
  parts = []
  for part in text.split('.')[:3]:
    digits = ''.join(c for c in part if c.isdigit())
    if not digits:
      break
    parts.append(int(digits))
  return tuple(parts)


def _accelerator_plugin() -> bool:
  """Whether a GPU or TPU plugin is installed (there the round's
  collectives are not XLA:CPU's, and the flag is left out: it was only
  checked on the CPU-only jaxlib)."""
  return any(importlib.util.find_spec(name) is not None for name in
             ('jax_cuda12_plugin', 'jax_cuda13_plugin', 'libtpu'))


def relax_collective_timeout(seconds: int = COLLECTIVE_TIMEOUT_S,
                             jaxlib_version: str | None = None,
                             accelerator: bool | None = None) -> bool:
  """Raises XLA:CPU's rendezvous termination timeout (default 40 s) to
  `seconds` through XLA_FLAGS, unless XLA_FLAGS already sets it, the
  jaxlib predates the flag or a GPU/TPU plugin is installed. Takes effect
  only before the CPU backend starts. Returns whether it changed
  XLA_FLAGS."""
  if jaxlib_version is None:
    import jaxlib  # pylint: disable=g-import-not-at-top
    jaxlib_version = jaxlib.__version__
  if accelerator is None:
    accelerator = _accelerator_plugin()
  current = os.environ.get('XLA_FLAGS', '')
  if (_TIMEOUT_FLAG + '=' in current or accelerator or
      _version(jaxlib_version) < _TIMEOUT_FLAG_SINCE):
    return False
  os.environ['XLA_FLAGS'] = f'{current} {_TIMEOUT_FLAG}={seconds}'.strip()
  return True


def available_cores() -> int:
  """Cores this process may run on (its affinity mask, not the machine)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:   # not Linux
    return os.cpu_count() or 1


def auto_cpu_devices(clients_per_round: int, cores: int | None = None,
                     strata: int = 1) -> int:
  """The fewest CPU devices (at most one per core) for the shortest round.

  With one device per core, the busiest device trains ceil(C / cores)
  clients. Fewer devices reach the same per-device load with less slot
  padding (a padded slot still trains): C = 20 on 16 cores gives 10
  devices of 2 clients, not 16 devices holding 12 padded slots.

  strata: sharded client data needs the device count to divide the
  sampling strata (RoundConfig.sample_strata); the count is then the
  largest divisor of `strata` not above the one above (C = 20, 4 strata
  on 16 cores: 4 devices, where 10 would be refused).
  """
  cores = max(1, available_cores() if cores is None else cores)
  clients = max(1, clients_per_round)
  per_device = -(-clients // cores)
  count = -(-clients // per_device)
  if strata > 1:
    count = max(d for d in range(1, count + 1) if strata % d == 0)
  return count


def configure_cpu_devices(cpu_devices: int, clients_per_round: int,
                          strata: int = 1) -> int:
  """Sets JAX's CPU device count (and relax_collective_timeout); call
  before any JAX computation.

  Args:
    cpu_devices: the --cpu_devices flag; 0 picks auto_cpu_devices.
    clients_per_round: C, the clients each round trains.
    strata: the sampling strata the device count must divide (sharded
      client data), else 1; auto mode only.

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
  relax_collective_timeout()
  for flag in reversed(os.environ.get('XLA_FLAGS', '').split()):
    if flag.startswith(_XLA_FLAG + '='):    # XLA reads the last one
      return int(flag.split('=', 1)[1])
  wanted = cpu_devices or auto_cpu_devices(clients_per_round, strata=strata)
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
