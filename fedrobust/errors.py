"""The library's error for bad settings: it names the argument, not a flag.

Library code knows argument names (`num_byzantine`, `clients_per_round`,
`lam`), never command-line flags. `experiments/` catches `SettingError` and
reports it under the flag that set the argument (see
`experiments/config.py::describe_error`).
"""

from __future__ import annotations


class SettingError(ValueError):
  """A bad value for one named argument of a library factory.

  Attributes:
    argument: the argument's name as the factory spells it.
    component: what was being built ('aggregator krum', 'method sdfc', ...);
      '' when the argument is a plain engine or data setting.
  """

  def __init__(self, argument: str, message: str, *, component: str = ''):
    self.argument = argument
    self.component = component
    self.message = message
    where = f' ({component})' if component else ''
    super().__init__(f'{argument}{where}: {message}')


def check_choice(argument: str, value, choices, *, component: str = ''):
  """Returns value if it is one of `choices`, else raises SettingError."""
  if value not in choices:
    raise SettingError(argument, f'got {value!r}; expected one of '
                       f'{sorted(choices)}', component=component)
  return value


def check_finite_range(argument: str, value: float, *, low: float | None = None,
                       high: float | None = None, low_open: bool = False,
                       high_open: bool = False, component: str = '') -> float:
  """A finite float in [low, high] (bounds optional, optionally open)."""
  import math  # pylint: disable=g-import-not-at-top
  if isinstance(value, bool) or not isinstance(value, (int, float)) or (
      not math.isfinite(value)):
    raise SettingError(argument, f'must be a finite number, got {value!r}',
                       component=component)
  bad_low = low is not None and (value <= low if low_open else value < low)
  bad_high = high is not None and (value >= high if high_open else
                                   value > high)
  if bad_low or bad_high:
    lo = '(' if low_open else '['
    hi = ')' if high_open else ']'
    interval = (f'{lo}{"-inf" if low is None else low}, '
                f'{"inf" if high is None else high}{hi}')
    raise SettingError(argument, f'must be in {interval}, got {value}',
                       component=component)
  return float(value)


def check_registration(kind: str, name: str, registry, *, replace: bool,
                       provides=(), provided=()) -> None:
  """Checks a registration: `name` is a plain name (letters, digits and
  underscores), new to `registry` unless `replace`, and every fact in
  `provides` is one of `provided`.

  Raises:
    ValueError: naming the component kind, the name and what is wrong.
  """
  if not (name and name.replace('_', '').isalnum() and name.isascii()):
    raise ValueError(f'{kind} name {name!r} must be letters, digits and '
                     'underscores')
  if name in registry and not replace:
    raise ValueError(f'{kind} {name!r} is registered already; pass '
                     'replace=True to replace it')
  for what in provides:
    if what not in provided:
      raise ValueError(f'{kind} {name!r}: provides={what!r}; expected '
                       f'names from {tuple(provided)}')

