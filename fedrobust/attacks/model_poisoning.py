"""Model-poisoning attacks: malicious clients rewrite their update rows.

  attack = get_model_attack(name, **hparams)
  updates = attack.apply(updates, is_malicious, mask, key)
    updates: float[C, D], the round's client deltas raveled by the engine.
    is_malicious, mask: bool[C]; key: a PRNG key.

Every row with `mask & is_malicious` is replaced by a malicious update; every
other row comes back bit-identical (a `jnp.where`, never arithmetic). Benign
statistics are taken over the rows with `mask & ~is_malicious` only, so a
masked slot never changes a result, even when it holds NaN. A benign row the
attackers' arithmetic cannot use (NaN, Inf, or a squared norm past float32's
range, e.g. 1e38 coordinates: `usable_rows`) is left out of their statistics
as well, as every robust rule drops it: a diverged honest client does not
turn the attackers' rows into NaN. The number of
real clients n = sum(mask) and of real attackers m = sum(mask & is_malicious)
are traced; shapes are static and no Python `if` looks at a traced value.

This file holds the interface, the shared benign statistics and gamma search,
and the attacks that need no aggregator oracle: sign flipping, Gaussian
noise, scaling (model replacement), IPM, LIE, and the AGR-agnostic min-max
and min-sum attacks. AGR-tailored attacks live in `agr_tailored.py`, Fang et
al.'s in `fang.py`.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.special import ndtri

from fedrobust.errors import SettingError

Apply = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]

DIRECTIONS = ('unit_vec', 'sign', 'std')


class ModelAttack(NamedTuple):
  """A model-poisoning attack as one pure, jittable function.

  Attributes:
    name: the registry name (the value of the 'attack' setting).
    needs_benign: True when the threat model grants the attacker the benign
      updates or their statistics (IPM, LIE, min-max, Fang, ...); False when
      each attacker only uses its own update or noise.
    apply: (updates float[C, D], is_malicious bool[C], mask bool[C], key)
      -> float[C, D].
  """
  name: str
  needs_benign: bool
  apply: Apply


# --------------------------------------------------------------------------
# Shared pieces.
# --------------------------------------------------------------------------


def invalid(attack: str, argument: str, message: str) -> SettingError:
  """The error every factory raises for a bad setting `argument`."""
  return SettingError(argument, message, component=f'attack {attack}')


def check_positive(attack: str, field: str, value) -> None:
  """Raises unless value is a finite real number > 0."""
  if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and
          math.isfinite(value) and value > 0):
    raise invalid(attack, field, f'must be a finite number > 0, got '
                  f'{value!r}')


def check_direction(attack: str, direction: str) -> None:
  """Raises unless direction is one of DIRECTIONS."""
  if direction not in DIRECTIONS:
    raise invalid(attack, 'direction', f'must be one of {DIRECTIONS}, got '
                  f'{direction!r}')


def check_count(attack: str, field: str, value, *, minimum: int) -> None:
  """Raises unless value is an int >= minimum."""
  if (not isinstance(value, numbers.Integral) or isinstance(value, bool) or
      value < minimum):
    raise invalid(attack, field, f'must be an int >= {minimum}, got '
                  f'{value!r}')


def check_search(attack: str, gamma_init, tau, max_iters) -> None:
  """Validates the settings of `halving_search`."""
  check_positive(attack, 'gamma_init', gamma_init)
  check_positive(attack, 'tau', tau)
  check_count(attack, 'max_iters', max_iters, minimum=1)


class BenignStats(NamedTuple):
  """What an attacker with benign knowledge sees in one round.

  Attributes:
    benign: bool[C], mask & ~is_malicious.
    attacker: bool[C], mask & is_malicious (the rows that get replaced).
    n: float[], real clients, sum(mask).
    m: float[], real attackers, sum(attacker).
    num_benign: float[], n - m.
    mean: float[D], mu_j = mean of the benign rows (0 if there are none).
    std: float[D], sigma_j, the unbiased (ddof=1) standard deviation of the
      benign rows, as torch.std in the LIE and NDSS'21 reference code; 0 when
      fewer than two benign rows.
  """
  benign: jax.Array
  attacker: jax.Array
  n: jax.Array
  m: jax.Array
  num_benign: jax.Array
  mean: jax.Array
  std: jax.Array


KNOWLEDGE = ('omniscient', 'partial')


def check_knowledge(attack: str, knowledge: str) -> None:
  """Raises unless knowledge is one of KNOWLEDGE."""
  if knowledge not in KNOWLEDGE:
    raise invalid(attack, 'knowledge', f'must be one of {KNOWLEDGE}, got '
                  f'{knowledge!r}')


def usable_rows(updates: jax.Array) -> jax.Array:
  """bool[C]: rows whose squared norm is finite in float32 (no NaN or Inf,
  and no coordinate so large that squared distances overflow)."""
  sq = jnp.sum(jnp.square(updates.astype(jnp.float32)), axis=1)
  return jnp.isfinite(sq)


def benign_stats(updates: jax.Array, is_malicious: jax.Array,
                 mask: jax.Array, knowledge: str = 'omniscient'
                 ) -> BenignStats:
  """Counts, coordinate-wise mean and std of the benign rows.

  Rows outside `benign` are selected away before any arithmetic, so NaN or
  Inf in a masked slot (or in an attacker's own row) never leaks in; nor
  does a benign row that is not `usable_rows`. The std is two-pass (centered), which keeps precision when all updates share a
  large component.

  With knowledge='partial' (the NDSS'21 partial-knowledge threat model)
  the attackers know only their own honest updates: `benign` is then the
  attackers' rows (before they are replaced), and the mean, std and
  distances are theirs; n and m stay the round's real counts.

  Args:
    updates: float[C, D].
    is_malicious: bool[C].
    mask: bool[C].
    knowledge: 'omniscient' (every benign update) or 'partial'.

  Returns:
    BenignStats.
  """
  attacker = mask & is_malicious
  benign = attacker if knowledge == 'partial' else mask & ~is_malicious
  benign = benign & usable_rows(updates)
  dtype = updates.dtype
  n = jnp.sum(mask).astype(dtype)
  m = jnp.sum(attacker).astype(dtype)
  nb = jnp.sum(benign).astype(dtype)
  rows = benign[:, None]
  x = jnp.where(rows, updates, 0.0)
  mean = jnp.sum(x, axis=0) / jnp.maximum(nb, 1.0)
  centered = jnp.where(rows, updates - mean[None, :], 0.0)
  var = jnp.sum(jnp.square(centered), axis=0) / jnp.maximum(nb - 1.0, 1.0)
  std = jnp.where(nb > 1, jnp.sqrt(var), 0.0)
  return BenignStats(benign, attacker, n, m, nb, mean, std)


def replace_malicious(updates: jax.Array, attacker: jax.Array,
                      malicious: jax.Array) -> jax.Array:
  """Rows where `attacker` is True take `malicious`; the rest are untouched.

  Args:
    updates: float[C, D].
    attacker: bool[C].
    malicious: float[D] (one vector every attacker sends) or float[C, D].

  Returns:
    float[C, D].
  """
  if malicious.ndim == 1:
    malicious = malicious[None, :]
  return jnp.where(attacker[:, None], malicious.astype(updates.dtype),
                   updates)


def perturbation(direction: str, stats: BenignStats) -> jax.Array:
  """The NDSS'21 perturbation p (float[D]) added to the benign mean.

  p = -mu / ||mu||_2 ('unit_vec'), -sign(mu) ('sign') or -sigma ('std').
  A zero benign mean gives p = 0 for 'unit_vec' (no direction to invert).
  """
  if direction == 'unit_vec':
    norm = jnp.sqrt(jnp.sum(jnp.square(stats.mean)))
    return jnp.where(norm > 0, -stats.mean / jnp.where(norm > 0, norm, 1.0),
                     0.0)
  if direction == 'sign':
    return -jnp.sign(stats.mean)
  if direction == 'std':
    return -stats.std
  raise ValueError(f'unknown direction {direction!r}')


class LineDistances(NamedTuple):
  """Squared distances from points on a line to the benign rows.

  For x(g) = o + g p and benign row b_i,
    ||x(g) - b_i||^2 = ||o - b_i||^2 + 2 g <o - b_i, p> + g^2 ||p||^2,
  so a gamma search costs O(C) per step instead of O(C D).

  Attributes:
    origin_sq: float[C], ||o - b_i||^2 (0 off the benign rows).
    cross: float[C], <o - b_i, p> (0 off the benign rows).
    p_sq: float[], ||p||^2.
  """
  origin_sq: jax.Array
  cross: jax.Array
  p_sq: jax.Array

  def at(self, gamma: jax.Array) -> jax.Array:
    """float[C]: ||o + gamma p - b_i||^2 (0 off the benign rows)."""
    sq = self.origin_sq + 2.0 * gamma * self.cross + gamma**2 * self.p_sq
    return jnp.maximum(sq, 0.0)


def line_distances(updates: jax.Array, benign: jax.Array, origin: jax.Array,
                   direction: jax.Array) -> LineDistances:
  """Precomputes LineDistances for x(g) = origin + g * direction.

  Args:
    updates: float[C, D].
    benign: bool[C].
    origin: float[D].
    direction: float[D].

  Returns:
    LineDistances; differences are taken directly (no Gram trick).
  """
  diff = jnp.where(benign[:, None], origin[None, :] - updates, 0.0)
  return LineDistances(origin_sq=jnp.sum(jnp.square(diff), axis=1),
                       cross=jnp.sum(diff * direction[None, :], axis=1),
                       p_sq=jnp.sum(jnp.square(direction)))


def benign_sq_distances(updates: jax.Array, stats: BenignStats) -> jax.Array:
  """float[C, C]: ||b_i - b_j||^2 between benign rows, 0 elsewhere.

  Uses ||x_i||^2 + ||x_j||^2 - 2 <x_i, x_j> on rows centered at the benign
  mean (x_i = b_i - mu), in full float32 matmul precision, so a component
  shared by all updates does not cancel catastrophically and memory stays
  O(C^2 + C D).
  """
  both = stats.benign[:, None] & stats.benign[None, :]
  x = jnp.where(stats.benign[:, None], updates - stats.mean[None, :], 0.0)
  gram = jnp.matmul(x, x.T, precision=lax.Precision.HIGHEST)
  sq = jnp.diagonal(gram)
  dist = jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * gram, 0.0)
  return jnp.where(both, dist, 0.0)


def halving_search(test: Callable, aux, *, gamma_init: float, tau: float,
                   max_iters: int) -> jax.Array:
  """The gamma search of Shejwalkar & Houmansadr (NDSS'21), as a while_loop.

    gamma <- gamma_init; step <- gamma_init / 2; gamma_succ <- 0
    while step >= tau and fewer than max_iters steps:
      if test(gamma): gamma_succ <- gamma; gamma <- gamma + step
      else:           gamma <- gamma - step
      step <- step / 2

  gamma stays in (0, 2 gamma_init); gamma_succ is 0 if no gamma passed.

  Args:
    test: (gamma float[], aux) -> (passes bool[], aux); `aux` is carried
      state (e.g. the previous objective value for AGR-tailored search).
    aux: the initial carried state (a pytree of arrays).
    gamma_init: the first gamma tried.
    tau: stop once the step falls below tau.
    max_iters: hard cap on the number of tests.

  Returns:
    float32[]: gamma_succ, the last gamma that passed.
  """
  def cond(state):
    _, step, _, i, _ = state
    return (step >= tau) & (i < max_iters)

  def body(state):
    gamma, step, succ, i, carried = state
    ok, carried = test(gamma, carried)
    succ = jnp.where(ok, gamma, succ)
    gamma = jnp.where(ok, gamma + step, gamma - step)
    return gamma, step / 2.0, succ, i + 1, carried

  f32 = jnp.float32
  init = (f32(gamma_init), f32(gamma_init / 2.0), f32(0.0),
          jnp.int32(0), aux)
  return lax.while_loop(cond, body, init)[2]


# --------------------------------------------------------------------------
# Attacks that need no benign knowledge.
# --------------------------------------------------------------------------


def sign_flip(*, scale: float = 1.0) -> ModelAttack:
  """Sign flipping: each attacker sends -scale times its honest update.

    Delta_mal_c = -scale * Delta_c.

  Args:
    scale: > 0.

  Returns:
    A ModelAttack with needs_benign=False.

  References:
    Li et al. "RSA: Byzantine-Robust Stochastic Aggregation Methods for
    Distributed Learning from Heterogeneous Datasets", AAAI 2019 (the
    sign-flipping attack); Damaskinos et al., ICML 2018 (reversed gradient).
  """
  check_positive('sign_flip', 'scale', scale)

  def apply(updates, is_malicious, mask, key):
    del key
    return replace_malicious(updates, mask & is_malicious, -scale * updates)

  return ModelAttack('sign_flip', False, apply)


def gaussian(*, std: float = 1.0) -> ModelAttack:
  """Gaussian noise: each attacker sends an independent N(0, std^2 I) draw.

  Args:
    std: > 0, the noise standard deviation per coordinate.

  Returns:
    A ModelAttack with needs_benign=False.

  References:
    Blanchard et al. "Machine Learning with Adversaries: Byzantine Tolerant
    Gradient Descent", NeurIPS 2017 (Gaussian Byzantine workers).
  """
  check_positive('gaussian', 'std', std)

  def apply(updates, is_malicious, mask, key):
    noise = std * jax.random.normal(key, updates.shape, updates.dtype)
    return replace_malicious(updates, mask & is_malicious, noise)

  return ModelAttack('gaussian', False, apply)


def scaling(*, factor: float | None = None) -> ModelAttack:
  """Boosting / model replacement: attackers scale their own update.

    Delta_mal_c = gamma * Delta_c,  gamma = factor, or n / m if None.

  Bagdasaryan et al. scale by gamma = n / eta so that one attacker's model
  replaces the global model under FedAvg; with m attackers sharing the
  boost and a server step of 1 that is n / m each. The attacker's own
  update is whatever it trained (a backdoor when combined with a data
  attack); no benign knowledge is used.

  Args:
    factor: > 0, or None for n / m (traced).

  Returns:
    A ModelAttack with needs_benign=False.

  References:
    Bagdasaryan et al. "How To Backdoor Federated Learning", AISTATS 2020
    (model replacement); Bhagoji et al. "Analyzing Federated Learning
    through an Adversarial Lens", ICML 2019 (explicit boosting).
  """
  if factor is not None:
    check_positive('scaling', 'factor', factor)

  def apply(updates, is_malicious, mask, key):
    del key
    attacker = mask & is_malicious
    if factor is None:
      n = jnp.sum(mask).astype(updates.dtype)
      m = jnp.sum(attacker).astype(updates.dtype)
      gamma = jnp.where(m > 0, n / jnp.maximum(m, 1.0), 1.0)
    else:
      gamma = factor
    return replace_malicious(updates, attacker, gamma * updates)

  return ModelAttack('scaling', False, apply)


def model_replacement(*, server_lr: float = 1.0) -> ModelAttack:
  """Model replacement (Bagdasaryan et al., AISTATS 2020, Eq. 3): each
  attacker submits gamma (X - G^t) with gamma = n / eta, n the round's real
  clients and eta the server's learning rate, so that under FedAvg its
  model X replaces the global model (each attacker boosts as if it were
  alone; `scaling`'s default n / m shares the boost among the m).

  Args:
    server_lr: eta, the server's step on the mean update (the runner's
      --server_lr; give the same value).

  Returns:
    A ModelAttack with needs_benign=False.
  """
  check_positive('model_replacement', 'server_lr', server_lr)

  def apply(updates, is_malicious, mask, key):
    del key
    gamma = jnp.sum(mask).astype(updates.dtype) / server_lr
    return replace_malicious(updates, mask & is_malicious, gamma * updates)

  return ModelAttack('model_replacement', False, apply)


def inf(*, value: float = math.inf) -> ModelAttack:
  """Inf (ByzFL's Inf): every attacker sends `value` in every coordinate
  (+inf by default). A rule must drop it; a mean cannot.

  Args:
    value: the constant (any float; +inf, -inf or a huge finite number).

  Returns:
    A ModelAttack with needs_benign=False.

  References:
    Allouah et al., ByzFL (2025), attack `Inf`.
  """
  if not isinstance(value, numbers.Real) or isinstance(value, bool) or (
      math.isnan(value)):
    raise invalid('inf', 'value', f'must be a number (not NaN), got '
                  f'{value!r}')

  def apply(updates, is_malicious, mask, key):
    del key
    return replace_malicious(updates, mask & is_malicious,
                             jnp.full(updates.shape[1:], value,
                                      updates.dtype))

  return ModelAttack('inf', False, apply)


# --------------------------------------------------------------------------
# Attacks that use benign statistics.
# --------------------------------------------------------------------------


def mimic(*, choice: int = 0) -> ModelAttack:
  """Mimic (Karimireddy, He, Jaggi, ICLR 2022): every attacker sends a copy
  of one benign client's update, over-weighting that client's data in
  every round (FLPoison's Mimic: the client `choice`). Here `choice`
  counts the round's benign clients in slot order (modulo their number).

  Args:
    choice: >= 0.

  Returns:
    A ModelAttack with needs_benign=True.
  """
  check_count('mimic', 'choice', choice, minimum=0)

  def apply(updates, is_malicious, mask, key):
    del key
    stats = benign_stats(updates, is_malicious, mask)
    order = jnp.cumsum(stats.benign) - 1          # rank among benign rows
    k = jnp.int32(choice) % jnp.maximum(jnp.sum(stats.benign), 1)
    pick = jnp.argmax(stats.benign & (order == k))
    return replace_malicious(updates, stats.attacker,
                             jnp.where(jnp.any(stats.benign), updates[pick],
                                       0.0))

  return ModelAttack('mimic', True, apply)



def ipm(*, epsilon: float = 0.5, knowledge: str = 'omniscient'
        ) -> ModelAttack:
  """Inner product manipulation: send -epsilon times the benign mean.

    Delta_mal = -epsilon * mu,  mu = (1 / (n - m)) sum_{benign i} Delta_i,

  which makes <E[aggregate], mu> negative for mean-like rules once epsilon
  exceeds (n - m) / m (Xie et al.); small epsilon targets
  distance-based rules such as Krum.

  Args:
    epsilon: > 0.
    knowledge: 'omniscient' or 'partial' (the attackers' own honest
      updates only; see benign_stats).

  Returns:
    A ModelAttack with needs_benign=True.

  References:
    Xie, Koyejo, Gupta. "Fall of Empires: Breaking Byzantine-tolerant SGD
    by Inner Product Manipulation", UAI 2019.
  """
  check_positive('ipm', 'epsilon', epsilon)
  check_knowledge('ipm', knowledge)

  def apply(updates, is_malicious, mask, key):
    del key
    stats = benign_stats(updates, is_malicious, mask, knowledge)
    return replace_malicious(updates, stats.attacker, -epsilon * stats.mean)

  return ModelAttack('ipm', True, apply)


LIE_Z_RULES = ('ndss', 'baruch', 'peers')

# The NDSS'21 authors' code (Shejwalkar & Houmansadr, the LIE cells of
# their notebooks) hard-codes z per attacker count for n = 50 clients:
# z_values = {3: 0.69847, 5: 0.7054, 8: 0.71904, 10: 0.72575, 12: 0.73891}.
# As (attacker fraction, z) points; other fractions interpolate linearly
# and clamp at the ends.
NDSS_LIE_Z = ((0.06, 0.69847), (0.10, 0.7054), (0.16, 0.71904),
              (0.20, 0.72575), (0.24, 0.73891))


def lie_z(n: jax.Array, m: jax.Array, rule: str = 'baruch') -> jax.Array:
  """LIE's z for n workers of which m are corrupted.

    'baruch': s = floor(n / 2 + 1) - m,  z = Phi^{-1}((n - s) / n)
              (Baruch et al., Sec. 3 and their release);
    'peers':  z = Phi^{-1}((n - m - s) / (n - m)), the same s
              (FLPoison's attackers/alie.py and Blades' ALIE);
    'ndss':   the NDSS'21 code's table NDSS_LIE_Z at the fraction m / n.

  Deviation: s is clamped to >= 1. When m >= floor(n/2 + 1) the attackers
  are a majority, s <= 0 and the formulas give Phi^{-1}(>= 1) = +inf; the
  clamp keeps z finite. A non-finite result (n <= 1) is replaced by 0.

  Args:
    n: float[], real clients.
    m: float[], real attackers.
    rule: one of LIE_Z_RULES.

  Returns:
    float[].
  """
  if rule == 'ndss':
    fraction = m / jnp.maximum(n, 1.0)
    xs, ys = zip(*NDSS_LIE_Z)
    return jnp.interp(fraction, jnp.asarray(xs), jnp.asarray(ys))
  s = jnp.maximum(jnp.floor(n / 2.0 + 1.0) - m, 1.0)
  if rule == 'peers':
    z = ndtri((n - m - s) / jnp.maximum(n - m, 1.0))
  else:
    z = ndtri((n - s) / jnp.maximum(n, 1.0))
  return jnp.where(jnp.isfinite(z), z, 0.0)


def lie(*, z: float | None = None, z_rule: str = 'ndss',
        knowledge: str = 'omniscient') -> ModelAttack:
  """A Little Is Enough: every attacker sends mu - z sigma.

    Delta_mal_j = mu_j - z sigma_j  for every coordinate j,

  with mu, sigma the benign mean and (unbiased) standard deviation, and z
  from `lie_z(n, m, z_rule)` unless given. The shift stays within the
  benign spread, so coordinate-wise and distance-based rules keep the
  attackers.

  The references disagree on z (BUILD_NOTES §3g): the default is
  the NDSS'21 authors' table (about 0.7), the value behind the LIE rows
  of the NDSS tables this library's threat tables follow; 'baruch' is
  the LIE paper's formula (this library's earlier rule; 0.39
  for n = 20, m = 4) and 'peers' FLPoison's and Blades' (0.16 there).

  Args:
    z: a fixed finite z, or None for the rule's z(n, m) (traced).
    z_rule: one of LIE_Z_RULES.
    knowledge: 'omniscient' or 'partial' (the attackers' own honest
      updates only; see benign_stats).

  Returns:
    A ModelAttack with needs_benign=True.

  References:
    Baruch, Baruch, Goldberg. "A Little Is Enough: Circumventing Defenses
    For Distributed Learning", NeurIPS 2019; Shejwalkar & Houmansadr,
    NDSS 2021 (their code's z_values).
  """
  if z is not None and not (isinstance(z, numbers.Real) and
                            math.isfinite(z)):
    raise invalid('lie', 'z', f'must be a finite number or None, got {z!r}')
  if z_rule not in LIE_Z_RULES:
    raise invalid('lie', 'z_rule', f'must be one of {LIE_Z_RULES}, got '
                  f'{z_rule!r}')
  check_knowledge('lie', knowledge)

  def apply(updates, is_malicious, mask, key):
    del key
    stats = benign_stats(updates, is_malicious, mask, knowledge)
    zz = lie_z(stats.n, stats.m, z_rule) if z is None else z
    return replace_malicious(updates, stats.attacker,
                             stats.mean - zz * stats.std)

  return ModelAttack('lie', True, apply)


SUM_THRESHOLDS = ('min', 'max')


def _agr_agnostic(name: str, direction: str, gamma_init: float, tau: float,
                  max_iters: int, threshold: str = 'min',
                  knowledge: str = 'omniscient') -> ModelAttack:
  """min_max / min_sum: largest gamma whose mu + gamma p passes the test."""
  check_direction(name, direction)
  check_search(name, gamma_init, tau, max_iters)
  if threshold not in SUM_THRESHOLDS:
    raise invalid(name, 'threshold', f'must be one of {SUM_THRESHOLDS}, got '
                  f'{threshold!r}')
  check_knowledge(name, knowledge)
  pick = jnp.min if threshold == 'min' else jnp.max
  empty = jnp.inf if threshold == 'min' else -jnp.inf   # non-benign rows

  def apply(updates, is_malicious, mask, key):
    del key
    stats = benign_stats(updates, is_malicious, mask, knowledge)
    p = perturbation(direction, stats)
    line = line_distances(updates, stats.benign, stats.mean, p)
    pair = benign_sq_distances(updates, stats)
    if name == 'min_max':
      widest = jnp.max(pair)

      def test(gamma, aux):
        far = jnp.max(jnp.where(stats.benign, line.at(gamma), 0.0))
        return far <= widest, aux
    else:
      sums = jnp.sum(pair, axis=1)
      bound = pick(jnp.where(stats.benign, sums, empty))

      def test(gamma, aux):
        total = jnp.sum(jnp.where(stats.benign, line.at(gamma), 0.0))
        return total <= bound, aux

    gamma = halving_search(test, (), gamma_init=gamma_init, tau=tau,
                           max_iters=max_iters)
    return replace_malicious(updates, stats.attacker,
                             stats.mean + gamma * p)

  return ModelAttack(name, True, apply)


def min_max(*, direction: str = 'std', gamma_init: float = 10.0,
            tau: float = 1e-5, max_iters: int = 50,
            knowledge: str = 'omniscient') -> ModelAttack:
  """AGR-agnostic min-max: as far as the benign spread allows, in distance.

    Delta_mal = mu + gamma p,   gamma = argmax gamma  s.t.
      max_{i benign} ||Delta_mal - Delta_i|| <= max_{i,j benign}
      ||Delta_i - Delta_j||,

  gamma found by `halving_search`; all attackers send the same vector.

  Args:
    direction: 'unit_vec' (p = -mu/||mu||), 'sign' (p = -sign(mu)) or 'std'
      (p = -sigma).
    gamma_init: first gamma tried; the search can reach < 2 gamma_init.
    tau: search stops once its step falls below tau.
    max_iters: hard cap on search steps.
    knowledge: 'omniscient' or 'partial' (the attackers' own honest
      updates only; see benign_stats).

  Returns:
    A ModelAttack with needs_benign=True.

  References:
    Shejwalkar & Houmansadr. "Manipulating the Byzantine: Optimizing Model
    Poisoning Attacks and Defenses for Federated Learning", NDSS 2021,
    AGR-agnostic attacks (min-max).
  """
  return _agr_agnostic('min_max', direction, gamma_init, tau, max_iters,
                       knowledge=knowledge)


def min_sum(*, direction: str = 'std', gamma_init: float = 10.0,
            tau: float = 1e-5, max_iters: int = 50,
            threshold: str = 'min',
            knowledge: str = 'omniscient') -> ModelAttack:
  """AGR-agnostic min-sum: as far as the benign spread allows, in sum.

    Delta_mal = mu + gamma p,   gamma = argmax gamma  s.t.
      sum_{i benign} ||Delta_mal - Delta_i||^2 <= min_{i benign}
      sum_{j benign} ||Delta_i - Delta_j||^2.

  The bound is the smallest benign score sum in the NDSS'21 authors' code
  (`our_attack_score`: `min_score = torch.min(scores)`) and the default;
  threshold='max' takes the largest, as FLPoison's min-sum does (a larger
  gamma; this library's earlier rule).

  Args:
    direction: 'unit_vec', 'sign' or 'std' (see `min_max`).
    gamma_init: first gamma tried.
    tau: search stops once its step falls below tau.
    max_iters: hard cap on search steps.
    threshold: 'min' (the authors' code) or 'max' (FLPoison).
    knowledge: 'omniscient' or 'partial' (the attackers' own honest
      updates only; see benign_stats).

  Returns:
    A ModelAttack with needs_benign=True.

  References:
    Shejwalkar & Houmansadr, NDSS 2021, AGR-agnostic attacks (min-sum).
  """
  return _agr_agnostic('min_sum', direction, gamma_init, tau, max_iters,
                       threshold, knowledge)
