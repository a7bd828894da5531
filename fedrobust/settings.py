"""Declarations of hyperparameters, made once by the component that owns
them.

A method (or any component with a registry) lists its settings as
`Setting`s. Each becomes a config key (`fedrobust/config.py`) and, on the
command line, a flag; the value reaches the factory under `arg`, and the
runner maps errors about `arg` back to the flag. The library itself never
spells a flag.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Setting(NamedTuple):
  """One hyperparameter.

  name: the public name; a method setting becomes the flag
    --<method>_<name> (e.g. sdfc's 'lambda' -> --sdfc_lambda), a `shared`
    one the flag --<name>, which several methods may declare alike.
  default: its default value; its Python type (bool, int, float, str) is
    the setting's type. A tuple default is a comma-separated list of the
    element type.
  help: one line for --help.
  choices: allowed values for a str setting (an enum flag).
  arg: the factory's keyword if it differs from `name` ('lambda' is a
    Python keyword, so SDFC's factory takes `lam`).
  shared: see `name`.
  execution: how a result is computed, not what it is (e.g. an SVD or a
    Gram route to the same singular values): equal results within float
    tolerance, so a resumed run may change it.
  """
  name: str
  default: Any
  help: str
  choices: tuple[str, ...] = ()
  arg: str = ''
  shared: bool = False
  execution: bool = False

  @property
  def kwarg(self) -> str:
    return self.arg or self.name


def defaults(settings: tuple[Setting, ...]) -> dict[str, Any]:
  """{kwarg: default} of `settings` (what a factory gets by default)."""
  return {s.kwarg: s.default for s in settings}
