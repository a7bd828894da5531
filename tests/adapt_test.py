"""Newcomers (unseen clients): hold-out, the newcomer hooks, adaptation.

Reuses the methods conformance suite's tiny cases (4 clients, MLP).
"""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust import adapt, engine
from fedrobust.data import hold_out, unseen_clients
from fedrobust.data.federated import EvalSet, FederatedSetup
from fedrobust.errors import SettingError
from fedrobust.methods.fedlora import add_dense, lora_modules
from fedrobust.transforms.base import get_path
from fedrobust.types import FederatedData, LocalData
from tests.engine_test import toy_data
from tests.methods_test import case, run_rounds

LOCAL = engine.LocalConfig(batch_size=4, num_epochs=2, steps_per_epoch=2)
OPT = engine.sgd(learning_rate=0.1, momentum=0.9)


def newcomers(counts):
  return toy_data(counts, 8, seed=21)


def assert_trees_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


class HoldOutTest(absltest.TestCase):

  def test_spread_over_groups_sorted_and_seeded(self):
    groups = np.repeat(np.arange(4), 5)          # 4 domains x 5 clients
    out = unseen_clients(20, 4, seed=3, groups=groups)
    self.assertEqual(sorted(groups[out].tolist()), [0, 1, 2, 3])
    self.assertEqual(out.tolist(), sorted(out.tolist()))
    np.testing.assert_array_equal(out, unseen_clients(20, 4, 3, groups))
    six = unseen_clients(20, 6, seed=3, groups=groups)
    counts = np.bincount(groups[six], minlength=4)
    self.assertLessEqual(counts.max() - counts.min(), 1)
    self.assertEqual(len(set(unseen_clients(20, 5, 0).tolist())), 5)

  def test_refusal_names_the_setting(self):
    with self.assertRaisesRegex(SettingError, 'unseen_clients'):
      unseen_clients(4, 4, 0)

  def test_hold_out_renumbers_and_keeps_each_clients_rows(self):
    k = 5
    train = FederatedData(np.arange(k * 3).reshape(k, 3),
                          np.arange(k * 3).reshape(k, 3) % 2,
                          np.arange(k) + 1)
    local = EvalSet(np.arange(k * 2).reshape(k, 1, 2),
                    np.zeros((k, 1, 2)), np.ones((k, 1, 2), bool))
    setup = FederatedSetup(train, local, None, None, None, None, None,
                           np.arange(k * 2).reshape(k, 2), 2, (3,),
                           client_groups=np.array([0, 0, 1, 1, 1]))
    seen, unseen = hold_out(setup, 2, seed=1)
    out = unseen_clients(k, 2, 1, setup.client_groups)
    keep = np.setdiff1d(np.arange(k), out)
    np.testing.assert_array_equal(unseen.train.x, train.x[out])
    np.testing.assert_array_equal(seen.train.count, train.count[keep])
    np.testing.assert_array_equal(seen.local_test.x, local.x[keep])
    np.testing.assert_array_equal(unseen.client_groups,
                                  setup.client_groups[out])
    np.testing.assert_array_equal(seen.histograms, setup.histograms[keep])
    self.assertIs(hold_out(setup, 0, 1)[1], None)


class AdaptTest(absltest.TestCase):

  def test_default_newcomer_starts_from_the_headline_and_trains(self):
    method = case('fedavg', 'plain')[0]
    state, _ = run_rounds('fedavg', 'plain', 1)
    cohorts = case_cohorts('fedavg')
    data = newcomers([0, 6])        # the first newcomer has no data
    fn = jax.jit(lambda s, d, k: adapt.adapt_newcomers(
        method, cohorts, s, d, k, local=LOCAL, optimizer=OPT))
    params, info = fn(state, data, jax.random.key(0))
    headline = adapt.headline_model(method, state)
    first = jax.tree.map(lambda l: l[0], params)
    second = jax.tree.map(lambda l: l[1], params)
    assert_trees_equal(first, headline)
    self.assertFalse(all(jax.tree.leaves(jax.tree.map(
        np.array_equal, second, headline))))
    self.assertTrue(np.isfinite(float(info['loss'][1])))
    again, _ = fn(state, data, jax.random.key(0))
    assert_trees_equal(again, params)

  def test_local_lora_newcomer_gets_w0_and_fedsa_the_shared_a_model(self):
    view = LocalData(newcomers([6]).x, newcomers([6]).y, jnp.int32(0),
                     jnp.int32(6))
    local = case('local_lora', 'plain')[0]
    s_local, _ = run_rounds('local_lora', 'plain', 2)
    start, _ = local.newcomer(s_local, view, jax.random.key(0))
    assert_trees_equal(start, s_local.method_state.base)
    # Nothing is aggregated: the server's adapter never moves.
    assert_trees_equal(s_local.params, case('local_lora', 'plain')[2].params)

    fedsa = case('fedsa_lora', 'plain')[0]
    s0 = case('fedsa_lora', 'plain')[2]
    s2, _ = run_rounds('fedsa_lora', 'plain', 2)
    start, _ = fedsa.newcomer(s2, view, jax.random.key(0))
    assert_trees_equal(start, fedsa.eval_models(s2)[0].params)
    ms = s2.method_state
    scale = case_cohorts('fedsa_lora')[0].transform.factor_scale(None)
    for p in lora_modules(s2.params[0]):
      a, b0 = get_path(s2.params[0], p)['a'], get_path(s0.params[0], p)['b']
      self.assertFalse(np.allclose(a, get_path(s0.params[0], p)['a']))
      np.testing.assert_array_equal(get_path(s2.params[0], p)['b'], b0)
      # Client k's model uses the shared a and its own b.
      personal = fedsa.eval_models(s2)[1].params
      for k in range(4):
        own_b = get_path(ms.own, p)['b'][k]
        want = get_path(ms.base, p)['kernel'] + scale * a @ own_b
        np.testing.assert_allclose(
            get_path(jax.tree.map(lambda l: l[k], personal), p)['kernel'],
            want, rtol=1e-5, atol=1e-6)

  def test_hilora_newcomer_is_routed_to_an_existing_cluster(self):
    method = case('hilora', 'plain')[0]
    state, _ = run_rounds('hilora', 'plain', 3)
    ms = state.method_state
    data = newcomers([6])
    start, info = method.newcomer(
        state, LocalData(data.x, data.y, jnp.int32(0), jnp.int32(6)),
        jax.random.key(1))
    j = int(info['cluster'])
    self.assertIn(j, range(int(ms.num_clusters)))
    want = add_dense(ms.base, {p: ms.root_dense[p] + ms.cluster_dense[p][j]
                               for p in ms.root_dense})
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6),
                 start, want)
    # Before clustering a newcomer gets W0 + root and no cluster.
    s0 = case('hilora', 'plain')[2]
    start0, info0 = method.newcomer(
        s0, LocalData(data.x, data.y, jnp.int32(0), jnp.int32(6)),
        jax.random.key(1))
    self.assertEqual(int(info0['cluster']), -1)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6),
                 start0, add_dense(s0.method_state.base,
                                   s0.method_state.root_dense))

  def test_several_cohorts_are_refused(self):
    method = case('fedavg', 'plain')[0]
    state = case('fedavg', 'plain')[2]
    cohorts = case_cohorts('fedavg')
    with self.assertRaisesRegex(SettingError, 'unseen_clients'):
      adapt.adapt_newcomers(method, cohorts * 2, state, newcomers([3]),
                            jax.random.key(0), local=LOCAL, optimizer=OPT)


def case_cohorts(name):
  """The cohorts of a conformance case (rebuilt: the case keeps none)."""
  from fedrobust import models  # pylint: disable=g-import-not-at-top
  from fedrobust.cohort import single_cohort  # pylint: disable=g-import-not-at-top
  from fedrobust.transforms import identity, lora  # pylint: disable=g-import-not-at-top
  from tests.engine_test import IMAGE, NUM_CLASSES  # pylint: disable=g-import-not-at-top
  from tests.methods_test import K, LORA_ONLY, SINGLE_RANK  # pylint: disable=g-import-not-at-top
  model = models.get_model('mlp', num_classes=NUM_CLASSES, input_shape=IMAGE,
                           hidden=(5,))
  if name in SINGLE_RANK:
    transform = lora(model, ranks=(2,), targets=('all',))
  elif name in LORA_ONLY:
    transform = lora(model, ranks=(1, 2), targets=('all',))
  else:
    transform = identity(model)
  return single_cohort(model, transform, K, K, ())


if __name__ == '__main__':
  absltest.main()
