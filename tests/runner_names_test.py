"""The runner holds no method, rule or attack names: a scan of
experiments/*.py for registry keys in comparisons, membership tests,
name tuples and dict keys. A component's needs come from its registry
entry; a name compared in the runner is a need that was not declared.

Aside, as the architecture allows: the paper-results join of the sweeps
(experiments/reference.py maps our attack names to the papers'), the flag
presets and sweep grids (not Python), and the analysis tools of one
method each (experiments/analysis/)."""

import ast
import glob
import os

import fedrobust

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASIDE = {'reference.py'}


def registry_names() -> set[str]:
  return (set(fedrobust.AGGREGATORS) | set(fedrobust.ATTACKS) |
          set(fedrobust.METHODS))


def names_in(source: str, names: set[str]) -> list[tuple[int, str]]:
  """(line, name) of every registry name compared, tested for membership,
  listed in a tuple/list/set assignment or used as a dict key."""
  found = []
  for node in ast.walk(ast.parse(source)):
    consts = []
    if isinstance(node, ast.Compare):
      for x in [node.left] + node.comparators:
        if isinstance(x, (ast.Tuple, ast.List, ast.Set)):
          consts += x.elts
        else:
          consts.append(x)
    elif isinstance(node, ast.Dict):
      consts += [k for k in node.keys if k is not None]
    elif isinstance(node, ast.Assign) and isinstance(
        node.value, (ast.Tuple, ast.List, ast.Set)):
      consts += node.value.elts
    found += [(node.lineno, c.value) for c in consts
              if isinstance(c, ast.Constant) and c.value in names]
  return found


def test_the_scan_finds_a_name():
  source = ("if config['aggregator'] == 'auror':\n  pass\n"
            "RULES = ('fltrust', 'x')\nd = {'lie': 1}\n"
            "ok = name in ('krum', 'bulyan')\n")
  assert sorted(names_in(source, registry_names())) == [
      (1, 'auror'), (3, 'fltrust'), (4, 'lie'), (5, 'bulyan'), (5, 'krum')]


def test_the_runner_names_no_component():
  names = registry_names()
  offenders = {}
  for path in sorted(glob.glob(os.path.join(ROOT, 'experiments', '*.py'))):
    if os.path.basename(path) in ASIDE:
      continue
    with open(path) as f:
      hits = names_in(f.read(), names)
    if hits:
      offenders[os.path.relpath(path, ROOT)] = hits
  assert not offenders, offenders
