"""3DFed (attacks/threedfed.py): the feedback rules against a NumPy
transcription of the release's read_indicator + adaptive_tuning, the noise
masks, and the attack on a tiny conv net (one compiled program)."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from fedrobust import attacks, engine
from fedrobust.attacks import threedfed as td
from fedrobust.errors import SettingError
from fedrobust.types import AttackContext, FederatedData

A, G, KMAX = 4, 2, 2


def release_tuning(f, live, k, alpha, group, *, thr=1e-4, clip=0.8,
                   g=G, a=A):
  """NumPy transcription of the release (indicator.py:10-40, tuning.py
  :6-57) for the deterministic parts: returns (weak, codes, k, the alpha
  interval of each group or None when unchanged)."""
  read = [i for i in range(len(f)) if live[i]]
  weak = any(f[i] > 1 or f[i] < -thr for i in read)
  fmax = max(f[i] for i in read)
  codes = {}
  for i in read:
    codes[i] = ('r' if f[i] <= thr else 'c' if f[i] <= clip * fmax else 'a')
  if weak:
    return True, codes, k, [(0.1, 0.1)] * len(alpha)
  dec_a = sum(1 for i, c in codes.items() if i >= a and c == 'a')
  k = max(k - dec_a, 0)
  if (not any(c in 'ac' for i, c in codes.items() if i < a)
      and dec_a == 0):
    k += 1
  full = a // g
  ok = [sum(1 for r in range(a) if group[r] == j and codes.get(r) == 'a')
        >= 0.8 * g for j in range(full)]
  cand = sorted(alpha[j] for j in range(full) if ok[j])
  if full <= 1:
    spans = [(0.0, 1.0) if not cand else (alpha[j], alpha[j])
             for j in range(len(alpha))]
  elif len(cand) == full:
    spans = [(cand[0], cand[1])] * len(alpha)
  elif cand:
    spans = [(cand[0], cand[0] + 0.1)] * len(alpha)
  else:
    spans = [(0.0, 1.0)] * len(alpha)
  return False, codes, min(k, KMAX), spans


class FeedbackTest(absltest.TestCase):

  def _state(self, f, live, k, alpha, group):
    t = A + KMAX
    value = np.full(t, 2.0, np.float32)
    base = np.linspace(-1, 1, t).astype(np.float32)
    theta = base + np.asarray(f, np.float32) * value
    state = td.ThreeDFedState(
        started=jnp.bool_(True), weak_dp=jnp.bool_(False), k=jnp.int32(k),
        alpha=jnp.asarray(alpha, jnp.float32),
        idx=jnp.arange(t, dtype=jnp.int32), value=jnp.asarray(value),
        base=jnp.asarray(base), live=jnp.asarray(live),
        group=jnp.asarray(group, jnp.int32),
        feedback=jnp.full((t,), jnp.nan))
    return state, jnp.asarray(theta)

  def test_matches_the_release(self):
    cases = [
        # every attacker accepted with full weight, no decoys
        ([.25, .25, .25, .25, 0, 0], [1, 1, 1, 1, 0, 0], 0, [.3, .6]),
        # all rejected: one more decoy
        ([0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], 0, [.3, .6]),
        # one decoy through, attackers rejected: k down by one
        ([0, 0, 0, 0, .2, 0], [1, 1, 1, 1, 1, 1], 2, [.3, .6]),
        # group 1 clipped (half weight), group 0 accepted
        ([.2, .2, .1, .1, 0, 0], [1, 1, 1, 1, 0, 0], 0, [.3, .6]),
        # a reading above 1: weak DP
        ([1.5, .2, .2, .2, 0, 0], [1, 1, 1, 1, 0, 0], 1, [.3, .6]),
        # a negative reading below -thr: weak DP
        ([.2, -.01, .2, .2, 0, 0], [1, 1, 1, 1, 0, 0], 1, [.3, .6]),
        # an attacker absent last round (not read)
        ([.2, 0, .2, .2, 0, 0], [1, 0, 1, 1, 0, 0], 0, [.3, .6]),
    ]
    group = [0, 0, 1, 1]
    for f, live, k, alpha in cases:
      with self.subTest(f=f):
        state, theta = self._state(f, np.asarray(live, bool), k, alpha,
                                   group)
        k2, alpha2, weak, codes = td.read_feedback(
            state, theta, num_attackers=A, group_size=G, max_decoys=KMAX,
            threshold=1e-4, clip_ratio=0.8, noise_mask_alpha=0.0,
            key=jax.random.key(3))
        weak_r, codes_r, k_r, spans = release_tuning(
            f, live, k, alpha, group)
        self.assertEqual(bool(weak), weak_r)
        want = {'r': 0, 'c': 1, 'a': 2}
        for i in range(A + KMAX):
          self.assertEqual(int(codes[i]), want[codes_r[i]] if i in codes_r
                           else -1, i)
        self.assertEqual(int(k2), k_r)
        for a2, (lo, hi) in zip(np.asarray(alpha2), spans):
          lo, hi = max(min(lo, .99), .01), max(min(hi, .99), .01)
          self.assertBetween(float(a2), lo - 1e-6, hi + 1e-6)

  def test_first_round_draws_alpha_and_reads_nothing(self):
    state = td.ThreeDFedState(
        started=jnp.bool_(False), weak_dp=jnp.bool_(False), k=jnp.int32(0),
        alpha=jnp.zeros((2,)), idx=jnp.zeros((6,), jnp.int32),
        value=jnp.ones((6,)), base=jnp.zeros((6,)), live=jnp.ones((6,), bool),
        group=jnp.zeros((4,), jnp.int32), feedback=jnp.zeros((6,)))
    k, alpha, weak, codes = td.read_feedback(
        state, jnp.full((6,), 5.0), num_attackers=A, group_size=G,
        max_decoys=KMAX, threshold=1e-4, clip_ratio=0.8,
        noise_mask_alpha=0.0, key=jax.random.key(0))
    self.assertEqual(int(k), 0)
    self.assertFalse(bool(weak))     # 5.0 would read as weak DP
    np.testing.assert_array_equal(codes, -1)
    self.assertTrue(np.all((np.asarray(alpha) > 0) & (np.asarray(alpha) < 1)))


class MaskTest(absltest.TestCase):

  def test_masks_stay_on_their_neurons_and_cancel(self):
    rng = np.random.default_rng(0)
    u = jnp.asarray(rng.normal(size=(9, 5)) * 0.01, jnp.float32)
    rows = jnp.asarray([[1, 1, 0, 0, 0], [0, 0, 1, 0, 1]], bool)
    m = td.optimise_masks(u, rows, jnp.asarray([.5, .5]), jax.random.key(1),
                          group_size=3, sigma=jnp.float32(.05), c_u=.1,
                          c_n=.08, c_l=.1, lr=.1, momentum=.9, steps=30,
                          lagrange_step=.1)
    chex.assert_shape(m, (2, 3, 9, 5))
    chex.assert_tree_all_finite(m)
    m = np.asarray(m)
    np.testing.assert_array_equal(m[0][:, :, 2:], 0)
    np.testing.assert_array_equal(m[1][:, :, [0, 1, 3]], 0)
    # Each mask moved off the update (UPs: norms near 1 from sigma 0.05 x
    # 30 entries), and the Lagrangian term keeps their group sum below
    # half of one mask (independent masks would sum to sqrt(3) of one).
    each = np.linalg.norm(m.reshape(2, 3, -1), axis=2)
    total = np.linalg.norm(m.sum(1).reshape(2, -1), axis=1)
    self.assertTrue(np.all(each > 0.5), each)
    self.assertTrue(np.all(total < 0.5 * each.mean(1)), (total, each))


class TinyNet(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = x.astype(jnp.float32) / 255.0
    x = nn.relu(nn.Conv(3, (3, 3))(x))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(6)(x))
    return nn.Dense(4)(x)


NET = TinyNet()


def apply_fn(params, x, *, train=False, key=None):
  del train, key
  return NET.apply({'params': params}, x)


def stamp(x, y):
  return x.at[:, :2, :2].set(255), jnp.full_like(y, 1)


C, K, N = 6, 6, 16


def tiny_problem():
  rng = np.random.default_rng(0)
  x = rng.integers(0, 255, (K, N, 6, 6, 1)).astype(np.uint8)
  y = rng.integers(0, 4, (K, N)).astype(np.int32)
  data = FederatedData(jnp.asarray(x), jnp.asarray(y),
                       jnp.asarray([16, 12, 16, 9, 16, 16], jnp.int32))
  params = NET.init(jax.random.key(0), jnp.zeros((1, 6, 6, 1)))['params']
  return params, data


def build(**kw):
  settings = dict(apply_fn=apply_fn, stamp=stamp, num_attackers=2,
                  num_classes=4, target_label=1, learning_rate=0.1,
                  batch_size=8, poison_epochs=2, group_size=2,
                  num_neurons=2, max_decoys=1, num_candidate=4)
  settings.update(kw)
  return td.thrdfed(**settings)


class ApplyTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params, cls.data = tiny_problem()
    cls.attack = build()
    cls.apply = staticmethod(jax.jit(cls.attack.apply))
    rng = np.random.default_rng(1)
    d = sum(x.size for x in jax.tree.leaves(cls.params))
    cls.d = d
    cls.updates = jnp.asarray(rng.normal(size=(C, d)) * 0.01, jnp.float32)

  def ctx(self):
    ids = jnp.arange(C, dtype=jnp.int32)
    return AttackContext(self.params, self.data, ids, ids)

  def test_rows_and_indicators(self):
    is_mal = jnp.asarray([1, 1, 0, 0, 0, 0], bool)
    mask = jnp.asarray([1, 1, 1, 1, 1, 0], bool)
    updates = self.updates.at[5].set(jnp.nan)   # a masked slot
    state = self.attack.init(self.params)
    out, new, decoys = self.apply(updates, is_mal, mask, jax.random.key(0),
                                  state, self.ctx())
    out = np.asarray(out)
    np.testing.assert_array_equal(out[2:5], np.asarray(updates)[2:5])
    self.assertTrue(np.isnan(out[5]).all())      # untouched, never read
    self.assertTrue(np.isfinite(out[:2]).all())
    self.assertFalse(np.asarray(decoys).any())   # k starts at 0
    self.assertTrue(bool(new.started))
    self.assertEqual(int(new.k), 0)
    np.testing.assert_array_equal(new.live, [True, True, False])
    layers = td.resolve_layers(self.params, indicator_layer='auto',
                               mask_layer='auto', decoy_layer='auto')
    off, shape = layers['indicator']
    idx = np.asarray(new.idx)
    self.assertTrue(np.all((idx >= off) & (idx < off + np.prod(shape))))
    self.assertLen(set(idx.tolist()), 3)
    np.testing.assert_allclose(out[[0, 1], idx[:2]], new.value[:2])
    # The two uploads share the backdoor update: they differ only in the
    # output layer (noise masks) and at the two indicators.
    ko, (fan_in, outs) = layers['mask']
    bo, _ = layers['mask_bias']
    differ = np.nonzero(out[0] != out[1])[0]
    allowed = set(range(ko, ko + fan_in * outs)) | set(
        range(bo, bo + outs)) | set(idx[:2].tolist())
    self.assertTrue(set(differ.tolist()) <= allowed)
    self.assertNotEmpty(set(differ.tolist()) & set(range(ko, ko + fan_in *
                                                         outs)))
    # FedAvg over the five real slots: each indicator reads 1/5.
    theta = jnp.concatenate([jnp.ravel(x) for x in
                             jax.tree.leaves(self.params)])
    after = theta + jnp.mean(jnp.asarray(out[:5]), axis=0)
    f = (after[new.idx] - new.base) / new.value
    np.testing.assert_allclose(np.asarray(f)[:2], 0.2, atol=2e-3)

  def test_attackers_stay_finite_beside_nonfinite_benign_rows(self):
    # The conformance cases for attacks: a NaN, an Inf and a 1e38 benign
    # client. 3DFed crafts its rows from its own training, so they stay
    # finite and the benign rows pass through as sent (same program).
    is_mal = jnp.asarray([1, 1, 0, 0, 0, 0], bool)
    mask = jnp.ones((C,), bool)
    updates = (self.updates.at[2].set(jnp.nan).at[3].set(jnp.inf)
               .at[4].set(1e38))
    out, _, decoys = self.apply(updates, is_mal, mask, jax.random.key(0),
                                self.attack.init(self.params), self.ctx())
    out = np.asarray(out)
    self.assertTrue(np.isfinite(out[:2]).all())
    np.testing.assert_array_equal(out[2:], np.asarray(updates)[2:])
    self.assertFalse(np.asarray(decoys).any())

  def test_decoy_overwrites_the_last_benign_slot(self):
    is_mal = jnp.asarray([1, 0, 1, 0, 0, 0], bool)
    mask = jnp.ones((C,), bool)
    state = self.attack.init(self.params)
    # Last round: both attackers read as rejected, so a decoy is added.
    state = state._replace(started=jnp.bool_(True),
                           idx=jnp.asarray([0, 1, 2], jnp.int32),
                           live=jnp.asarray([True, True, False]),
                           base=jnp.zeros((3,)),
                           alpha=jnp.asarray([.5]))
    params = jax.tree.map(jnp.zeros_like, self.params)
    ids = jnp.arange(C, dtype=jnp.int32)
    ctx = AttackContext(params, self.data, ids,
                        jnp.asarray([0, 0, 1, 0, 0, 0], jnp.int32))
    out, new, decoys = self.apply(self.updates, is_mal, mask,
                                  jax.random.key(1), state, ctx)
    self.assertEqual(int(new.k), 1)
    np.testing.assert_array_equal(decoys, [0, 0, 0, 0, 0, 1])
    out = np.asarray(out)
    np.testing.assert_array_equal(out[[1, 3, 4]],
                                  np.asarray(self.updates)[[1, 3, 4]])
    self.assertFalse(np.array_equal(out[5], np.asarray(self.updates)[5]))
    np.testing.assert_allclose(out[5, int(new.idx[2])], new.value[2])
    np.testing.assert_array_equal(new.live, [True, True, True])

  def test_no_attacker_no_change(self):
    state = self.attack.init(self.params)
    out, new, decoys = self.apply(self.updates, jnp.zeros((C,), bool),
                                  jnp.ones((C,), bool), jax.random.key(0),
                                  state, self.ctx())
    np.testing.assert_array_equal(out, self.updates)
    self.assertFalse(bool(new.started))
    self.assertFalse(np.asarray(decoys).any())
    # Other values, same shapes: no retrace.
    size = self.apply._cache_size()
    self.apply(self.updates * 2, jnp.ones((C,), bool), jnp.ones((C,), bool),
               jax.random.key(5), new, self.ctx())
    self.assertEqual(self.apply._cache_size(), size)


class SettingsTest(absltest.TestCase):

  def test_errors_name_the_setting(self):
    with self.assertRaisesRegex(SettingError, 'num_neurons'):
      build(num_neurons=4)
    with self.assertRaisesRegex(SettingError, 'group_size'):
      build(group_size=0)
    params, _ = tiny_problem()
    with self.assertRaisesRegex(SettingError, 'decoy_layer'):
      td.resolve_layers(params, indicator_layer='auto', mask_layer='auto',
                        decoy_layer='Conv_9')

  def test_registered(self):
    self.assertIn('3dfed', attacks.ATTACKS)
    self.assertIs(attacks.STATEFUL_ATTACKS['3dfed'], td.thrdfed)

  def test_engine_refuses_delays(self):
    threat = engine.Threat(num_malicious=2, stateful_attack=build())
    config = engine.RoundConfig(num_clients=K, clients_per_round=C,
                                strategy='sequential',
                                delay=engine.parse_delay('exponential:1:2'))
    with self.assertRaisesRegex(SettingError, 'attack'):
      engine.make_round_step(None, config, threat=threat)


if __name__ == '__main__':
  absltest.main()


class EngineTest(absltest.TestCase):

  def test_fedavg_rounds_carry_the_state_and_read_acceptance(self):
    from fedrobust.cohort import single_cohort
    from fedrobust.methods import get_method
    from fedrobust.models import Model
    from fedrobust.transforms import identity
    params, data = tiny_problem()
    model = Model('tiny', lambda key: NET.init(key, jnp.zeros(
        (1, 6, 6, 1)))['params'], apply_fn, (6, 6, 1), 4)
    local = engine.LocalConfig(batch_size=8, num_epochs=1,
                               steps_per_epoch=2)
    method = get_method('fedavg', cohorts=single_cohort(
        model, identity(model), K, C), local=local,
                        optimizer=engine.sgd(learning_rate=0.1))
    attack = build(num_neurons=2, max_decoys=1)
    threat = engine.Threat(
        malicious=jnp.asarray([1, 0, 1, 0, 0, 0], bool), num_malicious=2,
        stateful_attack=attack)
    config = engine.RoundConfig(num_clients=K, clients_per_round=C,
                                strategy='sequential')
    state = engine.init_server_state(method, (params,), K, 0)
    state = state._replace(attack=attack.init(params))
    step = jax.jit(engine.make_round_step(method, config, threat=threat))
    state, m1 = step(state, data)
    self.assertTrue(bool(state.attack.started))
    alpha1 = np.asarray(state.attack.alpha)
    state, m2 = step(state, data)
    # FedAvg took both uploads (16 examples each, so equal weights): each
    # indicator read 'a', the (single, full) group was accepted, so alpha
    # stays and no decoy is added. (With unequal example counts the
    # smaller attacker reads 'c', clipped: the ratio is relative.)
    np.testing.assert_array_equal(state.attack.alpha, alpha1)
    for m in (m1, m2):
      self.assertEqual(float(m['attack_k']), 0.0)
      self.assertEqual(float(m['attack_decoys']), 0.0)
      self.assertEqual(float(m['num_attacking']), 2.0)
      self.assertEqual(float(m['nonfinite_model']), 0.0)
