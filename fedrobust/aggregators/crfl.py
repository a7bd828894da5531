"""CRFL (Xie et al., ICML 2021): clip and perturb the global model.

Every round the server averages the updates, clips the norm of the whole
resulting model and adds isotropic Gaussian noise (parameter smoothing):

  w'      = w_t + (1/n) sum_i Delta_i
  w''     = w' / max(1, ||w'||_2 / rho)                  (clipping)
  w_{t+1} = w'' + eps,  eps ~ N(0, sigma^2 I)            (perturbation)

The returned update is w_{t+1} - w_t. Clipping bounds how far any update
(a backdoor included) can move the model in one round; the noise makes the
final model a smoothed one, which is what CRFL's certificate is about (the
certificate itself, i.e. Monte-Carlo prediction over noisy models at test
time, is outside an aggregation rule).

Robustness notes:
  * Non-finite clients are excluded from the mean.
  * ||w''|| <= rho always (overflow-safe norm), so the output is finite and
    ||w_{t+1}|| <= rho + ||eps|| whatever finite values clients send.
  * Cannot guarantee: a useful model. The mean itself is not robust: one
    1e30 client dominates the direction of w', and clipping then only
    bounds its size. rho must exceed the norm of a good model, or clipping
    shrinks every model (the paper tunes rho per dataset).

References:
  C. Xie, M. Chen, P.-Y. Chen, B. Li. "CRFL: Certifiably Robust Federated
  Learning against Backdoor Attacks." ICML 2021, Sec. 3, Algorithm 1.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.aggregators.base import Aggregator
from fedrobust.aggregators.mean import setting
from fedrobust.aggregators.finetune import (finite_clients,
                                            masked_mean_rows, ravel_one,
                                            safe_norm)
from fedrobust.tree import ravel_clients, tree_add, unravel_like

Params = Any


class CRFLState(NamedTuple):
  params: Params   # the current global model w_t (one client's shapes)


def crfl(*, num_byzantine: int, clip_norm: float = 15.0,
         sigma: float = 0.01) -> Aggregator:
  """CRFL aggregation.

  Args:
    num_byzantine: unused.
    clip_norm: rho > 0, bound on the L2 norm of the whole global model.
    sigma: std of the Gaussian parameter noise (>= 0; 0 disables it).

  Returns:
    Aggregator with state CRFLState. info: 'weights' float32[C] (1/n per
    real finite client), 'clip_scale' float32[] (the factor applied to w').
  """
  del num_byzantine
  if clip_norm <= 0:
    raise setting('crfl', 'clip_norm', f'must be > 0, got {clip_norm}')
  if sigma < 0:
    raise setting('crfl', 'sigma', f'must be >= 0, got {sigma}')

  def init(params):
    return CRFLState(params=params)

  def aggregate(updates, mask, state, key):
    params = state.params
    flat = ravel_clients(updates).astype(jnp.float32)
    valid = finite_clients(flat, mask)
    w = ravel_one(params)
    w_new = w + masked_mean_rows(flat, valid)
    norm = safe_norm(w_new)
    scale = jnp.where(norm > clip_norm, clip_norm / norm, 1.0)
    w_clip = w_new * scale
    noise = sigma * jax.random.normal(key, w.shape, jnp.float32)
    update = unravel_like(w_clip + noise - w, params)
    n = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
    info = {'weights': jnp.where(valid, 1.0 / n, 0.0).astype(jnp.float32),
            'clip_scale': scale.astype(jnp.float32)}
    return update, CRFLState(tree_add(params, update)), info

  return Aggregator(init, aggregate)
