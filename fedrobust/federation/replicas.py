"""Replicas: S seeds of one federation as one compiled program.

  import fedrobust

  reps = fedrobust.Replicas(dataset='fashion_mnist', num_clients=10,
                            aggregator='median', attack='lie',
                            malicious_fraction=0.2, num_seeds=4)
  state, history = reps.run(num_rounds=3)
  history[-1]['test_accuracy'], history[-1]['test_accuracy_std']

Replica i is the federation a single run with seed `seed + i` builds: its
own partition, malicious set, poison patterns, initial parameters and
client sampling. Every state and data array gains a leading replica axis.

How the replicas become one program: each replica's round is traced
(`jax.make_jaxpr`). What differs between seeds is data (the partition, the
state) and array constants the components close over (the malicious set,
trigger patterns, per-client ranks); the traced programs are otherwise the
same. The common program runs over the stacked arguments and constants,
with `jax.lax.map` (one replica after another inside the program: the
same operations as a single run, so bitwise its results) or `jax.vmap`
(side by side: fills an accelerator, may reassociate sums), in batches of
`replica_batch`. Constants equal in every replica stay unstacked.

Clients are padded to the largest replica's client (an extra masked local
step changes nothing; it only lengthens the step schedule when a replica's
own largest client is smaller).

A component that bakes seed-dependent Python values into the traced round
(a loop over a seeded set, a host callback) gives programs that differ in
more than array values; those replicas are refused before any round runs,
with the first differing line.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fedrobust.data import load_dataset
from fedrobust.engine import make_setup_step
from fedrobust.errors import SettingError
from fedrobust.federation import Federation
from fedrobust.federation.builder import check_settings, resolve


def _host(a) -> np.ndarray:
  if jnp.issubdtype(getattr(a, 'dtype', np.float32), jax.dtypes.prng_key):
    a = jax.random.key_data(a)
  return np.asarray(a)


def _first_difference(a: str, b: str) -> str:
  for x, y in zip(a.splitlines(), b.splitlines()):
    if x != y:
      return f'{x.strip()[:160]!r} against {y.strip()[:160]!r}'
  return 'the programs differ in length'


def stack(trees: Sequence[Any]) -> Any:
  """The trees' leaves stacked on a new leading (replica) axis, on the
  host (one transfer a leaf, no per-shape compile); a leaf split over a
  mesh axis keeps its split, one axis further in."""
  def one(*leaves):
    first = leaves[0]
    key = jnp.issubdtype(getattr(first, 'dtype', np.float32),
                         jax.dtypes.prng_key)
    out = np.stack([_host(a) for a in leaves])
    if key:
      out = jax.random.wrap_key_data(out, impl=jax.random.key_impl(first))
    sharding = getattr(first, 'sharding', None)
    if isinstance(sharding, NamedSharding):
      return jax.device_put(out, NamedSharding(
          sharding.mesh, P(None, *sharding.spec)))
    return out if key else jnp.asarray(out)
  return jax.tree.map(one, *trees)


def unstack(tree: Any, i: int) -> Any:
  """Replica i of a stacked tree."""
  return jax.tree.map(lambda a: a[i], tree)


_take = jax.jit(unstack)        # one compile per tree, any replica


def common_program(fns: Sequence[Callable], args: Sequence[tuple], *,
                   what: str, seeds: Sequence[int], batch: int
                   ) -> tuple[Callable, list]:
  """One function over stacked arguments that runs `fns[i](*args[i])` for
  every replica i.

  Args:
    fns: each replica's pure function.
    args: each replica's arguments (same structure, shapes and dtypes;
      arrays or ShapeDtypeStructs).
    what: what the functions are, for errors ('round', 'setup step').
    seeds: the replicas' seeds, for errors.
    batch: replicas run side by side (vmap); 1 runs them one after
      another (lax.map).

  Returns:
    (fn(constants, *stacked_args) -> stacked outputs, the stacked
    constants to pass it).

  Raises:
    SettingError naming num_seeds: the traced programs differ in more
      than array values, or one has host effects (callbacks).
  """
  traced = [jax.make_jaxpr(f, return_shape=True)(*a)
            for f, a in zip(fns, args)]
  closed = [t[0] for t in traced]
  text = [str(c.jaxpr) for c in closed]
  for seed, t in zip(seeds[1:], text[1:]):
    if t != text[0]:
      raise SettingError('num_seeds', f"the {what} of seed {seed} differs "
                         f"from seed {seeds[0]}'s in more than array values "
                         f'({_first_difference(text[0], t)}): a component '
                         'gives its arrays seed-dependent shapes or makes '
                         'seed-dependent Python choices while tracing, so '
                         'the replicas cannot share one program; run the '
                         'seeds as separate runs')
  if closed[0].jaxpr.effects:
    raise SettingError('num_seeds', f'the {what} has host-side effects '
                       f'({sorted(map(str, closed[0].jaxpr.effects))}), '
                       'which replicas cannot share; run the seeds as '
                       'separate runs')
  jaxpr = closed[0].jaxpr
  out_tree = jax.tree.structure(traced[0][1])
  consts = [c.consts for c in closed]
  shared = [all(np.array_equal(_host(c[k]), _host(consts[0][k]))
                for c in consts[1:]) for k in range(len(consts[0]))]
  fixed = [c for c, s in zip(consts[0], shared) if s]
  varying = [jnp.stack([c[k] for c in consts])
             for k, s in enumerate(shared) if not s]

  def one(varying_k, args_k):
    it_v, it_f = iter(varying_k), iter(fixed)
    values = [next(it_f) if s else next(it_v) for s in shared]
    out = jax.core.eval_jaxpr(jaxpr, values, *jax.tree.leaves(args_k))
    return jax.tree.unflatten(out_tree, out)

  num = len(fns)

  def fn(varying_c, *stacked_args):
    xs = (varying_c, stacked_args)
    if batch >= num:
      return jax.vmap(one)(*xs)
    if batch <= 1:
      return jax.lax.map(lambda x: one(*x), xs)
    return jax.lax.map(lambda x: one(*x), xs, batch_size=batch)
  return fn, varying


class Replicas:
  """S seeds of a federation, stepped as one compiled program.

  The interface follows `Federation`: `init`, `step`, `evaluate`, `run`,
  `compile`, `state_template`; states carry a leading replica axis, and
  step/evaluate return one entry per replica (`step_each`,
  `evaluate_each`). `members[i]` is replica i's own Federation (seed
  `seed + i`), for anything per replica.
  """

  def __init__(self, settings: dict[str, Any] | None = None, /, *,
               data: Any = None, **overrides: Any):
    config = resolve({**(settings or {}), **overrides})
    check_settings(config)
    self.config = config
    self.num_seeds = int(config['num_seeds'])
    if jax.process_count() > 1:
      raise SettingError('num_seeds', 'replicas run in one process; under '
                         'jax.distributed run the seeds as separate runs')
    self.seeds = [config['seed'] + i for i in range(self.num_seeds)]
    if data is None:       # read once, partitioned per seed
      data = load_dataset(config['dataset'], config['data_dir'])
    one = lambda seed, size=None: Federation(
        dict(config, seed=seed, num_seeds=1), data=data, client_size=size)
    members = [one(s) for s in self.seeds]
    # Each replica's own client size (its largest client), and the size
    # all are padded to.
    self.client_sizes = [m.program.setup.train.y.shape[1] for m in members]
    size = max(self.client_sizes)
    self.members = [m if m.program.setup.train.y.shape[1] == size else
                    one(s, size) for m, s in zip(members, self.seeds)]
    self._warn_padding(size)
    first = self.members[0]
    self.program = first.program
    self.put = first.put
    self.replicated = first.replicated
    batch = config['replica_batch'] or (
        1 if jax.default_backend() == 'cpu' else self.num_seeds)
    self.batch = min(batch, self.num_seeds)
    self.data = stack([m.data for m in self.members])
    self.server_data = stack([m.server_data for m in self.members])
    self._compiled = None
    self.compile_seconds = None
    for m in self.members[1:]:      # one compile of each evaluation
      m.evaluator._fns = first.evaluator._fns
    # Traced and checked now, so that replicas that cannot share one
    # program are refused before anything runs or is written.
    t0 = time.perf_counter()
    templates = [m.state_template() for m in self.members]
    args = [(t, m.data, m.server_data)
            for t, m in zip(templates, self.members)]
    self._round = self._program([m.round_step() for m in self.members],
                                args, 'round')
    self._setup = None
    if self.program.method.client_setup is not None:
      self._setup = self._program(
          [make_setup_step(m.program.method, m.program.round_config,
                           mesh=m.program.mesh) for m in self.members],
          args, 'setup step')
    self.trace_seconds = time.perf_counter() - t0

  def _warn_padding(self, size: int) -> None:
    """Padding adds masked local steps at the end of each epoch: nothing
    changes, except the step keys of later epochs and an AdamW warm-up,
    which follow the padded schedule. Says which replicas that may touch."""
    config = self.config
    per_epoch = lambda n: -(-n // config['batch_size'])
    longer = [seed for seed, n in zip(self.seeds, self.client_sizes)
              if per_epoch(n) < per_epoch(size)]
    touched = []
    if config['local_epochs'] > 1:
      touched.append('the step keys of epochs 2 and later (a model that '
                     'draws randomness in training, e.g. dropout)')
    if config['local_optimizer'] == 'adamw' and config['warmup_fraction']:
      touched.append("AdamW's warm-up length")
    if longer and touched:
      logging.warning(
          'replicas of seeds %s run %d local steps an epoch instead of '
          'their own %s: %s follow the longer schedule, so these replicas '
          'match their single runs in distribution, not bit for bit',
          longer, per_epoch(size),
          [per_epoch(n) for seed, n in zip(self.seeds, self.client_sizes)
           if seed in longer], ' and '.join(touched))

  # ---- State ---------------------------------------------------------------

  def param_shapes(self) -> tuple:
    """Replica 0's model params as shapes (every replica's are alike)."""
    return self.members[0].param_shapes()

  def initial_params(self, pretrain: Callable | None = None) -> tuple:
    """Each replica's round-0 params, stacked; (params, replica 0's
    pretraining info)."""
    out = [m.initial_params(pretrain) for m in self.members]
    return stack([p for p, _ in out]), out[0][1]

  def state_template(self):
    """The stacked server state's shapes and dtypes."""
    t = self.members[0].state_template()
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(
        (self.num_seeds,) + tuple(s.shape), s.dtype,
        sharding=getattr(s, 'sharding', None)), t)

  def replica(self, i: int) -> Federation:
    """Replica i's own Federation (seed `seed + i`)."""
    return self.members[i]

  def replica_state(self, state, i: int):
    """Replica i's state of the stacked one."""
    return _take(state, i)

  def join(self, params: list) -> tuple:
    """The stacked params from each replica's."""
    return stack(params)

  def _program(self, fns, args, what):
    return common_program(fns, args, what=what, seeds=self.seeds,
                          batch=self.batch)

  def init(self, params: tuple | None = None):
    """The stacked round-0 state (after the method's setup step)."""
    if params is None:
      params, _ = self.initial_params()
    states = [m._initial_state(_take(params, i))
              for i, m in enumerate(self.members)]
    state = self.put(stack(states))
    if self._setup is not None:
      fn, consts = self._setup
      state = jax.jit(fn)(consts, state, self.data, self.server_data)
    return state

  # ---- Rounds --------------------------------------------------------------

  def compile(self, state):
    """Compiles the replicas' common round (once)."""
    if self._compiled is None:
      fn, consts = self._round
      jitted = jax.jit(fn, donate_argnums=1, **(
          {'out_shardings': self.replicated} if self.program.mesh else {}))
      t0 = time.perf_counter()
      compiled = jitted.lower(consts, state, self.data,
                              self.server_data).compile()
      self.compile_seconds = time.perf_counter() - t0
      self._compiled = (compiled, consts)
    return self._compiled[0]

  def step_each(self, state) -> tuple[Any, list[dict[str, Any]]]:
    """One round of every replica: (state, [replica i's metrics])."""
    compiled = self.compile(state)
    state, metrics = compiled(self._compiled[1], state, self.data,
                              self.server_data)
    metrics = jax.device_get(metrics)
    return state, [unstack(metrics, i) for i in range(self.num_seeds)]

  step = step_each

  def evaluate_each(self, state) -> list[dict[str, Any]]:
    """Each replica's evaluation (Federation.evaluate)."""
    return [m.evaluate(_take(state, i))
            for i, m in enumerate(self.members)]

  evaluate = evaluate_each

  def adapt_unseen(self, state) -> list[dict[str, Any]]:
    return [m.adapt_unseen(_take(state, i))
            for i, m in enumerate(self.members)]

  def run(self, num_rounds: int | None = None, *, state=None,
          eval_every: int | None = None):
    """Federation.run over the replicas: rows carry every replica's values
    ('replicas'), their mean (the plain keys) and std ('<key>_std')."""
    from fedrobust.federation import run_rounds  # the package imports this module
    return run_rounds(self, num_rounds, state=state, eval_every=eval_every)


def _numeric(v) -> bool:
  return (v is not None and not isinstance(v, (bool, str)) and
          np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number))


def combine_rows(rows: list[dict[str, Any]], seeds: Sequence[int]
                 ) -> dict[str, Any]:
  """One row from each replica's: every numeric key's mean across the
  replicas (under its own name) and sample std (`<key>_std`, ddof 1),
  any other key where every replica has the same value, plus the
  replicas' own rows under 'replicas' (each with its 'seed'). A single
  row is returned as it is."""
  if len(rows) == 1:
    return rows[0]
  out: dict[str, Any] = {}
  for key in rows[0]:
    values = [r.get(key) for r in rows]
    if key == 'round' or not all(_numeric(v) for v in values):
      if all(v == values[0] for v in values):     # else per replica only
        out[key] = values[0]
      continue
    v = np.asarray(values, np.float64)
    out[key] = float(np.mean(v))
    out[key + '_std'] = float(np.std(v, ddof=1))
  out['seeds'] = list(seeds)
  out['replicas'] = [dict(r, seed=s) for r, s in zip(rows, seeds)]
  return out
