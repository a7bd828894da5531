r"""FedDPA's personal accuracy under other mixing rules, read from a finished
run's last checkpoint (BUILD_NOTES §3f):

  python experiments/analysis/feddpa_mix.py WORKDIR

prints the clients' mean accuracy on their own test splits with the
instance-wise weighting (as the run evaluated it), with a fixed weight w_G
on the global adapter (0: the local adapter alone, 1: the global one), and
the instance-wise rule's weights on those inputs (mean, 10th and 90th
percentile).
"""
import json
import os
import sys

if __package__ in (None, ''):   # run as a script: make `experiments` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))))
# pylint: disable=g-import-not-at-top
import jax
import jax.numpy as jnp
import numpy as np

from experiments import train
from fedrobust.checkpoint import Checkpointer
from fedrobust.engine import init_server_state
from fedrobust.methods.fedlora import add_dense, products
from fedrobust.methods.feddpa import similarity_weight


def mean_own(scores) -> float:
  """Mean accuracy over the clients that have a local test split."""
  has = np.asarray(scores['count']) > 0
  return float(np.mean(np.asarray(scores['accuracy'])[has]))


def main(workdir: str) -> dict:
  """The accuracies and weights (module docstring) of the run in workdir."""
  with open(os.path.join(workdir, 'config.json')) as f:
    config = train.resolve(json.load(f))
  train.configure_cpu_devices(1, config['clients_per_round'])
  program = train.build(config)
  setup, cohorts, method = program.setup, program.cohorts, program.method
  data = jax.tree.map(jnp.asarray, setup.train)
  key = jax.random.key(config['seed'])
  fresh = tuple(c.model.init(key if j == 0 else jax.random.fold_in(key, j))
                for j, c in enumerate(cohorts))
  init = lambda p: init_server_state(method, p, config['num_clients'],
                                     config['seed'] + 1,
                                     config=program.round_config, data=data,
                                     server_data=program.server_data)
  template = jax.eval_shape(init, fresh)
  step, state = Checkpointer(os.path.join(
      workdir, 'checkpoints')).restore_latest(template)
  evaluator = train.Evaluator(program, lambda x: x, config['eval_batch_size'])
  personal = method.eval_models(state)[-1]
  c = cohorts[0]
  scale = c.transform.factor_scale(None)
  base, g, l, anchors = personal.params
  own = evaluator.for_cohort(0)['own']
  members = list(c.members)
  index = jnp.arange(len(members), dtype=jnp.int32)
  lt = evaluator.local_tests[0]

  def mixed_set(wg):
    def one(b, gg, ll):
      pg, pl = products(gg, scale), products(ll, scale)
      return add_dense(b, {p: wg * pg[p] + (1 - wg) * pl[p] for p in pg})
    return jax.vmap(one)(base, g, l)

  out = {'step': int(step)}
  out['instance-wise (as run)'] = mean_own(
      evaluator.fns(personal)['own'](personal.params, index, lt))
  for wg in (0.0, 0.25, 0.5, 1.0):
    out[f'fixed w_G={wg}'] = mean_own(own(mixed_set(wg), index, lt))
  # The weights the instance-wise rule gave on the clients' own test inputs.
  def weights(k):
    p = jax.tree.map(lambda leaf: leaf[k], personal.params)
    b, gg, ll, an = p
    x, mask = lt[0][k], lt[2][k]
    pl = products(ll, scale)
    logits = jax.vmap(lambda xb: c.model.apply(add_dense(b, pl), xb))(x)
    w = jax.vmap(lambda q: similarity_weight(q, an, 0.5))(logits)
    return np.asarray(w)[np.asarray(mask)]
  ws = np.concatenate([weights(k) for k in range(len(members))])
  out['w_G on own test inputs: mean, p10, p90'] = [
      float(ws.mean()), float(np.percentile(ws, 10)),
      float(np.percentile(ws, 90))]
  return out


if __name__ == '__main__':
  print(json.dumps(main(sys.argv[1]), indent=1))
