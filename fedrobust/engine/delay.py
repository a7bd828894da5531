"""Client delays for semi-asynchronous rounds.

A client sampled in round t that is free starts training from the round's
broadcast; its update arrives d rounds later (d = 0: this round, as in a
synchronous round), and the client is busy, hence unavailable, until its
update has arrived. d is drawn per (client, round) from the user's choice:

  none            every update arrives in the round it was computed
  uniform:MAX     d ~ U{0, ..., MAX}
  exponential:M   d ~ Geometric with mean M on {0, 1, ...} (the discrete
                  exponential: P(d = k) = (1 - p)^k p, p = 1 / (1 + M)),
                  capped at MAX = ceil(8 M) (P(cap) < 0.2% for M >= 1), or
                  at an explicit cap: exponential:M:MAX

The cap bounds the in-flight buffer: a cohort holds (MAX + 1) * C_j
pending updates (engine.arrivals). A client's delay depends on its id and
the round only, never on its slot.

By default the server takes every update due in a round, so the
aggregator sees all (MAX + 1) * C_j buffer rows, most of them masked. With
`max_arrivals` A (RoundConfig) it takes at most A of them, oldest computed
first, and hands the aggregator only those A rows; the rest wait a round
longer (their client stays busy) and arrive staler. A >= C_j keeps the ring
safe: the entries computed R - 1 rounds ago are the oldest pending ones,
at most C_j, so they are always taken before their ring row is reused.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.errors import SettingError
from fedrobust.types import PendingBuffer

DELAY_KINDS = ('none', 'uniform', 'exponential')


class DelayModel(NamedTuple):
  kind: str         # 'uniform' or 'exponential'
  mean: float       # exponential: M; uniform: MAX / 2
  max_delay: int    # the cap (uniform: MAX)


def parse_delay(text: str) -> DelayModel | None:
  """'none' | 'uniform:MAX' | 'exponential:MEAN[:MAX]' -> DelayModel/None.

  Raises:
    SettingError: naming `client_delay`.
  """
  parts = (text or 'none').strip().split(':')
  kind = parts[0]
  bad = SettingError('client_delay', f'{text!r}; expected none, '
                     'uniform:MAX (int >= 1) or exponential:MEAN[:MAX] '
                     '(MEAN > 0)')
  if kind == 'none' and len(parts) == 1:
    return None
  try:
    if kind == 'uniform' and len(parts) == 2:
      top = int(parts[1])
      if top < 1:
        raise bad
      return DelayModel('uniform', top / 2.0, top)
    if kind == 'exponential' and len(parts) in (2, 3):
      mean = float(parts[1])
      if not (mean > 0 and math.isfinite(mean)):
        raise bad
      cap = int(parts[2]) if len(parts) == 3 else max(1, math.ceil(8 * mean))
      if cap < 1:
        raise bad
      return DelayModel('exponential', mean, cap)
  except ValueError:
    raise bad from None
  raise bad


def sample_delays(key: jax.Array, ids: jax.Array, model: DelayModel
                  ) -> jax.Array:
  """int32[C] delays in rounds for clients `ids` (keyed by client id)."""
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(ids)
  if model.kind == 'uniform':
    draw = jax.vmap(lambda k: jax.random.randint(k, (), 0,
                                                 model.max_delay + 1))(keys)
  else:
    p = 1.0 / (1.0 + model.mean)
    draw = jax.vmap(lambda k: jax.random.geometric(k, p))(keys) - 1
  return jnp.minimum(draw, model.max_delay).astype(jnp.int32)


def ring_rows(model: DelayModel) -> int:
  """R = max_delay + 1 rounds of slots in a cohort's in-flight buffer."""
  return model.max_delay + 1


def empty_buffer(output_shapes, ids_shape: int, model: DelayModel):
  """A PendingBuffer of zeros for a cohort with `ids_shape` slots per round.

  Args:
    output_shapes: ONE client's ClientOutput as ShapeDtypeStructs.
    ids_shape: the cohort's (padded) slots per round.
    model: the delay model.
  """
  p = ring_rows(model) * ids_shape
  zeros = lambda s: jnp.zeros((p, *s.shape), s.dtype)
  return PendingBuffer(
      outputs=jax.tree.map(zeros, output_shapes),
      ids=jnp.zeros((p,), jnp.int32), is_malicious=jnp.zeros((p,), bool),
      computed_round=jnp.zeros((p,), jnp.int32),
      arrival_round=jnp.zeros((p,), jnp.int32), valid=jnp.zeros((p,), bool))


def enqueue(buffer, now: jax.Array, outputs, ids: jax.Array,
            is_malicious: jax.Array, delays: jax.Array, mask: jax.Array,
            model: DelayModel):
  """Writes round `now`'s slots into ring row now mod R.

  The row's previous entries were written R rounds ago with delays <= R - 1
  and have arrived, so nothing in flight is overwritten. Masked slots are
  written invalid (they never arrive).
  """
  c = ids.shape[0]
  start = (now % ring_rows(model)) * c
  put = lambda leaf, new: jax.lax.dynamic_update_slice_in_dim(
      leaf, new.astype(leaf.dtype), start, axis=0)
  return buffer._replace(
      outputs=jax.tree.map(put, buffer.outputs, outputs),
      ids=put(buffer.ids, ids), is_malicious=put(buffer.is_malicious,
                                                 is_malicious & mask),
      computed_round=put(buffer.computed_round,
                         jnp.broadcast_to(now, (c,))),
      arrival_round=put(buffer.arrival_round, now + delays),
      valid=put(buffer.valid, mask))


def empty_tickets(ticket_shapes, num_clients: int):
  """train_on_arrival's in-flight table: one row per client id (a client
  has at most one update in flight), holding what its training needs when
  it is due (`ticket_shapes`: ONE client's, e.g. its start-round key)."""
  zeros = lambda s: jnp.zeros((num_clients, *s.shape), s.dtype)
  return PendingBuffer(
      outputs=jax.tree.map(zeros, ticket_shapes),
      ids=jnp.arange(num_clients, dtype=jnp.int32),
      is_malicious=jnp.zeros((num_clients,), bool),
      computed_round=jnp.zeros((num_clients,), jnp.int32),
      arrival_round=jnp.zeros((num_clients,), jnp.int32),
      valid=jnp.zeros((num_clients,), bool))


def start_tickets(table, now: jax.Array, tickets, ids: jax.Array,
                  is_malicious: jax.Array, delays: jax.Array,
                  mask: jax.Array):
  """Writes the clients starting in round `now` into their rows (masked
  slots write nothing)."""
  rows = jnp.where(mask, ids, table.ids.shape[0])
  put = lambda leaf, new: leaf.at[rows].set(new.astype(leaf.dtype),
                                           mode='drop')
  return table._replace(
      outputs=jax.tree.map(put, table.outputs, tickets),
      is_malicious=put(table.is_malicious, is_malicious & mask),
      computed_round=put(table.computed_round,
                         jnp.broadcast_to(now, ids.shape)),
      arrival_round=put(table.arrival_round, now + delays),
      valid=put(table.valid, mask))


def take_oldest(buffer, now: jax.Array, count: int):
  """The server takes at most `count` of the updates due now.

  Due rows are taken oldest computed first (ties in slot order); due rows
  beyond `count` stay in flight with arrival_round now + 1.

  Returns:
    (rows int32[min(count, P)]: the buffer rows taken, in order;
     taken bool[...]: which of them are real arrivals;
     staleness int32[...] of those rows;
     deferred bool[P]: rows due now that wait a round;
     the buffer without the taken rows).
  """
  due = buffer.valid & (buffer.arrival_round == now)
  key = jnp.where(due, buffer.computed_round, jnp.iinfo(jnp.int32).max)
  rows = jnp.argsort(key, stable=True)[:count].astype(jnp.int32)
  taken = due[rows]
  picked = jnp.zeros(due.shape, bool).at[rows].set(taken)
  deferred = due & ~picked
  staleness = jnp.where(taken, now - buffer.computed_round[rows], 0)
  return rows, taken, staleness, deferred, buffer._replace(
      valid=buffer.valid & ~picked,
      arrival_round=jnp.where(deferred, now + 1, buffer.arrival_round))


def dequeue(buffer, now: jax.Array):
  """(arriving bool[P], staleness int32[P], buffer without them)."""
  arriving = buffer.valid & (buffer.arrival_round == now)
  staleness = jnp.where(arriving, now - buffer.computed_round, 0)
  return arriving, staleness, buffer._replace(valid=buffer.valid & ~arriving)
