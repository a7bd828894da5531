"""Pre-aggregators: transforms of the round's updates that run before ANY
aggregation rule (`compose(pre, rule)`; the runner's --pre_aggregator).

  pre = PRE_AGGREGATORS[name](num_byzantine=f, **hparams)
  mixed = pre.apply(flat float[C, D], mask bool[C], key)   # a Mixed

Mixed.back maps the inner rule's per-slot weights (float[C']) to the
original C slots, so detection metrics keep reading one weight per client.

  nnm        Nearest-neighbour mixing (Allouah et al., AISTATS 2023, Alg. 1;
             ByzFL's NNM): every update is replaced by the mean of its
             n - f nearest real updates in L2, itself included.
  bucketing  Bucketing (Karimireddy, He, Jaggi, ICLR 2022, Alg. 1): the
             real updates are shuffled and averaged in buckets of s; the
             rule sees ceil(n / s) bucket means.
  arc        Adaptive robust clipping (Allouah et al., NeurIPS 2024, Alg. 1;
             ByzFL's ARC): the k = floor(2 (f / n) (n - f)) largest updates
             are clipped to the norm of the (k + 1)-th largest.

Masked slots never enter a neighbourhood, a bucket or the norm ranking,
and stay masked. Shapes are static: n and f enter as traced counts.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.aggregators.base import Aggregator
from fedrobust.aggregators import krum as krum_lib
from fedrobust.aggregators.finetune import (finite_clients, first_client,
                                            safe_norm, select_rows)
from fedrobust.errors import SettingError
from fedrobust.tree import ravel_clients, unravel_like


class Mixed(NamedTuple):
  flat: jax.Array      # float32[C', D], the inner rule's updates
  mask: jax.Array      # bool[C']
  back: Callable       # weights float[C'] -> float[C] (per original slot)
  forward: Callable    # client weights float[C] -> float[C'] (their sums)


class PreAggregator(NamedTuple):
  name: str
  apply: Callable   # (flat [C, D], mask [C], key) -> Mixed
  slots: Callable[[int], int]   # C -> C', the inner rule's slot count


def _setting(name: str, argument: str, message: str) -> SettingError:
  return SettingError(argument, message, component=f'pre_aggregator {name}')


def _check_f(name: str, num_byzantine: int) -> None:
  if num_byzantine < 0:
    raise _setting(name, 'num_byzantine', f'must be >= 0, got '
                   f'{num_byzantine}')


def _same(weights):
  return weights


def nnm(*, num_byzantine: int) -> PreAggregator:
  """Nearest-neighbour mixing with f = num_byzantine."""
  _check_f('nnm', num_byzantine)

  def apply(flat, mask, key):
    del key
    valid = finite_clients(flat, mask)
    x = select_rows(flat, valid)
    n = jnp.sum(valid)
    k = jnp.maximum(n - num_byzantine, 1)
    dist = krum_lib.pairwise_sq_dists(x, valid)    # +inf off the real rows
    # Rank of every j in row i's distance order (itself first: 0 distance,
    # ties broken by index, which argsort's stability gives).
    order = jnp.argsort(dist, axis=1, stable=True)
    rank = jnp.argsort(order, axis=1)
    near = (rank < k) & valid[None, :]
    mixed = jnp.matmul(near.astype(x.dtype), x,
                       precision='highest') / k.astype(x.dtype)
    return Mixed(jnp.where(valid[:, None], mixed, 0.0), valid, _same, _same)

  return PreAggregator('nnm', apply, lambda c: c)


def bucketing(*, num_byzantine: int, bucket_size: int = 2) -> PreAggregator:
  """Bucketing with buckets of `bucket_size` (the paper's s = 2)."""
  del num_byzantine
  if bucket_size < 1:
    raise _setting('bucketing', 'bucket_size', f'must be >= 1, got '
                   f'{bucket_size}')
  s = int(bucket_size)

  def apply(flat, mask, key):
    c, d = flat.shape
    b = -(-c // s)
    valid = finite_clients(flat, mask)
    x = select_rows(flat, valid)
    # Real clients first, in a random order; absent slots last.
    priority = jnp.where(valid, jax.random.uniform(key, (c,)), 2.0)
    order = jnp.argsort(priority)
    pad = b * s - c
    order = jnp.concatenate([order, jnp.full((pad,), c, order.dtype)])
    x_pad = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])
    v_pad = jnp.concatenate([valid, jnp.zeros((1,), bool)])
    members = v_pad[order].reshape(b, s)
    rows = x_pad[order].reshape(b, s, d)
    count = jnp.sum(members, axis=1)
    means = jnp.sum(rows, axis=1) / jnp.maximum(count, 1)[:, None].astype(
        x.dtype)
    bucket_of = jnp.zeros((c + 1,), jnp.int32).at[order].set(
        jnp.repeat(jnp.arange(b, dtype=jnp.int32), s))[:c]

    def back(weights):
      share = weights[bucket_of] / jnp.maximum(count[bucket_of], 1)
      return jnp.where(valid, share, 0.0)

    def forward(weights):
      w = jnp.concatenate([jnp.where(valid, weights, 0.0),
                           jnp.zeros((1,), weights.dtype)])
      return jnp.sum(w[order].reshape(b, s), axis=1)

    return Mixed(means, count > 0, back, forward)

  return PreAggregator('bucketing', apply, lambda c: -(-c // s))


def arc(*, num_byzantine: int) -> PreAggregator:
  """Adaptive robust clipping with f = num_byzantine."""
  _check_f('arc', num_byzantine)

  def apply(flat, mask, key):
    del key
    valid = finite_clients(flat, mask)
    x = select_rows(flat, valid)
    n = jnp.sum(valid).astype(jnp.float32)
    f = jnp.float32(num_byzantine)
    k = jnp.floor(2.0 * f / jnp.maximum(n, 1.0) * (n - f)).astype(jnp.int32)
    k = jnp.clip(k, 0, jnp.maximum(jnp.sum(valid) - 1, 0))
    norms = safe_norm(x, axis=1)
    ranked = jnp.sort(jnp.where(valid, norms, -1.0))[::-1]   # descending
    threshold = ranked[k]
    scale = jnp.where(norms > threshold,
                      threshold / jnp.where(norms > 0, norms, 1.0), 1.0)
    return Mixed(jnp.where(valid[:, None], x * scale[:, None], 0.0), valid,
                 _same, _same)

  return PreAggregator('arc', apply, lambda c: c)


PRE_AGGREGATORS: dict[str, Callable[..., PreAggregator]] = {
    'nnm': nnm,
    'bucketing': bucketing,
    'arc': arc,
}


def get_pre_aggregator(name: str, **kwargs) -> PreAggregator:
  """PRE_AGGREGATORS[name]; SettingError naming pre_aggregator otherwise."""
  if name not in PRE_AGGREGATORS:
    raise SettingError('pre_aggregator', f'{name!r} is not a known '
                       f'pre-aggregator; expected one of '
                       f'{sorted(PRE_AGGREGATORS)}')
  try:
    return PRE_AGGREGATORS[name](**kwargs)
  except TypeError as err:
    raise SettingError('pre_aggregator_kwargs', f'pre-aggregator {name!r}: '
                       f'{err}') from None


def compose(pre: PreAggregator, rule: Aggregator) -> Aggregator:
  """The rule run on pre's output. The rule may read `weights` (a
  bucket's weight is the sum of its members'), `coverage` when every
  client owns every coordinate (None) and `params`, the global model,
  which mixing leaves as it is (FLAME, DeepSight, FLARE, Horus); a mixed
  or bucketed slot has no single client's id, score, partial coverage or
  staleness, so rules that read those are refused."""
  extra = sorted(set(rule.reads) - {'weights', 'coverage', 'params'})
  if extra:
    raise SettingError('pre_aggregator', f'{pre.name} mixes client updates; '
                       f'the rule reads {extra}, which a mixed slot does '
                       'not have')

  def aggregate(updates, mask, state, key, **extras):
    pre_key, rule_key = jax.random.split(key)
    mask = jnp.asarray(mask, bool)
    mixed = pre.apply(ravel_clients(updates).astype(jnp.float32), mask,
                      pre_key)
    inner = jax.vmap(unravel_like, in_axes=(0, None))(mixed.flat,
                                                       first_client(updates))
    inner_extras = {}
    if 'params' in rule.reads:
      inner_extras['params'] = extras['params']
    if 'coverage' in rule.reads:
      if extras.get('coverage') is not None:
        raise SettingError('pre_aggregator', f'{pre.name} mixes client '
                           'updates; clients that own different coordinates '
                           '(width-sliced models, mixed LoRA ranks) cannot '
                           'be mixed')
      inner_extras['coverage'] = None
    if 'weights' in rule.reads:
      inner_extras['weights'] = mixed.forward(
          jnp.where(mask, extras['weights'], 0.0).astype(jnp.float32))
    update, state, info = rule.aggregate(inner, mixed.mask, state, rule_key,
                                         **inner_extras)
    if 'weights' in info:
      info = dict(info, weights=mixed.back(info['weights']).astype(
          jnp.float32))
    return update, state, info

  return Aggregator(rule.init, aggregate, rule.reads)

