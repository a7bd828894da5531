"""Crab (a recovery baseline of FedHAN's Figs. 6-8): the release's round
and client rankings against NumPy transcriptions in PyTorch's layout, and
a hand-built run through windows, kept rounds, the rollback and the
calibrated steps."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.aggregators import call_aggregator, get_aggregator
from fedrobust.aggregators import crab as crab_lib
from fedrobust.errors import SettingError

FORGET = np.array([False, False, False, True])   # client 3 is forgotten


def np_softmax(x, axis):
  e = np.exp(x - x.max(axis=axis, keepdims=True))
  return e / e.sum(axis=axis, keepdims=True)


def to_torch(x, name):
  """flax layout -> PyTorch's: kernels (in, out) -> (out, in) and
  (kh, kw, in, out) -> (out, in, kh, kw); every other leaf (bias,
  nn.Embed's (vocab, d) table, ViT's (1, n, d) tokens) is stored alike."""
  if name != 'kernel':
    return x
  if x.ndim == 2:
    return x.T
  if x.ndim == 4:
    return np.transpose(x, (3, 2, 0, 1))
  return x


def np_release_kl(prior, now):
  """select_round: sum over tensors of F.kl_div(log_softmax(now, -1),
  softmax(prior, -1), 'sum') in PyTorch's layout."""
  total = 0.0
  for (name, p), (_, q) in zip(prior, now):
    p, q = to_torch(np.float64(p), name), to_torch(np.float64(q), name)
    y = np_softmax(p, -1)
    total += np.sum(y * (np.log(y) - np.log(np_softmax(q, -1))))
  return total


def np_release_similarity(global_model, client):
  """select_client_in_round: the mean over tensors with ndim > 1 of
  mean(torch.cosine_similarity(g, c)) (dim 1) in PyTorch's layout."""
  sims = []
  for (name, g), (_, c) in zip(global_model, client):
    g, c = to_torch(np.float64(g), name), to_torch(np.float64(c), name)
    if g.ndim > 1:
      cos = np.sum(g * c, axis=1) / np.maximum(
          np.linalg.norm(g, axis=1) * np.linalg.norm(c, axis=1), 1e-8)
      sims.append(cos.mean())
  return float(np.mean(sims))


class RankingTest(absltest.TestCase):

  def test_kl_and_similarity_match_the_release_in_torch_layout(self):
    rng = np.random.default_rng(0)
    # Module -> (leaf name, shape): conv and dense kernels are transposed
    # in PyTorch; the bias, an nn.Embed table and ViT's class token are
    # not (softmax and cosine along their own last axis / dim 1).
    shapes = {'a_conv': ('kernel', (3, 3, 2, 4)),
              'b_dense': ('kernel', (5, 3)), 'c_bias': ('bias', (3,)),
              'd_embed': ('embedding', (6, 4)), 'e_vit': ('cls', (1, 2, 4))}
    before = {m: {n: rng.normal(size=s).astype(np.float32)}
              for m, (n, s) in shapes.items()}
    after = jax.tree.map(
        lambda v: v + 0.3 * rng.normal(size=v.shape).astype(np.float32),
        before)
    named = lambda t: [(n, t[m][n]) for m, (n, _) in sorted(shapes.items())]
    got = float(crab_lib.round_kl(before, after))
    np.testing.assert_allclose(got, np_release_kl(named(before),
                                                  named(after)), rtol=1e-5)
    clients = jax.tree.map(
        lambda v: np.stack([v + 0.5 * rng.normal(size=v.shape)
                            for _ in range(3)]).astype(np.float32), after)
    sims = np.asarray(crab_lib.client_similarity(after, clients))
    want = [np_release_similarity(
        named(after), [(n, c[i]) for n, c in named(clients)])
            for i in range(3)]
    np.testing.assert_allclose(sims, want, rtol=1e-5)


class CrabRunTest(absltest.TestCase):
  """Kernel 'kernel' (in 2, out 1) and bias 'b'; clients 0-2 remain, client 3
  is forgotten at round R = 6; P = 0.6, X = 0.7 (2 of 3 arrivals kept)."""

  def setUp(self):
    super().setUp()
    self.agg = get_aggregator('crab', num_clients=4, forget=FORGET,
                              unlearn_round=6)
    self.w0 = {'b': np.zeros(1, np.float32),
               'kernel': np.ones((2, 1), np.float32)}
    self.params = {k: v.copy() for k, v in self.w0.items()}
    self.state = self.agg.init(jax.tree.map(jnp.asarray, self.params))
    self.step = jax.jit(lambda u, m, s, ids, tau, w, loss, p: call_aggregator(
        self.agg, u, m, s, jax.random.key(0), ids=ids, staleness=tau,
        weights=w, losses=loss, params=p, coverage=None))

  def round(self, k_rows, b_rows, ids, loss=1.0, tau=None, w=None,
            mask=None):
    n = len(ids)
    tau = np.zeros(n) if tau is None else tau
    w = np.ones(n) if w is None else w
    mask = np.ones(n, bool) if mask is None else np.asarray(mask, bool)
    updates = {'b': jnp.asarray(np.reshape(b_rows, (n, 1)), jnp.float32),
               'kernel': jnp.asarray(np.reshape(k_rows, (n, 2, 1)),
                                   jnp.float32)}
    out, self.state, info = self.step(
        updates, jnp.asarray(mask), self.state, jnp.asarray(ids, jnp.int32),
        jnp.asarray(tau, jnp.int32), jnp.asarray(w, jnp.float32),
        jnp.full(n, loss, jnp.float32),
        jax.tree.map(jnp.asarray, self.params))
    out = jax.tree.map(np.asarray, out)
    self.params = {k: self.params[k] + out[k] for k in self.params}
    return out, info

  def test_windows_rollback_and_calibration(self):
    even = [[0.01, 0.01]] * 3                   # KL 0: both inputs move alike
    # Round 1 (loss 1.0 opens the window): FedAvg of every arrival.
    out, _ = self.round(even, [1.0, 2.0, 6.0], [0, 1, 3], loss=1.0)
    np.testing.assert_allclose(out['b'], [3.0], rtol=1e-6)
    moved_2 = {k: self.params[k] - self.w0[k] for k in self.params}
    # Round 2: the largest change of the window. Clients 0 and 3 agree
    # with the new model, client 1 does not: 0 and 3 are kept, 3 is
    # forgotten, so the stored step is client 0's alone.
    out, info = self.round([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]],
                           [4.0, -1.0, 9.0], [0, 1, 3], loss=0.95)
    self.assertEqual(float(info['crab_selected_clients']), 2.0)
    # Round 3: loss 0.85 < 0.9 * 1.0 closes rounds 1-3; floor(3 * 0.6) = 1
    # round is kept: round 2, which becomes the rollback round.
    self.round(even, [0.0, 0.0, 0.0], [0, 1, 2], loss=0.85)
    np.testing.assert_array_equal(self.state.kept_rounds, [2, -1, -1, -1, -1])
    self.assertEqual(int(self.state.rollback_round), 2)
    np.testing.assert_allclose(self.state.norms[0], [4.0, 2.0], rtol=1e-6)
    rollback = {'b': moved_2['b'] + 4.0,
                'kernel': moved_2['kernel'] + np.array([[2.0], [0.0]])}
    for name in rollback:
      np.testing.assert_allclose(self.state.rollback[name], rollback[name],
                                 rtol=1e-6)
    # Rounds 4-5: a new window (loss 0.8, 0.79) closed by R - 1 = 5; of
    # its two rounds floor(2 * 0.6) = 1 is kept: round 5 (round 4 moves
    # both inputs alike, KL 0). Clients 0 and 1 are kept there.
    self.round(even, [0.0, 0.0, 0.0], [0, 1, 2], loss=0.8)
    out, info = self.round([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]],
                           [2.0, 4.0, 0.0], [0, 1, 2], loss=0.79)
    self.assertEqual(float(info['crab_selected_clients']), 2.0)
    np.testing.assert_array_equal(self.state.kept_rounds, [2, 5, -1, -1, -1])
    np.testing.assert_allclose(self.state.norms[1], [3.0, 1.0], rtol=1e-6)
    # Round 6 = R: the model becomes w_2 + client 0's round-2 update; the
    # round's arrivals are dropped.
    moved = {k: self.params[k] - self.w0[k] for k in self.params}
    out, info = self.round(even, [5.0, 5.0, 5.0], [0, 1, 3])
    for name in rollback:
      np.testing.assert_allclose(out[name], rollback[name] - moved[name],
                                 rtol=1e-5, atol=1e-6)
    self.assertEqual(float(info['unlearned']), 1.0)
    np.testing.assert_allclose(info['weights'], [0, 0, 0])
    # Round 7 (k = 1): client 0 trained from the rolled-back model, client
    # 1's update is older, client 3 is forgotten. Step lengths of round 5
    # (b 3, k 1), directions of client 0's update.
    out, info = self.round([[3.0, 4.0], [7.0, 7.0], [1.0, 1.0]],
                           [2.0, 8.0, 8.0], [0, 1, 3], tau=[0, 1, 0])
    np.testing.assert_allclose(out['b'], [3.0], rtol=1e-6)
    np.testing.assert_allclose(out['kernel'], [[0.6], [0.8]], rtol=1e-6)
    self.assertEqual(float(info['calibrating']), 1.0)
    np.testing.assert_allclose(info['weights'], [1, 0, 0])
    # Round 8: both kept rounds used; FedAvg of the fresh remaining
    # arrivals (staleness <= 1).
    out, info = self.round([[1.0, 1.0], [3.0, 3.0], [9.0, 9.0]],
                           [1.0, 3.0, 9.0], [0, 1, 3], tau=[0, 1, 0])
    np.testing.assert_allclose(out['b'], [2.0], rtol=1e-6)
    self.assertEqual(float(info['calibrating']), 0.0)

  def test_masked_slots_change_nothing(self):
    rows = [[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]]
    a, _ = self.round(rows, [4.0, -1.0, 9.0], [0, 1, 3])
    state_a = self.state
    self.setUp()
    b, _ = self.round(rows + [[np.nan, 1e30]], [4.0, -1.0, 9.0, np.inf],
                      [0, 1, 3, 2], mask=[1, 1, 1, 0])
    for name in a:
      np.testing.assert_array_equal(a[name], b[name])
    np.testing.assert_array_equal(state_a.win_norms, self.state.win_norms)
    np.testing.assert_array_equal(state_a.win_kl, self.state.win_kl)

  def test_settings_are_checked(self):
    for kwargs, arg in (({'unlearn_round': 1}, 'unlearn_round'),
                        ({'select_round_ratio': 0.0}, 'select_round_ratio'),
                        ({'select_client_ratio': 1.5},
                         'select_client_ratio'),
                        ({'alpha': 1.0}, 'alpha'),
                        ({'max_window': 0}, 'max_window'),
                        ({'forget': np.zeros(3, bool)}, 'forget')):
      with self.assertRaises(SettingError) as ctx:
        get_aggregator('crab', **{'num_clients': 4, 'forget': FORGET,
                                  'unlearn_round': 6, **kwargs})
      self.assertEqual(ctx.exception.argument, arg, kwargs)


if __name__ == '__main__':
  absltest.main()
