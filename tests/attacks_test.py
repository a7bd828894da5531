"""Tests for fedrobust.attacks: the ModelAttack contract and each definition.

One shared round: C=10 slots, D=12; slots 8 and 9 are padding holding NaN
(slot 8 is also flagged malicious); slots 0 and 1 are the real attackers.
So n = 8 real clients, m = 2 real attackers, 6 benign rows. Each attack
program is jitted once and its outputs cached, to keep XLA compiles few.
"""

import functools
import statistics

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
from scipy.cluster import hierarchy
from scipy.spatial.distance import squareform

from fedrobust.attacks import (ATTACKS, MODEL_ATTACKS, ModelAttack,
                               get_model_attack)
from fedrobust.attacks.fang import fang_krum
from fedrobust.attacks.model_poisoning import lie_z
from fedrobust.errors import SettingError

C, D = 10, 12
MASK = np.array([1, 1, 1, 1, 1, 1, 1, 1, 0, 0], bool)
MALICIOUS = np.array([1, 1, 0, 0, 0, 0, 0, 0, 1, 0], bool)
ATTACKER = MASK & MALICIOUS
BENIGN = MASK & ~MALICIOUS
N, M = int(MASK.sum()), int(ATTACKER.sum())
KEY = jax.random.key(0)


def make_updates(seed=0, pad=np.nan):
  rng = np.random.default_rng(seed)
  x = rng.normal(0.2, 1.0, (C, D)).astype(np.float32)
  x[~MASK] = pad
  return x


UPDATES = make_updates()

CONFIGS = {
    'sign_flip': ('sign_flip', {}),
    'gaussian': ('gaussian', {}),
    'scaling': ('scaling', {}),
    'ipm': ('ipm', {}),
    'lie': ('lie', {}),
    'min_max': ('min_max', {}),
    'min_sum': ('min_sum', {}),
    'tailored_trimmed_mean': ('agr_tailored', {'rule': 'trimmed_mean'}),
    'tailored_median': ('agr_tailored', {'rule': 'median'}),
    'tailored_krum': ('agr_tailored', {'rule': 'krum'}),
    'tailored_multi_krum': ('agr_tailored', {'rule': 'multi_krum'}),
    'fang_trim': ('fang_trim', {}),
    'fang_krum': ('fang_krum', {}),
    'inf': ('inf', {'value': 1e30}),
    'mimic': ('mimic', {}),
    'model_replacement': ('model_replacement', {}),
    'optimal_ipm': ('optimal_ipm', {}),
    'optimal_alie': ('optimal_alie', {'rule': 'median'}),
    'signguard_adaptive': ('signguard_adaptive', {}),
    'clippedclustering_adaptive': ('clippedclustering_adaptive', {}),
}

NEEDS_BENIGN = {'sign_flip': False, 'gaussian': False, 'scaling': False,
                'ipm': True, 'lie': True, 'min_max': True, 'min_sum': True,
                'agr_tailored': True, 'fang_trim': True, 'fang_krum': True,
                'inf': False, 'mimic': True, 'optimal_ipm': True,
                'model_replacement': False,
                'optimal_alie': True, 'signguard_adaptive': True,
                'clippedclustering_adaptive': True}


@functools.lru_cache(maxsize=None)
def jitted(label, **extra):
  name, kwargs = CONFIGS[label] if label in CONFIGS else (label, {})
  return jax.jit(get_model_attack(name, **kwargs, **extra).apply)


@functools.lru_cache(maxsize=None)
def attacked(label, **extra):
  """Attack output (jitted) on the shared round, as float32[C, D]."""
  return np.asarray(jitted(label, **extra)(UPDATES, MALICIOUS, MASK, KEY))


# ----------------------------------------------------------------------------
# NumPy references (float64).
# ----------------------------------------------------------------------------


def benign_rows(x=UPDATES):
  return x[BENIGN].astype(np.float64)


def sq_dists(x):
  x = np.asarray(x, np.float64)
  return np.sum((x[:, None, :] - x[None, :, :])**2, axis=-1)


def krum_scores(x, f):
  d = sq_dists(x)
  k = len(x) - f - 2
  return np.array([np.sort(np.delete(d[i], i))[:k].sum()
                   for i in range(len(x))])


def trimmed_mean(x, f):
  return np.sort(x, axis=0)[f:len(x) - f].mean(axis=0)


def deviation(out, rule):
  """|| rule(real rows of out) - rule(benign rows) ||."""
  real = out[MASK].astype(np.float64)
  return np.linalg.norm(rule(real) - rule(benign_rows()))


def recover_gamma(mal, mu, p):
  """gamma with mal = mu + gamma p (checked to hold)."""
  gamma = np.dot(mal - mu, p) / np.dot(p, p)
  np.testing.assert_allclose(mal, mu + gamma * p, rtol=1e-4, atol=1e-5)
  return gamma


def direction(name, b):
  mu = b.mean(0)
  return {'unit_vec': -mu / np.linalg.norm(mu), 'sign': -np.sign(mu),
          'std': -b.std(0, ddof=1)}[name]


# ----------------------------------------------------------------------------
# The contract every registry entry keeps.
# ----------------------------------------------------------------------------


class ConformanceTest(parameterized.TestCase):

  @parameterized.named_parameters(*[(k, k) for k in CONFIGS])
  def test_contract(self, label):
    out = attacked(label)
    self.assertEqual(out.shape, (C, D))
    self.assertEqual(out.dtype, np.float32)
    # Benign and padded rows bit-identical (NaN == NaN here).
    np.testing.assert_array_equal(out[~ATTACKER], UPDATES[~ATTACKER])
    self.assertTrue(np.all(np.isfinite(out[ATTACKER])))
    self.assertTrue(np.all(out[ATTACKER] != UPDATES[ATTACKER]))

  @parameterized.named_parameters(*[(k, k) for k in CONFIGS])
  def test_padding_is_inert_and_jit_agrees(self, label):
    fn = jitted(label)
    other = UPDATES.copy()
    other[~MASK] = 1e30
    out_other = np.asarray(fn(other, MALICIOUS, MASK, KEY))
    np.testing.assert_array_equal(out_other[ATTACKER],
                                  attacked(label)[ATTACKER])
    name, kwargs = CONFIGS[label]
    eager = np.asarray(get_model_attack(name, **kwargs).apply(
        UPDATES, MALICIOUS, MASK, KEY))
    np.testing.assert_allclose(eager, attacked(label), rtol=1e-5, atol=1e-6)
    # No real attacker: the round comes back untouched.
    none = np.asarray(fn(UPDATES, np.zeros(C, bool), MASK, KEY))
    np.testing.assert_array_equal(none, UPDATES)

  @parameterized.product(label=sorted(CONFIGS),
                         bad=('nan', '+inf', '-inf', '1e38'))
  def test_attackers_stay_finite_beside_a_bad_benign_row(self, label, bad):
    """A diverged honest client (NaN / Inf, or 1e38 coordinates whose
    squares overflow) is left out of the attackers' statistics: their
    rows stay finite and every other row comes back as sent."""
    x = UPDATES.copy()
    row = int(np.flatnonzero(BENIGN)[0])
    x[row, ::2] = {'nan': np.nan, '+inf': np.inf, '-inf': -np.inf,
                   '1e38': 1e38}[bad]
    out = np.asarray(jitted(label)(x, MALICIOUS, MASK, KEY))
    self.assertTrue(np.all(np.isfinite(out[ATTACKER])), out[ATTACKER])
    np.testing.assert_array_equal(out[~ATTACKER], x[~ATTACKER])

  @parameterized.named_parameters(*[(k, k) for k in CONFIGS])
  def test_one_trace_for_every_round(self, label):
    name, kwargs = CONFIGS[label]
    attack = get_model_attack(name, **kwargs)

    def step(x, malicious, mask, key):
      return attack.apply(x, malicious, mask, key)
    step.__name__ = f'attack_step_{label}'
    step = jax.jit(chex.assert_max_traces(step, n=1))
    for seed in range(3):               # new values, attackers and mask
      rng = np.random.default_rng(seed)
      malicious = MALICIOUS if seed != 1 else np.roll(MALICIOUS, 1)
      step(make_updates(seed), malicious, MASK | (rng.random(C) < 0.5),
           jax.random.key(seed))

  def test_no_retrace_across_rounds(self):
    attack = get_model_attack('min_max')

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(x, key):
      return attack.apply(x, MALICIOUS, MASK, key)

    for seed in range(3):
      step(make_updates(seed), jax.random.key(seed))

  def test_registry(self):
    self.assertEqual(set(MODEL_ATTACKS), set(NEEDS_BENIGN))
    # Every registered model attack runs under the conformance tests.
    self.assertEqual({name for name, _ in CONFIGS.values()},
                     set(MODEL_ATTACKS))
    self.assertTrue(set(MODEL_ATTACKS) <= set(ATTACKS))
    for name, factory in MODEL_ATTACKS.items():
      attack = factory()
      self.assertIsInstance(attack, ModelAttack)
      self.assertEqual(attack.name, name)
      self.assertEqual(attack.needs_benign, NEEDS_BENIGN[name], name)

  def test_get_model_attack_errors_name_the_argument(self):
    with self.assertRaisesRegex(SettingError, r"attack: 'nope'.*'lie'"):
      get_model_attack('nope')
    with self.assertRaisesRegex(SettingError,
                                r"attack_kwargs: attack 'lie' takes no"):
      get_model_attack('lie', epsilon=1.0)

  @parameterized.parameters(
      ('sign_flip', {'scale': 0.0}, 'scale'),
      ('gaussian', {'std': -1.0}, 'std'),
      ('scaling', {'factor': 0}, 'factor'),
      ('ipm', {'epsilon': float('nan')}, 'epsilon'),
      ('lie', {'z': float('inf')}, 'z'),
      ('min_max', {'direction': 'up'}, 'direction'),
      ('min_sum', {'tau': 0.0}, 'tau'),
      ('min_sum', {'threshold': 'mean'}, 'threshold'),
      ('lie', {'z_rule': 'median'}, 'z_rule'),
      ('min_max', {'max_iters': 0}, 'max_iters'),
      ('agr_tailored', {'rule': 'bulyan'}, 'rule'),
      ('agr_tailored', {'rule': 'custom'}, 'aggregate_fn'),
      ('agr_tailored', {'num_byzantine': -1}, 'num_byzantine'),
      ('fang_trim', {'b': 1.0}, 'b'),
      ('fang_krum', {'reference': 'zero'}, 'reference'),
      ('inf', {'value': float('nan')}, 'value'),
      ('mimic', {'choice': -1}, 'choice'),
      ('optimal_ipm', {'rule': 'krum'}, 'rule'),
      ('optimal_alie', {'tau_min': 0.0}, 'tau_min'),
      ('clippedclustering_adaptive', {'margin': 0.0}, 'margin'),
  )
  def test_bad_settings_name_the_argument(self, name, kwargs, message):
    argument = message.split()[0]
    with self.assertRaises(SettingError) as ctx:
      get_model_attack(name, **kwargs)
    self.assertEqual(ctx.exception.argument, argument)
    self.assertEqual(ctx.exception.component, f'attack {name}')


# ----------------------------------------------------------------------------
# Each attack against its definition.
# ----------------------------------------------------------------------------


class DefinitionTest(parameterized.TestCase):

  def test_sign_flip(self):
    np.testing.assert_array_equal(attacked('sign_flip')[ATTACKER],
                                  -UPDATES[ATTACKER])
    out = get_model_attack('sign_flip', scale=2.5).apply(
        UPDATES, MALICIOUS, MASK, KEY)
    np.testing.assert_array_equal(np.asarray(out)[ATTACKER],
                                  np.float32(-2.5) * UPDATES[ATTACKER])

  def test_gaussian_rows_are_independent_draws(self):
    mal = attacked('gaussian')[ATTACKER]
    self.assertFalse(np.allclose(mal[0], mal[1]))
    self.assertLess(np.abs(mal).max(), 6.0)
    other = jitted('gaussian')(UPDATES, MALICIOUS, MASK, jax.random.key(1))
    self.assertFalse(np.allclose(np.asarray(other)[ATTACKER], mal))

  def test_scaling(self):
    np.testing.assert_array_equal(attacked('scaling')[ATTACKER],
                                  np.float32(N / M) * UPDATES[ATTACKER])
    out = get_model_attack('scaling', factor=3.0).apply(
        UPDATES, MALICIOUS, MASK, KEY)
    np.testing.assert_array_equal(np.asarray(out)[ATTACKER],
                                  np.float32(3.0) * UPDATES[ATTACKER])

  def test_ipm(self):
    expected = -0.5 * benign_rows().mean(0)
    for row in attacked('ipm')[ATTACKER]:
      np.testing.assert_allclose(row, expected, rtol=1e-5, atol=1e-6)

  @parameterized.parameters('ndss', 'baruch', 'peers')
  def test_lie(self, z_rule):
    """Golden z per reference: Baruch et al. (and their release)
    Phi^-1((n - s) / n); FLPoison's attackers/alie.py and Blades
    Phi^-1((n - m - s) / (n - m)), s = floor(n / 2 + 1) - m; the NDSS'21
    notebooks' z_values table (n = 50), here at m / n = 2 / 8 = 0.25, past
    its last entry (12 of 50: 0.73891)."""
    s = np.floor(N / 2 + 1) - M
    z = {'baruch': statistics.NormalDist().inv_cdf((N - s) / N),
         'peers': statistics.NormalDist().inv_cdf((N - M - s) / (N - M)),
         'ndss': 0.73891}[z_rule]
    b = benign_rows()
    expected = b.mean(0) - z * b.std(0, ddof=1)
    for row in attacked('lie', z_rule=z_rule)[ATTACKER]:
      np.testing.assert_allclose(row, expected, rtol=1e-5, atol=1e-5)
    if z_rule != 'ndss':
      return
    np.testing.assert_array_equal(attacked('lie'), attacked('lie',
                                                            z_rule='ndss'))
    # The table itself: 10 of 50 attackers (and 4 of 20) give 0.72575, and
    # a fraction between two entries interpolates.
    for n, m, want in ((50, 10, 0.72575), (20, 4, 0.72575), (50, 3, 0.69847),
                       (100, 18, (0.71904 + 0.72575) / 2)):
      self.assertAlmostEqual(float(lie_z(jnp.float32(n), jnp.float32(m),
                                         'ndss')), want, places=5)
    out = get_model_attack('lie', z=1.5).apply(UPDATES, MALICIOUS, MASK, KEY)
    np.testing.assert_allclose(np.asarray(out)[ATTACKER][0],
                               b.mean(0) - 1.5 * b.std(0, ddof=1),
                               rtol=1e-5, atol=1e-5)

  @parameterized.parameters('std', 'unit_vec', 'sign')
  def test_min_max(self, direction_name):
    out = (attacked('min_max') if direction_name == 'std'
           else attacked('min_max', direction=direction_name))
    b = benign_rows()
    mal = out[ATTACKER].astype(np.float64)
    np.testing.assert_array_equal(mal[0], mal[1])
    bound = np.sqrt(sq_dists(b).max())

    def farthest(x):
      return np.sqrt(((x[None, :] - b)**2).sum(1)).max()

    self.assertLessEqual(farthest(mal[0]), bound * (1 + 1e-5))
    p = direction(direction_name, b)
    gamma = recover_gamma(mal[0], b.mean(0), p)
    self.assertGreater(gamma, 0.0)
    if gamma < 2 * 10.0 - 1e-3:   # Below the search cap: near-maximal.
      self.assertGreater(farthest(b.mean(0) + 1.1 * gamma * p), bound)

  @parameterized.parameters(('std', 'min'), ('unit_vec', 'min'),
                            ('std', 'max'))
  def test_min_sum(self, direction_name, threshold):
    out = (attacked('min_sum') if (direction_name, threshold) == ('std',
                                                                   'min')
           else attacked('min_sum', direction=direction_name,
                         threshold=threshold))
    b = benign_rows()
    mal = out[ATTACKER].astype(np.float64)
    np.testing.assert_array_equal(mal[0], mal[1])
    sums = sq_dists(b).sum(1)
    bound = sums.min() if threshold == 'min' else sums.max()

    def total(x):
      return ((x[None, :] - b)**2).sum()

    self.assertLessEqual(total(mal[0]), bound * (1 + 1e-5))
    p = direction(direction_name, b)
    gamma = recover_gamma(mal[0], b.mean(0), p)
    self.assertGreater(gamma, 0.0)
    if gamma < 2 * 10.0 - 1e-3:
      self.assertGreater(total(b.mean(0) + 1.1 * gamma * p), bound)

  def test_model_replacement(self):
    """Bagdasaryan et al. Eq. 3: gamma = n / eta per attacker."""
    np.testing.assert_allclose(attacked('model_replacement')[ATTACKER],
                               N * UPDATES[ATTACKER], rtol=1e-6)
    out = get_model_attack('model_replacement', server_lr=0.5).apply(
        UPDATES, MALICIOUS, MASK, KEY)
    np.testing.assert_allclose(np.asarray(out)[ATTACKER],
                               2 * N * UPDATES[ATTACKER], rtol=1e-6)

  def test_inf_and_mimic(self):
    out = np.asarray(get_model_attack('inf').apply(UPDATES, MALICIOUS, MASK,
                                                   KEY))
    self.assertTrue(np.all(np.isposinf(out[ATTACKER])))
    np.testing.assert_array_equal(out[~ATTACKER], UPDATES[~ATTACKER])
    first, third = np.flatnonzero(BENIGN)[[0, 2]]
    for row in attacked('mimic')[ATTACKER]:
      np.testing.assert_array_equal(row, UPDATES[first])
    out = np.asarray(get_model_attack('mimic', choice=2).apply(
        UPDATES, MALICIOUS, MASK, KEY))
    np.testing.assert_array_equal(out[ATTACKER][0], UPDATES[third])

  def test_signguard_adaptive_golden_blades(self):
    """Blades' SignGuardAdversary, transcribed: hstack(rand(pos),
    -rand(neg), zeros) indexed by a random permutation, the same for every
    attacker; with the attack's own draws the rows are equal exactly."""
    out = attacked('signguard_adaptive')
    mu = benign_rows().mean(0).astype(np.float32)
    k_noise, k_perm = jax.random.split(KEY)
    u = np.asarray(jax.random.uniform(k_noise, (D,), jnp.float32))
    perm = np.asarray(jax.random.permutation(k_perm, D))
    pos, neg = int((mu > 0).sum()), int((mu < 0).sum())
    noise = np.concatenate([u[:pos], -u[pos:pos + neg],
                            np.zeros(D - pos - neg, np.float32)])
    for row in out[ATTACKER]:
      np.testing.assert_array_equal(row, noise[perm])
      self.assertEqual((row > 0).sum(), pos)
      self.assertEqual((row < 0).sum(), neg)
      self.assertTrue(np.all(np.abs(row) < 1))

  def test_clippedclustering_adaptive_golden_blades(self):
    """Blades' chain attack, transcribed in float64 with scipy's single
    linkage, on the geometry's intent (see the docstring's departures)."""
    scale, margin, eps = 10.0, 0.1, 1e-4
    b = benign_rows()
    mu = b.mean(0)
    unit = b / np.linalg.norm(b, axis=1, keepdims=True)
    dist = 1 - unit @ unit.T
    np.fill_diagonal(dist, 0.0)
    theta_c = np.arccos(1 - dist[~np.eye(len(b), dtype=bool)].min()) - margin
    labels = hierarchy.fcluster(hierarchy.linkage(
        squareform(dist, checks=False), method='single'), t=2,
                                criterion='maxclust')
    sizes = {lab: (labels == lab).sum() for lab in set(labels)}
    big = max(sizes, key=lambda lab: (sizes[lab],
                                      -np.flatnonzero(labels == lab)[0]))
    members = np.flatnonzero(labels == big)
    mu_u = mu / np.linalg.norm(mu)
    to_mean = 1 - unit[members] @ mu_u
    far = members[np.argmax(to_mean)]
    theta = np.arccos(1 - to_mean.max())
    v = unit[far]
    want = []
    for _ in range(M):
      if theta + theta_c >= np.pi:
        want.append(-scale * mu)
        continue
      phi = theta + theta_c - eps
      a = np.cos(phi) - np.sin(phi) / np.tan(theta)
      bb = np.cos(theta_c - eps) + np.sin(theta_c - eps) / np.tan(theta)
      v = a * mu_u + bb * v
      want.append(scale * v)
      theta = phi
    got = attacked('clippedclustering_adaptive')[ATTACKER]
    np.testing.assert_allclose(got, np.stack(want), rtol=2e-4, atol=2e-4)
    # The geometry: consecutive attackers are theta_c - eps apart and at
    # unit norm * scale, closer than the two closest benign updates.
    if theta + theta_c < np.pi:
      g = got / np.linalg.norm(got, axis=1, keepdims=True)
      np.testing.assert_allclose(np.linalg.norm(got, axis=1), scale,
                                 rtol=1e-4)
      np.testing.assert_allclose(np.arccos(np.clip(g[0] @ g[1], -1, 1)),
                                 theta_c - eps, atol=1e-3)

  @parameterized.parameters(('optimal_ipm', 'trimmed_mean'),
                            ('optimal_alie', 'median'))
  def test_optimal_attacks_maximise_the_rules_deviation(self, name, rule):
    """Brute force over the same log grid of tau (NumPy rules): the attack
    picks the tau whose crafted update moves the rule farthest from the
    benign mean (ByzFL's objective)."""
    b = benign_rows()
    mu, sigma = b.mean(0), b.std(0, ddof=1)
    craft = (lambda t: -t * mu) if name == 'optimal_ipm' else (
        lambda t: mu - t * sigma)
    agg = ((lambda x: trimmed_mean(x, M)) if rule == 'trimmed_mean' else
           (lambda x: np.median(x, axis=0)))

    def deviation(t):
      x = UPDATES[MASK].astype(np.float64).copy()
      x[MALICIOUS[MASK]] = craft(t)
      return np.linalg.norm(agg(x) - mu)

    taus = np.geomspace(0.01, 100.0, 41)
    devs = np.array([deviation(t) for t in taus])
    out = attacked(name)[ATTACKER].astype(np.float64)
    got = np.linalg.norm(agg(np.concatenate([out, b])) - mu)
    self.assertAlmostEqual(got, devs.max(), places=4)
    self.assertGreaterEqual(got + 1e-6, deviation(0.5))

  def test_partial_knowledge_uses_only_the_attackers_own_updates(self):
    """NDSS'21 partial knowledge: statistics over the attackers' own honest
    updates (their rows before replacement); n and m stay the round's."""
    own = UPDATES[ATTACKER].astype(np.float64)
    z = float(lie_z(jnp.float32(N), jnp.float32(M), 'ndss'))
    out = np.asarray(get_model_attack('lie', knowledge='partial').apply(
        UPDATES, MALICIOUS, MASK, KEY))
    for row in out[ATTACKER]:
      np.testing.assert_allclose(row, own.mean(0) - z * own.std(0, ddof=1),
                                 rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[BENIGN], UPDATES[BENIGN])
    # min-max: the bound is the attackers' own widest pair.
    mal = np.asarray(get_model_attack('min_max', knowledge='partial').apply(
        UPDATES, MALICIOUS, MASK, KEY))[ATTACKER][0].astype(np.float64)
    bound = np.sqrt(sq_dists(own).max())
    far = np.sqrt(((mal[None] - own)**2).sum(1)).max()
    self.assertLessEqual(far, bound * (1 + 1e-5))
    self.assertGreater(far, 0.5 * bound)
    # IPM: -epsilon times the attackers' own mean.
    ipm_rows = np.asarray(get_model_attack('ipm', knowledge='partial').apply(
        UPDATES, MALICIOUS, MASK, KEY))[ATTACKER]
    for row in ipm_rows:
      np.testing.assert_allclose(row, -0.5 * own.mean(0), rtol=1e-5,
                                 atol=1e-6)
    # min-sum: the sum of squared distances to the attackers' own rows is
    # within the smallest own score sum, and the benign rows are unread:
    # moving them changes nothing.
    attack = get_model_attack('min_sum', knowledge='partial')
    mal = np.asarray(attack.apply(UPDATES, MALICIOUS, MASK, KEY))[ATTACKER]
    bound = sq_dists(own).sum(1).min()
    self.assertLessEqual(((mal[0].astype(np.float64)[None] - own)**2).sum(),
                         bound * (1 + 1e-4))
    moved = UPDATES.copy()
    moved[BENIGN] += 3.0
    for name in ('lie', 'ipm', 'min_max', 'min_sum'):
      a = get_model_attack(name, knowledge='partial')
      np.testing.assert_allclose(
          np.asarray(a.apply(moved, MALICIOUS, MASK, KEY))[ATTACKER],
          np.asarray(a.apply(UPDATES, MALICIOUS, MASK, KEY))[ATTACKER],
          rtol=1e-6, atol=1e-6, err_msg=name)
    with self.assertRaisesRegex(SettingError, 'knowledge'):
      get_model_attack('ipm', knowledge='all')

  def test_min_sum_golden_ndss(self):
    """Golden: the NDSS'21 authors' `our_attack_score` (min-sum, dev_type
    'std', threshold 10, threshold_diff 1e-5), transcribed to NumPy; the
    attackers' update is model_re - lamda_succ * std over the benign rows,
    with min_score = the smallest benign score sum."""
    b = benign_rows()
    model_re, deviation = b.mean(0), b.std(0, ddof=1)
    scores = sq_dists(b).sum(1)
    min_score = scores.min()
    lamda, lamda_fail, lamda_succ = 10.0, 10.0, 0.0
    while abs(lamda_succ - lamda) > 1e-5:
      mal = model_re - lamda * deviation
      if ((b - mal)**2).sum() <= min_score:
        lamda_succ, lamda = lamda, lamda + lamda_fail / 2
      else:
        lamda = lamda - lamda_fail / 2
      lamda_fail /= 2
    want = model_re - lamda_succ * deviation
    got = attacked('min_sum')[ATTACKER][0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # FLPoison's largest-sum bound reaches farther.
    gamma = lambda x: recover_gamma(x.astype(np.float64), model_re,
                                    -deviation)
    self.assertGreater(gamma(attacked('min_sum', threshold='max')[ATTACKER][0]),
                       gamma(got) + 1e-3)

  @parameterized.named_parameters(
      ('median', 'tailored_median', lambda x: np.median(x, axis=0)),
      ('trimmed_mean', 'tailored_trimmed_mean',
       lambda x: trimmed_mean(x, M)))
  def test_tailored_deviates_more_than_lie(self, label, rule):
    tailored = deviation(attacked(label), rule)
    self.assertGreater(tailored, deviation(attacked('lie'), rule))

  @parameterized.parameters('krum', 'multi_krum')
  def test_tailored_krum_is_selected(self, rule):
    out = attacked(f'tailored_{rule}')
    mal = out[ATTACKER].astype(np.float64)
    np.testing.assert_array_equal(mal[0], mal[1])
    real = out[MASK].astype(np.float64)
    is_mal = ATTACKER[MASK]
    scores = krum_scores(real, M)
    mal_score = scores[is_mal].min()
    if rule == 'krum':   # Selected, up to float32 rounding at the boundary.
      self.assertLessEqual(mal_score, scores[~is_mal].min() * (1 + 1e-4))
    else:                # Both copies among the n - f kept.
      kept = np.sum(scores[~is_mal] < mal_score * (1 - 1e-4)) + M
      self.assertLessEqual(kept, N - M)
    # And it is a real move away from the benign mean.
    self.assertGreater(np.linalg.norm(mal[0] - benign_rows().mean(0)), 0.1)

  def test_tailored_custom_rule_against_the_mean(self):
    def masked_mean(x, mask):
      w = mask.astype(x.dtype)
      return jnp.sum(jnp.where(mask[:, None], x, 0.0), 0) / jnp.sum(w)

    attack = get_model_attack('agr_tailored', rule='custom',
                              aggregate_fn=masked_mean)
    out = np.asarray(jax.jit(attack.apply)(UPDATES, MALICIOUS, MASK, KEY))
    b = benign_rows()
    gamma = recover_gamma(out[0].astype(np.float64), b.mean(0),
                          direction('std', b))
    # The mean's deviation grows without bound in gamma: the search climbs
    # to its cap, 2 * gamma_init.
    self.assertGreater(gamma, 19.9)

  def test_fang_trim_values_lie_in_their_intervals(self):
    b = benign_rows()
    w_max, w_min = b.max(0), b.min(0)
    up = np.sign(b.mean(0)) < 0
    lo = np.where(up, w_max, w_min)
    hi = np.where(up, np.where(w_max > 0, 2 * w_max, w_max / 2),
                  np.where(w_min > 0, w_min / 2, 2 * w_min))
    mal = attacked('fang_trim')[ATTACKER].astype(np.float64)
    tol = 1e-6
    self.assertTrue(np.all(mal >= np.minimum(lo, hi) - tol))
    self.assertTrue(np.all(mal <= np.maximum(lo, hi) + tol))
    self.assertFalse(np.allclose(mal[0], mal[1]))   # Independent draws.

  def test_fang_krum_is_selected_by_krum(self):
    out = attacked('fang_krum')
    mal = out[ATTACKER].astype(np.float64)
    np.testing.assert_array_equal(mal[0], mal[1])
    s = np.sign(benign_rows().mean(0))
    lam = -mal[0] / s
    np.testing.assert_allclose(lam, lam[0], rtol=1e-6)   # 0 - lambda s.
    self.assertGreater(lam[0], 0.0)
    real = out[MASK].astype(np.float64)
    self.assertTrue(ATTACKER[MASK][np.argmin(krum_scores(real, M))])

  def test_fang_krum_benign_mean_reference(self):
    out = np.asarray(fang_krum(reference='benign_mean').apply(
        UPDATES, MALICIOUS, MASK, KEY))
    b = benign_rows()
    lam = (b.mean(0) - out[0]) / np.sign(b.mean(0))
    np.testing.assert_allclose(lam, lam[0], rtol=1e-4)
    real = out[MASK].astype(np.float64)
    self.assertTrue(ATTACKER[MASK][np.argmin(krum_scores(real, M))])


if __name__ == '__main__':
  absltest.main()
