"""Tests for the server-aided aggregators (fedrobust.aggregators.server_aided).

(1) A conformance test per rule, over a few rounds so that the stateful
rules (history, global model, L-BFGS memory) are exercised; (2) one
behaviour test per rule on inputs whose answer is known.

The model is softmax regression on 2x2x1 uint8 images, 3 classes; the
server set has 12 examples. Each rule is compiled once, for SLOTS = 6
slots, and the compiled function is shared between tests (the CPU is slow
to compile).
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.aggregators import call_aggregator
from fedrobust.aggregators import fldetector as fldetector_lib
from fedrobust.aggregators import lasa as lasa_lib
from fedrobust.aggregators.finetune import make_server_sgd
from fedrobust.aggregators.server_aided import SERVER_AIDED
from fedrobust.models.pipelines import normalize

# foolsgold_ids needs `ids`: the shared conformance suite
# (aggregators_test.py, whose NAMES include it) passes them.
NAMES = sorted(set(SERVER_AIDED) - {'foolsgold_ids'})
C = 4                    # real clients in the conformance rounds
PAD_AT = (1, 4)          # where the padded layout adds two masked slots
SLOTS = C + 2            # the compiled slot count
NUM_CLASSES = 3
V = 12


def apply_fn(params, x, **unused):    # Model.apply's train/key: unused
  del unused
  x = normalize(x, 0.5, 0.5)           # the native input pipeline
  return x.reshape(x.shape[0], -1) @ params['w'] + params['b'][None, :]


def _make_params_and_server_data():
  rng = np.random.default_rng(0)
  params = {'w': (3.0 * rng.normal(size=(4, NUM_CLASSES))).astype(np.float32),
            'b': np.zeros((NUM_CLASSES,), np.float32)}
  x = rng.integers(0, 256, (V, 2, 2, 1), dtype=np.uint8)
  logits = apply_fn(params, (x.astype(np.float32) / 255.0 - 0.5) / 0.5)
  y = np.argmax(logits, axis=-1).astype(np.int32)   # a confident, right model
  y[:2] = (y[:2] + 1) % NUM_CLASSES                 # a few wrong labels
  return params, (x, y)


PARAMS, SERVER_DATA = _make_params_and_server_data()
# The `params` extra (the global model) for the rules that read it.
GLOBAL = jax.tree.map(jnp.asarray, PARAMS)
SERVER = dict(server_data=SERVER_DATA, apply_fn=apply_fn)


def hparams(name: str, slots: int) -> dict:
  """Small settings per rule; slot-indexed rules need the slot count."""
  return {
      'fltrust': dict(SERVER, server_steps=2, server_batch_size=5),
      'finetune': dict(SERVER, server_steps=2, server_batch_size=5),
      'sageflow': dict(SERVER),
      'foolsgold': dict(num_clients=slots),
      'fldetector': dict(num_clients=slots, window=2, warmup=2),
      'rlr': dict(threshold=2),
      'crfl': dict(clip_norm=15.0, sigma=0.01),
      'lasa': {},
      # Small clusters for 4 clients; the head is the whole model ('w',
      # 'b' at the root).
      'deepsight': dict(apply_fn=apply_fn, input_shape=(2, 2, 1),
                        output_path='', num_seeds=1, num_samples=48,
                        sample_batch=32,
                        min_cluster_size=2, min_samples=1),
      'flare': dict(SERVER, output_path='', aux_data_num=8),
  }[name]


def aggregate(agg, updates, mask, state, key):
  """agg.aggregate, with the global model for the rules that read it
  (DeepSight, FLARE); FLDetector's optional `ids` stay unset."""
  if 'params' in agg.reads:
    return call_aggregator(agg, updates, mask, state, key, params=GLOBAL)
  return agg.aggregate(updates, mask, state, key)


@functools.lru_cache(maxsize=None)
def compiled(name: str, slots: int):
  """(Aggregator, jitted aggregate that may trace once), per rule and C."""
  agg = SERVER_AIDED[name](num_byzantine=1, **hparams(name, slots))

  def step(updates, mask, state, key):
    return aggregate(agg, updates, mask, state, key)

  # chex counts traces per (definition site, source, __name__): a unique
  # name gives every compiled instance its own counter.
  step.__name__ = f'step_{name}_{slots}'
  return agg, jax.jit(chex.assert_max_traces(step, n=1))


def tree(flat):
  """float[K, 15] -> stacked updates {'b': [K, 3], 'w': [K, 4, 3]}."""
  flat = np.asarray(flat, np.float32)
  return {'b': flat[:, :3], 'w': flat[:, 3:].reshape(-1, 4, NUM_CLASSES)}


def flat1(one):
  """ONE client's tree -> float64[15] in ravel order ('b' then 'w')."""
  return np.concatenate([np.asarray(one['b'], np.float64).ravel(),
                         np.asarray(one['w'], np.float64).ravel()])


def honest(seed, num=C):
  rng = np.random.default_rng(seed)
  common = rng.normal(size=(1, 15))
  return (0.1 * (common + 0.5 * rng.normal(size=(num, 15)))).astype(
      np.float32)


def pad(flat):
  """Inserts a NaN slot and a 1e30 slot (both masked) into float[C, 15]."""
  garbage = np.stack([np.full(15, np.nan), np.full(15, 1e30)])
  return (np.insert(flat, PAD_AT, garbage, axis=0),
          np.insert(np.ones(len(flat), bool), PAD_AT, False))


def assert_finite_tree(testcase, t):
  for leaf in jax.tree.leaves(t):
    leaf = np.asarray(leaf)
    if np.issubdtype(leaf.dtype, np.floating):
      testcase.assertTrue(np.all(np.isfinite(leaf)), leaf)


def consistent_updates(rng, k, attacker):
  """state -> float[k, 15]: updates of k clients that follow one quadratic
  (consistent over rounds, FLDetector's premise), except `attacker`'s,
  which are fresh noise every round."""
  a = rng.normal(size=(15, 15))
  hess = 0.2 * (a @ a.T / 15 + np.eye(15))
  targets = rng.normal(size=(k, 15))

  def make(state):
    x = -0.1 * (flat1(state.params)[None] - targets) @ hess
    x += 1e-4 * rng.normal(size=x.shape)
    x[attacker] = 0.5 * rng.normal(size=15)
    return x
  return make


class ConformanceTest(parameterized.TestCase):
  """Shapes, masks, NaN/Inf/1e30 clients, jit vs eager, no retrace.

  One compile per rule: the jitted function sees the padded layout (C real
  clients plus two masked slots holding NaN and 1e30, SLOTS = C + 2) and
  is compared with the EAGER rule on the C real clients alone, which
  checks at once that appended masked slots are inert and that jit agrees
  with no-jit. Masked slot contents are also swapped for zeros under the
  same compiled function.
  """

  @parameterized.parameters(*NAMES)
  def test_conformance(self, name):
    agg, step = compiled(name, SLOTS)
    eager = SERVER_AIDED[name](num_byzantine=1, **hparams(name, C))
    state, state_e = agg.init(PARAMS), eager.init(PARAMS)
    for round_ in range(3):
      x = honest(round_)
      xp, maskp = pad(x)
      key = jax.random.key(round_)
      before = state
      out, state, info = step(tree(xp), jnp.asarray(maskp), state, key)
      chex.assert_trees_all_equal_shapes_and_dtypes(
          out, jax.tree.map(jnp.asarray, PARAMS))
      assert_finite_tree(self, (out, state))
      weights = np.asarray(info['weights'])
      self.assertEqual(info['weights'].dtype, jnp.float32)
      self.assertEqual(weights.shape, (SLOTS,))
      self.assertTrue(np.all(np.isfinite(weights)) and np.all(weights >= 0))
      np.testing.assert_array_equal(weights[~maskp], 0.0)
      # Eager, without the masked slots: the same answer.
      out_e, state_e, info_e = aggregate(eager, tree(x), jnp.ones(C, bool),
                                         state_e, key)
      np.testing.assert_allclose(flat1(out), flat1(out_e), atol=1e-6,
                                 rtol=1e-6)
      np.testing.assert_allclose(weights[maskp], info_e['weights'],
                                 atol=1e-6)
      # Zeros instead of NaN / 1e30 in the masked slots: the same answer.
      xz = np.where(maskp[:, None], xp, 0.0)
      out_z, _, _ = step(tree(xz), jnp.asarray(maskp), before, key)
      np.testing.assert_allclose(flat1(out_z), flat1(out), atol=1e-6,
                                 rtol=1e-6)
    # One bad real client: NaN / Inf is excluded, 1e30 stays finite.
    bad_slot = 3                        # a real slot of the padded layout
    for bad in (np.nan, np.inf, -np.inf, 1e30):
      xp, maskp = pad(honest(7))
      xp[bad_slot, ::2] = 1e30 * xp[bad_slot, ::2] if bad == 1e30 else bad
      out, new_state, info = step(tree(xp), jnp.asarray(maskp), state,
                                  jax.random.key(9))
      assert_finite_tree(self, (out, new_state, info['weights']))
      if not np.isfinite(bad):
        self.assertEqual(float(info['weights'][bad_slot]), 0.0)
    # Every call above reused the one trace (chex.assert_max_traces(n=1)).

  # Rules whose output does not depend on the order of the clients
  # (FoolsGold and FLDetector keep per-slot history: a permutation moves
  # clients away from their history, so they are not symmetric per call).
  # FLARE is symmetric up to ties in its MMD ranking, which it breaks by
  # slot; on this linear model every client's penultimate-layer
  # representation is the input itself, so all MMDs tie and it is left out.
  SYMMETRIC = ('crfl', 'deepsight', 'finetune', 'fltrust', 'lasa', 'rlr',
               'sageflow')

  @parameterized.parameters(*SYMMETRIC)
  def test_permuting_clients_changes_nothing(self, name):
    agg, step = compiled(name, SLOTS)
    x, mask = pad(honest(11))
    x[3] = -3.0 * x[3]                     # one client unlike the others
    perm = np.random.default_rng(4).permutation(SLOTS)
    key = jax.random.key(5)
    out, _, info = step(tree(x), jnp.asarray(mask), agg.init(PARAMS), key)
    out_p, _, info_p = step(tree(x[perm]), jnp.asarray(mask[perm]),
                            agg.init(PARAMS), key)
    np.testing.assert_allclose(flat1(out_p), flat1(out), atol=1e-5,
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(info_p['weights']),
                               np.asarray(info['weights'])[perm], atol=1e-5)

  def test_registry_and_missing_server_data(self):
    self.assertEqual(set(SERVER_AIDED), {
        'fltrust', 'foolsgold', 'foolsgold_ids', 'rlr', 'crfl',
        'fldetector', 'lasa', 'sageflow', 'finetune', 'deepsight', 'flare'})
    with self.assertRaises((TypeError, ValueError)):
      SERVER_AIDED['fltrust'](num_byzantine=0)
    with self.assertRaisesRegex(ValueError, 'server_data'):
      SERVER_AIDED['sageflow'](num_byzantine=0, server_data=None,
                               apply_fn=apply_fn)


class BehaviourTest(absltest.TestCase):

  def test_fltrust_zero_weight_for_update_opposite_to_server(self):
    agg, step = compiled('fltrust', SLOTS)
    key = jax.random.key(11)
    train = make_server_sgd(SERVER_DATA, apply_fn, rule='t',
                            learning_rate=0.01, steps=2, batch_size=5)
    g0 = flat1(jax.tree.map(jnp.subtract, train(PARAMS, key), PARAMS))
    rng = np.random.default_rng(1)
    x = g0[None] * (1.0 + 0.2 * rng.normal(size=(SLOTS, 15)))
    x[3] = -5.0 * g0
    out, _, info = step(tree(x), jnp.ones(SLOTS, bool), agg.init(PARAMS),
                        key)
    weights = np.asarray(info['weights'])
    self.assertEqual(weights[3], 0.0)
    self.assertTrue(np.all(np.delete(weights, 3) > 0.1))
    self.assertAlmostEqual(float(np.sum(weights)), 1.0, places=5)
    self.assertLessEqual(np.linalg.norm(flat1(out)),
                         np.linalg.norm(g0) * (1 + 1e-5))

  def test_foolsgold_downweights_identical_sybils(self):
    agg, step = compiled('foolsgold', SLOTS)
    state = agg.init(PARAMS)
    rng = np.random.default_rng(2)
    for round_ in range(4):
      x = rng.normal(size=(SLOTS, 15)).astype(np.float32)   # 4 diverse
      x[5] = x[4]                                          # 2 sybils
      _, state, info = step(tree(x), jnp.ones(SLOTS, bool), state,
                            jax.random.key(round_))
    weights = np.asarray(info['weights'])
    self.assertTrue(np.all(weights[4:] < 0.01), weights)
    self.assertTrue(np.all(weights[:4] > 0.1), weights)

  def test_foolsgold_golden_deep_fg(self):
    """Golden: the authors' deep-fg `foolsgold()` (DistSys/FoolsGold,
    deep-fg/fg/foolsgold.py; epsilon 1e-5, no importance weighting),
    transcribed to NumPy: cosine similarity of the summed deltas over
    sig_features_idx (here the output layer's kernel), pardoning, logit,
    and np.dot(delta.T, wv). With features='all' and normalize='sum' the
    rule is the one this library shipped before."""
    rng = np.random.default_rng(7)
    shapes = {'Dense_0': {'bias': (3,), 'kernel': (5, 3)},
              'Dense_1': {'bias': (2,), 'kernel': (3, 2)}}
    one = jax.tree.map(lambda s: np.zeros(s, np.float32), shapes,
                       is_leaf=lambda s: isinstance(s, tuple))
    d = 3 + 15 + 2 + 6
    sig = np.arange(d - 6, d)          # Dense_1/kernel, last in ravel order
    n = 5

    def deep_fg(this_delta, summed, eps=1e-5):
      cs = summed[:, sig] @ summed[:, sig].T
      norms = np.linalg.norm(summed[:, sig], axis=1)
      cs = cs / np.outer(norms, norms) - np.eye(n)
      maxcs = np.max(cs, axis=1) + eps
      for i in range(n):
        for j in range(n):
          if i != j and maxcs[i] < maxcs[j]:
            cs[i][j] = cs[i][j] * maxcs[i] / maxcs[j]
      wv = 1 - np.max(cs, axis=1)
      wv = np.clip(wv, 0, 1)
      wv = wv / np.max(wv)
      wv[wv == 1] = .99
      wv = np.log(wv / (1 - wv) + eps) + 0.5
      wv[np.isinf(wv) | (wv > 1)] = 1
      wv[wv < 0] = 0
      return this_delta.T @ wv, wv

    def stack(flat):
      out, off = {}, 0
      for module in ('Dense_0', 'Dense_1'):
        out[module] = {}
        for leaf in ('bias', 'kernel'):
          size = int(np.prod(shapes[module][leaf]))
          out[module][leaf] = flat[:, off:off + size].reshape(
              n, *shapes[module][leaf])
          off += size
      return out

    agg = SERVER_AIDED['foolsgold'](num_byzantine=0, num_clients=n,
                                    normalize='none')
    state = agg.init(one)
    self.assertEqual(state.history.shape, (n, 6))
    summed = np.zeros((n, d))
    for _ in range(3):
      x = rng.normal(size=(n, d)).astype(np.float32)
      x[4, sig] = x[3, sig] + 0.01 * rng.normal(size=6)    # sybils, on the
      summed += x                                          # output layer
      out, state, info = agg.aggregate(stack(x), jnp.ones(n, bool), state,
                                       jax.random.key(0))
    want, wv = deep_fg(x.astype(np.float64), summed)
    np.testing.assert_allclose(np.asarray(info['alpha']), wv, rtol=1e-4,
                               atol=1e-5)
    self.assertLess(float(np.max(wv[3:])), 0.05)
    got = np.concatenate([np.asarray(out[m][l]).ravel()
                          for m in ('Dense_0', 'Dense_1')
                          for l in ('bias', 'kernel')])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # The whole update as features does not see these sybils.
    whole = SERVER_AIDED['foolsgold'](num_byzantine=0, num_clients=n,
                                      features='all', normalize='sum')
    st = whole.init(one)
    rng = np.random.default_rng(7)
    for _ in range(3):
      x = rng.normal(size=(n, d)).astype(np.float32)
      x[4, sig] = x[3, sig] + 0.01 * rng.normal(size=6)
      _, st, info_all = whole.aggregate(stack(x), jnp.ones(n, bool), st,
                                        jax.random.key(0))
    self.assertGreater(float(np.min(np.asarray(info_all['alpha'])[3:])), 0.5)
    self.assertAlmostEqual(float(np.sum(info_all['weights'])), 1.0, places=5)

  def test_foolsgold_ids_follows_clients_across_slots(self):
    """Partial participation: two sybils (ids 4 and 5) never share a slot
    position from round to round, and one arrives without the other; the
    id-indexed history still ties them together."""
    agg = SERVER_AIDED['foolsgold_ids'](num_byzantine=0, num_clients=8)
    step = jax.jit(lambda u, m, st, ids: call_aggregator(
        agg, u, m, st, jax.random.key(0), ids=ids))
    state = agg.init(PARAMS)
    rng = np.random.default_rng(3)
    sybil = rng.normal(size=15).astype(np.float32)
    rounds = [[0, 4, 1, 5], [5, 2, 3, 4], [4, 6, 7, 0], [1, 5, 4, 2]]
    sent = np.zeros((8, 15))
    for ids in rounds:
      x = rng.normal(size=(4, 15)).astype(np.float32)
      for j, i in enumerate(ids):
        if i in (4, 5):
          x[j] = sybil
      sent[ids] += x
      _, state, info = step(tree(x), jnp.ones(4, bool), state,
                            jnp.asarray(ids, jnp.int32))
    np.testing.assert_allclose(state.history, sent, rtol=1e-5, atol=1e-5)
    weights = dict(zip(rounds[-1], np.asarray(info['weights'])))
    self.assertLess(weights[4] + weights[5], 0.02, weights)
    # normalize='clients': alpha / n.
    self.assertGreater(float(weights[1] + weights[2]), 0.2)
    np.testing.assert_allclose(np.asarray(info['weights']),
                               np.asarray(info['alpha']) / 4, rtol=1e-6)
    with self.assertRaisesRegex(ValueError, 'num_clients'):
      SERVER_AIDED['foolsgold_ids'](num_byzantine=0)

  def test_rlr_flips_coordinates_without_agreement(self):
    x = np.zeros((3, 15), np.float32)
    x[:, :4] = [[1, 1, 1, -1],
                [1, 1, -1, 1],
                [1, -2, -1, 1]]
    # theta = 3: votes (3, 1, -1, 1) -> only the first coordinate keeps +1.
    agg = SERVER_AIDED['rlr'](num_byzantine=0, threshold=3)
    out, _, info = agg.aggregate(tree(x), jnp.ones(3, bool), (),
                                 jax.random.key(0))
    np.testing.assert_allclose(flat1(out)[:4], [1.0, 0.0, 1 / 3, -1 / 3],
                               atol=1e-6)
    np.testing.assert_allclose(flat1(out)[4:], 0.0)
    # The default theta = f + 1 = 3 for f = 2 gives the same answer.
    agg = SERVER_AIDED['rlr'](num_byzantine=2)
    out2, _, _ = agg.aggregate(tree(x), jnp.ones(3, bool), (),
                               jax.random.key(0))
    np.testing.assert_allclose(flat1(out2), flat1(out), atol=1e-6)
    np.testing.assert_allclose(info['weights'], [1 / 3] * 3, atol=1e-6)

  def test_rlr_golden_authors_weighted_mean(self):
    """Golden: the authors' release (TinfoilHat0/Defending-Against-
    Backdoors-with-Robust-Learning-Rate, aggregation.py): agg_avg weights
    each update by its client's example count, compute_robustLR sets
    lr = -server_lr where |sum sign| < theta and +server_lr elsewhere,
    and the step is lr * agg_avg."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(5, 15)).astype(np.float32)
    n_data = np.array([10.0, 40.0, 25.0, 5.0, 20.0], np.float32)
    theta = 3
    signs = np.abs(np.sign(x).sum(0))
    lr = np.where(signs < theta, -1.0, 1.0)
    want = lr * (n_data[:, None] * x).sum(0) / n_data.sum()
    agg = SERVER_AIDED['rlr'](num_byzantine=0, threshold=theta)
    out, _, info = call_aggregator(agg, tree(x), jnp.ones(5, bool), (),
                                   jax.random.key(0),
                                   weights=jnp.asarray(n_data))
    np.testing.assert_allclose(flat1(out), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(info['weights'], n_data / n_data.sum(),
                               rtol=1e-6)

  def test_crfl_clips_global_model_norm(self):
    agg = SERVER_AIDED['crfl'](num_byzantine=0, clip_norm=2.0, sigma=0.0)
    x = honest(3)
    big = jax.tree.map(lambda p: 10.0 * p, PARAMS)
    out, state, _ = jax.jit(agg.aggregate)(
        tree(x), jnp.ones(C, bool), agg.init(big), jax.random.key(0))
    new = flat1(big) + flat1(out)
    self.assertLessEqual(np.linalg.norm(new), 2.0 * (1 + 1e-5))
    expected = flat1(big) + x.mean(0)
    np.testing.assert_allclose(new, 2.0 * expected / np.linalg.norm(expected),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(flat1(state.params), new, rtol=1e-6)
    # Inside the ball (and without noise) CRFL is the plain mean.
    agg = SERVER_AIDED['crfl'](num_byzantine=0, clip_norm=1e3, sigma=0.0,
                               schedule='fixed')
    out, _, _ = jax.jit(agg.aggregate)(
        tree(x), jnp.ones(C, bool), agg.init(PARAMS), jax.random.key(0))
    np.testing.assert_allclose(flat1(out), x.mean(0), atol=1e-5)

  def test_crfl_golden_dynamic_threshold_and_update_clip(self):
    """Golden: the CRFL authors' main.py (MNIST) clips the global model to
    min(param_clip_thres, 0.1 epoch + 2) every epoch (from 1); FLPoison's
    aggregators/crfl.py clips the mean update to norm_threshold instead:
    agg * min(1, thr / (||agg|| + 1e-10))."""
    x = honest(5)
    big = jax.tree.map(lambda p: 10.0 * p, PARAMS)
    agg = SERVER_AIDED['crfl'](num_byzantine=0, clip_norm=2.25, sigma=0.0)
    step = jax.jit(agg.aggregate)
    state, w = agg.init(big), flat1(big)
    for epoch in (1, 2, 3, 4):
      out, state, info = step(tree(x), jnp.ones(C, bool), state,
                              jax.random.key(epoch))
      thres = min(2.25, epoch * 0.1 + 2)
      want = w + x.mean(0)
      want = want * min(1.0, thres / np.linalg.norm(want))
      np.testing.assert_allclose(flat1(state.params), want, rtol=1e-5,
                                 atol=1e-6)
      self.assertAlmostEqual(float(info['clip_norm']), thres, places=5)
      w = want
    upd = SERVER_AIDED['crfl'](num_byzantine=0, clip_norm=0.05, sigma=0.0,
                               schedule='fixed', clip='update')
    out, _, _ = jax.jit(upd.aggregate)(tree(x), jnp.ones(C, bool),
                                       upd.init(big), jax.random.key(0))
    mean = x.mean(0).astype(np.float64)
    np.testing.assert_allclose(
        flat1(out), mean * min(1, 0.05 / (np.linalg.norm(mean) + 1e-10)),
        rtol=1e-5, atol=2e-6)

  def test_fldetector_flags_a_random_noise_client(self):
    agg, step = compiled('fldetector', SLOTS)   # window = warmup = 2
    state = agg.init(PARAMS)
    attacker = 3
    updates = consistent_updates(np.random.default_rng(4), SLOTS, attacker)
    flagged, weights = [], None
    for round_ in range(7):
      x = updates(state)
      _, state, info = step(tree(x), jnp.ones(SLOTS, bool), state,
                            jax.random.key(round_))
      flagged.append(np.asarray(info['flagged']))
      weights = np.asarray(info['weights'])
    self.assertFalse(np.any(np.stack(flagged[:2])))     # warm-up
    for f in flagged[3:]:
      np.testing.assert_array_equal(f, np.arange(SLOTS) == attacker)
    self.assertEqual(weights[attacker], 0.0)

  def test_fldetector_history_follows_the_client_id(self):
    """Clients move between slots every round (ids given) and a masked
    padded slot with a garbage update sits among them: the history follows
    the id, so the noise client is flagged wherever it lands."""
    k = SLOTS - 1
    agg = SERVER_AIDED['fldetector'](num_byzantine=1, num_clients=k,
                                     window=2, warmup=2)
    step = jax.jit(lambda u, m, st, key, ids: call_aggregator(
        agg, u, m, st, key, ids=ids))
    state = agg.init(PARAMS)
    rng = np.random.default_rng(4)
    attacker = 3
    updates = consistent_updates(rng, k, attacker)
    for round_ in range(7):
      x = updates(state)
      order = rng.permutation(k)                 # slot s holds client order[s]
      slots = np.concatenate([x[order], np.full((1, 15), np.nan)])
      ids = np.concatenate([order, [0]]).astype(np.int32)
      mask = np.arange(SLOTS) < k
      _, state, info = step(tree(slots), jnp.asarray(mask), state,
                            jax.random.key(round_), jnp.asarray(ids))
      flagged = np.asarray(info['flagged'])
      if round_ >= 3:
        np.testing.assert_array_equal(flagged, (ids == attacker) & mask)
        self.assertEqual(int(np.argmax(np.asarray(info['suspicion']))),
                         int(np.flatnonzero(order == attacker)[0]))
      assert_finite_tree(self, state)

  def test_lbfgs_hvp_secant_and_absent_pairs(self):
    rng = np.random.default_rng(5)
    a = rng.normal(size=(6, 6))
    hess = a @ a.T + np.eye(6)
    s = rng.normal(size=(4, 6))
    y = s @ hess
    present = np.array([False, True, True, True])
    s_bad, y_bad = s.copy(), y.copy()
    s_bad[0], y_bad[0] = 1e30, np.nan            # an absent, garbage pair
    hvp = jax.jit(fldetector_lib.lbfgs_hvp)
    # BFGS satisfies the newest secant equation: H s_N = y_N.
    np.testing.assert_allclose(hvp(s_bad, y_bad, present, s[-1]), y[-1],
                               rtol=1e-4, atol=1e-3)
    v = rng.normal(size=6)
    s[0], y[0] = 0.0, 0.0
    np.testing.assert_allclose(hvp(s_bad, y_bad, present, v),
                               hvp(s, y, present, v), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        hvp(s, y, np.zeros(4, bool), v), np.zeros(6))

  def test_lasa_sparsification_keeps_the_right_count(self):
    # One real client: clipping to the median norm and both filters keep
    # it, so the output is its sparsified update.
    agg, step = compiled('lasa', SLOTS)
    x = honest(6, num=SLOTS)
    x[1:] = np.nan
    mask = jnp.arange(SLOTS) == 0
    out, _, info = step(tree(x), mask, agg.init(PARAMS), jax.random.key(0))
    w = np.asarray(out['w']).ravel()
    keep = int(np.floor(0.7 * 12))     # sparsity 0.3 drops 30% of 'w'
    self.assertEqual(int(np.sum(w != 0)), keep)
    top = np.sort(np.abs(x[0, 3:]))[::-1][:keep]
    np.testing.assert_allclose(np.sort(np.abs(w[w != 0]))[::-1], top,
                               rtol=1e-6)
    np.testing.assert_allclose(out['b'], x[0, :3], rtol=1e-6)  # dense bias
    np.testing.assert_allclose(info['weights'], np.arange(SLOTS) == 0)
    # The helper on its own: k largest |values| among eligible coordinates.
    got = lasa_lib.sparsify(jnp.asarray([[3.0, -1.0, -4.0, 2.0, 9.0]]),
                            np.array([True, True, True, True, False]), 2)
    np.testing.assert_array_equal(got, [[3.0, 0.0, -4.0, 0.0, 9.0]])

  def test_sageflow_excludes_a_high_entropy_model(self):
    agg, step = compiled('sageflow', SLOTS)
    x = honest(7, num=SLOTS)
    x[2] = -flat1(PARAMS)     # model 0: uniform predictions, entropy ln 3
    out, _, info = step(tree(x), jnp.ones(SLOTS, bool), agg.init(PARAMS),
                        jax.random.key(0))
    entropy = np.asarray(info['entropy'])
    self.assertAlmostEqual(entropy[2], np.log(3.0), places=4)
    self.assertTrue(np.all(np.delete(entropy, 2) < 1.0))
    weights = np.asarray(info['weights'])
    self.assertEqual(weights[2], 0.0)
    inv = 1.0 / np.delete(np.asarray(info['loss']), 2)
    np.testing.assert_allclose(np.delete(weights, 2), inv / inv.sum(),
                               rtol=1e-5)
    np.testing.assert_allclose(flat1(out), weights @ x, rtol=1e-4,
                               atol=1e-6)


if __name__ == '__main__':
  absltest.main()
