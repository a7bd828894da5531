"""Graceful preemption: SIGTERM or SIGINT ends a run at a round boundary.

TPU VMs, spot GPUs, Slurm and Kubernetes preempt a job with SIGTERM and
a grace period. Inside `Preemption`, the first SIGTERM or SIGINT only sets
a flag: the runner finishes the round in flight, checkpoints it (verified,
like every step) and exits with `EXIT_CODE`. Running the same command
again resumes from that round, bitwise as if nothing had happened.

The first signal also restores the default handlers, so a second one ends
the process at once (the newest checkpoint is still intact; only the
rounds since it are lost, as after kill -9).

Under jax.distributed every process must stop after the same round, or
the next collective would hang: `requested()` is then agreed across
processes (any process that got a signal stops them all), at the round
boundary that every process reaches.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Callable

import jax
import numpy as np

# EX_TEMPFAIL (sysexits.h): "a temporary failure; the user is invited to
# retry". Schedulers and scripts can requeue on it.
EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
  """The run stopped early at a signal; its last round is checkpointed."""

  def __init__(self, message: str, summary: dict):
    super().__init__(message)
    self.summary = summary


def _agreed_any(flag: bool) -> bool:
  """Whether `flag` is set on any process (a collective under
  jax.distributed; every process must call it at the same point)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  flags = multihost_utils.process_allgather(np.asarray([int(flag)],
                                                       np.int32))
  return bool(np.any(flags))


class Preemption:
  """Catches SIGTERM / SIGINT for the life of the `with` block.

  `received` names the first signal (None until one comes); `requested()`
  is what the loop asks at each round boundary.
  """

  def __init__(self, agree: Callable[[bool], bool] | None = None):
    self.received: str | None = None
    self._agree = agree
    self._previous: dict[int, object] = {}

  def _handle(self, signum, frame) -> None:
    del frame
    self.received = signal.Signals(signum).name
    # A second signal takes the default action: the process ends at once.
    for sig in SIGNALS:
      signal.signal(sig, signal.SIG_DFL)
    logging.warning('%s received: finishing this round, then checkpointing '
                    'it and exiting (send it again to abort at once)',
                    self.received)

  def __enter__(self) -> 'Preemption':
    if threading.current_thread() is threading.main_thread():
      for sig in SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def requested(self) -> bool:
    """Whether to stop after this round (agreed across processes)."""
    return (self._agree or _agreed_any)(self.received is not None)
