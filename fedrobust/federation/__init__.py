"""The front door: a federation built from settings, run round by round.

  import fedrobust

  fed = fedrobust.Federation(dataset='fashion_mnist', num_clients=10,
                             aggregator='median', attack='lie',
                             malicious_fraction=0.2, max_train_examples=3000)
  state, history = fed.run(num_rounds=3)
  history[-1]['test_accuracy']

A `Federation` takes a run's settings (keyword arguments, or a dict with
one key per setting of `fedrobust.config`; `fedrobust.config.defaults()`
lists them all), checks them, loads and partitions the data and builds the
cohorts, the method, the aggregation rule and the threat model. `init`
gives the round-0 server state; `step` runs one compiled round (sample,
local training, threat, arrivals, server update, metrics); `evaluate`
scores the method's models; `run` loops the two. The command-line runner
(`experiments/`) drives this same class and adds files, checkpoints and
logging around it.

Errors are `fedrobust.errors.SettingError`s naming the setting to change.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fedrobust.engine import (make_round_step, make_setup_step,
                              place_clients)
from fedrobust.engine.detection import detection_rates
from fedrobust.errors import SettingError
from fedrobust.federation.builder import (Program, build, check_settings,
                                        initial_params,
                                        initial_server_state,
                                        pretrain_cohort, resolve)
from fedrobust.federation.evaluation import Evaluator, adapt_unseen
from fedrobust.types import ServerState


class Federation:
  """A checked, built federation and its compiled round.

  Attributes:
    config: the resolved settings (every key of fedrobust.config).
    program: the built pieces (data setup, cohorts, method, threat, round
      configuration, mesh); see fedrobust.federation.builder.Program.
  """

  num_seeds = 1

  def __init__(self, settings: dict[str, Any] | None = None, /, *,
               data: Any = None, client_size: int | None = None,
               **overrides: Any):
    """Checks the settings and builds the federation.

    Args:
      settings: a dict of settings (keys of fedrobust.config.defaults()).
      data: your own fedrobust.data.Dataset (fedrobust.data.from_arrays),
        used instead of loading the `dataset` setting.
      client_size: pad every client's data to this many examples
      (fedrobust.Replicas pads its replicas to one shape).
      **overrides: settings as keywords (they win over `settings`).

    Raises:
      SettingError: naming the setting to change.
    """
    config = resolve({**(settings or {}), **overrides})
    check_settings(config)
    if config['num_seeds'] > 1:
      raise SettingError('num_seeds', f"num_seeds={config['num_seeds']}: "
                         'a Federation is one seed; fedrobust.Replicas runs '
                         'several as one program')
    self.config = config
    self.seeds = [config['seed']]
    self.program: Program = build(config, data, client_size=client_size)
    self.client_sizes = [self.program.setup.train.y.shape[1]]
    mesh = self.program.mesh
    self.replicated = NamedSharding(mesh, P()) if mesh else None
    self.put = functools.partial(jax.device_put, device=self.replicated)
    self.data = place_clients(self.program.setup.train, mesh,
                              config['client_data'])
    self.server_data = self.put(self.program.server_data)
    self._compiled = None
    self._evaluator = None
    self._fresh = None
    self.compile_seconds = None

  # ---- State ---------------------------------------------------------------

  def _fresh_params(self) -> tuple:
    """Each cohort's freshly initialised params, made once (a pretrained
    cohort such as MiniLM reads its weights file to make them)."""
    if self._fresh is None:
      self._fresh = initial_params(self.program.cohorts, self.config['seed'])
    return self._fresh

  def param_shapes(self) -> tuple:
    """Each cohort's full model params as shapes and dtypes."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                        self._fresh_params())

  def initial_params(self, pretrain: Callable | None = None) -> tuple:
    """Each cohort's round-0 params; with pretrain_epochs > 0, centrally
    pretrained on the public split (`pretrain(cohort, params, j, train)`
    may replace the training, e.g. with a stored backbone; `train()` runs
    it). Returns (params tuple, {cohort name: pretraining info}).

    The params are a copy of the fresh ones, which the federation keeps:
    a round donates its state, and with it the params it was started from.
    """
    fresh = jax.tree.map(jnp.copy, self._fresh_params())
    if not self.config['pretrain_epochs']:
      return fresh, {}
    out, info = [], {}
    for j, (c, p) in enumerate(zip(self.program.cohorts, fresh)):
      train = functools.partial(pretrain_cohort, self.config, self.program,
                                c, p, j)
      p, info[c.name] = (pretrain(c, p, j, train) if pretrain is not None
                         else train())
      out.append(p)
    return tuple(out), info

  def state_template(self) -> ServerState:
    """The server state's shapes and dtypes (placed like the state)."""
    template = jax.eval_shape(self._initial_state, self.param_shapes())
    if self.replicated is None:
      return template
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(
        s.shape, s.dtype, sharding=self.replicated), template)

  def _initial_state(self, params) -> ServerState:
    return initial_server_state(self.program, self.config, params,
                                data=self.data, server_data=self.server_data)

  def init(self, params: tuple | None = None) -> ServerState:
    """The round-0 server state, after the method's one-off setup step
    (e.g. every client's local warm-up) if it has one.

    Args:
      params: each cohort's starting params (default: initial_params()).
    """
    if params is None:
      params, _ = self.initial_params()
    state = self.put(self._initial_state(params))
    method = self.program.method
    if method.client_setup is not None:
      setup_step = jax.jit(make_setup_step(method, self.program.round_config,
                                           mesh=self.program.mesh))
      state = setup_step(state, self.data, self.server_data)
    return state

  # ---- Rounds --------------------------------------------------------------

  def round_step(self, *, skip_nonfinite: bool | None = None,
                 log_clients: bool | None = None):
    """The pure round function (state, data, server_data) -> (state,
    metrics), not yet jitted."""
    config = self.config
    if skip_nonfinite is None:
      skip_nonfinite = config['on_divergence'] == 'skip_round'
    return make_round_step(
        self.program.method, self.program.round_config,
        mesh=self.program.mesh, threat=self.program.threat.threat,
        skip_nonfinite=skip_nonfinite,
        log_clients=config['log_clients'] if log_clients is None
        else log_clients)

  def compile(self, state: ServerState):
    """Compiles the round for `state`'s shapes (once; the state buffer is
    donated to each call). Returns the compiled program."""
    if self._compiled is None:
      # The state goes in replicated; XLA may otherwise choose to leave a
      # [clients, ...] leaf of the output sharded over the client axis.
      step_fn = jax.jit(self.round_step(), donate_argnums=0, **(
          {'out_shardings': self.replicated} if self.program.mesh else {}))
      t0 = time.perf_counter()
      self._compiled = step_fn.lower(state, self.data,
                                     self.server_data).compile()
      self.compile_seconds = time.perf_counter() - t0
    return self._compiled

  def step(self, state: ServerState) -> tuple[ServerState, dict[str, Any]]:
    """One round. The input state is donated: use the returned one.

    Returns:
      (new state, the round's metrics as host numpy values).
    """
    state, metrics = self.compile(state)(state, self.data, self.server_data)
    return state, jax.device_get(metrics)

  def replica(self, i: int) -> 'Federation':
    """Replica i's Federation: this one (fedrobust.Replicas has several)."""
    del i
    return self

  def replica_state(self, state: ServerState, i: int) -> ServerState:
    del i
    return state

  def join(self, params: list) -> tuple:
    """The state's params from each replica's (one here)."""
    (out,) = params
    return out

  def step_each(self, state: ServerState
                ) -> tuple[ServerState, list[dict[str, Any]]]:
    """step, with the metrics as a list of one replica's (as
    fedrobust.Replicas.step_each gives every replica's)."""
    state, metrics = self.step(state)
    return state, [metrics]

  def evaluate_each(self, state: ServerState) -> list[dict[str, Any]]:
    """evaluate, as a list of one replica's."""
    return [self.evaluate(state)]

  @property
  def evaluator(self) -> Evaluator:
    if self._evaluator is None:
      self._evaluator = Evaluator(self.program, self.put,
                                  self.config['eval_batch_size'],
                                  self.program.mesh)
    return self._evaluator

  def evaluate(self, state: ServerState) -> dict[str, Any]:
    """Global, local and (under a backdoor) attack metrics of the method's
    models: test_accuracy, local_accuracy, attack_success_rate, ..."""
    return self.evaluator(self.program.method.eval_models(state))

  def adapt_unseen(self, state: ServerState) -> dict[str, Any]:
    """The newcomers' (unseen_clients) accuracy after adapting."""
    return adapt_unseen(self.program, state, self.evaluator, self.put,
                        self.config)

  def run(self, num_rounds: int | None = None, *,
          state: ServerState | None = None, eval_every: int | None = None
          ) -> tuple[ServerState, list[dict[str, Any]]]:
    """Runs rounds from `state` (default: init()) and evaluates every
    `eval_every` rounds and after the last.

    With on_divergence='stop' the loop ends after the first round whose
    model is not finite (that round is evaluated); 'skip_round' drops such
    a round's update inside the step.

    Returns:
      (final state, one row per evaluated round: 'round', the round's
      metrics with the detection rates, and the evaluation's).
    """
    return run_rounds(self, num_rounds, state=state, eval_every=eval_every)


def run_rounds(fed, num_rounds: int | None = None, *, state=None,
               eval_every: int | None = None):
  """The loop of Federation.run and Replicas.run: steps every replica,
  evaluates every `eval_every` rounds and after the last; one row per
  evaluated round (combine_rows over the replicas)."""
  num_rounds = num_rounds or fed.config['num_rounds']
  eval_every = eval_every or fed.config['eval_every']
  stop_on_nan = fed.config['on_divergence'] == 'stop'
  state = fed.init() if state is None else state
  start = int(np.max(np.asarray(state.round)))
  rows = []
  for rnd in range(start + 1, start + num_rounds + 1):
    state, each = fed.step_each(state)
    stop = stop_on_nan and any(bool(m['nonfinite_model']) for m in each)
    if rnd % eval_every == 0 or rnd == start + num_rounds or stop:
      per = []
      for metrics, evaluation in zip(each, fed.evaluate_each(state)):
        metrics.pop('clients', None)
        row = {'round': rnd, **{k: float(np.asarray(v))
                                for k, v in metrics.items()}}
        if 'det_tp' in row:
          row.update(detection_rates(row, ''))
        row.update(evaluation)
        per.append(row)
      rows.append(combine_rows(per, fed.seeds))
    if stop:
      break
  return state, rows


# Last: replicas.py builds on Federation, and run_rounds combines the
# replicas' rows with its combine_rows.
from fedrobust.federation.replicas import Replicas, combine_rows  # noqa: E402

__all__ = ['Federation', 'Program', 'Replicas', 'combine_rows', 'build',
           'check_settings', 'resolve']
