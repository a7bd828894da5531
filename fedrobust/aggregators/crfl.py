"""CRFL (Xie et al., ICML 2021): clip and perturb the global model.

Every round the server averages the updates, clips the norm of the whole
resulting model and adds isotropic Gaussian noise (parameter smoothing):

  w'      = w_t + (1/n) sum_i Delta_i
  w''     = w' / max(1, ||w'||_2 / rho_t)                (clipping)
  w_{t+1} = w'' + eps,  eps ~ N(0, sigma^2 I)            (perturbation)

rho_t is the authors' dynamic threshold (AI-secure/CRFL, main.py: for
MNIST rho_t = min(param_clip_thres, 0.1 t + 2), t the round from 1;
LOAN 0.025 t + 2, EMNIST 0.25 t + 4): rho_t = min(clip_norm, slope t +
offset), the default, or a fixed rho_t = clip_norm (schedule='fixed';
this library's earlier choice). FLPoison's CRFL clips the averaged
UPDATE instead (norm 3, sigma 0.001): clip='update'.

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
  round: jax.Array   # int32[]: rounds aggregated so far


SCHEDULES = ('dynamic', 'fixed')
CLIPS = ('model', 'update')


def crfl(*, num_byzantine: int, clip_norm: float = 15.0,
         sigma: float = 0.01, schedule: str = 'dynamic', slope: float = 0.1,
         offset: float = 2.0, clip: str = 'model') -> Aggregator:
  """CRFL aggregation.

  Args:
    num_byzantine: unused.
    clip_norm: rho > 0, bound on the L2 norm of the whole global model
      (the cap of the dynamic threshold).
    sigma: std of the Gaussian parameter noise (>= 0; 0 disables it).
    schedule: 'dynamic' (rho_t = min(clip_norm, slope t + offset), the
      authors' code) or 'fixed' (rho_t = clip_norm).
    slope, offset: the dynamic threshold's line (the authors' MNIST
      values 0.1 and 2).
    clip: 'model' (the paper and its code: the norm of w') or 'update'
      (FLPoison: the norm of the averaged update).

  Returns:
    Aggregator with state CRFLState. info: 'weights' float32[C] (1/n per
    real finite client), 'clip_scale' float32[] (the factor applied to w').
  """
  del num_byzantine
  if clip_norm <= 0:
    raise setting('crfl', 'clip_norm', f'must be > 0, got {clip_norm}')
  if sigma < 0:
    raise setting('crfl', 'sigma', f'must be >= 0, got {sigma}')
  if schedule not in SCHEDULES:
    raise setting('crfl', 'schedule', f'must be one of {SCHEDULES}, got '
                  f'{schedule!r}')
  if clip not in CLIPS:
    raise setting('crfl', 'clip', f'must be one of {CLIPS}, got {clip!r}')
  if schedule == 'dynamic' and (slope < 0 or offset <= 0):
    raise setting('crfl', 'slope', f'the dynamic threshold needs slope >= 0 '
                  f'and offset > 0, got {slope}, {offset}')

  def init(params):
    return CRFLState(params=params, round=jnp.int32(0))

  def aggregate(updates, mask, state, key):
    params = state.params
    flat = ravel_clients(updates).astype(jnp.float32)
    valid = finite_clients(flat, mask)
    t = state.round + 1
    rho = jnp.float32(clip_norm)
    if schedule == 'dynamic':
      rho = jnp.minimum(rho, slope * t.astype(jnp.float32) + offset)
    w = ravel_one(params)
    step = masked_mean_rows(flat, valid)
    target = w + step if clip == 'model' else step
    norm = safe_norm(target)
    scale = jnp.where(norm > rho, rho / norm, 1.0)
    w_clip = target * scale if clip == 'model' else w + step * scale
    noise = sigma * jax.random.normal(key, w.shape, jnp.float32)
    update = unravel_like(w_clip + noise - w, params)
    n = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
    info = {'weights': jnp.where(valid, 1.0 / n, 0.0).astype(jnp.float32),
            'clip_scale': scale.astype(jnp.float32),
            'clip_norm': rho.astype(jnp.float32)}
    return update, CRFLState(tree_add(params, update), t), info

  return Aggregator(init, aggregate)
