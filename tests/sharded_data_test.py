"""Client data sharded over the device mesh, and the stratified sample it
needs (RoundConfig.sample_strata, RoundConfig.client_data)."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from fedrobust import engine
from fedrobust.data import federated
from fedrobust.engine import execution
from fedrobust.engine.evaluate import pad_to_batches, rebatch
from fedrobust.errors import SettingError

from tests.data_test import RecordingSource
from tests.engine_test import fedavg_method, linear_model, toy_data
from tests.horus_test import two_architecture_horus


def _needs_devices(test, n=4):
  if jax.device_count() < n:
    test.skipTest(f'needs {n} devices (XLA_FLAGS=--xla_force_host_platform_'
                  'device_count=4, set by conftest.py)')


class StrataSampleTest(absltest.TestCase):

  def test_each_stratum_gives_its_share_uniformly(self):
    config = engine.RoundConfig(num_clients=12, clients_per_round=6,
                                strategy='vmap', sample_strata=3)
    draw = jax.jit(jax.vmap(lambda k: engine.sample_clients(k, config)))
    ids, mask = draw(jax.random.split(jax.random.key(0), 2000))
    ids, mask = np.asarray(ids), np.asarray(mask)
    self.assertTrue(mask.all())
    for s in range(3):   # slots 2s, 2s + 1: two distinct ids of stratum s
      block = ids[:, 2 * s:2 * s + 2]
      self.assertTrue(np.all((block >= 4 * s) & (block < 4 * s + 4)))
      self.assertTrue(np.all(block[:, 0] < block[:, 1]))
    # Uniform within a stratum: each client is in 2 of 4 draws on average.
    freq = np.bincount(ids.ravel(), minlength=12) / len(ids)
    np.testing.assert_allclose(freq, 0.5, atol=0.04)
    pairs = {tuple(r) for r in ids[:, :2].tolist()}
    self.assertLen(pairs, 6)   # every pair of stratum 0 occurs

  def test_one_stratum_is_the_uniform_sample(self):
    uniform = engine.RoundConfig(num_clients=10, clients_per_round=4,
                                 strategy='vmap')
    one = uniform._replace(sample_strata=1)
    for k in range(3):
      key = jax.random.key(k)
      np.testing.assert_array_equal(engine.sample_clients(key, uniform)[0],
                                    engine.sample_clients(key, one)[0])

  def test_cohort_members_per_stratum(self):
    slots = engine.CohortSlots((0, 3, 4, 7), 2)
    ids, mask = engine.sample_cohort(jax.random.key(1), slots, 2,
                                     num_clients=8, strata=2)
    self.assertTrue(np.asarray(mask).all())
    self.assertIn(int(ids[0]), (0, 3))
    self.assertIn(int(ids[1]), (4, 7))

  def test_bad_settings_name_the_argument(self):
    base = engine.RoundConfig(num_clients=8, clients_per_round=4,
                              strategy='vmap')
    for config, argument in (
        (base._replace(sample_strata=3), 'sample_strata'),     # 8 % 3
        (base._replace(sample_strata=8), 'sample_strata'),     # 4 % 8
        (base._replace(sample_strata=0), 'sample_strata'),
        (base._replace(client_data='striped'), 'client_data'),
        (base._replace(num_devices=4, client_data='sharded',
                       sample_strata=2), 'client_data'),
        (base._replace(num_devices=2, client_data='sharded', sample_strata=2,
                       delay=engine.parse_delay('uniform:2'), max_arrivals=4,
                       train_on_arrival=True), 'client_data'),
        (base._replace(sample_strata=2, cohorts=(
            engine.CohortSlots((0, 1, 2, 3), 2),
            engine.CohortSlots((4, 5, 6, 7), 2))), 'sample_strata')):
      with self.assertRaises(SettingError) as ctx:
        engine.make_round_step(None, config)
      self.assertEqual(ctx.exception.argument, argument)

  def test_every_round_attacker_needs_replicated_data(self):
    _needs_devices(self, 2)
    model = linear_model()
    method = fedavg_method(model, batch_size=4, epochs=1, n_max=4,
                           num_clients=4)
    config = engine.RoundConfig(num_clients=4, clients_per_round=2,
                                strategy='vmap', num_devices=2,
                                sample_strata=2, client_data='sharded')
    threat = engine.Threat(malicious=np.array([True, False, False, False]),
                           every_round=True)
    with self.assertRaises(SettingError) as ctx:
      engine.make_round_step(method, config, mesh=engine.client_mesh(2),
                             threat=threat)
    self.assertEqual(ctx.exception.argument, 'client_data')

  def test_place_clients_needs_an_even_split(self):
    _needs_devices(self)
    data = toy_data([2, 3, 1, 2, 2, 3], 3)
    with self.assertRaises(SettingError) as ctx:
      execution.place_clients(data, engine.client_mesh(4), 'sharded')
    self.assertEqual(ctx.exception.argument, 'client_data')


class LazyPlacementTest(absltest.TestCase):

  def test_each_device_block_is_built_from_its_own_rows(self):
    """A lazy ClientRows leaf placed over 4 devices: each device gets its
    2 clients' rows, equal to placing the full array, and a block never
    reads past its clients (the recording source is asked once per
    device)."""
    _needs_devices(self)
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (40, 3)).astype(np.uint8)
    parts = [np.arange(5 * k, 5 * k + 1 + k % 4) for k in range(8)]
    source = RecordingSource(x)
    calls = []
    rows = federated.ClientRows(source, parts, 4)
    block = rows.block
    rows.block = lambda lo, hi: calls.append((lo, hi)) or block(lo, hi)
    mesh = engine.client_mesh(4)
    placed = execution.place_clients(rows, mesh, 'sharded')
    self.assertEqual(sorted(calls), [(0, 2), (2, 4), (4, 6), (6, 8)])
    self.assertEqual(source.read, set(np.concatenate(parts).tolist()))
    full = np.asarray(federated.ClientRows(x, parts, 4))
    for shard in placed.addressable_shards:
      lo = shard.index[0].start
      np.testing.assert_array_equal(np.asarray(shard.data), full[lo:lo + 2])
    chex.assert_trees_all_equal(
        np.asarray(execution.place_clients(rows, mesh, 'replicated')), full)

  def test_each_device_builds_its_own_test_batches(self):
    """The global test set as the Evaluator places it over 4 devices
    (rebatch, then split by batch): 11 examples in batches of 4 (3
    batches) are re-cut into 4 batches of 3, each device's batch built
    on its own (one block each), every example read, equal to the built
    set."""
    _needs_devices(self)
    x = np.arange(1, 12, dtype=np.uint8)[:, None].repeat(2, axis=1)
    y = np.arange(11, dtype=np.int32) % 3
    source = RecordingSource(x)
    batches = pad_to_batches(federated.RowTable(source, np.arange(11)), y, 4)
    recut = rebatch(*batches, 4)
    self.assertIsInstance(recut[0], federated.RowTable)
    calls = []
    block = recut[0].block
    recut[0].block = lambda lo, hi: calls.append((lo, hi)) or block(lo, hi)
    placed = execution.place_clients(recut, engine.client_mesh(4), 'sharded')
    self.assertEqual(sorted(calls), [(0, 1), (1, 2), (2, 3), (3, 4)])
    self.assertEqual(sorted(source.read), list(range(11)))
    built = rebatch(*pad_to_batches(x, y, 4), 4)
    for got, want in zip(placed, built):
      for shard in got.addressable_shards:
        lo = shard.index[0].start
        np.testing.assert_array_equal(np.asarray(shard.data), want[lo:lo + 1])


class ShardedDataTest(parameterized.TestCase):
  """Sharded data gives the bits of replicated data with the same strata."""

  def _fedavg(self, layout, strategy):
    model = linear_model()
    data = toy_data([5, 9, 2, 7, 4, 6, 3, 8], 9, seed=3)
    method = fedavg_method(model, batch_size=4, epochs=2, n_max=9,
                           momentum=0.9, num_clients=8)
    config = engine.RoundConfig(num_clients=8, clients_per_round=4,
                                strategy=strategy, num_devices=4,
                                sample_strata=4, client_data=layout)
    mesh = engine.client_mesh(4)
    data = execution.place_clients(data, mesh, layout)
    step = jax.jit(engine.make_round_step(method, config, mesh=mesh))
    state = engine.init_server_state(method, model.init(jax.random.key(0)),
                                     8, seed=1)
    for _ in range(3):
      state, metrics = step(state, data, ())
    return data, state, metrics

  @parameterized.parameters('sequential', 'vmap')
  def test_fedavg_rounds_bit_for_bit(self, strategy):
    _needs_devices(self)
    ref_data, ref, ref_metrics = self._fedavg('replicated', strategy)
    data, state, metrics = self._fedavg('sharded', strategy)
    # Each device holds its two clients' rows only.
    self.assertEqual(data.x.sharding.spec, P(execution.CLIENT_AXIS))
    self.assertEqual({s.data.shape[0] for s in data.x.addressable_shards},
                     {2})
    self.assertEqual({s.data.shape[0] for s in ref_data.x.addressable_shards},
                     {8})
    chex.assert_trees_all_equal(state.params, ref.params)
    for name in ('train_loss', 'examples', 'clients_trained'):
      self.assertEqual(float(metrics[name]), float(ref_metrics[name]))
    self.assertEqual(float(metrics['clients_trained']), 4.0)

  def test_setup_step_and_cohorts_bit_for_bit(self):
    """Horus's warm-up setup step (every client once, device-blocked) and
    a round of two interleaved cohorts."""
    _needs_devices(self)
    mlp, lstm, cohorts, method = two_architecture_horus(8)
    host = toy_data([4, 3, 4, 2, 4, 4, 1, 3], 4, seed=7)
    mesh = engine.client_mesh(4)
    out = {}
    for layout in ('replicated', 'sharded'):
      config = engine.RoundConfig(
          num_clients=8, clients_per_round=8, strategy='vmap',
          num_devices=4, sample_strata=4, client_data=layout,
          cohorts=tuple(engine.CohortSlots(c.members, 4) for c in cohorts))
      data = execution.place_clients(host, mesh, layout)
      state = engine.init_server_state(
          method, (mlp.init(jax.random.key(0)),
                   lstm.init(jax.random.key(1))), 8, seed=0)
      state = jax.jit(engine.make_setup_step(method, config, mesh=mesh))(
          state, data, ())
      backbones = state.method_state.backbones
      state, _ = jax.jit(engine.make_round_step(method, config, mesh=mesh))(
          state, data, ())
      out[layout] = (backbones, state.params)
    chex.assert_trees_all_equal(out['sharded'], out['replicated'])
    # Every client's backbone is its own: no two rows alike.
    first = np.asarray(jax.tree.leaves(out['sharded'][0][0])[0])
    self.assertEqual(len({r.tobytes() for r in first}), 4)

  def test_device_blocked_members_cover_every_member_once(self):
    config = engine.RoundConfig(num_clients=8, clients_per_round=3,
                                strategy='vmap', num_devices=2,
                                client_data='sharded')
    ids, mask, order = engine.round.device_blocked_members(
        engine.CohortSlots((5, 0, 1, 2), 3), config)
    # Device 0 holds 0..3 (members 0, 1, 2), device 1 holds 4..7 (5).
    np.testing.assert_array_equal(ids, [0, 1, 2, 5, 5, 5])
    np.testing.assert_array_equal(mask, [1, 1, 1, 1, 0, 0])
    # The members in the cohort's order (5, 0, 1, 2), then the padding.
    np.testing.assert_array_equal(ids[order], [5, 0, 1, 2, 5, 5])
    np.testing.assert_array_equal(order[4:], [4, 5])

  def test_sharded_data_needs_its_mesh(self):
    config = engine.RoundConfig(num_clients=8, clients_per_round=4,
                                strategy='vmap', num_devices=2,
                                sample_strata=2, client_data='sharded')
    method = fedavg_method(linear_model(), batch_size=4, epochs=1, n_max=4,
                           num_clients=8)
    with self.assertRaises(SettingError) as ctx:
      engine.make_round_step(method, config)
    self.assertEqual(ctx.exception.argument, 'client_data')


  def test_setup_step_checks_its_config_and_mesh(self):
    """The setup step refuses what the round step refuses: a mesh of
    another size than the config's (a row within a 4-client block would
    index a device holding 2), and strata that do not divide the clients."""
    _needs_devices(self)
    _, _, cohorts, method = two_architecture_horus(8)
    slots = tuple(engine.CohortSlots(c.members, 4) for c in cohorts)
    config = engine.RoundConfig(
        num_clients=8, clients_per_round=8, strategy='vmap', num_devices=2,
        sample_strata=4, client_data='sharded', cohorts=slots)
    with self.assertRaises(SettingError) as ctx:
      engine.make_setup_step(method, config, mesh=engine.client_mesh(4))
    self.assertEqual(ctx.exception.argument, 'num_devices')
    with self.assertRaises(SettingError) as ctx:
      engine.make_setup_step(method, config._replace(sample_strata=3),
                             mesh=engine.client_mesh(2))
    self.assertEqual(ctx.exception.argument, 'sample_strata')

if __name__ == '__main__':
  absltest.main()
