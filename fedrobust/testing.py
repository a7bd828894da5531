"""Conformance checks for an aggregation rule, as a function to call.

`check_rule` runs a rule on a tiny pytree of updates and checks the
contract of `fedrobust/aggregators/base.py` that every rule of the package
meets (and `tests/aggregators_test.py` checks for each of them):

  shapes       the update has one client's tree, shapes and dtypes and is
               finite; info['weights'] is a finite float32[C], >= 0, and 0
               on every masked slot.
  masked       masked slots are inert: extra slots with mask False holding
               NaN, +Inf, -Inf or 1e30 change neither the update nor the
               real clients' weights, and get weight 0.
  permutation  permuting the clients together with their mask and their
               per-client extras leaves the update and permutes the weights.
  finite       one real client sending NaN, +Inf or -Inf (in half of its
               coordinates) or a 1e30-scaled update keeps the update and the
               weights finite. Checked only for num_byzantine >= 1: a rule
               built for f = 0 promises nothing against a bad client.
  jit          the jitted rule agrees with the rule run op by op (update,
               state and info).
  retrace      the jitted aggregate traces once: rounds with new values, a
               new mask, a new key and the state the last round returned,
               all of the same shapes, trace it no further.
  identical    when every real client sends the same update u, the update
               is u.

  report = check_rule(my_rule)                 # AssertionError on a failure
  report = check_rule(my_rule, raise_on_failure=False)
  report.passed, report.failed, report['masked'].detail

A rule may fail a check by design (FoolsGold weighs identical histories 0,
so it fails `identical`; a rule that ranks clients by slot fails
`permutation`); pass those names in `skip` and state the reason next to
the call.

Each check is also a function of its own (`check_shapes`, `check_masked`,
...) that takes a runner, so a test suite can run them on its own compiled
rules. A runner is

  run(x, mask, *, slots=None, state=None, key=None) -> (update, state, info)

which aggregates the client rows x (float32[K, D], each row one client's
update raveled in jax.tree.leaves order) under mask (bool[K]). `slots`
(int[K]) names, for each row, the client of the check's base input whose
per-client extras (weight, id, score, ...) that row carries, so extras move
with their rows; None means row k carries client k's. `state` None is the
rule's initial state; `key` None is a fixed key.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedrobust import aggregators
from fedrobust.aggregators.base import EXTRAS, Aggregator, call_aggregator

CHECKS = ('shapes', 'masked', 'permutation', 'finite', 'jit', 'retrace',
          'identical')
# What a bad client sends (check_finite): NaN or +-Inf in every other
# coordinate, or its whole update scaled by 1e30.
BAD_VALUES = ('nan', '+inf', '-inf', '1e30')
# What the extra masked slots of check_masked hold, one value per slot.
MASKED_FILL = (np.nan, np.inf, -np.inf, 1e30)

Runner = Callable[..., tuple[Any, Any, Mapping[str, Any]]]


class CheckResult(NamedTuple):
  """The outcome of one check.

  Attributes:
    name: the check, one of CHECKS.
    passed: True or False; None when the check was skipped.
    detail: what was measured (the largest difference, the bad entries),
      or why the check was skipped.
  """
  name: str
  passed: bool | None
  detail: str


@dataclasses.dataclass(frozen=True)
class ConformanceReport:
  """The results of `check_rule`, one per check in CHECKS order.

  Attributes:
    rule: the rule's name, as used in messages.
    results: one CheckResult per check.
  """
  rule: str
  results: tuple[CheckResult, ...]

  @property
  def passed(self) -> bool:
    """True when no check failed (skipped checks do not count)."""
    return not self.failed

  @property
  def failed(self) -> tuple[str, ...]:
    """The names of the failed checks."""
    return tuple(r.name for r in self.results if r.passed is False)

  @property
  def skipped(self) -> tuple[str, ...]:
    """The names of the skipped checks."""
    return tuple(r.name for r in self.results if r.passed is None)

  def __getitem__(self, name: str) -> CheckResult:
    for result in self.results:
      if result.name == name:
        return result
    raise KeyError(f'no check {name!r}; the checks are {CHECKS}')

  def __str__(self) -> str:
    mark = {True: 'PASS', False: 'FAIL', None: 'SKIP'}
    head = (f'rule {self.rule!r} passed the conformance checks' if self.passed
            else f'rule {self.rule!r} failed conformance check(s) '
            f'{", ".join(self.failed)}')
    return '\n'.join([head] + [f'  {mark[r.passed]} {r.name}: {r.detail}'
                               for r in self.results])


# ----------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------


def count_traces(fn: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps a plain function to count how often its Python body runs.

  Under jax.jit the body runs once per trace, so
  `jax.jit(count_traces(f))` traces f and `.traces` (an int attribute of
  the returned wrapper) says how many times, as chex.assert_max_traces
  counts. Do not call the wrapper outside jit: those calls count too.

  Args:
    fn: a plain (not jitted) function.

  Returns:
    The wrapper, with an int attribute `traces`, 0 until it first runs.
  """

  @functools.wraps(fn)
  def counted(*args, **kwargs):
    counted.traces += 1
    return fn(*args, **kwargs)

  counted.traces = 0
  return counted


def _numeric(value: Any) -> np.ndarray:
  value = value if isinstance(value, np.ndarray) else jnp.asarray(value)
  if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
    value = jax.random.key_data(value)
  return np.asarray(value, np.float64)


def _raveled(tree: Any) -> np.ndarray:
  leaves = [_numeric(leaf).ravel() for leaf in jax.tree.leaves(tree)]
  return np.concatenate(leaves) if leaves else np.zeros(0)


def _max_violation(got: np.ndarray, want: np.ndarray, atol: float,
                   rtol: float) -> tuple[bool, float]:
  """(any entry out of tolerance, max |got - want|): equal entries (equal
  Infs, NaN against NaN) match; NaN against a number differs by inf."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.shape != want.shape:
    return True, np.inf
  same = (got == want) | (np.isnan(got) & np.isnan(want))
  with np.errstate(invalid='ignore', over='ignore'):
    diff = np.where(same, 0.0, np.abs(got - want))
  diff = np.where(np.isnan(diff), np.inf, diff)
  bad = diff > atol + rtol * np.abs(np.where(np.isfinite(want), want, 0.0))
  return bool(np.any(bad)), float(np.max(diff, initial=0.0))


def _tree_mismatches(got: Any, want: Any, atol: float, rtol: float
                     ) -> list[str]:
  """Leaf paths (with their max |difference|) where two trees differ."""
  got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
  want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
  if got_def != want_def:
    return [f'tree structures differ: {got_def} vs {want_def}']
  out = []
  for (path, a), (_, b) in zip(got_leaves, want_leaves):
    a, b = _numeric(a), _numeric(b)
    bad, diff = _max_violation(a, b, atol, rtol)
    if bad:
      shape = '' if a.shape == b.shape else f' (shapes {a.shape} vs {b.shape})'
      out.append(f'{jax.tree_util.keystr(path) or "<leaf>"} max |diff| '
                 f'{diff:.3g}{shape}')
  return out


def _weights(info: Mapping[str, Any]) -> np.ndarray:
  if not isinstance(info, Mapping) or 'weights' not in info:
    raise AssertionError("info has no 'weights' entry (float32[C], each "
                         "slot's weight)")
  return _numeric(info['weights'])


def _tolerance(atol: float, rtol: float) -> str:
  return f'allowed {atol:g} + {rtol:g} * |value|'


# ----------------------------------------------------------------------------
# The checks. Each returns a CheckResult; an exception from the rule
# propagates (check_rule records it as a failure).
# ----------------------------------------------------------------------------


def check_shapes(run: Runner, x: np.ndarray, mask: np.ndarray,
                 like: Any) -> CheckResult:
  """The update has one client's tree, shapes and dtypes, and is finite;
  info['weights'] is a finite float32[K], >= 0, and 0 on masked slots.

  Args:
    run: a runner (see the module docstring).
    x: float32[K, D] client rows; masked rows may hold anything.
    mask: bool[K].
    like: one client's tree (arrays or ShapeDtypeStructs): the expected
      structure, shapes and dtypes of the update.

  Returns:
    CheckResult('shapes', passed, detail).
  """
  mask = np.asarray(mask, bool)
  update, _, info = run(x, mask)
  problems = []
  got_def, want_def = jax.tree.structure(update), jax.tree.structure(like)
  if got_def != want_def:
    problems.append(f'the update is {got_def}, expected {want_def}')
  else:
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(update)[0],
                            jax.tree.leaves(like)):
      got = (tuple(np.shape(a)), np.dtype(getattr(a, 'dtype', type(a))))
      want = (tuple(np.shape(b)), np.dtype(b.dtype))
      if got != want:
        problems.append(f'leaf {jax.tree_util.keystr(path)} is {got[1]}'
                        f'{list(got[0])}, expected {want[1]}{list(want[0])}')
  flat = _raveled(update)
  if not np.all(np.isfinite(flat)):
    problems.append(f'{int(np.sum(~np.isfinite(flat)))} of {flat.size} '
                    'update entries are not finite')
  if 'weights' not in info:
    problems.append("info has no 'weights' entry")
  else:
    dtype = np.asarray(info['weights']).dtype
    weights = _numeric(info['weights'])
    if dtype != np.float32 or weights.shape != mask.shape:
      problems.append(f"info['weights'] is {dtype}{list(weights.shape)}, "
                      f'expected float32{list(mask.shape)}')
    elif not np.all(np.isfinite(weights)) or np.any(weights < 0):
      problems.append(f"info['weights'] has entries that are not finite or "
                      f'are negative: {weights.tolist()}')
    elif np.any(weights[~mask] != 0):
      problems.append(f"info['weights'] on masked slots is "
                      f'{weights[~mask].tolist()}, expected 0')
  if problems:
    return CheckResult('shapes', False, '; '.join(problems))
  return CheckResult('shapes', True, f'{len(jax.tree.leaves(update))} leaves '
                     "of one client's shapes and dtypes, finite; weights "
                     f'float32[{len(mask)}], 0 on masked slots')


def _fill_positions(num_rows: int, count: int) -> tuple[int, ...]:
  return tuple(min(1 + 2 * i, num_rows) for i in range(count))


def check_masked(run: Runner, x: np.ndarray, *,
                 fill: Sequence[float] = MASKED_FILL,
                 positions: Sequence[int] | None = None,
                 atol: float = 1e-5, rtol: float = 1e-5) -> CheckResult:
  """Masked slots are inert: extra masked slots holding garbage change
  neither the update nor the real clients' weights, and get weight 0.

  The rule runs on the K real rows of x, then on x with one extra masked
  row per value of `fill` (the row full of that value) inserted before the
  rows `positions` (numpy.insert's indices; by default 1, 3, 5, ... capped
  at K, i.e. between the real rows and at the end). An extra slot carries
  the per-client extras of a real client, as the engine's in-flight
  buffers do.

  Args:
    run: a runner.
    x: float32[K, D], every row a real client.
    fill: the masked slots' values.
    positions: where they go, one per fill value.
    atol: absolute tolerance on the update and the weights.
    rtol: relative tolerance on the update.

  Returns:
    CheckResult('masked', passed, detail).
  """
  x = np.asarray(x, np.float32)
  k, d = x.shape
  positions = tuple(_fill_positions(k, len(fill)) if positions is None
                    else positions)
  if len(positions) != len(fill):
    raise ValueError(f'{len(fill)} fill values but {len(positions)} '
                     'positions')
  base, _, base_info = run(x, np.ones(k, bool))
  rows = np.asarray([[value] * d for value in fill], np.float32)
  padded = np.insert(x, positions, rows, axis=0)
  mask = np.insert(np.ones(k, bool), positions, False)
  slots = np.insert(np.arange(k), positions,
                    [min(p, k - 1) for p in positions])
  out, _, info = run(padded, mask, slots=slots)
  problems = []
  bad, diff = _max_violation(_raveled(out), _raveled(base), atol, rtol)
  if bad:
    problems.append(f'the update changed by max |diff| {diff:.3g} '
                    f'({_tolerance(atol, rtol)})')
  weights, base_weights = _weights(info), _weights(base_info)
  if np.any(weights[~mask] != 0):
    problems.append(f'masked slots got weights {weights[~mask].tolist()}')
  bad_w, diff_w = _max_violation(weights[mask], base_weights, atol, 0.0)
  if bad_w:
    problems.append(f"the real clients' weights changed by max |diff| "
                    f'{diff_w:.3g} (allowed {atol:g})')
  where = (f'masked slots holding {", ".join(f"{v:g}" for v in fill)} '
           f'inserted at {list(positions)} of {k} real clients')
  if problems:
    return CheckResult('masked', False, '; '.join(problems) + f' when {where}')
  return CheckResult('masked', True, f'max |diff| {diff:.3g} with {where}')


def check_permutation(run: Runner, x: np.ndarray, mask: np.ndarray,
                      perm: Sequence[int] | None = None, *,
                      atol: float = 1e-5, rtol: float = 1e-5) -> CheckResult:
  """Permuting the clients (rows, mask and per-client extras together)
  leaves the update and permutes the weights.

  Args:
    run: a runner.
    x: float32[K, D] client rows.
    mask: bool[K].
    perm: the permutation of range(K); by default the reversed order.
    atol: absolute tolerance on the update and the weights.
    rtol: relative tolerance on the update.

  Returns:
    CheckResult('permutation', passed, detail).
  """
  x, mask = np.asarray(x, np.float32), np.asarray(mask, bool)
  perm = (np.arange(len(x))[::-1] if perm is None
          else np.asarray(perm, np.int64))
  out, _, info = run(x, mask)
  out_p, _, info_p = run(x[perm], mask[perm], slots=perm)
  problems = []
  bad, diff = _max_violation(_raveled(out_p), _raveled(out), atol, rtol)
  if bad:
    problems.append(f'the update changed by max |diff| {diff:.3g} '
                    f'({_tolerance(atol, rtol)})')
  bad_w, diff_w = _max_violation(_weights(info_p), _weights(info)[perm],
                                 atol, 0.0)
  if bad_w:
    problems.append(f'the weights did not follow their clients: max |diff| '
                    f'{diff_w:.3g} (allowed {atol:g})')
  where = f'clients permuted as {perm.tolist()}'
  if problems:
    return CheckResult('permutation', False,
                       '; '.join(problems) + f' with the {where}')
  return CheckResult('permutation', True, f'max |diff| {diff:.3g} with the '
                     f'{where}')


def poison(x: np.ndarray, row: int, bad: str) -> np.ndarray:
  """A copy of x where client `row` sends `bad` (one of BAD_VALUES)."""
  x = np.array(x, np.float32)
  if bad == '1e30':
    x[row] = 1e30 * x[row]
  elif bad in BAD_VALUES:
    x[row, ::2] = {'nan': np.nan, '+inf': np.inf, '-inf': -np.inf}[bad]
  else:
    raise ValueError(f'bad must be one of {BAD_VALUES}, got {bad!r}')
  return x


def check_finite(run: Runner, x: np.ndarray, mask: np.ndarray, *,
                 row: int | None = None,
                 bad: Iterable[str] = BAD_VALUES) -> CheckResult:
  """With one real client sending NaN, +-Inf or a 1e30-scaled update, the
  update and the weights stay finite.

  Args:
    run: a runner.
    x: float32[K, D] client rows.
    mask: bool[K].
    row: the bad client, a real slot; by default the last real one.
    bad: the kinds of bad update tried, each on its own (see BAD_VALUES).

  Returns:
    CheckResult('finite', passed, detail).
  """
  mask = np.asarray(mask, bool)
  row = int(np.flatnonzero(mask)[-1]) if row is None else row
  problems, kinds = [], tuple(bad)
  for kind in kinds:
    update, _, info = run(poison(x, row, kind), mask)
    flat, weights = _raveled(update), _weights(info)
    if not (np.all(np.isfinite(flat)) and np.all(np.isfinite(weights))):
      problems.append(f'{kind}: {int(np.sum(~np.isfinite(flat)))} of '
                      f'{flat.size} update entries and '
                      f'{int(np.sum(~np.isfinite(weights)))} weights not '
                      'finite')
  if problems:
    return CheckResult('finite', False, f'client {row} bad: '
                       + '; '.join(problems))
  return CheckResult('finite', True, f'finite with client {row} sending '
                     f'{", ".join(kinds)}')


def check_jit(eager: Runner, jitted: Runner, x: np.ndarray,
              mask: np.ndarray, *, atol: float = 1e-5,
              rtol: float = 1e-5) -> CheckResult:
  """The jitted rule agrees with the rule run op by op: update, state and
  info, leaf by leaf.

  Args:
    eager: a runner that calls the rule without jit.
    jitted: a runner that calls it under jax.jit.
    x: float32[K, D] client rows.
    mask: bool[K].
    atol: absolute tolerance.
    rtol: relative tolerance.

  Returns:
    CheckResult('jit', passed, detail).
  """
  got, want = jitted(x, mask), eager(x, mask)
  problems = []
  for part, a, b in zip(('update', 'state', 'info'), got, want):
    problems += [f'{part}{m}' for m in _tree_mismatches(a, b, atol, rtol)]
  if problems:
    return CheckResult('jit', False, 'jit differs from eager: '
                       + '; '.join(problems) + f' ({_tolerance(atol, rtol)})')
  return CheckResult('jit', True, 'update, state and info agree within '
                     f'{atol:g} + {rtol:g} * |value|')


def check_retrace(run: Runner, rounds: Sequence[tuple[np.ndarray, np.ndarray]],
                  traces: Callable[[], int]) -> CheckResult:
  """The jitted aggregate is traced no further after its first round.

  Runs one round per (x, mask) in `rounds`, round r with key
  jax.random.key(r) and the state the previous round returned (the initial
  state first), as a training run does.

  Args:
    run: a runner whose aggregate is jitted.
    rounds: at least two (x, mask) pairs of the same shapes.
    traces: returns how often the jitted function has been traced so far
      (e.g. the `.traces` of a count_traces wrapper).

  Returns:
    CheckResult('retrace', passed, detail).
  """
  if len(rounds) < 2:
    raise ValueError('check_retrace needs at least two rounds')
  state, after_first = None, None
  for r, (x, mask) in enumerate(rounds):
    _, state, _ = run(x, mask, state=state, key=jax.random.key(r))
    if r == 0:
      after_first = traces()
  more = traces() - after_first
  if more:
    return CheckResult('retrace', False, f'traced {more} more time(s) in '
                       f'rounds 2..{len(rounds)} of the same shapes')
  return CheckResult('retrace', True, f'no new trace over {len(rounds)} '
                     'rounds of new values, masks, keys and state')


def check_identical(run: Runner, x: np.ndarray, mask: np.ndarray,
                    u: np.ndarray, *, atol: float = 1e-5,
                    rtol: float = 1e-5) -> CheckResult:
  """When every real client sends u, the update is u.

  Args:
    run: a runner.
    x: float32[K, D]; the real rows are replaced by u, masked rows kept.
    mask: bool[K].
    u: float32[D].
    atol: absolute tolerance.
    rtol: relative tolerance.

  Returns:
    CheckResult('identical', passed, detail).
  """
  mask = np.asarray(mask, bool)
  x = np.array(x, np.float32)
  x[mask] = np.asarray(u, np.float32)
  out, _, _ = run(x, mask)
  bad, diff = _max_violation(_raveled(out), np.asarray(u, np.float64), atol,
                             rtol)
  detail = (f'max |update - u| {diff:.3g} with {int(mask.sum())} real '
            'clients all sending u')
  if bad:
    return CheckResult('identical', False,
                       f'{detail} ({_tolerance(atol, rtol)})')
  return CheckResult('identical', True, detail)


# ----------------------------------------------------------------------------
# check_rule.
# ----------------------------------------------------------------------------


def _default_params() -> dict[str, np.ndarray]:
  return {'bias': np.zeros((3,), np.float32),
          'kernel': np.zeros((2, 2), np.float32)}


def _build(rule: Any, num_byzantine: int) -> Aggregator:
  if isinstance(rule, str):
    return aggregators.get_aggregator(rule, num_byzantine=num_byzantine)
  if not isinstance(rule, Aggregator) and callable(rule):
    try:
      parameters = inspect.signature(rule).parameters.values()
    except (TypeError, ValueError):
      parameters = ()
    takes_f = any(p.name == 'num_byzantine' or p.kind is p.VAR_KEYWORD
                  for p in parameters)
    rule = rule(num_byzantine=num_byzantine) if takes_f else rule()
  if isinstance(rule, Aggregator):
    return rule
  if hasattr(rule, 'init') and hasattr(rule, 'aggregate'):
    return Aggregator(rule.init, rule.aggregate,
                      tuple(getattr(rule, 'reads', ())))
  raise TypeError('rule must be an Aggregator, a registry name or a factory '
                  f'returning an Aggregator; got {rule!r}')


def _rule_name(rule: Any, agg: Aggregator) -> str:
  if isinstance(rule, str):
    return rule
  fn = rule if not isinstance(rule, Aggregator) else agg.aggregate
  fn = getattr(fn, 'func', fn)                       # functools.partial
  name = getattr(fn, '__qualname__', None) or type(fn).__name__
  return name.split('.<locals>')[0]


class _Harness:
  """check_rule's runners: client rows -> the stacked tree of `params`,
  per-client extras indexed by slot, one jitted and counted aggregate."""

  def __init__(self, agg: Aggregator, params: Any, num_clients: int,
               extras: Mapping[str, Any], rng: np.random.Generator,
               key: jax.Array):
    unknown = sorted(set(agg.reads) - set(EXTRAS) - set(extras))
    made = [n for n in agg.reads if n not in extras]
    cannot = sorted(set(made) & {'retrain'})
    if unknown or cannot:
      raise ValueError(f'the rule reads {unknown + cannot}, which check_rule '
                       'cannot make up: pass them in `extras`')
    self.agg, self.key = agg, key
    self.params = jax.tree.map(jnp.asarray, params)
    self.like = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(np.shape(p), np.asarray(p).dtype),
        params)
    c = num_clients
    made_up = {'weights': rng.uniform(1.0, 2.0, c).astype(np.float32),
               'ids': np.arange(c, dtype=np.int32),
               'staleness': np.zeros(c, np.int32),
               'scores': rng.uniform(0.0, 3.0, c).astype(np.float32),
               'losses': rng.uniform(0.0, 2.0, c).astype(np.float32)}
    self.per_client = {n: made_up[n] for n in made if n in made_up}
    self.fixed = dict(extras)
    if 'coverage' in made:
      self.fixed['coverage'] = None
    if 'params' in made:
      self.fixed['params'] = self.params

    def aggregate(updates, mask, state, key, per_client):
      return call_aggregator(agg, updates, mask, state, key, **per_client,
                             **self.fixed)

    self.eager_aggregate = aggregate
    self.counted = count_traces(aggregate)
    self.jit_aggregate = jax.jit(self.counted)

  def stack(self, x: np.ndarray) -> Any:
    leaves, treedef = jax.tree.flatten(self.like)
    out, start = [], 0
    for leaf in leaves:
      size = int(np.prod(leaf.shape, dtype=np.int64))
      out.append(jnp.asarray(x[:, start:start + size].reshape(
          (len(x),) + tuple(leaf.shape)), leaf.dtype))
      start += size
    return jax.tree.unflatten(treedef, out)

  def _call(self, fn, x, mask, slots, state, key):
    x = np.asarray(x, np.float32)
    slots = np.arange(len(x)) if slots is None else np.asarray(slots)
    per_client = {n: jnp.asarray(v[slots]) for n, v in self.per_client.items()}
    state = self.agg.init(self.params) if state is None else state
    key = self.key if key is None else key
    return fn(self.stack(x), jnp.asarray(mask, bool), state, key, per_client)

  def jitted(self, x, mask, *, slots=None, state=None, key=None):
    return self._call(self.jit_aggregate, x, mask, slots, state, key)

  def eager(self, x, mask, *, slots=None, state=None, key=None):
    return self._call(self.eager_aggregate, x, mask, slots, state, key)


def _guarded(name: str, check: Callable[[], CheckResult]) -> CheckResult:
  try:
    return check()
  except Exception as err:  # pylint: disable=broad-except
    message = ' '.join(str(err).split())
    if len(message) > 400:
      message = message[:400] + '...'
    return CheckResult(name, False, f'raised {type(err).__name__}: {message}')


def check_rule(rule: Any, *, num_clients: int = 5, num_byzantine: int = 1,
               permutation_invariant: bool = True, seed: int = 0,
               params: Any = None, extras: Mapping[str, Any] | None = None,
               skip: Iterable[str] = (), atol: float = 1e-5,
               rtol: float = 1e-5, name: str | None = None,
               raise_on_failure: bool = True) -> ConformanceReport:
  """Runs the conformance checks (CHECKS) on an aggregation rule.

  The rule aggregates num_clients slots of a tiny pytree (by default
  {'bias': [3], 'kernel': [2, 2]}, float32), one slot masked out and
  holding NaN. It is jitted once per slot count (num_clients, and
  num_clients + 4 for `masked`) and also run op by op for `jit`. See the
  module docstring for what each check guarantees.

  Extras the rule declares in `reads` are made up per client (weights in
  [1, 2), ids 0..C-1, staleness 0 as in a synchronous round, scores in
  [0, 3), losses in [0, 2)), travel with
  their clients when the checks permute or insert slots, and `coverage` is
  None and `params` the `params` tree. Extras check_rule cannot make up
  (`retrain`) go in `extras`.

  A rule may fail a check by design; name it in `skip` (say why next to the
  call). E.g. a rule that keeps per-slot history is not permutation
  invariant (`skip=('permutation',)`, or permutation_invariant=False), and
  a rule that weighs identical clients 0 as sybils fails `identical`.

  Args:
    rule: an Aggregator; a factory returning one (called with
      num_byzantine= when it takes that keyword, else with no argument;
      use functools.partial for other settings); or a name in
      fedrobust.aggregators.AGGREGATORS.
    num_clients: C, the slots per round (num_clients - 1 real in most
      checks). At least 3.
    num_byzantine: f, passed to a factory. With f = 0 the `finite` check is
      skipped: such a rule promises nothing against a bad client.
    permutation_invariant: False skips `permutation`.
    seed: seeds the client rows, the per-client extras and the key.
    params: one client's tree (arrays), the shapes and dtypes the rule
      aggregates and its `init` argument; values are its `params` extra.
    extras: extras passed unchanged to every call (no client axis), added
      to or replacing the made-up ones.
    skip: names from CHECKS not to run; they are reported as skipped.
    atol: absolute tolerance of every comparison.
    rtol: relative tolerance of the update comparisons.
    name: the rule's name in messages; by default the registry name or the
      factory's (or aggregate function's) name.
    raise_on_failure: when True, a failed check raises.

  Returns:
    The ConformanceReport, one CheckResult per check of CHECKS.

  Raises:
    AssertionError: when a check fails and raise_on_failure is True; the
      message names the rule, the failed checks and what was measured.
    ValueError: an unknown name in `skip`, fewer than 3 clients, or an extra
      the rule reads that check_rule cannot make up.
  """
  skip = tuple(skip)
  unknown = sorted(set(skip) - set(CHECKS))
  if unknown:
    raise ValueError(f'skip names unknown checks {unknown}; the checks are '
                     f'{CHECKS}')
  if num_clients < 3:
    raise ValueError(f'num_clients must be >= 3, got {num_clients}')
  agg = _build(rule, num_byzantine)
  name = name or _rule_name(rule, agg)
  rng = np.random.default_rng(seed)
  params = _default_params() if params is None else params
  harness = _Harness(agg, params, num_clients, dict(extras or {}), rng,
                     jax.random.key(seed))
  c = num_clients
  d = sum(int(np.prod(np.shape(p), dtype=np.int64))
          for p in jax.tree.leaves(params))

  def rows(absent: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(size=(c, d)).astype(np.float32)
    mask = np.ones(c, bool)
    if absent is not None:
      x[absent], mask[absent] = np.nan, False
    return x, mask

  x, mask = rows(absent=2 % c)
  all_real = rows()[0]
  perm = rng.permutation(c)
  if np.array_equal(perm, np.arange(c)):
    perm = perm[::-1]
  rounds = [rows(absent=r % c) for r in range(3)]
  u = rng.normal(size=d).astype(np.float32)
  tol = dict(atol=atol, rtol=rtol)
  checks = {
      'shapes': lambda: check_shapes(harness.jitted, x, mask, harness.like),
      'masked': lambda: check_masked(harness.jitted, all_real, **tol),
      'permutation': lambda: check_permutation(harness.jitted, x, mask, perm,
                                               **tol),
      'finite': lambda: check_finite(harness.jitted, x, mask),
      'jit': lambda: check_jit(harness.eager, harness.jitted, x, mask, **tol),
      'retrace': lambda: check_retrace(harness.jitted, rounds,
                                       lambda: harness.counted.traces),
      'identical': lambda: check_identical(harness.jitted, x, mask, u, **tol),
  }
  why_not = {name_: 'skipped by the caller' for name_ in skip}
  if not permutation_invariant:
    why_not.setdefault('permutation', 'the rule does not claim permutation '
                       'invariance')
  if num_byzantine == 0:
    why_not.setdefault('finite', 'num_byzantine=0: the rule promises '
                       'nothing against a bad client')
  results = tuple(
      CheckResult(check, None, why_not[check]) if check in why_not
      else _guarded(check, checks[check]) for check in CHECKS)
  report = ConformanceReport(name, results)
  if raise_on_failure and not report.passed:
    raise AssertionError(str(report))
  return report


__all__ = ['BAD_VALUES', 'CHECKS', 'CheckResult', 'ConformanceReport',
           'MASKED_FILL', 'Runner', 'check_finite', 'check_identical',
           'check_jit', 'check_masked', 'check_permutation',
           'check_retrace', 'check_rule', 'check_shapes', 'count_traces',
           'poison']
