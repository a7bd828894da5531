"""State and data containers shared by the engine and the methods.

Dimension letters: K all clients of the federation, C clients in a round, N
examples of the largest client (padding), S local steps, B batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

Params = Any
PyTree = Any


class FederatedData(NamedTuple):
  """Every client's training data, padded to the largest client, on device.

  Images stay uint8 until a batch is gathered inside the compiled round.
  """
  x: jax.Array       # uint8[K, N, H, W, Ch]
  y: jax.Array       # int32[K, N]
  count: jax.Array   # int32[K], real examples of each client (<= N)


class LocalData(NamedTuple):
  """ONE client's view inside the round: the shared arrays plus its id."""
  x: jax.Array          # uint8[K, N, H, W, Ch] (not batched over clients)
  y: jax.Array          # int32[K, N]
  client_id: jax.Array  # int32[]
  count: jax.Array      # int32[]
  is_malicious: jax.Array | bool = False  # bool[], attacking this round
  attacker_rank: jax.Array | int = 0      # int32[], rank among attackers


class BatchPlan(NamedTuple):
  """ONE client's local-training schedule; leading axis S = epochs * steps."""
  index: jax.Array         # int32[S, B], rows of the client's data
  example_mask: jax.Array  # bool[S, B], False for padding in a partial batch
  step_mask: jax.Array     # bool[S], False for a step past the client's data


class ClientOutput(NamedTuple):
  """What ONE client returns; stacked over the round's clients as [C, ...]."""
  delta: Params          # client_params - server_params
  weight: jax.Array      # float32[], aggregation weight (examples seen)
  client_state: PyTree   # the method's new per-client state (() if none)
  metrics: dict[str, jax.Array]  # float32[] each


class ServerState(NamedTuple):
  """Everything a round reads and writes; checkpointed as one pytree."""
  round: jax.Array     # int32[], rounds completed
  params: Params       # the global model
  method_state: PyTree  # server-side state of the method (per-client arrays
                        # are indexed by client id: leaves [K, ...])
  key: jax.Array       # PRNG key data (uint32[2]); see engine.round
