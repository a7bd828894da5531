"""Stage one of a round: which clients of a cohort take part.

sample_cohort draws the cohort's C_j clients (uniformly, or per stratum of
ids); sample_slots turns that draw into the round's Slots: clients busy
with an earlier update are masked (client delays), the threat shapes the
sample (threat.threatened_sample) and marks its attackers, every client
gets its training key, and the arrival mode starts the live clients.

Shapes: C slots of a cohort (C_j padded to the device count), K clients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.engine.config import CohortSlots, RoundConfig, strata_members
from fedrobust.engine.pipeline import (Flight, RoundKeys, Slots, StepContext,
                                       per_cohort)
from fedrobust.engine.threat import slot_attackers, threatened_sample
from fedrobust.errors import SettingError

if TYPE_CHECKING:
  from fedrobust.engine.arrivals import ArrivalMode


def sample_cohort(key: jax.Array, slots: CohortSlots, num_slots: int, *,
                  num_clients: int = 0, strata: int = 1
                  ) -> tuple[jax.Array, jax.Array]:
  """Uniform sample of C_j distinct members, sorted, padded to the slots.

  With strata > 1 (RoundConfig.sample_strata; num_clients K needed): C_j /
  strata members of each stratum (ids s K / strata .. (s + 1) K / strata -
  1), uniform within it, sorted; the slots are stratum-major, so under a
  mesh whose devices hold the strata in order every slot is a client of
  its own device. Slots past C_j are padding, as without strata.

  Args:
    key: the cohort's sampling key.
    slots: the cohort.
    num_slots: C_j padded to the device count.
    num_clients: K (needed with strata).
    strata: RoundConfig.sample_strata.

  Returns:
    ids int32[num_slots] and mask bool[num_slots]; padded slots carry the
    first member's id and mask False.
  """
  members = jnp.asarray(slots.members, jnp.int32)
  k, c = len(slots.members), slots.clients_per_round
  if strata > 1:
    per = c // strata
    ids = []
    for s, block in enumerate(strata_members(slots, num_clients, strata)):
      block = jnp.asarray(block, jnp.int32)
      pick = jax.random.permutation(jax.random.fold_in(key, s),
                                    block.shape[0])[:per]
      ids.append(jnp.sort(block[pick]))
    ids = jnp.concatenate(ids)
  elif c == k:
    ids = members
  else:
    ids = jnp.sort(members[jax.random.permutation(key, k)[:c]])
  pad = num_slots - c
  mask = jnp.concatenate([jnp.ones(c, bool), jnp.zeros(pad, bool)])
  # From the members array, not the Python int: replicas of a federation
  # (fedrobust.Replicas) share this program with other members.
  fill = jnp.broadcast_to(members[:1], (pad,))
  return jnp.concatenate([ids.astype(jnp.int32), fill]), mask




def sample_clients(key: jax.Array, config: RoundConfig
                   ) -> tuple[jax.Array, jax.Array]:
  """The single-cohort sample (see sample_cohort)."""
  slots = config.cohort_slots()
  if len(slots) != 1:
    raise SettingError('cohorts', 'sample_clients is for one cohort; use '
                       'sample_cohort')
  return sample_cohort(key, slots[0], config.num_slots,
                       num_clients=config.num_clients,
                       strata=config.sample_strata)


def device_blocked_members(slots: CohortSlots, config: RoundConfig
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Every member of the cohort once, grouped by the device holding it.

  The slots are grouped by the device whose block of sharded data holds
  the member, each device's group padded to the largest with masked copies
  of its first member (the setup step's "everyone" under
  client_data='sharded').

  Returns:
    ids int32[N * G] and mask bool[N * G] for N devices of G slots, and
    the slot order that lists the members in the cohort's own order,
    padding last.
  """
  blocks = strata_members(slots, config.num_clients, config.num_devices)
  width = max(len(b) for b in blocks)
  ids = np.concatenate([list(b) + [b[0]] * (width - len(b))
                        for b in blocks]).astype(np.int32)
  mask = np.concatenate([[True] * len(b) + [False] * (width - len(b))
                         for b in blocks])
  slot_of = {int(m): i for i, m in enumerate(ids) if mask[i]}
  order = np.array([slot_of[m] for m in slots.members] +
                   np.flatnonzero(~mask).tolist())
  return ids, mask, order


def client_keys(key: jax.Array, ids: jax.Array) -> jax.Array:
  """Key data per slot: the client id folded into `key`."""
  return jax.vmap(lambda i: jax.random.key_data(
      jax.random.fold_in(key, i)))(ids)


def sample_slots(ctx: StepContext, mode: ArrivalMode, j: int,
                 slots: CohortSlots, keys: RoundKeys, now: jax.Array,
                 flight: Flight) -> tuple[Slots, Any, Flight]:
  """The sample stage: cohort j's clients of round `now`.

  Args:
    ctx: the step's context.
    mode: the arrival mode (which clients are free; starting them).
    j: the cohort's index.
    slots: the cohort.
    keys: the round's keys.
    now: int32[] the round number.
    flight: the client delays' bookkeeping so far this round.

  Returns:
    (the sampled Slots, whose live slots (mask) are the clients that start
    this round; their delays int32[C], or None without client delays; the
    updated Flight).
  """
  config = ctx.config
  key = per_cohort(keys.sample, j)
  ids, mask = sample_cohort(key, slots, config.padded(slots.clients_per_round),
                            num_clients=config.num_clients,
                            strata=config.sample_strata)
  free = mode.free(flight, now)
  if free is not None:
    mask = mask & free[ids]    # busy clients are away
  ids, mask = threatened_sample(ctx.threat, key, slots, ids, mask, free, now)
  is_mal, rank = slot_attackers(ctx.threat, keys.threat, ids, mask,
                                config.num_clients, now)
  # A client's key depends on its id and the round, never on its slot.
  started = Slots(ids, mask, is_mal, rank, client_keys(keys.client, ids))
  delays, flight = mode.start(config, key, ids, mask, flight, now)
  return started, delays, flight
