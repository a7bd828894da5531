"""Who attacks in a round, and the model attack on their updates.

A Threat marks the attacking slots of a round's sample (data poisoning then
happens inside their local training: client_update sees
LocalData.is_malicious and LocalData.attacker_rank) and applies its model
attack to their deltas, raveled to float[C, D] per cohort: attackers craft
within their own architecture.

Shapes: C slots of a cohort, K clients, D flattened params.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.engine.config import CohortSlots
from fedrobust.engine.pipeline import (Attacked, RoundKeys, Slots,
                                       StepContext, per_cohort)
from fedrobust.tree import ravel_clients, unravel_like
from fedrobust.types import AttackContext, ClientOutput, FederatedData


class Threat(NamedTuple):
  """Who attacks, from when, and how updates are poisoned.

  Data poisoning is the method's business: client_update sees
  LocalData.is_malicious and LocalData.attacker_rank.

  Attributes:
    malicious: bool[K] fixed malicious set, or None to draw `num_malicious`
      clients afresh every round from the round key.
    num_malicious: attackers drawn each round when `malicious` is None.
    start_round: first (1-based) round in which attackers act; before it
      they behave honestly.
    model_attack: optional apply(updates float[C, D], is_malicious bool[C],
      mask bool[C], key) -> float[C, D] on the raveled client deltas (per
      cohort: attackers craft within their own architecture).
    absent: the malicious clients never take part (their slots are masked
      every round): the "Retrain" baseline of recovery papers, training
      without the attackers. Needs a fixed `malicious` set.
    every_round: from start_round on, every round's sample holds at least
      one attacker (FedHAN's detector setting, "at least one attacker per
      round"): if the uniform sample has none, a free attacker of the
      cohort takes the slot of a sampled benign client. Needs a fixed set.
    stateful_attack: optional attacks.threedfed.StatefulAttack (3DFed): a
      model attack that keeps state across rounds (ServerState.attack,
      from its init) and sees the global model and the data; synchronous
      rounds with one cohort only.
  """
  malicious: jax.Array | None = None
  num_malicious: int = 0
  start_round: int = 1
  model_attack: Callable | None = None
  absent: bool = False
  every_round: bool = False
  stateful_attack: Any = None


def malicious_slots(key: jax.Array, ids: jax.Array, mask: jax.Array,
                    threat: Threat, num_clients: int, round_number: jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
  """The attacking slots of a round.

  Returns:
    bool[C] attacking this round, int32[C] rank among the attackers.
  """
  if threat.malicious is not None:
    is_mal = threat.malicious[ids]
    # Rank by client id, so a client keeps its rank (DBA piece) every round.
    rank = jnp.cumsum(threat.malicious)[ids] - 1
  else:
    chosen = jnp.zeros(num_clients, bool).at[
        jax.random.permutation(key, num_clients)[:threat.num_malicious]
    ].set(True)
    is_mal = chosen[ids]
    rank = jnp.cumsum(is_mal) - 1
  is_mal = is_mal & mask & (round_number >= threat.start_round)
  return is_mal, jnp.maximum(rank, 0).astype(jnp.int32)


def slot_attackers(threat: Threat | None, key: jax.Array, ids: jax.Array,
                   mask: jax.Array, num_clients: int, round_number: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
  """`malicious_slots`, or no attacker without a (present) threat."""
  if threat is None or threat.absent:
    return jnp.zeros(ids.shape, bool), jnp.zeros(ids.shape, jnp.int32)
  return malicious_slots(key, ids, mask, threat, num_clients, round_number)


def with_an_attacker(key: jax.Array, slots: CohortSlots, ids: jax.Array,
                     mask: jax.Array, malicious: jax.Array,
                     free: jax.Array | None) -> jax.Array:
  """ids with one attacker swapped in when the live sample holds none.

  A uniformly drawn attacker of the cohort that is free (not busy, not
  sampled) replaces the first live benign slot; without such an attacker
  or benign slot the sample is unchanged.

  Args:
    key: the draw's key.
    slots: the cohort.
    ids: int32[C] the sampled clients.
    mask: bool[C] live slots.
    malicious: bool[K] the fixed malicious set.
    free: bool[K], clients that may start training (None: all).

  Returns:
    int32[C] the ids, one benign slot replaced where needed.
  """
  members = jnp.asarray(slots.members, jnp.int32)
  sampled = jnp.zeros(malicious.shape, bool).at[
      jnp.where(mask, ids, malicious.shape[0])].set(True, mode='drop')
  ok = malicious[members] & ~sampled[members]
  if free is not None:
    ok = ok & free[members]
  bad_slot = malicious[ids] & mask
  benign_slot = mask & ~malicious[ids]
  draw = jnp.where(ok, jax.random.uniform(key, members.shape), -1.0)
  pick = members[jnp.argmax(draw)]
  swap = ~jnp.any(bad_slot) & jnp.any(ok) & jnp.any(benign_slot)
  slot = jnp.argmax(benign_slot)
  return jnp.where(swap & (jnp.arange(ids.shape[0]) == slot), pick, ids)


def threatened_sample(threat: Threat | None, key: jax.Array,
                      slots: CohortSlots, ids: jax.Array, mask: jax.Array,
                      free: jax.Array | None, now: jax.Array
                      ) -> tuple[jax.Array, jax.Array]:
  """A cohort's sample as the threat shapes it.

  Absent attackers' slots are masked; with `every_round`, from the start
  round on, an attacker takes a benign slot of a sample without one
  (with_an_attacker, keyed by `key` folded with 0xA77).

  Args:
    threat: the attackers, or None.
    key: the cohort's sampling key.
    slots: the cohort.
    ids: int32[C] the sampled clients.
    mask: bool[C] live slots.
    free: bool[K] clients that may start training, or None (all).
    now: int32[] the round number.

  Returns:
    (ids int32[C], mask bool[C]).
  """
  if threat is None:
    return ids, mask
  if threat.absent:
    mask = mask & ~threat.malicious[ids]    # attackers never take part
  elif threat.every_round:
    forced = with_an_attacker(jax.random.fold_in(key, 0xA77), slots, ids,
                              mask, threat.malicious, free)
    ids = jnp.where(now >= threat.start_round, forced, ids)
  return ids, mask


def _with_flat_deltas(outputs: ClientOutput, flat: jax.Array
                      ) -> ClientOutput:
  """outputs with its deltas replaced by the rows of flat float[C, D]."""
  like = jax.tree.map(lambda leaf: leaf[0], outputs.delta)
  return outputs._replace(delta=jax.vmap(
      lambda row: unravel_like(row, like))(flat))


def apply_model_attack(outputs: ClientOutput, threat: Threat,
                       is_mal: jax.Array, mask: jax.Array, key: jax.Array
                       ) -> ClientOutput:
  """outputs with threat.model_attack applied to the raveled deltas."""
  return _with_flat_deltas(outputs, threat.model_attack(
      ravel_clients(outputs.delta), is_mal, mask, key))


def apply_stateful_attack(outputs: ClientOutput, threat: Threat,
                          is_mal: jax.Array, mask: jax.Array, key: jax.Array,
                          attack_state: Any, context: AttackContext
                          ) -> tuple[ClientOutput, Any, jax.Array]:
  """threat.stateful_attack on the raveled deltas.

  Returns:
    (outputs attacked, the attack's new state, decoys bool[C]: benign
    slots that carry the attackers' upload).
  """
  attacked, attack_state, decoys = threat.stateful_attack.apply(
      ravel_clients(outputs.delta), is_mal, mask, key, attack_state, context)
  return _with_flat_deltas(outputs, attacked), attack_state, decoys


def attack_slots(ctx: StepContext, j: int, slots: Slots,
                 outputs: ClientOutput, keys: RoundKeys, attack_state: Any,
                 params: Any, data: FederatedData
                 ) -> tuple[Attacked, Any]:
  """The threat stage: the model attacks on a cohort's trained updates.

  The model attack is keyed by the round's attack key (per cohort), the
  stateful attack by that key folded with 0x3DFED; the stateful attack
  sees the global model `params` the clients started from and the data.

  Args:
    ctx: the step's context (its threat may be None).
    j: the cohort.
    slots: the slots that trained.
    outputs: their ClientOutput, leaves [C, ...].
    keys: the round's keys.
    attack_state: the stateful attack's state (ServerState.attack).
    params: cohort j's global trainable tree.
    data: the federated data.

  Returns:
    (Attacked, the stateful attack's new state).
  """
  threat = ctx.threat
  attacking = jnp.sum(slots.is_mal).astype(jnp.float32)
  decoys = None
  if threat is not None and threat.model_attack is not None:
    outputs = apply_model_attack(outputs, threat, slots.is_mal, slots.mask,
                                 per_cohort(keys.attack, j))
  if threat is not None and threat.stateful_attack is not None:
    outputs, attack_state, decoys = apply_stateful_attack(
        outputs, threat, slots.is_mal, slots.mask,
        jax.random.fold_in(keys.attack, 0x3DFED), attack_state,
        AttackContext(params, data, slots.ids, slots.rank))
    # A decoy is the attackers' upload in a benign client's slot.
    slots = slots._replace(is_mal=slots.is_mal | decoys)
  return Attacked(outputs, slots, attacking, decoys), attack_state
