"""Tests for fedrobust.engine and FedAvg: masks, references, strategies."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust import aggregators, engine
from fedrobust.cohort import single_cohort
from fedrobust.engine import execution
from fedrobust.errors import SettingError
from fedrobust.methods import get_method
from fedrobust.models import Model
from fedrobust.models.pipelines import normalize
from fedrobust.transforms import identity
from fedrobust.types import (Arrivals, ClientOutput, FederatedData,
                             LocalData)

NUM_CLASSES = 3
IMAGE = (2, 2, 1)


def linear_model() -> Model:
  """Softmax regression on 4 pixels: small enough for a NumPy reference."""
  def init(key):
    return {'w': 0.1 * jax.random.normal(key, (4, NUM_CLASSES)),
            'b': jnp.zeros((NUM_CLASSES,))}

  def apply(params, x, **unused):   # train, key: no train-time behaviour
    del unused
    x = normalize(x, 0.5, 0.5)       # the native input pipeline
    return x.reshape(x.shape[0], -1) @ params['w'] + params['b'][None, :]

  return Model('linear', init, apply, IMAGE, NUM_CLASSES)


def toy_data(counts, n_max, seed=0):
  rng = np.random.default_rng(seed)
  k = len(counts)
  x = rng.integers(0, 256, (k, n_max, *IMAGE), dtype=np.uint8)
  y = rng.integers(0, NUM_CLASSES, (k, n_max)).astype(np.int32)
  for c, n in enumerate(counts):   # loud garbage in the padding rows
    x[c, n:] = 255
    y[c, n:] = NUM_CLASSES - 1
  return FederatedData(jnp.asarray(x), jnp.asarray(y),
                       jnp.asarray(counts, jnp.int32))


def fedavg_method(model, *, batch_size, epochs, n_max, lr=0.1, momentum=0.0,
                  unroll=1, num_clients=6, aggregator=None):
  local = engine.LocalConfig(batch_size=batch_size, num_epochs=epochs,
                             steps_per_epoch=-(-n_max // batch_size),
                             unroll=unroll)
  return get_method('fedavg', cohorts=single_cohort(
      model, identity(model), num_clients, num_clients), local=local,
                    optimizer=engine.sgd(learning_rate=lr,
                                         momentum=momentum),
                    aggregator=aggregator)


class BatchPlanTest(absltest.TestCase):

  def test_each_epoch_is_a_permutation_of_real_rows(self):
    config = engine.LocalConfig(batch_size=3, num_epochs=2,
                                steps_per_epoch=4)
    plan = engine.make_batch_plan(jax.random.key(0), jnp.int32(7),
                                  config=config)
    chex.assert_shape(plan.index, (8, 3))
    np.testing.assert_array_equal(plan.step_mask, [1, 1, 1, 0] * 2)
    for epoch in range(2):
      idx = np.asarray(plan.index[4 * epoch:4 * epoch + 4])
      mask = np.asarray(plan.example_mask[4 * epoch:4 * epoch + 4])
      self.assertEqual(sorted(idx[mask].tolist()), list(range(7)))
    self.assertFalse(np.array_equal(plan.index[:4], plan.index[4:]))


class MaskingTest(absltest.TestCase):

  def test_padded_steps_and_examples_are_inert(self):
    """A client padded to 20 rows trains exactly like the same 5 rows alone."""
    model = linear_model()
    params = model.init(jax.random.key(0))
    padded = toy_data([5], 20)
    exact = FederatedData(padded.x[:, :5], padded.y[:, :5], padded.count)
    outs = []
    for data, n_max in ((padded, 20), (exact, 5)):
      method = fedavg_method(model, batch_size=8, epochs=2, n_max=n_max)
      local = LocalData(data.x, data.y, jnp.int32(0), data.count[0])
      out = jax.jit(functools.partial(method.client_update, 0))(
          ((), params, jnp.int32(1)), (), local, jax.random.key(1), ())
      outs.append(out.delta)
    chex.assert_trees_all_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)

  def test_masked_client_slot_is_inert(self):
    """A masked slot holding NaN/huge updates changes nothing."""
    model = linear_model()
    method = fedavg_method(model, batch_size=4, epochs=1, n_max=4)
    state = engine.init_server_state(method, model.init(jax.random.key(0)),
                                     6, seed=0)
    params = state.params[0]
    rng = np.random.default_rng(0)
    delta = jax.tree.map(
        lambda p: jnp.asarray(rng.normal(size=(3, *p.shape)), jnp.float32),
        params)
    weight = jnp.array([3.0, 5.0, 7.0])
    out = ClientOutput(delta, weight, (), {})
    arrive = lambda out, mask: (Arrivals(
        jnp.arange(mask.shape[0]), mask, out,
        jnp.zeros(mask.shape, jnp.int32)),)
    full, _, _ = method.server_update(
        state, arrive(out, jnp.array([True, True, True])), None, ())
    poisoned = ClientOutput(
        jax.tree.map(lambda d: jnp.concatenate(
            [d, jnp.full((2, *d.shape[1:]), jnp.nan)]), delta),
        jnp.array([3.0, 5.0, 7.0, 1e30, jnp.inf]), (), {})
    masked, _, _ = method.server_update(
        state, arrive(poisoned, jnp.array([True, True, True, False, False])),
        None, ())
    chex.assert_trees_all_close(masked, full, rtol=1e-6)
    chex.assert_tree_all_finite(masked)


def numpy_fedavg_round(params, data, *, lr, epochs):
  """Full-batch GD on softmax regression per client, then weighted mean."""
  w0, b0 = np.asarray(params['w'], np.float64), np.asarray(params['b'],
                                                           np.float64)
  deltas_w, deltas_b, weights = [], [], []
  for c, n in enumerate(np.asarray(data.count)):
    x = (np.asarray(data.x[c, :n], np.float64).reshape(n, -1) / 255 - 0.5) / 0.5
    onehot = np.eye(NUM_CLASSES)[np.asarray(data.y[c, :n])]
    w, b = w0.copy(), b0.copy()
    for _ in range(epochs):
      z = x @ w + b
      p = np.exp(z - z.max(1, keepdims=True))
      p /= p.sum(1, keepdims=True)
      g = (p - onehot) / n
      w, b = w - lr * x.T @ g, b - lr * g.sum(0)
    deltas_w.append(w - w0)
    deltas_b.append(b - b0)
    weights.append(n)
  weights = np.asarray(weights, np.float64) / np.sum(weights)
  return {'w': w0 + np.tensordot(weights, deltas_w, 1),
          'b': b0 + np.tensordot(weights, deltas_b, 1)}


class FedAvgReferenceTest(absltest.TestCase):

  def test_round_matches_numpy(self):
    model = linear_model()
    counts, n_max = [6, 3, 8], 8
    data = toy_data(counts, n_max)
    method = fedavg_method(model, batch_size=n_max, epochs=3, n_max=n_max,
                           lr=0.5, num_clients=3)
    state = engine.init_server_state(method, model.init(jax.random.key(0)),
                                     3, seed=0)
    expected = numpy_fedavg_round(state.params[0], data, lr=0.5, epochs=3)
    step = engine.make_round_step(method, engine.RoundConfig(
        num_clients=3, clients_per_round=3, strategy='vmap'))
    new_state, metrics = jax.jit(step)(state, data, ())
    chex.assert_trees_all_close(new_state.params[0], expected, rtol=1e-4,
                                atol=1e-6)
    self.assertEqual(float(metrics['examples']), sum(counts))
    self.assertEqual(int(new_state.round), 1)


class StrategyTest(parameterized.TestCase):
  """vmap, chunked, sequential and mesh-sharded rounds agree."""

  def _run(self, strategy, *, chunk_size=0, num_devices=1, rounds=2):
    model = linear_model()
    data = toy_data([5, 9, 2, 7, 4, 6], 9, seed=3)
    method = fedavg_method(model, batch_size=4, epochs=2, n_max=9,
                           momentum=0.9)
    config = engine.RoundConfig(num_clients=6, clients_per_round=3,
                                strategy=strategy, chunk_size=chunk_size,
                                num_devices=num_devices)
    mesh = engine.client_mesh(num_devices) if num_devices > 1 else None
    step = jax.jit(engine.make_round_step(method, config, mesh=mesh))
    state = engine.init_server_state(method, model.init(jax.random.key(0)),
                                     6, seed=1)
    for _ in range(rounds):
      state, metrics = step(state, data, ())
    return state.params, metrics

  def test_strategies_agree(self):
    ref_params, ref_metrics = self._run('vmap')
    for strategy, chunk in (('sequential', 0), ('chunked', 2),
                            ('chunked', 4)):
      params, metrics = self._run(strategy, chunk_size=chunk)
      chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(metrics['train_loss'],
                                 ref_metrics['train_loss'], rtol=1e-5)

  def test_sharded_round_matches_single_device(self):
    if jax.device_count() < 4:
      self.skipTest('needs 4 devices (XLA_FLAGS=--xla_force_host_platform_'
                    'device_count=4, set by conftest.py)')
    ref_params, ref_metrics = self._run('sequential')
    for strategy in ('vmap', 'sequential'):
      params, metrics = self._run(strategy, num_devices=4)
      chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)
      self.assertEqual(float(metrics['examples']),
                       float(ref_metrics['examples']))

  def test_no_retrace_across_rounds(self):
    model = linear_model()
    data = toy_data([5, 9, 2, 7], 9)
    method = fedavg_method(model, batch_size=4, epochs=1, n_max=9,
                           num_clients=4)
    round_step = engine.make_round_step(method, engine.RoundConfig(
        num_clients=4, clients_per_round=2, strategy='sequential'))

    @functools.partial(jax.jit, donate_argnums=0)
    @chex.assert_max_traces(n=1)
    def step(state, data):
      return round_step(state, data, ())

    state = engine.init_server_state(method, model.init(jax.random.key(0)),
                                     4, seed=0)
    seen = set()
    for _ in range(4):
      state, _ = step(state, data)
      seen.add(int(state.round))
    self.assertEqual(seen, {1, 2, 3, 4})

  def test_initial_state_copies_only_repeated_or_held_buffers(self):
    """init_server_state copies a leaf only when its buffer repeats one
    already in the state or is one of the caller's params (a donation
    would delete or reuse it); copying every leaf doubled the start-up
    peak (FedHAN at N = 1,000: 17.2 GB for 12.4 GB of state)."""
    held = {'w': jnp.ones(3)}
    shared, own = jnp.zeros(4), jnp.arange(5.0)
    tree = (held, {'a': shared, 'b': shared, 'c': own, 'n': np.ones(2)})
    out = engine.distinct_buffers(tree, held=held)
    pointers = [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(out)]
    self.assertLen(set(pointers), len(pointers))
    self.assertNotIn(held['w'].unsafe_buffer_pointer(), pointers)
    self.assertEqual(out[1]['a'].unsafe_buffer_pointer(),
                     shared.unsafe_buffer_pointer())   # first use kept
    self.assertEqual(out[1]['c'].unsafe_buffer_pointer(),
                     own.unsafe_buffer_pointer())      # not copied
    chex.assert_trees_all_equal(out, tree)
    # The whole state of a rule that keeps the params donates cleanly.
    model = linear_model()
    method = fedavg_method(model, batch_size=4, epochs=1, n_max=9,
                           num_clients=4)
    params = model.init(jax.random.key(0))
    state = engine.init_server_state(method, params, 4, seed=0)
    for leaf in jax.tree.leaves(params):
      self.assertNotIn(leaf.unsafe_buffer_pointer(), [
          x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)])

  def test_sampling(self):
    config = engine.RoundConfig(num_clients=10, clients_per_round=3,
                                strategy='vmap', num_devices=4)
    ids, mask = engine.sample_clients(jax.random.key(0), config)
    np.testing.assert_array_equal(mask, [1, 1, 1, 0])
    real = np.asarray(ids[:3])
    self.assertEqual(len(set(real.tolist())), 3)
    self.assertTrue(np.all(np.diff(real) > 0))
    self.assertTrue(np.all((real >= 0) & (real < 10)))

  def test_bad_settings_name_the_argument(self):
    for config, argument in (
        (engine.RoundConfig(4, 2, 'pmap'), 'client_execution'),
        (engine.RoundConfig(4, 5, 'vmap'), 'clients_per_round'),
        (engine.RoundConfig(4, 2, 'vmap', cohorts=(
            engine.CohortSlots((0, 1), 1), engine.CohortSlots((2,), 1))),
         'cohorts'),
        (engine.RoundConfig(4, 3, 'vmap', cohorts=(
            engine.CohortSlots((0, 1), 1), engine.CohortSlots((2, 3), 1))),
         'cohorts')):
      with self.assertRaises(SettingError) as ctx:
        engine.make_round_step(None, config)
      self.assertEqual(ctx.exception.argument, argument)


if __name__ == '__main__':
  absltest.main()


class ModelAttackHookTest(absltest.TestCase):

  def test_attack_replaces_only_malicious_deltas(self):
    """Sign-flipping client 1 of 3 under the mean: the server step equals
    the NumPy mean of (d0, -d1, d2) computed from the honest round."""
    from fedrobust import aggregators, attacks  # pylint: disable=g-import-not-at-top
    model = linear_model()
    data = toy_data([4, 4, 4], 4)
    method = fedavg_method(model, batch_size=4, epochs=1, n_max=4,
                           num_clients=3,
                           aggregator=aggregators.get_aggregator(
                               'mean', num_byzantine=1))
    config = engine.RoundConfig(num_clients=3, clients_per_round=3,
                                strategy='vmap')
    state = engine.init_server_state(method, model.init(jax.random.key(0)),
                                     3, seed=0)
    honest = engine.make_round_step(method, config)
    threat = engine.Threat(
        malicious=jnp.array([False, True, False]), num_malicious=1,
        model_attack=attacks.get_model_attack('sign_flip').apply)
    attacked = engine.make_round_step(method, config, threat=threat)
    # Per-client deltas of the honest round, from client_update directly.
    key = jax.random.split(jax.random.wrap_key_data(state.key), 6)[2]
    deltas = []
    for c in range(3):
      out = method.client_update(
          0, method.broadcast(state, 0), (),
          LocalData(data.x, data.y, jnp.int32(c), data.count[c]),
          jax.random.fold_in(key, c), ())
      deltas.append(out.delta)
    expected = jax.tree.map(
        lambda p, a, b, c: p + (a - b + c) / 3, state.params[0], *deltas)
    new_state, metrics = jax.jit(attacked)(state, data, ())
    chex.assert_trees_all_close(new_state.params[0], expected, rtol=1e-5,
                                atol=1e-6)
    self.assertEqual(float(metrics['num_attacking']), 1.0)
    plain, _ = jax.jit(honest)(state, data, ())
    self.assertFalse(np.allclose(plain.params[0]['w'],
                                 new_state.params[0]['w']))


class RetrainHookTest(absltest.TestCase):
  """The 'retrain' extra (FedHAN's exact replay rounds) trains the named
  clients from the values it is given, on their own data, and applies the
  model attack to undetected attackers."""

  def test_retrain_from_other_values_matches_numpy(self):
    from fedrobust import attacks  # pylint: disable=g-import-not-at-top
    model = linear_model()
    counts, n_max = [5, 3, 4], 5
    data = toy_data(counts, n_max, seed=3)
    # A shift that changes the logits' differences (a constant one would
    # leave softmax regression's gradients as they are).
    shift = {'w': 0.3 * np.arange(12.0).reshape(4, 3) / 12, 'b':
             np.array([0.2, -0.1, 0.0])}

    def aggregate(updates, mask, state, key, *, weights, params, retrain):
      del updates, key
      moved = jax.tree.map(lambda p, d: p + d, params, shift)
      # Slots reversed: the hook follows the ids, not the round's slots.
      order = jnp.arange(mask.shape[0])[::-1]
      ids = jnp.arange(mask.shape[0], dtype=jnp.int32)[order]
      deltas, coverage = retrain(moved, ids, mask[order], jnp.int32(5))
      w = weights[order] / jnp.sum(weights)
      update = jax.tree.map(lambda d: jnp.tensordot(w, d, 1), deltas)
      return update, state, {'no_coverage': jnp.float32(coverage is None)}

    probe = aggregators.Aggregator(aggregators.stateless_init, aggregate,
                                   reads=('weights', 'params', 'retrain'))
    method = fedavg_method(model, batch_size=n_max, epochs=2, n_max=n_max,
                           lr=0.5, num_clients=3, aggregator=probe)
    state = engine.init_server_state(method, model.init(jax.random.key(0)),
                                     3, seed=0)
    threat = engine.Threat(
        malicious=jnp.array([False, True, False]), num_malicious=1,
        model_attack=attacks.get_model_attack('sign_flip').apply)
    step = engine.make_round_step(method, engine.RoundConfig(
        num_clients=3, clients_per_round=3, strategy='vmap'), threat=threat)
    new_state, metrics = jax.jit(step)(state, data, ())
    moved = jax.tree.map(lambda p, d: np.asarray(p, np.float64) + d,
                         state.params[0], shift)
    expected = jax.tree.map(np.asarray, state.params[0])
    for c, sign in zip(range(3), (1.0, -1.0, 1.0)):
      one = FederatedData(data.x[c:c + 1], data.y[c:c + 1],
                          data.count[c:c + 1])
      after = numpy_fedavg_round(moved, one, lr=0.5, epochs=2)
      expected = jax.tree.map(
          lambda e, a, m: e + sign * counts[c] / sum(counts) * (a - m),
          expected, after, moved)
    chex.assert_trees_all_close(new_state.params[0], expected, rtol=1e-4,
                                atol=1e-6)
    self.assertEqual(float(metrics['no_coverage']), 1.0)


class CohortRoundTest(absltest.TestCase):
  """Two architectures in one compiled round (FedAvg, shared head)."""

  def test_shared_head_and_private_layers_match_numpy(self):
    from fedrobust import models  # pylint: disable=g-import-not-at-top
    from fedrobust.cohort import Cohort  # pylint: disable=g-import-not-at-top
    mlp = models.get_model('mlp', num_classes=NUM_CLASSES,
                           input_shape=IMAGE, hidden=(5,))
    lstm = models.get_model('row_lstm', num_classes=NUM_CLASSES,
                            input_shape=IMAGE, hidden=4)
    cohorts = (Cohort('mlp', mlp, identity(mlp), (0, 2, 4), 3),
               Cohort('lstm', lstm, identity(lstm), (1, 3, 5), 3))
    data = toy_data([4, 3, 4, 2, 4, 4], 4, seed=7)
    local = engine.LocalConfig(batch_size=4, num_epochs=1, steps_per_epoch=1)
    method = get_method('fedavg', cohorts=cohorts, local=local,
                        optimizer=engine.sgd(learning_rate=0.5))
    config = engine.RoundConfig(
        num_clients=6, clients_per_round=6, strategy='vmap',
        cohorts=tuple(engine.CohortSlots(c.members, 3) for c in cohorts))
    params = (mlp.init(jax.random.key(0)), lstm.init(jax.random.key(1)))
    state = engine.init_server_state(method, params, 6, seed=0)
    new_state, metrics = jax.jit(engine.make_round_step(method, config))(
        state, data, ())
    key = jax.random.split(jax.random.wrap_key_data(state.key), 6)[2]
    deltas = {}
    for j, c in enumerate(cohorts):
      for i in c.members:
        deltas[i] = method.client_update(
            j, method.broadcast(state, j), (),
            LocalData(data.x, data.y, jnp.int32(i), data.count[i]),
            jax.random.fold_in(key, i), ()).delta
    counts = np.asarray(data.count, np.float64)
    # Private layers: weighted mean within the cohort.
    for j, (c, private) in enumerate(((cohorts[0], 'Dense_0'),
                                      (cohorts[1], 'recurrent'))):
      w = counts[list(c.members)] / counts[list(c.members)].sum()
      for leaf in state.params[j][private]:
        expected = state.params[j][private][leaf] + sum(
            wi * deltas[i][private][leaf] for wi, i in zip(w, c.members))
        np.testing.assert_allclose(new_state.params[j][private][leaf],
                                   expected, rtol=1e-5, atol=1e-6)
    # Head: kernels [5, 3] (mlp) and [4, 3] (lstm) zero-padded to [5, 3];
    # row 4 is owned by the mlp clients only.
    pad = lambda k: np.pad(np.asarray(k), ((0, 5 - k.shape[0]), (0, 0)))
    num = sum(counts[i] * pad(deltas[i]['Dense_1' if i % 2 == 0 else
                                        'head']['kernel']) for i in range(6))
    owners = np.array([counts.sum()] * 4 + [counts[[0, 2, 4]].sum()])
    avg = num / owners[:, None]
    np.testing.assert_allclose(new_state.params[0]['Dense_1']['kernel'],
                               state.params[0]['Dense_1']['kernel'] + avg,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_state.params[1]['head']['kernel'],
                               state.params[1]['head']['kernel'] + avg[:4],
                               rtol=1e-5, atol=1e-6)
    self.assertEqual(float(metrics['clients_trained']), 6.0)
    labels = [m.label for m in method.eval_models(new_state)]
    self.assertEqual(labels, ['mlp', 'lstm'])


class SpreadBatchTest(absltest.TestCase):
  """execution.spread_batch: a server step's batch split over the mesh."""

  def setUp(self):
    super().setUp()
    if jax.device_count() < 4:
      self.skipTest('needs 4 devices (set by conftest.py)')
    self.mesh = engine.client_mesh(4)

  @staticmethod
  def grad_of(x_rows):
    def fn(w, x):
      x = execution.spread_batch(x.reshape(x_rows, -1))
      return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
    return fn

  def test_on_mesh_splits_the_batch_and_keeps_the_values(self):
    w = jax.random.normal(jax.random.key(0), (6, 3))
    x = jax.random.normal(jax.random.key(1), (8, 6))
    replicated = jax.sharding.NamedSharding(self.mesh,
                                            jax.sharding.PartitionSpec())
    w_r, x_r = jax.device_put((w, x), replicated)
    fn = self.grad_of(8)
    plain = jax.jit(fn).lower(w, x).compile()
    spread = jax.jit(execution.on_mesh(fn, self.mesh)).lower(w_r, x_r).compile()
    # Each device takes 2 of the 8 rows; the gradient is all-reduced.
    self.assertIn('all-reduce', spread.as_text())
    self.assertNotIn('all-reduce', plain.as_text())
    chex.assert_trees_all_close(spread(w_r, x_r), plain(w, x), rtol=1e-5,
                                atol=1e-5)

  def test_left_alone_off_mesh_inside_shard_map_and_when_indivisible(self):
    x = jnp.arange(24.0).reshape(6, 4)
    seen = []

    def record(v):
      out = execution.spread_batch(v)
      seen.append(out is v)
      return out

    jax.jit(record).lower(x)                                 # no mesh
    jax.jit(execution.on_mesh(record, self.mesh)).lower(x)   # 6 % 4 != 0
    per_client = jnp.arange(32.0).reshape(4, 8)
    jax.jit(execution.on_mesh(lambda p: execution.run_clients(
        lambda one, _: record(one), p, (), strategy='vmap', mesh=self.mesh),
        self.mesh)).lower(per_client)                        # manual axis
    self.assertEqual(seen, [True, True, True])
    jax.jit(execution.on_mesh(record, self.mesh)).lower(
        jnp.zeros((8, 4)))                                   # splits
    self.assertFalse(seen[-1])

  def test_coordinatewise_rules_split_by_coordinate_bit_for_bit(self):
    """Median and trimmed mean on the mesh: the clients' rows (sharded by
    client, as the round's clients return them) reach each device's
    columns by an all-to-all, the result equals the one-device rule bit
    for bit, and on_mesh hands it back replicated."""
    c, d = 8, 12
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(c, d)), jnp.float32)
    x = x.at[5, 3].set(jnp.inf)
    mask = jnp.array([True] * 6 + [False] * 2)
    by_client = jax.sharding.NamedSharding(
        self.mesh, jax.sharding.PartitionSpec('clients'))
    for rule in (aggregators.get_aggregator('median'),
                 aggregators.get_aggregator('trimmed_mean',
                                            num_byzantine=1)):
      fn = lambda u, m, rule=rule: rule.aggregate(
          {'w': u}, m, (), jax.random.key(0))[0]['w']
      plain = jax.jit(fn)(x, mask)
      on_mesh = jax.jit(execution.on_mesh(fn, self.mesh)).lower(
          jax.device_put(x, by_client), mask).compile()
      self.assertTrue('all-to-all' in on_mesh.as_text(),
                      'no all-to-all in the compiled rule')
      got = on_mesh(jax.device_put(x, by_client), mask)
      self.assertTrue(got.sharding.is_fully_replicated)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))


class DelayTest(parameterized.TestCase):

  def test_parse(self):
    self.assertIsNone(engine.parse_delay('none'))
    self.assertEqual(engine.parse_delay('uniform:3'),
                     engine.DelayModel('uniform', 1.5, 3))
    self.assertEqual(engine.parse_delay('exponential:2'),
                     engine.DelayModel('exponential', 2.0, 16))
    self.assertEqual(engine.parse_delay('exponential:2:5').max_delay, 5)
    for bad in ('uniform', 'uniform:0', 'exponential:-1', 'poisson:2',
                'exponential:x'):
      with self.assertRaises(SettingError) as ctx:
        engine.parse_delay(bad)
      self.assertEqual(ctx.exception.argument, 'client_delay')

  def test_geometric_delays_have_the_mean_and_the_cap(self):
    from fedrobust.engine import delay  # pylint: disable=g-import-not-at-top
    ids = jnp.arange(20000)
    d = np.asarray(delay.sample_delays(jax.random.key(0), ids,
                                       delay.DelayModel('exponential', 2.0,
                                                        100)))
    self.assertAlmostEqual(d.mean(), 2.0, delta=0.06)
    self.assertEqual(d.min(), 0)
    capped = delay.sample_delays(jax.random.key(0), ids,
                                 delay.DelayModel('exponential', 2.0, 3))
    self.assertEqual(int(capped.max()), 3)

  def _run(self, delay, rounds, max_arrivals=0, clients_per_round=4,
           train_on_arrival=False, max_staleness=0):
    model = linear_model()
    data = toy_data([5, 9, 2, 7, 4, 6], 9, seed=3)
    method = fedavg_method(model, batch_size=4, epochs=1, n_max=9)
    config = engine.RoundConfig(num_clients=6,
                                clients_per_round=clients_per_round,
                                strategy='vmap', delay=delay,
                                max_arrivals=max_arrivals,
                                train_on_arrival=train_on_arrival,
                                max_staleness=max_staleness)
    state = engine.init_server_state(method, model.init(jax.random.key(0)),
                                     6, seed=1, config=config, data=data)
    step = jax.jit(engine.make_round_step(method, config))
    history = []
    for _ in range(rounds):
      state, metrics = step(state, data, ())
      history.append(jax.device_get(metrics))
    return state, history

  def assert_nothing_lost(self, state, history):
    """Every update trained has arrived or is still in flight."""
    trained = sum(float(m['clients_trained']) for m in history)
    arrived = sum(float(m['arrivals']) for m in history)
    in_flight = int(jnp.sum(state.pending.buffers[0].valid))
    self.assertEqual(trained, arrived + in_flight)

  def test_every_update_arrives_once_within_the_cap(self):
    state, history = self._run(engine.DelayModel('uniform', 1.0, 2), 7)
    self.assert_nothing_lost(state, history)
    self.assertLessEqual(max(float(m['staleness_max']) for m in history),
                         2.0)
    self.assertGreater(max(float(m['staleness_max']) for m in history), 0.0)
    # A busy client is not sampled: fewer than C train in some round.
    self.assertLess(min(float(m['clients_trained']) for m in history), 4.0)
    busy = np.asarray(state.pending.busy_until)
    self.assertTrue(np.all(busy <= 7 + 2))

  def test_training_on_arrival_equals_training_at_the_start(self):
    model = engine.DelayModel('uniform', 1.5, 3)
    run = functools.partial(self._run, model, 9, max_arrivals=2,
                            clients_per_round=2)
    held, held_hist = run()
    lazy, lazy_hist = run(train_on_arrival=True)
    chex.assert_trees_all_close(lazy.params, held.params, rtol=1e-6,
                                atol=1e-7)
    for key in ('arrivals', 'staleness_max', 'arrivals_deferred'):
      self.assertEqual([float(m[key]) for m in lazy_hist],
                       [float(m[key]) for m in held_hist], key)
    # The state holds tickets and R models, not updates.
    buf = lazy.pending.buffers[0]
    self.assertEqual(set(buf.outputs), {'key', 'rank'})
    self.assertEqual(jax.tree.leaves(lazy.pending.models[0])[0].shape[0], 4)
    with self.assertRaises(SettingError) as ctx:
      self._run(model, 1, clients_per_round=2, train_on_arrival=True)
    self.assertEqual(ctx.exception.argument, 'train_on_arrival')

  def test_every_client_in_flight_gives_queueing_staleness(self):
    """N/K staleness: all 6 clients start whenever free, the server takes
    one update a round, so updates wait ~N/K rounds; those older than
    max_staleness are dropped when due."""
    state, history = self._run(engine.DelayModel('uniform', 0.5, 1), 14,
                               max_arrivals=1, clients_per_round=6,
                               train_on_arrival=True, max_staleness=4)
    self.assertEqual(max(float(m['arrivals']) for m in history), 1.0)
    self.assertEqual(max(float(m['clients_trained']) for m in history), 1.0)
    stale = [float(m['staleness_max']) for m in history]
    self.assertGreater(max(stale), 1.0)        # past the delay cap
    self.assertLessEqual(max(stale), 4.0)      # the model ring's depth
    self.assertGreater(sum(float(m['arrivals_expired']) for m in history),
                       0.0)
    self.assertEqual(jax.tree.leaves(state.pending.models[0])[0].shape[0],
                     5)
    with self.assertRaises(SettingError) as ctx:
      self._run(engine.DelayModel('uniform', 0.5, 1), 1, max_staleness=3)
    self.assertEqual(ctx.exception.argument, 'max_staleness')

  def test_take_oldest_defers_the_newest_due_updates(self):
    from fedrobust.engine import delay  # pylint: disable=g-import-not-at-top
    buf = delay.empty_buffer(
        {'u': jax.ShapeDtypeStruct((2,), jnp.float32)}, 3,
        delay.DelayModel('uniform', 1.0, 2))
    buf = buf._replace(
        ids=jnp.arange(9, dtype=jnp.int32) + 10,
        computed_round=jnp.array([3, 3, 3, 4, 4, 4, 5, 5, 5], jnp.int32),
        arrival_round=jnp.array([5, 5, 6, 5, 9, 5, 5, 5, 5], jnp.int32),
        valid=jnp.array([1, 0, 1, 1, 1, 1, 1, 1, 0], bool))
    rows, taken, stale, late, rest = delay.take_oldest(buf, jnp.int32(5), 3)
    # Due now: rows 0 (computed 3), 3, 5 (computed 4), 6, 7 (computed 5).
    np.testing.assert_array_equal(rows, [0, 3, 5])
    np.testing.assert_array_equal(taken, [True] * 3)
    np.testing.assert_array_equal(stale, [2, 1, 1])
    np.testing.assert_array_equal(np.flatnonzero(late), [6, 7])
    np.testing.assert_array_equal(rest.valid,
                                  [0, 0, 1, 0, 1, 0, 1, 1, 0])
    np.testing.assert_array_equal(np.asarray(rest.arrival_round)[[6, 7]],
                                  [6, 6])
    # Fewer due than the cap: the tail rows are masked.
    rows, taken, _, late, _ = delay.take_oldest(rest, jnp.int32(6), 3)
    np.testing.assert_array_equal(np.asarray(rows)[np.asarray(taken)],
                                  [2, 6, 7])
    self.assertFalse(late.any())
    rows, taken, _, _, _ = delay.take_oldest(rest, jnp.int32(7), 3)
    self.assertFalse(taken.any())

  def test_max_arrivals_caps_the_rows_and_loses_nothing(self):
    model = engine.DelayModel('uniform', 1.5, 3)
    run = functools.partial(self._run, model, 10, clients_per_round=2)
    full, full_hist = run()
    # A cap as large as the buffer only reorders the rows.
    same, _ = run(max_arrivals=8)
    chex.assert_trees_all_close(same.params, full.params, rtol=1e-5,
                                atol=1e-6)
    capped, history = run(max_arrivals=2)
    self.assertGreater(max(float(m['arrivals']) for m in full_hist), 2)
    self.assertLessEqual(max(float(m['arrivals']) for m in history), 2)
    self.assertGreater(sum(float(m['arrivals_deferred']) for m in history),
                       0)
    self.assert_nothing_lost(capped, history)
    # Deferral can push staleness past the delay cap.
    self.assertGreaterEqual(max(float(m['staleness_max']) for m in history),
                            3.0)
    with self.assertRaises(SettingError) as ctx:
      self._run(model, 1, max_arrivals=3)   # below C = 4
    self.assertEqual(ctx.exception.argument, 'max_arrivals')
    with self.assertRaises(SettingError) as ctx:
      self._run(None, 1, max_arrivals=4)
    self.assertEqual(ctx.exception.argument, 'max_arrivals')

  def test_with_an_attacker_swaps_one_in_only_when_none_is_sampled(self):
    from fedrobust.engine.round import CohortSlots, with_an_attacker  # pylint: disable=g-import-not-at-top
    slots = CohortSlots(tuple(range(10)), 4)
    mal = jnp.zeros(10, bool).at[jnp.array([7, 8])].set(True)
    ids = jnp.array([0, 2, 3, 5, 0], jnp.int32)
    mask = jnp.array([False, True, True, True, False])
    key = jax.random.key(3)
    out = np.asarray(with_an_attacker(key, slots, ids, mask, mal, None))
    # The first live benign slot (1) takes attacker 7 or 8; the rest stay.
    self.assertIn(out[1], (7, 8))
    np.testing.assert_array_equal(np.delete(out, 1), [0, 3, 5, 0])
    # Already one attacker: unchanged.
    ids2 = ids.at[2].set(8)
    np.testing.assert_array_equal(
        with_an_attacker(key, slots, ids2, mask, mal, None), ids2)
    # No free attacker: unchanged.
    free = jnp.ones(10, bool).at[jnp.array([7, 8])].set(False)
    np.testing.assert_array_equal(
        with_an_attacker(key, slots, ids, mask, mal, free), ids)
    # A busy attacker is never picked.
    free = jnp.ones(10, bool).at[7].set(False)
    for seed in range(5):
      out = with_an_attacker(jax.random.key(seed), slots, ids, mask, mal,
                             free)
      self.assertEqual(int(out[1]), 8)

  def test_attacker_every_round_in_the_round(self):
    model = linear_model()
    data = toy_data([5, 9, 2, 7, 4, 6, 3, 8, 5, 6], 9, seed=3)
    method = fedavg_method(model, batch_size=4, epochs=1, n_max=9,
                           num_clients=10)
    config = engine.RoundConfig(num_clients=10, clients_per_round=3,
                                strategy='vmap',
                                delay=engine.DelayModel('uniform', 0.5, 1))
    counts = {}
    for every in (False, True):
      threat = engine.Threat(malicious=jnp.arange(10) >= 8,
                             num_malicious=2, start_round=2,
                             every_round=every)
      state = engine.init_server_state(
          method, model.init(jax.random.key(0)), 10, seed=1, config=config,
          data=data)
      step = jax.jit(engine.make_round_step(method, config, threat=threat))
      counts[every] = []
      for _ in range(8):
        state, metrics = step(state, data, ())
        counts[every].append(float(metrics['num_attacking']))
    self.assertIn(0.0, counts[False][1:])
    self.assertGreaterEqual(min(counts[True][1:]), 1.0)

  def test_zero_delays_equal_the_synchronous_round(self):
    sync, _ = self._run(None, 3)
    instant, history = self._run(engine.DelayModel('exponential', 1e-9, 2),
                                 3)
    chex.assert_trees_all_close(instant.params, sync.params, rtol=1e-6,
                                atol=1e-7)
    self.assertEqual([float(m['staleness_max']) for m in history],
                     [0.0] * 3)
