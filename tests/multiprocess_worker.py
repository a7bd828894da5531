"""One process of tests/multiprocess_test.py: compiled rounds under
jax.distributed (multi-controller JAX) on CPU.

  python tests/multiprocess_worker.py OUT_JSON DATA_DIR NUM_DEVICES \
      [COORDINATOR NUM_PROCESSES PROCESS_ID]

With the last three arguments the process joins a jax.distributed job
(gloo collectives between CPU processes, as between the hosts of a pod
slice); without them it runs alone. Either way it builds the run config
of the test below, places the data and state replicated on a NUM_DEVICES
mesh spanning every process's devices, runs ROUNDS compiled rounds, and
writes each round's metrics and the final global parameters' sha256 (as
seen by this process) to OUT_JSON. With client_data 'sharded' (an
override) each process builds and places only its own devices' block of
clients, and reports which examples it read. NUM_DEVICES >= 2 (the mesh is the
runner's, which has none on one device). $FEDROBUST_MP_OVERRIDES, a JSON
object, overrides CONFIG's settings (e.g. {"method": "sdfc", ...}).

With $FEDROBUST_MP_WORKDIR set, the process runs the runner itself,
`train.run`, in that workdir (shared by every process; it resumes what is
there) and writes its rounds_completed and params sha256 instead, and
which test images it read.
"""

import json
import os
import sys

import numpy as np

if __package__ in (None, ''):   # run as a script: make the repo importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

ROUNDS = 2
# A robust rule under a model-poisoning attack, so that the attack's
# statistics and the rule's sort/trim see every client of the round.
CONFIG = dict(
    dataset='idx', model='mlp', num_clients=8, clients_per_round=6,
    local_test_fraction=0.0, num_rounds=ROUNDS, batch_size=32,
    local_lr=0.05, eval_batch_size=50, aggregator='trimmed_mean',
    attack='lie', malicious_fraction=0.25, seed=3)


class _Recording:
  """An example array that records which rows are read from it."""

  def __init__(self, array):
    self.array, self.shape, self.dtype = array, array.shape, array.dtype
    self.read = set()

  def __getitem__(self, rows):
    self.read.update(int(r) for r in np.asarray(rows).ravel())
    return self.array[rows]


def main(argv):
  out_path, data_dir, num_devices = argv[1], argv[2], int(argv[3])
  import jax  # pylint: disable=g-import-not-at-top
  if len(argv) > 4:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(coordinator_address=argv[4],
                               num_processes=int(argv[5]),
                               process_id=int(argv[6]))
  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec
  from experiments import config as config_lib
  from experiments import train
  from fedrobust.engine import round as round_lib
  from fedrobust.data import ClientRows
  from fedrobust.engine.execution import place_clients
  # pylint: enable=g-import-not-at-top

  config = config_lib.defaults()
  config.update(CONFIG, data_dir=data_dir, num_devices=num_devices,
                workdir='unused')
  config.update(json.loads(os.environ.get('FEDROBUST_MP_OVERRIDES', '{}')))
  workdir = os.environ.get('FEDROBUST_MP_WORKDIR')
  if workdir:
    # Record which test images the run builds (the Evaluator's placement).
    test_images = []
    from fedrobust.federation import builder  # pylint: disable=g-import-not-at-top
    load = builder.load_dataset

    def recording_load(*args, **kwargs):
      dataset = load(*args, **kwargs)
      test_images.append(_Recording(dataset.test_x))
      return dataset._replace(test_x=test_images[-1])
    builder.load_dataset = recording_load
    from experiments import preemption  # pylint: disable=g-import-not-at-top
    try:
      summary = train.run(dict(config, workdir=workdir, checkpoint_every=1))
    except preemption.Preempted as err:    # a SIGTERM here or on the peer
      summary = err.summary
    with open(out_path, 'w') as f:
      json.dump({'process_index': jax.process_index(),
                 'status': summary['status'],
                 'rounds_completed': summary['rounds_completed'],
                 'params_sha256': summary['params_sha256'],
                 'test_examples_read': sorted(test_images[0].read)}, f)
    if summary['status'] == 'preempted':
      sys.exit(preemption.EXIT_CODE)
    return
  program = train.build(config)
  replicated = NamedSharding(program.mesh, PartitionSpec())
  put = lambda tree: jax.device_put(tree, replicated)
  host = program.setup.train
  rows = [0, config['num_clients']]
  if config['client_data'] == 'sharded':
    # This process's block of clients; with $FEDROBUST_MP_GARBLE every
    # other row of the label and count arrays is overwritten first, so a
    # result equal to the single process's shows that no process read
    # another's rows (the images: examples_read below).
    spans = [index[0] for index in NamedSharding(
        program.mesh, PartitionSpec('clients')).addressable_devices_indices_map(
            host.x.shape).values()]
    rows = [min(s.start for s in spans), max(s.stop for s in spans)]
    if os.environ.get('FEDROBUST_MP_GARBLE'):
      other = np.ones(host.x.shape[0], bool)
      other[rows[0]:rows[1]] = False
      host = host._replace(y=np.where(other[:, None], 0, host.y),
                           count=np.where(other, 1, host.count))
  # The images stay lazy (data.ClientRows); record which examples the
  # placement reads from the source.
  host = host._replace(x=ClientRows(_Recording(host.x.source),
                                    host.x.parts, host.x.n))
  data = place_clients(host, program.mesh, config['client_data'])
  server_data = put(program.server_data)
  state = put(round_lib.init_server_state(
      program.method, train.initial_params(program.cohorts, config['seed']),
      config['num_clients'], config['seed'] + 1,
      config=program.round_config, data=data, server_data=server_data))
  step = jax.jit(round_lib.make_round_step(
      program.method, program.round_config, mesh=program.mesh,
      threat=program.threat.threat), out_shardings=replicated)
  rounds = []
  for _ in range(ROUNDS):
    state, metrics = step(state, data, server_data)
    rounds.append({k: float(np.asarray(v)) for k, v in metrics.items()
                   if np.ndim(v) == 0})
  with open(out_path, 'w') as f:
    json.dump({'process_index': jax.process_index(),
               'process_count': jax.process_count(),
               'devices': jax.device_count(),
               'local_devices': jax.local_device_count(),
               'rounds': rounds,
               'data_rows': rows,
               'examples_read': sorted(host.x.source.read),
               'block_examples': sorted(np.concatenate(
                   host.x.parts[rows[0]:rows[1]]).tolist()),
               'params_sha256': train.params_sha256(state.params)}, f)


if __name__ == '__main__':
  main(sys.argv)
