"""Your own rules, attacks and methods, taken by name on the command line.

  python experiments/main.py --plugins=my_rules --aggregator=my_rule ...

`--plugins=mod1,mod2` imports those Python modules (importable from the
current directory or PYTHONPATH) before the flags are defined, so that
what they register (`fedrobust.register_rule`, `register_attack`,
`register_method`) is a valid choice of --aggregator, --attack and
--method. `sweep.py` forwards the flag to every cell.
"""

from __future__ import annotations

import importlib
import os
import sys

FLAG = '--plugins'


def requested(argv: list[str]) -> list[str]:
  """The modules named by --plugins=... in argv (also inside a
  --base_flags=... value)."""
  out = []
  for arg in argv:
    for part in arg.split():
      for prefix in (FLAG + '=', '--base_flags=' + FLAG + '='):
        if part.startswith(prefix):
          out += [m for m in part[len(prefix):].split(',') if m]
  return out


def load(argv: list[str]) -> list[str]:
  """Imports the --plugins modules of argv; returns their names.

  Raises:
    SystemExit: a module cannot be imported (the message names it).
  """
  if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())
  names = requested(argv)
  for name in names:
    try:
      importlib.import_module(name)
    except ImportError as err:
      raise SystemExit(f'error: --plugins={name}: cannot import it ({err})'
                       ) from None
  return names
