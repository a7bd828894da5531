"""A conformance suite over every METHODS entry (plus engine variants).

Each case compiles ONE round program (tiny model, 4 clients) wrapped in
chex.assert_max_traces(n=1), shared by its tests:
  * a 2-round run stays finite;
  * masked arrival slots holding NaN/Inf garbage (and a duplicated client
    id) change neither the global params nor the method state;
  * no retrace across rounds;
  * exact resume: a checkpoint after round 1, restored and continued, is
    bitwise the uninterrupted 2-round state.
Every method's round, sharded over 4 (host-platform) devices with one
client each, must give the single-device round's state, and so must its
round on 2 devices that each hold only their 2 clients' data
(client_data='sharded'). Variants run
FedAvg with client delays (the in-flight buffer must survive
the checkpoint), with clients trained on arrival from the stored model of
their start round (the model ring must survive it) and with
heterogeneous-rank LoRA (coverage masks).
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust import engine, models
from fedrobust.checkpoint import Checkpointer
from fedrobust.cohort import single_cohort
from fedrobust.methods import METHODS, get_method
from fedrobust.transforms import identity, lora
from fedrobust.types import Arrivals, LocalData
from tests.engine_test import IMAGE, NUM_CLASSES, toy_data

K = 4
LORA_ONLY = ('fdlora', 'fedalt', 'feddpa_f', 'feddpa_t', 'fedit',
             'fedsa_lora', 'ffa_lora', 'flexlora', 'flora', 'hilora',
             'local_lora', 'lora_fair', 'pf2lora', 'rfd_lora')   # need the LoRA transform
# LoRA methods with one rank for every client
SINGLE_RANK = ('fdlora', 'fedalt', 'feddpa_f', 'feddpa_t', 'fedsa_lora',
               'hilora', 'local_lora', 'pf2lora')
# Settings that make a 3-round test reach every stage of a staged method.
SETTINGS = {'hilora': dict(root_rounds=1, cluster_rounds=1, k_max=2),
            'feddpa_f': dict(global_rounds=1),
            'pf2lora': dict(client_rank=1),
            'fdlora': dict(sync_every=2, fusion_points=3)}
CASES = [(name, 'plain') for name in sorted(METHODS)] + [
    ('fedavg', 'delay'), ('fedavg', 'lazy'), ('fedavg', 'lora'),
    # One LoRA rank for every client (the transform's scale is a scalar).
    ('lora_fair', 'rank2'), ('flexlora', 'rank2'),
    # HiLoRA's ablation without the cascade (tiers trained jointly).
    ('hilora', 'joint')]


@functools.lru_cache(maxsize=None)
def case(name, variant):
  """(method, jitted round, initial state, data, server_data)."""
  model = models.get_model('mlp', num_classes=NUM_CLASSES,
                           input_shape=IMAGE, hidden=(5,))
  if variant == 'rank2' or name in SINGLE_RANK:
    transform = lora(model, ranks=(2,), targets=('all',))
    specs = (2.0,) * K
  elif variant == 'lora' or name in LORA_ONLY:
    transform = lora(model, ranks=(1, 2), targets=('all',))
    specs = (1.0, 2.0, 2.0, 1.0)
  else:
    transform, specs = identity(model), ()
  cohorts = single_cohort(model, transform, K, K, specs)
  local = engine.LocalConfig(batch_size=4, num_epochs=1, steps_per_epoch=2)
  method = get_method(name, cohorts=cohorts, local=local,
                      optimizer=engine.sgd(learning_rate=0.1, momentum=0.9),
                      **SETTINGS.get(name, {}),
                      **({'cascade': False} if variant == 'joint' else {}),
                      **({'cluster_basis': 'input_update'}
                         if variant == 'input_update' else {}))
  data = toy_data([5, 8, 3, 6], 8, seed=4)
  server_data = {}
  if 'validation' in METHODS[name].server_data:
    v = toy_data([8], 8, seed=9)
    server_data['validation'] = (v.x[0].reshape(2, 4, *IMAGE),
                                 v.y[0].reshape(2, 4), jnp.ones((2, 4), bool))
  if 'anchors' in METHODS[name].server_data:
    # 8 anchors: one batch that splits over the 4 devices of 'sharded'.
    server_data['anchors'] = toy_data([8], 8, seed=11).x[0]
  # 'sharded': 4 devices, one client each, the data replicated;
  # 'sharded_data': 2 devices, each holding its 2 clients' data only.
  sharded = variant in ('sharded', 'sharded_data')
  devices = {'sharded': 4, 'sharded_data': 2}.get(variant, 1)
  config = engine.RoundConfig(
      num_clients=K, clients_per_round=K, strategy='vmap',
      num_devices=devices,
      sample_strata=2 if variant == 'sharded_data' else 1,
      client_data='sharded' if variant == 'sharded_data' else 'replicated',
      delay=engine.DelayModel('uniform', 1.0, 2)
      if variant in ('delay', 'lazy') else None,
      max_arrivals=K if variant == 'lazy' else 0,
      train_on_arrival=variant == 'lazy')
  mesh = engine.client_mesh(devices) if sharded else None
  round_step = engine.make_round_step(method, config, mesh=mesh)

  def step(state, data, server_data):
    return round_step(state, data, server_data)

  # chex counts traces per function name: one name per case.
  step.__name__ = f'round_{name}_{variant}'
  step = jax.jit(chex.assert_max_traces(step, n=1), donate_argnums=0)

  state = engine.init_server_state(method, model.init(jax.random.key(0)), K,
                                   seed=1, config=config, data=data,
                                   server_data=server_data)
  if sharded:   # replicated in, as experiments/train.py puts them
    state, server_data = jax.device_put(
        (state, server_data),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    data = engine.place_clients(data, mesh, config.client_data)
  return method, step, state, data, server_data


def copy(tree):
  return jax.tree.map(jnp.array, tree)


def run_rounds(name, variant, rounds, state=None):
  """(state after `rounds` rounds from a copy of `state`, last metrics)."""
  _, step, initial, data, server_data = case(name, variant)
  state = copy(initial if state is None else state)
  metrics = None
  for _ in range(rounds):
    state, metrics = step(state, data, server_data)
  return state, metrics


class MethodConformanceTest(parameterized.TestCase):

  @parameterized.parameters(*CASES)
  def test_two_rounds_stay_finite(self, name, variant):
    method = case(name, variant)[0]
    state, metrics = run_rounds(name, variant, 2)
    chex.assert_tree_all_finite(state.params)
    for key, value in jax.device_get(metrics).items():
      if key != 'detection_weight_auc':      # NaN without attackers
        self.assertTrue(np.isfinite(value), key)
    self.assertEqual(int(state.round), 2)
    for m in method.eval_models(state):
      chex.assert_tree_all_finite(m.params)

  @parameterized.parameters(*CASES)
  def test_masked_arrivals_are_inert(self, name, variant):
    method, _, state, data, server_data = case(name, variant)
    ids = jnp.arange(3, dtype=jnp.int32)

    # Jitted, so each case is one program, not hundreds of op-by-op ones
    # (every XLA:CPU executable holds memory maps; see conftest.py).
    @jax.jit
    def three_clients(state, data, server_data):
      client_state = method.client_state(state.method_state, 0, ids)
      outs = [method.client_update(
          0, method.broadcast(state, 0),
          jax.tree.map(lambda leaf, i=i: leaf[i], client_state),
          LocalData(data.x, data.y, ids[i], data.count[i]),
          jax.random.key(i), server_data) for i in range(3)]
      return jax.tree.map(lambda *leaves: jnp.stack(leaves), *outs)

    real = three_clients(state, data, server_data)

    def garbage(leaf):   # two extra slots of NaN / Inf / 1e30
      fill = {0: jnp.nan, 1: jnp.inf}
      extra = jnp.stack([jnp.full(leaf.shape[1:], fill[k], jnp.float32)
                         if jnp.issubdtype(leaf.dtype, jnp.floating) else
                         jnp.ones(leaf.shape[1:], leaf.dtype)
                         for k in range(2)]).astype(leaf.dtype)
      return jnp.concatenate([leaf, extra])

    padded = jax.tree.map(garbage, real)
    arrive = lambda outputs, ids, mask: (Arrivals(
        ids, mask, outputs, jnp.zeros(mask.shape, jnp.int32)),)
    server_update = jax.jit(method.server_update)
    ref = server_update(state, arrive(real, ids, jnp.ones(3, bool)),
                        jax.random.key(5), server_data)
    # The masked slots carry a real client's id (0) and an unused one (3).
    got = server_update(
        state, arrive(padded, jnp.array([0, 1, 2, 0, 3], jnp.int32),
                      jnp.array([True, True, True, False, False])),
        jax.random.key(5), server_data)
    chex.assert_trees_all_close(got[0], ref[0], rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(got[1], ref[1], rtol=1e-6, atol=1e-7)

  def _assert_matches_single_device(self, name, variant):
    single, single_metrics = run_rounds(name, 'plain', 2)
    sharded, sharded_metrics = run_rounds(name, variant, 2)
    chex.assert_trees_all_close(sharded.params, single.params, rtol=1e-5,
                                atol=1e-6)
    chex.assert_trees_all_close(sharded.method_state, single.method_state,
                                rtol=1e-5, atol=1e-6)
    for key in ('examples', 'clients_trained'):
      self.assertEqual(float(sharded_metrics[key]),
                       float(single_metrics[key]), key)

  @parameterized.parameters(*sorted(METHODS))
  def test_sharded_round_matches_single_device(self, name):
    if jax.device_count() < 4:
      self.skipTest('needs 4 devices (XLA_FLAGS=--xla_force_host_platform_'
                    'device_count=4, set by conftest.py)')
    self._assert_matches_single_device(name, 'sharded')

  @parameterized.parameters(*sorted(METHODS))
  def test_sharded_data_matches_single_device(self, name):
    """Each of 2 devices holds 2 clients' rows (a client indexing the
    data by its id instead of LocalData.row would read another's)."""
    if jax.device_count() < 2:
      self.skipTest('needs 2 devices (set by conftest.py)')
    self.assertEqual(case(name, 'sharded_data')[3].x.sharding.spec,
                     jax.sharding.PartitionSpec('clients'))
    self._assert_matches_single_device(name, 'sharded_data')

  @parameterized.parameters(*CASES)
  def test_no_retrace_across_rounds(self, name, variant):
    state, _ = run_rounds(name, variant, 3)   # max_traces(n=1) inside
    self.assertEqual(int(state.round), 3)

  @parameterized.parameters(*CASES)
  def test_resume_is_exact(self, name, variant):
    _, step, state, data, server_data = case(name, variant)
    straight, _ = run_rounds(name, variant, 2)
    resumed, _ = run_rounds(name, variant, 1)
    directory = self.create_tempdir().full_path
    ckpt = Checkpointer(directory, keep=2)
    ckpt.save(1, resumed)
    ckpt.close()
    template = jax.eval_shape(lambda s: s, state)
    restored_step, restored = Checkpointer(directory).restore_latest(
        template)
    self.assertEqual(restored_step, 1)
    resumed, _ = step(restored, data, server_data)
    chex.assert_trees_all_equal(resumed, straight)


class WidthRedrawTest(absltest.TestCase):

  def test_redraw_changes_a_clients_width_between_rounds(self):
    """With Cohort.redraw a client's width is drawn per (client, round)
    key from the listed ratios; without it, it keeps its spec."""
    from fedrobust.cohort import Cohort  # pylint: disable=g-import-not-at-top
    from fedrobust.transforms import width  # pylint: disable=g-import-not-at-top
    model = models.get_model('mlp', num_classes=NUM_CLASSES,
                             input_shape=IMAGE, hidden=(8,))
    transform = width(model, ratios=(0.5, 1.0))
    local = engine.LocalConfig(batch_size=4, num_epochs=1, steps_per_epoch=2)
    data = toy_data([5, 8], 8, seed=4)
    owned = {}
    for redraw in ((), (0.5, 1.0)):
      cohorts = (Cohort('mlp', model, transform, (0, 1), 2, (0.5, 1.0),
                        redraw),)
      method = get_method('fedavg', cohorts=cohorts, local=local,
                          optimizer=engine.sgd(learning_rate=0.1))
      state = engine.init_server_state(
          method, model.init(jax.random.key(0)), 2, seed=1)
      run = jax.jit(lambda key, m=method, st=state: m.client_update(
          0, m.broadcast(st, 0), m.client_state(st.method_state, 0,
                                                jnp.int32(0)),
          LocalData(data.x, data.y, jnp.int32(0), data.count[0]), key, ()))
      owned[redraw] = {
          float(sum(jnp.sum(c) for c in jax.tree.leaves(
              run(jax.random.key(r)).coverage))) for r in range(12)}
    self.assertLen(owned[()], 1)            # client 0 keeps width 0.5
    self.assertLen(owned[(0.5, 1.0)], 2)    # both widths drawn


if __name__ == '__main__':
  absltest.main()
