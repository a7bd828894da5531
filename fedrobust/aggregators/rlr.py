"""Robust learning rate, RLR (Ozdayi et al., AAAI 2021).

Per coordinate d, the server counts the sign votes of the n real clients
and flips its learning rate where the agreement is below a threshold:

  eta_d = +1  if |sum_i sgn(g_{i,d})| >= theta
          -1  otherwise
  update_d = eta_d * sum_i n_i g_{i,d} / sum_i n_i

A backdoor pushes coordinates the honest majority does not care about;
there the honest signs cancel, the vote falls under theta and the
attackers' contribution is reversed.

Robustness notes:
  * Non-finite clients are excluded (no vote, no mean contribution).
  * theta defaults to max(1, f + 1): a coordinate must collect more
    agreeing votes than the f attackers can cast alone. The authors'
    release sets theta per experiment, always above the attackers' count
    (src/runner.sh: theta = 4 with 1 corrupt agent of 10 on Fashion-MNIST,
    8 with 4 of 40 on CIFAR-10, 8 on FEMNIST with about 34 agents and 3.4
    corrupt a round); f + 1 is the smallest such value, not the release's
    (give `threshold` to run theirs). The effective theta is clamped to
    n (the real clients of the round), so a unanimous coordinate is never flipped when
    few clients take part (the paper assumes theta <= n).
  * Cannot guarantee: bounded magnitude. The step is a (sign-corrected)
    mean, so one finite 1e30 client moves it by 1e30 / n; RLR targets
    backdoors, not Byzantine magnitude attacks. Also, with theta too high
    honest but heterogeneous coordinates are flipped and learning stalls.

References:
  M. S. Ozdayi, M. Kantarcioglu, Y. R. Gel. "Defending against Backdoors in
  Federated Learning with Robust Learning Rate." AAAI 2021, Sec. 4.
"""

from __future__ import annotations

import jax.numpy as jnp

from fedrobust.aggregators.base import Aggregator, stateless_init
from fedrobust.aggregators.finetune import (finite_clients, first_client,
                                            select_rows)
from fedrobust.tree import ravel_clients, unravel_like


WEIGHTINGS = ('data', 'equal')


def rlr(*, num_byzantine: int, threshold: int | None = None,
        weighting: str = 'data') -> Aggregator:
  """RLR on the mean of the round's updates.

  Args:
    num_byzantine: f; sets the default threshold.
    threshold: theta >= 1, an integer vote count; None -> max(1, f + 1).
    weighting: the mean's weights: 'data' (the authors' code, agg_avg:
      sum_i n_i g_i / sum_i n_i with n_i the client's example count, read
      from `weights`) or 'equal' (1/n; this library's earlier choice).

  Returns:
    A stateless Aggregator. info: 'weights' float32[C] (1/n per real
    finite client), 'flipped_fraction' float32[] (share of coordinates
    whose learning rate was -1).
  """
  theta = max(1, num_byzantine + 1) if threshold is None else int(threshold)
  if theta < 1:
    raise ValueError(f'rlr: threshold must be >= 1, got {threshold}')
  if weighting not in WEIGHTINGS:
    raise ValueError(f'rlr: weighting must be one of {WEIGHTINGS}, got '
                     f'{weighting!r}')

  def aggregate(updates, mask, state, key, *, weights=None):
    del key
    flat = ravel_clients(updates).astype(jnp.float32)
    valid = finite_clients(flat, mask)
    clean = select_rows(flat, valid)
    n = jnp.sum(valid.astype(jnp.int32))
    votes = jnp.sum(jnp.sign(clean), axis=0)          # masked rows are 0
    effective = jnp.minimum(theta, jnp.maximum(n, 1)).astype(jnp.float32)
    lr = jnp.where(jnp.abs(votes) >= effective, 1.0, -1.0)
    if weighting == 'data' and weights is not None:
      w = jnp.where(valid, jnp.maximum(weights.astype(jnp.float32), 0.0), 0.0)
      total = jnp.sum(w)
      w = jnp.where(total > 0, w / jnp.where(total > 0, total, 1.0), 0.0)
    else:
      w = jnp.where(valid, 1.0 / jnp.maximum(n, 1), 0.0)
    mean = jnp.einsum('c,cd->d', w, clean, precision='highest')
    update = unravel_like(lr * mean, first_client(updates))
    info = {'weights': w.astype(jnp.float32),
            'flipped_fraction': jnp.mean(lr < 0).astype(jnp.float32)}
    return update, state, info

  reads = ('weights',) if weighting == 'data' else ()
  return Aggregator(stateless_init, aggregate, reads=reads)

