"""3DFed (Li et al., IEEE S&P 2023): an adaptive, stateful backdoor.

The attackers learn from the global model whether last round's uploads
were accepted, and tune themselves with three modules:

  * a constrained backdoor update: attacker 0 trains from the global model
    theta_t on 0.3 CE(clean batch) + 0.3 CE(triggered clone) + 0.4
    ||theta - theta_t||_2, and every attacker uploads that one update,
    scaled up (by at most `weight_scale`) to a benign update's norm;
  * indicators: each upload plants 1e5 x its own value at one coordinate
    of a low-curvature layer (the last conv kernel); next round the global
    model's change there, divided by the planted value, reads as the
    upload's aggregation weight: accepted, clipped or rejected;
  * noise masks on the output layer, per group of `group_size` attackers,
    optimised to spread the uploads apart (high UPs) while cancelling in
    their sum (the Lagrangian term), mixed by alpha_g, which the feedback
    tunes;
  * decoy models: k plain models with one weight pushed far from a benign
    model's value, each planting an indicator too; they overwrite benign
    uploads (the reference writes them to slots N-1-j). k grows when
    nothing got through and shrinks as decoys are accepted.

Transcribed from the authors' release (haoyangliASTAPLE/3DFed, commit
6e0e8ec: attacks/thrdfed.py and attacks/components/{indicator,mask,decoy,
tuning}.py, loss_functions.py); BUILD_NOTES §3g lists the constants and
where this departs from it. In short: the alpha feedback is counted per
real group (the release counts it in attacker-id order while giving masks
out in a shuffled one), the decoys' target coordinates are the k smallest
|u_bd - u_ben| (the release's streaming pick misplaces indices for k >= 2),
k is capped at `max_decoys` (static shapes), and weight decay is left to
the runner's optimizer settings.

Interface (a stateful model attack; the engine keeps its state in
ServerState.attack):

  attack = thrdfed(apply_fn=..., stamp=..., num_attackers=A, ...)
  state = attack.init(params)
  updates, state, decoys = attack.apply(updates, is_malicious, mask, key,
                                        state, context)
    updates: float[C, D], the round's raveled client deltas;
    context: AttackContext (the global model, the federated data, the
      slots' client ids and attacker ranks);
    decoys: bool[C], benign slots overwritten by a decoy (counted as
      attackers in the detection metrics).
Rows that neither an attacker nor a decoy owns come back bit-identical; a
masked slot is never read or written.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedrobust.errors import SettingError
from fedrobust.local import (LocalConfig, local_sgd, masked_cross_entropy,
                             sgd)
from fedrobust.tree import tree_sq_norm, tree_sub
from fedrobust.types import LocalData

Params = Any


class StatefulAttack(NamedTuple):
  """A model attack that keeps state across rounds (see module docstring).

  init: params -> state pytree (static shapes).
  apply: (updates, is_malicious, mask, key, state, context)
      -> (updates, state, decoys bool[C]).
  metrics: state -> {name: float32[]}, logged per round as attack_<name>.
  """
  name: str
  init: Callable[[Params], Any]
  apply: Callable[..., tuple[jax.Array, Any, jax.Array]]
  metrics: Callable[[Any], dict[str, jax.Array]]


def _state_metrics(state: 'ThreeDFedState') -> dict[str, jax.Array]:
  """k, weak DP and the range of this round's readings (NaN: none read)."""
  read = jnp.isfinite(state.feedback)
  any_read = jnp.any(read)
  return {
      'k': state.k.astype(jnp.float32),
      'weak_dp': state.weak_dp.astype(jnp.float32),
      'feedback_min': jnp.where(any_read, jnp.min(
          jnp.where(read, state.feedback, jnp.inf)), jnp.nan),
      'feedback_max': jnp.where(any_read, jnp.max(
          jnp.where(read, state.feedback, -jnp.inf)), jnp.nan),
  }


class ThreeDFedState(NamedTuple):
  started: jax.Array    # bool[], an attack round has run
  weak_dp: jax.Array    # bool[], the feedback looked like weak DP (sticky)
  k: jax.Array          # int32[], decoys in use
  alpha: jax.Array      # float32[NG], UPs/noise mix of each group
  idx: jax.Array        # int32[T], flat indicator coordinates (A + K slots)
  value: jax.Array      # float32[T], the values planted there
  base: jax.Array       # float32[T], theta_t at those coordinates
  live: jax.Array       # bool[T], planted last round (read this round)
  group: jax.Array      # int32[A], each attacker rank's mask group
  feedback: jax.Array   # float32[T], this round's readings f (NaN: unread)


def _invalid(argument: str, message: str) -> SettingError:
  return SettingError(argument, message, component='attack 3dfed')


def _leaves(params: Params) -> list[tuple[str, int, tuple[int, ...]]]:
  """(module/leaf path, flat offset, shape) in ravel order."""
  out, start = [], 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = '/'.join(str(getattr(p, 'key', getattr(p, 'idx', p)))
                    for p in path)
    out.append((name, start, tuple(leaf.shape)))
    start += math.prod(leaf.shape)
  return out


def resolve_layers(params: Params, *, indicator_layer: str,
                   mask_layer: str, decoy_layer: str
                   ) -> dict[str, tuple[int, tuple[int, ...]]]:
  """Offsets and shapes of the kernels 3DFed writes to.

  'auto' picks what the release uses on its MNIST net: the indicator in
  the last conv kernel (conv2), the noise masks on the output layer's
  kernel and bias (fc2), the decoys' push in the kernel before it (fc1).
  An explicit value is a module path ('Conv_1', 'Dense_1').
  """
  leaves = _leaves(params)
  kernels = [(n, o, s) for n, o, s in leaves if n.endswith('/kernel')]
  convs = [x for x in kernels if len(x[2]) == 4]
  denses = [x for x in kernels if len(x[2]) == 2]

  def named(arg, module):
    for n, o, s in leaves:
      if n == f'{module}/kernel':
        return n, o, s
    raise _invalid(arg, f'no kernel at module path {module!r}; the model '
                   f'has {[n.rsplit("/", 1)[0] for n, _, _ in kernels]}')

  def pick(arg, value, candidates, missing):
    if value != 'auto':
      return named(arg, value)
    if not candidates:
      raise _invalid(arg, f'{missing}; name a layer (its module path)')
    return candidates[-1]

  mask = pick('mask_layer', mask_layer, denses,
              'the model has no Dense output layer')
  ind = pick('indicator_layer', indicator_layer, convs,
             'the model has no conv kernel')
  dec = pick('decoy_layer', decoy_layer,
             [x for x in denses if x[1] < mask[1]],
             'no Dense kernel before the output layer')
  if len(mask[2]) != 2:
    raise _invalid('mask_layer', f'{mask[0]} is not a Dense kernel '
                   f'(shape {mask[2]})')
  module = mask[0].rsplit('/', 1)[0]
  bias = [(o, s) for n, o, s in leaves if n == f'{module}/bias']
  if not bias:
    raise _invalid('mask_layer', f'{module} has no bias')
  return {'indicator': (ind[1], ind[2]), 'mask': (mask[1], mask[2]),
          'mask_bias': bias[0], 'decoy': (dec[1], dec[2])}


def _leaf_at(params: Params, off: int) -> tuple[int, int]:
  """(leaf number, its flat offset) of the leaf holding flat offset off."""
  start = 0
  for i, leaf in enumerate(jax.tree.leaves(params)):
    if start <= off < start + leaf.size:
      return i, start
    start += leaf.size
  raise ValueError(f'offset {off} is past the params')


def _safe_norm(sq: jax.Array) -> jax.Array:
  """sqrt with gradient 0 at 0 (torch's norm backward; jnp's is NaN)."""
  pos = sq > 0
  return jnp.where(pos, jnp.sqrt(jnp.where(pos, sq, 1.0)), 0.0)


def _uniform(key, shape, lo, hi):
  return lo + jax.random.uniform(key, shape) * (hi - lo)


def read_feedback(state: ThreeDFedState, theta_at: jax.Array, *,
                  num_attackers: int, group_size: int, max_decoys: int,
                  threshold: float, clip_ratio: float,
                  noise_mask_alpha: float, key: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The release's read_indicator + adaptive_tuning.

  Args:
    state: last round's plantings (idx, value, base, live, group).
    theta_at: float32[T], the global model now at state.idx.

  Returns:
    (k, alpha, weak_dp, codes int32[T]: 0 rejected, 1 clipped, 2 accepted,
    -1 not read).
  """
  a, g = num_attackers, group_size
  num_groups = -(-a // g)
  f = (theta_at - state.base) / state.value
  read = state.live & state.started & ~state.weak_dp
  anomaly = jnp.any(read & ((f > 1.0) | (f < -threshold)))
  weak = state.weak_dp | anomaly
  fmax = jnp.max(jnp.where(read, f, -jnp.inf))
  codes = jnp.where(f <= threshold, 0, jnp.where(f <= clip_ratio * fmax, 1,
                                                 2))
  codes = jnp.where(read, codes, -1)
  is_decoy = jnp.arange(a + max_decoys) >= a
  decoys_in = jnp.sum(is_decoy & (codes == 2))
  attackers_in = jnp.any(~is_decoy & (codes >= 1))
  k = jnp.maximum(state.k - decoys_in, 0)
  k = jnp.where(~attackers_in & (decoys_in == 0), k + 1, k)
  k = jnp.minimum(k, max_decoys).astype(jnp.int32)
  # Alpha: a full group counts as accepted when >= 80% of it read 'a'.
  full = a // g
  acc = codes[:a] == 2
  per_group = jnp.zeros((num_groups,), jnp.int32).at[state.group].add(
      acc.astype(jnp.int32))
  ok = (per_group >= 0.8 * g) & (jnp.arange(num_groups) < full)
  n_ok = jnp.sum(ok)
  cand = jnp.sort(jnp.where(ok, state.alpha, jnp.inf))
  fresh = _uniform(key, (num_groups,), noise_mask_alpha, 1.0)
  u = jax.random.uniform(jax.random.fold_in(key, 1), (num_groups,))
  if full <= 1:
    alpha = jnp.where(n_ok == 0, fresh, state.alpha)
  else:
    alpha = jnp.where(
        n_ok == full, cand[0] + u * (cand[1] - cand[0]),
        jnp.where(n_ok > 0, cand[0] + u * 0.1, fresh))
  alpha = jnp.where(alpha >= 1.0, 0.99, jnp.where(alpha <= 0.0, 0.01, alpha))
  any_read = jnp.any(read)
  # Nothing read (first attack round, or no planting survived): keep the
  # state; the very first round draws alpha afresh.
  alpha = jnp.where(any_read, alpha,
                    jnp.where(state.started, state.alpha, fresh))
  k = jnp.where(any_read, k, state.k)
  # Weak DP (sticky): alpha 0.1, k frozen, nothing read again.
  alpha = jnp.where(weak, 0.1, alpha).astype(jnp.float32)
  k = jnp.where(weak, state.k, k).astype(jnp.int32)
  return k, alpha, weak, codes


def optimise_masks(u_cols: jax.Array, rows: jax.Array, alpha: jax.Array,
                   key: jax.Array, *, group_size: int, sigma: jax.Array,
                   c_u: float, c_n: float, c_l: float, lr: float,
                   momentum: float, steps: int, lagrange_step: float,
                   lagrange_weighting: str = 'release') -> jax.Array:
  """The noise masks of every group (release: mask.py).

  Args:
    u_cols: float32[F + 1, L], the backdoor update on the output layer
      (kernel rows, then the bias row; L classes).
    rows: bool[NG, L], each group's chosen output neurons R_g.
    alpha: float32[NG].
    sigma: the initial masks' standard deviation.
    lagrange_weighting: 'release' (mask i of a group takes i + 1 copies of
      the Lagrangian term's gradient, as the release's loop of backward()
      calls gives it) or 'own' (each mask its own loss's gradient).

  Returns:
    float32[NG, G, F + 1, L], zero outside each group's R_g.
  """
  ng = rows.shape[0]
  shape = (ng, group_size) + u_cols.shape
  m0 = sigma * jax.random.normal(key, shape, jnp.float32)
  m0 = m0 - jnp.mean(m0, axis=1, keepdims=True)

  def own_loss(mi, r, a, lam):
    r = r[None, :].astype(jnp.float32)
    ups = jnp.sum(r[0] * c_u / jnp.sum(jnp.abs(u_cols + mi), axis=0))
    noise = c_n * _safe_norm(jnp.sum((mi * r) ** 2))
    return (a * ups + (1.0 - a) * noise) / (1.0 + lam)

  def lag_loss(mi, others, r, lam):
    r = r[None, :].astype(jnp.float32)
    lag = c_l * _safe_norm(jnp.sum(((others + mi) * r) ** 2))
    return lam * lag / (1.0 + lam)

  # The release steps mask i after i + 1 backward() calls of the group's
  # losses, each adding the Lagrangian term's gradient ('release'); 'own'
  # is each mask's own loss.
  copies = (jnp.arange(1, group_size + 1, dtype=jnp.float32)
            if lagrange_weighting == 'release' else
            jnp.ones((group_size,), jnp.float32))

  def grads(m, lam):
    total = jnp.sum(m, axis=1)      # [NG, F + 1, L]

    def one_group(mg, tot, r, a, lm):
      others = jax.lax.stop_gradient(tot[None] - mg)
      own = jax.vmap(jax.grad(own_loss), in_axes=(0, None, None, None))(
          mg, r, a, lm)
      lag = jax.vmap(jax.grad(lag_loss), in_axes=(0, 0, None, None))(
          mg, others, r, lm)
      return own + copies[:, None, None] * lag
    return jax.vmap(one_group)(m, total, rows, alpha, lam)

  def step(carry, _):
    m, buf, lam = carry
    g = grads(m, lam)
    buf = momentum * buf + g
    m = m - lr * buf
    r = rows[:, None, :].astype(jnp.float32)
    lam = lam + lagrange_step * jnp.sqrt(jnp.sum(
        (jnp.sum(m, axis=1) * r) ** 2, axis=(1, 2)))
    return (m, buf, lam), None

  (m, _, _), _ = jax.lax.scan(
      step, (m0, jnp.zeros_like(m0), jnp.ones((ng,), jnp.float32)), None,
      length=steps)
  return m * rows[:, None, None, :].astype(jnp.float32)


def thrdfed(*, apply_fn: Callable, stamp: Callable, num_attackers: int,
            num_classes: int, target_label: int, learning_rate: float,
            batch_size: int, local_epochs: int = 1, momentum: float = 0.0,
            weight_decay: float = 0.0, poison_epochs: int = 15,
            group_size: int = 2, num_neurons: int = 8, max_decoys: int = 4,
            weight_scale: float = 5.0, num_candidate: int = 10,
            indicator_scale: float = 1e5, zero_fallback: float = 1e-2,
            threshold: float = 1e-4, clip_ratio: float = 0.8,
            noise_mask_alpha: float = 0.0, mask_sigma: float = 0.05,
            mask_sigma_weak_dp: float = 0.01, c_u: float = 0.1,
            c_n: float = 8e-2, c_l: float = 0.1, mask_lr: float = 0.1,
            mask_momentum: float = 0.9, mask_steps: int = 30,
            lagrange_step: float = 0.1, lagrange_weighting: str = 'release',
            decoy_push: float = 10.0,
            loss_weights: tuple[float, float, float] = (0.3, 0.3, 0.4),
            indicator_layer: str = 'auto', mask_layer: str = 'auto',
            decoy_layer: str = 'auto') -> StatefulAttack:
  """Builds 3DFed; defaults are the release's MNIST configuration.

  Args:
    apply_fn: Model.apply.
    stamp: (x uint8[B, ...], y int32[B]) -> the triggered clone of the
      batch with the target label (every example: the release's MNIST
      poisoning proportion 1.0).
    num_attackers: A, the attackers (ranks 0..A-1; indicator slot r is
      rank r's).
    num_classes, target_label: the output layer's classes and the
      backdoor's target (never a noise-mask neuron).
    learning_rate, batch_size, local_epochs, momentum, weight_decay: the
      benign clients' local training (the benign reference and decoys run
      it; the backdoor runs `poison_epochs` epochs of it).
    group_size, num_neurons: G attackers per noise-mask group and |R_g|.
    max_decoys: the cap on k (the release has none).
    Others: the release's constants (module docstring; BUILD_NOTES §3g).
  """
  a, g = num_attackers, group_size
  for name, value, lo in (('num_attackers', a, 1), ('group_size', g, 1),
                          ('num_neurons', num_neurons, 1),
                          ('max_decoys', max_decoys, 0),
                          ('poison_epochs', poison_epochs, 1),
                          ('local_epochs', local_epochs, 1),
                          ('num_candidate', num_candidate, 1),
                          ('mask_steps', mask_steps, 0)):
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
      raise _invalid(name, f'must be an int >= {lo}, got {value!r}')
  if num_neurons > num_classes - 1:
    raise _invalid('num_neurons', f'{num_neurons} output neurons, but only '
                   f'{num_classes - 1} classes besides the target')
  if not 0 <= target_label < num_classes:
    raise _invalid('target_label', f'must be in [0, {num_classes})')
  for name, value in (('learning_rate', learning_rate),
                      ('weight_scale', weight_scale),
                      ('indicator_scale', indicator_scale),
                      ('threshold', threshold), ('mask_lr', mask_lr)):
    if not (math.isfinite(value) and value > 0):
      raise _invalid(name, f'must be a finite number > 0, got {value!r}')
  if not 0.0 < clip_ratio <= 1.0:
    raise _invalid('clip_ratio', f'must be in (0, 1], got {clip_ratio}')
  if not 0.0 <= noise_mask_alpha < 1.0:
    raise _invalid('noise_mask_alpha', f'must be in [0, 1), got '
                   f'{noise_mask_alpha}')
  if lagrange_weighting not in ('release', 'own'):
    raise _invalid('lagrange_weighting', "must be 'release' or 'own', got "
                   f'{lagrange_weighting!r}')
  num_groups = -(-a // g)
  slots = a + max_decoys
  w_clean, w_bd, w_dist = loss_weights
  opt = sgd(learning_rate=learning_rate, momentum=momentum,
            weight_decay=weight_decay)

  def init(params):
    del params
    return ThreeDFedState(
        started=jnp.bool_(False), weak_dp=jnp.bool_(False),
        k=jnp.int32(0), alpha=jnp.zeros((num_groups,), jnp.float32),
        idx=jnp.zeros((slots,), jnp.int32),
        value=jnp.ones((slots,), jnp.float32),
        base=jnp.zeros((slots,), jnp.float32),
        live=jnp.zeros((slots,), bool),
        group=jnp.zeros((a,), jnp.int32),
        feedback=jnp.full((slots,), jnp.nan, jnp.float32))

  def ravel(tree):
    return jnp.concatenate([jnp.ravel(x).astype(jnp.float32)
                            for x in jax.tree.leaves(tree)])

  def train(loss_fn, params, local, key, epochs):
    n_pad = local.x.shape[1]
    config = LocalConfig(batch_size, epochs, -(-n_pad // batch_size))
    out, _ = local_sgd(loss_fn, params, local, key, optimizer=opt,
                       config=config)
    return out

  def ce(p, x, y, m, key, train_mode=True):
    logits = apply_fn(p, x, train=train_mode, key=key)
    return masked_cross_entropy(logits, y, m)[0]

  def apply(updates, is_malicious, mask, key, state, context):
    updates = jnp.asarray(updates)
    c, d = updates.shape
    params = context.params
    layers = resolve_layers(params, indicator_layer=indicator_layer,
                            mask_layer=mask_layer, decoy_layer=decoy_layer)
    theta = ravel(params)
    if theta.shape[0] != d:
      raise _invalid('updates', f'rows of {d} values, the model has '
                     f'{theta.shape[0]}')
    attacking = mask & is_malicious
    rank = jnp.asarray(context.rank, jnp.int32)
    ids = jnp.asarray(context.ids, jnp.int32)
    (k_feedback, k_bd, k_ben, k_mask, k_rows, k_perm,
     k_dec) = jax.random.split(key, 7)
    k, alpha, weak, codes = read_feedback(
        state, theta[state.idx], num_attackers=a, group_size=g,
        max_decoys=max_decoys, threshold=threshold, clip_ratio=clip_ratio,
        noise_mask_alpha=noise_mask_alpha, key=k_feedback)

    def attack():
      # Attacker 0: the attacking slot of lowest rank.
      first = jnp.argmin(jnp.where(attacking, rank, jnp.iinfo(jnp.int32).max))
      cid = ids[first]
      local = LocalData(context.data.x, context.data.y, cid,
                        context.data.count[cid])

      def bd_loss(p, x, y, m, kk):
        xs, ys = stamp(x, y)
        dist = _safe_norm(tree_sq_norm(jax.tree.map(
            lambda q: q.astype(jnp.float32), tree_sub(p, params))))
        return (w_clean * ce(p, x, y, m, kk) + w_bd * ce(p, xs, ys, m, kk) +
                w_dist * dist), {}

      def ben_loss(p, x, y, m, kk):
        return ce(p, x, y, m, kk), {}

      ben = train(ben_loss, params, local, k_ben, local_epochs)
      u_bd = ravel(train(bd_loss, params, local, k_bd, poison_epochs)) - theta
      u_ben = ravel(ben) - theta
      b_norm = jnp.linalg.norm(u_ben)
      u_norm = jnp.linalg.norm(u_bd)
      s = jnp.minimum(b_norm / jnp.where(u_norm > 0, u_norm, 1.0),
                      weight_scale)
      u_bd = jnp.maximum(s, 1.0) * u_bd

      # Indicators: T = A + k coordinates of the indicator layer with the
      # smallest |curvature| among the num_candidate * T smallest
      # |u_bd| + |u_ben|.
      off, shape = layers['indicator']
      size = math.prod(shape)
      analog = (jnp.abs(u_bd[off:off + size]) +
                jnp.abs(u_ben[off:off + size]))
      pool_max = min(num_candidate * slots, size)
      _, pool = jax.lax.top_k(-analog, pool_max)
      t = a + k
      pool_ok = jnp.arange(pool_max) < num_candidate * t
      curv = curvature(params, local, off, shape)
      score = jnp.where(pool_ok, jnp.abs(curv[pool]), jnp.inf)
      _, pick = jax.lax.top_k(-score, slots)
      idx = (off + pool[pick]).astype(jnp.int32)

      # Noise masks on the output layer, per group.
      (ko, kshape), (bo, _) = layers['mask'], layers['mask_bias']
      fan_in, outs = kshape
      u_cols = jnp.concatenate([
          u_bd[ko:ko + fan_in * outs].reshape(fan_in, outs),
          u_bd[bo:bo + outs][None]], axis=0)
      draw = jax.random.uniform(k_rows, (num_groups, outs))
      draw = draw.at[:, target_label].set(jnp.inf)
      order = jnp.argsort(draw, axis=1)[:, :num_neurons]
      rows = jnp.zeros((num_groups, outs), bool).at[
          jnp.arange(num_groups)[:, None], order].set(True)
      masks = optimise_masks(
          u_cols, rows, alpha, k_mask, group_size=g,
          sigma=jnp.where(weak, mask_sigma_weak_dp, mask_sigma),
          c_u=c_u, c_n=c_n, c_l=c_l, lr=mask_lr, momentum=mask_momentum,
          steps=mask_steps, lagrange_step=lagrange_step,
          lagrange_weighting=lagrange_weighting)
      masks = masks.reshape((num_groups * g,) + u_cols.shape)
      # The nm-th attacker of a shuffled order takes mask nm (group nm // G).
      position = jnp.argsort(jax.random.permutation(k_perm, a))
      group = (position // g).astype(jnp.int32)

      def plant(row, r):
        v = indicator_scale * row[idx[r]]
        v = jnp.where(v == 0, zero_fallback, v)
        return row.at[idx[r]].set(v), v

      def attacker_row(r):
        m = masks[position[r]]
        row = u_bd.at[ko:ko + fan_in * outs].add(m[:fan_in].ravel())
        row = row.at[bo:bo + outs].add(m[fan_in])
        return plant(row, r)

      att_rows, att_vals = jax.vmap(attacker_row)(jnp.arange(a))

      # Decoys: the k smallest |u_bd - u_ben| of the decoy layer, each
      # pushed more than decoy_push away from the benign model there.
      doff, dshape = layers['decoy']
      dsize = math.prod(dshape)
      ben_flat = ravel(ben)
      if max_decoys:
        _, target = jax.lax.top_k(
            -jnp.abs(u_bd[doff:doff + dsize] - u_ben[doff:doff + dsize]),
            max_decoys)
        target = doff + target

        which, leaf_off = _leaf_at(params, doff)

        def decoy(j):
          p_j = target[j]

          def loss(p, x, y, m, kk):
            w = jnp.ravel(jax.tree.leaves(p)[which])[p_j - leaf_off]
            dist = jnp.abs(w.astype(jnp.float32) - ben_flat[p_j])
            push = jnp.where(dist > decoy_push, 1e-10 * dist, -10.0 * dist)
            return 0.5 * (push + ce(p, x, y, m, kk)), {}

          def run():
            out = train(loss, params, local, jax.random.fold_in(k_dec, j),
                        local_epochs)
            return plant(ravel(out) - theta, a + j)

          return jax.lax.cond(j < k, run,
                              lambda: (jnp.zeros((d,), jnp.float32),
                                       jnp.float32(1.0)))

        dec_rows, dec_vals = jax.lax.map(decoy, jnp.arange(max_decoys))
      else:
        dec_rows = jnp.zeros((0, d), jnp.float32)
        dec_vals = jnp.zeros((0,), jnp.float32)

      # Slots: attackers by rank; decoy j overwrites the j-th benign slot
      # from the end (the release writes decoy j to slot N - 1 - j).
      benign = mask & ~is_malicious
      from_end = jnp.cumsum(benign[::-1])[::-1] - 1
      decoy_of = jnp.where(benign & (from_end < k), from_end, -1)
      r = jnp.clip(rank, 0, a - 1)
      out = jnp.where(attacking[:, None], att_rows[r].astype(updates.dtype),
                      updates)
      if max_decoys:
        j = jnp.clip(decoy_of, 0, max_decoys - 1)
        out = jnp.where((decoy_of >= 0)[:, None],
                        dec_rows[j].astype(updates.dtype), out)
      present = jnp.zeros((a,), bool).at[jnp.where(attacking, r, a)].set(
          True, mode='drop')
      used = jnp.arange(max_decoys) < jnp.minimum(k, jnp.sum(benign))
      new = ThreeDFedState(
          started=jnp.bool_(True), weak_dp=weak, k=k, alpha=alpha, idx=idx,
          value=jnp.concatenate([att_vals, dec_vals]).astype(jnp.float32),
          base=theta[idx], live=jnp.concatenate([present, used]),
          group=group, feedback=feedback)
      return out, new, decoy_of >= 0

    # Diagnostics: what each planted slot read this round.
    feedback = jnp.where(codes >= 0, (theta[state.idx] - state.base) /
                         state.value, jnp.nan).astype(jnp.float32)

    def idle():
      return (updates, state._replace(live=jnp.zeros_like(state.live),
                                      feedback=feedback),
              jnp.zeros((c,), bool))

    return jax.lax.cond(jnp.any(attacking), attack, idle)

  def curvature(params, local, off, shape):
    """sum over attacker 0's batches, clean and triggered, of H 1 on the
    indicator layer (the release's 'curvature': a Hessian row sum), in
    eval mode."""
    leaves, treedef = jax.tree.flatten(params)
    which, _ = _leaf_at(params, off)
    tangent = jax.tree.unflatten(treedef, [
        jnp.ones_like(x) if i == which else jnp.zeros_like(x)
        for i, x in enumerate(leaves)])
    n_pad = local.x.shape[1]
    steps = -(-n_pad // batch_size)
    rows = jnp.arange(steps * batch_size, dtype=jnp.int32).reshape(
        steps, batch_size)

    def hv(p, x, y, m):
      # Reverse over reverse (the zoo's convolutions have custom VJPs, so
      # forward mode is out): d/dp <grad L(p), v>.
      grad = jax.grad(lambda q: ce(q, x, y, m, None, False))
      directional = lambda q: sum(
          jnp.vdot(gq, tq) for gq, tq in zip(jax.tree.leaves(grad(q)),
                                             jax.tree.leaves(tangent)))
      return jax.tree.leaves(jax.grad(directional)(p))[which]

    def body(total, r):
      m = r < local.count
      x = local.x[local.row, jnp.minimum(r, n_pad - 1)]
      y = local.y[local.row, jnp.minimum(r, n_pad - 1)]
      xs, ys = stamp(x, y)
      live = jnp.any(m)
      add = jax.lax.cond(
          live, lambda: hv(params, x, y, m) + hv(params, xs, ys, m),
          lambda: jnp.zeros(shape, jnp.float32))
      return total + add.astype(jnp.float32), None

    total, _ = jax.lax.scan(body, jnp.zeros(shape, jnp.float32), rows)
    return total.ravel()

  return StatefulAttack('3dfed', init, apply, _state_metrics)
