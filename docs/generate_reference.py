"""Writes docs/reference.md from the registries and `Setting` declarations.

  python docs/generate_reference.py           # rewrite docs/reference.md
  python docs/generate_reference.py --check   # exit 1 if it is stale

Everything in the reference comes from the code: the METHODS entries (their
summaries and settings), the AGGREGATORS, PRE_AGGREGATORS, ATTACKS, MODELS,
DATASETS and PARTITIONERS registries (each entry's docstring, else the
comment above it in the registry's literal, else the docstring of the
function it returns a call of), the core settings of fedrobust/config.py
(grouped by the comments in CORE) and the literal flags experiments/main.py
defines besides them (--distributed). `render()` returns the text;
tests/docs_reference_test.py fails when the checked-in file differs.

The output is deterministic: entries sorted by name, no timestamps, no
memory addresses, no absolute paths; one table row per line, at most
MAX_ROW characters (long help is cut at a sentence end, marked with an
ellipsis; --helpfull prints it whole).
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import inspect
import os
import re
import sys
import textwrap
import types
from typing import Any, Iterable, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as a script: docs/ is sys.path[0]
  sys.path.insert(0, ROOT)

# pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import config as config_lib
from fedrobust import config as fedrobust_config
from fedrobust import aggregators as aggregators_lib
from fedrobust import attacks as attacks_lib
from fedrobust import models as models_lib
from fedrobust.aggregators import pre as pre_lib
from fedrobust.data import partition as partition_lib
from fedrobust.data import sources as sources_lib
from fedrobust.methods import METHODS
from fedrobust.settings import Setting, defaults

OUTPUT = os.path.join('docs', 'reference.md')
COMMAND = 'python docs/generate_reference.py'
MAX_ROW = 300          # characters per table row
MAX_DESCRIPTION = 200  # characters of a registry entry's description
ELLIPSIS = '\u2026'


# ---------------------------------------------------------------------------
# Text helpers.
# ---------------------------------------------------------------------------

_ABBREVIATIONS = ('al.', 'e.g.', 'i.e.', 'eq.', 'eqs.', 'sec.', 'alg.',
                  'app.', 'fig.', 'vs.', 'cf.', 'tab.', 'no.', 'approx.',
                  'resp.', 'etc.')
# A sentence ends at . ! or ? (and any closing quotes or brackets) followed
# by white space and anything but a lower-case letter.
_SENTENCE_END = re.compile(r'(?<=[.!?])["\')\]]*\s+(?=[^a-z\s])')


def sentences(text: str) -> list[str]:
  """`text` (white space collapsed) split into sentences."""
  text = ' '.join(text.split())
  out: list[str] = []
  start = 0
  for match in _SENTENCE_END.finditer(text):
    piece = text[start:match.start()]
    words = piece.split()
    if words and words[-1].lower().lstrip('(') in _ABBREVIATIONS:
      continue      # 'et al. 2017', 'Eq. 9': not a sentence end
    out.append(text[start:match.end()].strip())
    start = match.end()
  if text[start:].strip():
    out.append(text[start:].strip())
  return out


def shorten(text: str, budget: int) -> str:
  """`text` in at most `budget` characters: whole sentences while they fit,
  else the words that fit; an ellipsis marks a cut."""
  text = ' '.join(text.split())
  if len(text) <= budget:
    return text
  kept = ''
  for sentence in sentences(text):
    candidate = f'{kept} {sentence}'.strip()
    if len(candidate) + 2 > budget:
      break
    kept = candidate
  if kept:
    return f'{kept} {ELLIPSIS}'
  words = ''
  for word in text.split():
    candidate = f'{words} {word}'.strip()
    if len(candidate) + 1 > budget:
      break
    words = candidate
  return (words.rstrip(',;:') or text[:max(budget - 1, 0)]) + ELLIPSIS


def prose(text: str) -> str:
  """Plain text as a table cell: '|' escaped, and what Markdown would take
  for markup (a '<' opening an HTML tag, '_' or '*' between punctuation,
  a backslash) escaped."""
  text = ' '.join(text.split())
  text = text.replace('\\', '\\\\').replace('|', '\\|')
  text = text.replace('<', '&lt;')
  # '_' and '*' inside a word (num_clients) are never emphasis; elsewhere
  # they may be.
  text = re.sub(r'(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])', r'\\_', text)
  text = re.sub(r'\*(?! )|(?<! )\*', r'\\*', text)
  return text


def paragraph(text: str) -> list[str]:
  """Prose outside tables, wrapped at 100 columns."""
  return textwrap.wrap(text, 100, break_long_words=False,
                       break_on_hyphens=False) + ['']


def _article(noun: str) -> str:
  return ('an ' if noun[:1].lower() in 'aeiou' else 'a ') + noun


def code(text: str) -> str:
  """`text` as a code span in a table cell ('|' escaped)."""
  text = str(text).replace('|', '\\|')
  fence = '``' if '`' in text else '`'
  pad = ' ' if fence == '``' else ''
  return f'{fence}{pad}{text}{pad}{fence}'


def value_text(value: Any) -> str:
  """A deterministic spelling of a default or bound value."""
  if isinstance(value, (bool, int, float, str, type(None))):
    return repr(value)
  if isinstance(value, (tuple, list)):
    inner = ', '.join(value_text(v) for v in value)
    return f'({inner},)' if isinstance(value, tuple) and len(value) == 1 \
        else (f'({inner})' if isinstance(value, tuple) else f'[{inner}]')
  return type(value).__name__ + '(...)'


def default_cell(setting: Setting) -> str:
  """The flag's default as typed on the command line."""
  value = setting.default
  if value is None:
    return '(unset)'
  if isinstance(value, bool):
    return code('true' if value else 'false')
  if isinstance(value, (tuple, list)):
    return code(','.join(str(v) for v in value))
  if isinstance(value, str) and not value:
    return code("''")
  return code(value)


def table(header: tuple[str, ...], rows: Iterable[tuple[str, ...]],
          flexible: int) -> list[str]:
  """A Markdown table; column `flexible` of each row (plain text, not yet
  escaped) is shortened so that the row fits in MAX_ROW characters."""
  lines = ['| ' + ' | '.join(header) + ' |',
           '|' + '|'.join('---' for _ in header) + '|']
  for row in rows:
    cells = list(row)
    fixed = '| ' + ' | '.join(c if i != flexible else '' for i, c in
                              enumerate(cells)) + ' |'
    budget = MAX_ROW - len(fixed)
    text = cells[flexible]
    limit = budget
    cell = prose(text)
    while len(cell) > budget and limit > 1:
      # Escaping lengthens the text: cut the plain text shorter until the
      # escaped cell fits.
      cell = prose(shorten(text, limit))
      limit -= max(len(cell) - budget, 1)
    cells[flexible] = cell
    lines.append('| ' + ' | '.join(cells) + ' |')
  return lines


# ---------------------------------------------------------------------------
# What a registry entry is and what it does.
# ---------------------------------------------------------------------------


def _own_doc(obj: Any) -> str:
  """obj's own docstring ('' when it has none or only inherits one)."""
  if isinstance(obj, type):
    doc = obj.__dict__.get('__doc__') or ''
    if doc.startswith(obj.__name__ + '('):   # a dataclass's generated doc
      return ''
  elif isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)):
    doc = obj.__doc__ or ''
  else:
    return ''
  return inspect.cleandoc(doc)


def _first_sentence(doc: str) -> str:
  paragraph = doc.strip().split('\n\n')[0]
  found = sentences(paragraph)
  return found[0] if found else ''


def _unwrap(obj: Any) -> tuple[Any, dict[str, Any]]:
  """(the function behind a functools.partial, its bound keywords)."""
  bound: dict[str, Any] = {}
  while isinstance(obj, functools.partial):
    bound = {**dict(obj.keywords), **bound}
    obj = obj.func
  return obj, bound


def _returned_callee(fn: Any) -> Any:
  """What `fn` returns a call of, when its source says so plainly
  (`return load_idx(...)`, `return text.vader_dataset(...)`); else None."""
  if not isinstance(fn, types.FunctionType):
    return None
  try:
    tree = ast.parse(inspect.cleandoc('\n' + inspect.getsource(fn)))
  except (OSError, TypeError, SyntaxError):
    return None
  body = tree.body[0].body if tree.body and isinstance(
      tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else []
  calls = [n.value for n in body if isinstance(n, ast.Return) and
           isinstance(n.value, ast.Call)]
  if len(calls) != 1:
    return None
  parts, node = [], calls[0].func
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if not isinstance(node, ast.Name):
    return None
  root = node.id
  if root in fn.__globals__:
    obj = fn.__globals__[root]
  else:    # a name the function imports itself (`from a.b import text`)
    obj = None
    for stmt in ast.walk(tree):
      if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
        for alias in stmt.names:
          if (alias.asname or alias.name) == root:
            try:
              obj = importlib.import_module(f'{stmt.module}.{alias.name}')
            except ImportError:
              obj = getattr(importlib.import_module(stmt.module), alias.name,
                            None)
    if obj is None:
      return None
  for attr in reversed(parts):
    obj = getattr(obj, attr, None)
  return obj


def describe(obj: Any, comment: str = '') -> str:
  """One sentence on what a registry entry does: its docstring's first
  sentence (the module's when the docstring points there), else the
  comment above it in the registry, else the docstring of the function
  it returns a call of."""
  fn, _ = _unwrap(obj)
  text = _first_sentence(_own_doc(fn))
  if re.search(r'see the module docstring', text, re.I):
    module = sys.modules.get(getattr(fn, '__module__', '') or '')
    text = _first_sentence(inspect.cleandoc(getattr(module, '__doc__', '')
                                            or '')) or text
  if not text and comment:
    text = comment
  if not text:
    callee = _returned_callee(fn)
    if callee is not None:
      text = _first_sentence(_own_doc(_unwrap(callee)[0]))
  return shorten(text, MAX_DESCRIPTION) if text else '-'


def defined_as(obj: Any, home: types.ModuleType) -> str:
  """Where an entry's implementation lives, as a dotted name (with the
  keywords a partial binds, the values a closure captured)."""
  fn, bound = _unwrap(obj)
  module = getattr(fn, '__module__', None)
  qualname = getattr(fn, '__qualname__', None)
  if module is None or qualname is None:       # a marker object
    names = sorted(n for n, v in vars(home).items() if v is obj)
    return f'{home.__name__}.{names[0]}' if names else type(obj).__name__
  args = dict(bound)
  if '.<locals>.' in qualname and isinstance(fn, types.FunctionType):
    qualname = qualname.split('.<locals>.')[0]     # the factory
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
      try:
        args[name] = cell.cell_contents
      except ValueError:       # an empty cell
        continue
  text = f'{module}.{qualname}'
  if args:
    text += '(' + ', '.join(f'{k}={value_text(v)}'
                            for k, v in sorted(args.items())) + ')'
  return text


def _comment_above(lines: list[str], lineno: int) -> str:
  """The comment lines directly above source line `lineno` (1-based)."""
  found: list[str] = []
  i = lineno - 2
  while i >= 0 and lines[i].strip().startswith('#'):
    found.append(lines[i].strip().lstrip('#').strip())
    i -= 1
  return ' '.join(reversed(found))


def _module_ast(module: types.ModuleType) -> tuple[ast.Module, list[str]]:
  source = inspect.getsource(module)
  return ast.parse(source), source.splitlines()


def _assigned(tree: ast.Module, name: str) -> ast.expr | None:
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == name for t in node.targets):
      return node.value
    if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and node.target.id == name):
      return node.value
  return None


def registry_comments(module: types.ModuleType, name: str) -> dict[str, str]:
  """{key: the comment above it} of the dict literal `name` in `module`
  (following `**OTHER` into literals of the same module)."""
  tree, lines = _module_ast(module)
  out: dict[str, str] = {}

  def visit(var: str, seen: frozenset[str]) -> None:
    node = _assigned(tree, var)
    if not isinstance(node, ast.Dict):
      return
    for key, value in zip(node.keys, node.values):
      if key is None and isinstance(value, ast.Name) and value.id not in seen:
        visit(value.id, seen | {value.id})
      elif isinstance(key, ast.Constant) and isinstance(key.value, str):
        comment = _comment_above(lines, key.lineno)
        if comment:
          out.setdefault(key.value, comment)

  visit(name, frozenset({name}))
  return out


# ---------------------------------------------------------------------------
# The sections.
# ---------------------------------------------------------------------------


class Entry(NamedTuple):
  name: str
  description: str
  defined_as: str
  aliases: tuple[str, ...] = ()
  kind: str = ''


class Registry(NamedTuple):
  title: str          # the section heading
  anchor: str         # its Markdown anchor
  noun: str           # what one entry is called
  entries: dict[str, Any]
  home: types.ModuleType
  comment_sources: tuple[tuple[types.ModuleType, str], ...]
  kinds: tuple[tuple[str, dict[str, Any]], ...] = ()
  intro: str = ''


def registries() -> tuple[Registry, ...]:
  """The registries the reference lists, in section order."""
  try:
    server_aided = importlib.import_module(
        'fedrobust.aggregators.server_aided')
  except ModuleNotFoundError:
    server_aided = None
  rule_sources = ((aggregators_lib, 'AGGREGATORS'),) + (
      ((server_aided, 'SERVER_AIDED'),) if server_aided else ())
  return (
      Registry('Rules', 'rules', 'rule', aggregators_lib.AGGREGATORS,
               aggregators_lib, rule_sources,
               intro='Server aggregation rules (`--aggregator`, settings '
               'by `--aggregator_kwargs`; registry '
               '`fedrobust.aggregators.AGGREGATORS`).'),
      Registry('Pre-aggregators', 'pre-aggregators', 'pre-aggregator',
               pre_lib.PRE_AGGREGATORS, pre_lib,
               ((pre_lib, 'PRE_AGGREGATORS'),),
               intro='Steps run before any rule (`--pre_aggregator`, '
               'settings by `--pre_aggregator_kwargs`; registry '
               '`fedrobust.aggregators.PRE_AGGREGATORS`).'),
      Registry('Attacks', 'attacks', 'attack', attacks_lib.ATTACKS,
               attacks_lib,
               ((attacks_lib, 'MODEL_ATTACKS'), (attacks_lib, 'DATA_ATTACKS'),
                (attacks_lib, 'STATEFUL_ATTACKS')),
               kinds=(('model', attacks_lib.MODEL_ATTACKS),
                      ('data', attacks_lib.DATA_ATTACKS),
                      ('stateful', attacks_lib.STATEFUL_ATTACKS)),
               intro='Attacks run by the malicious clients (`--attack`, '
               'settings by `--attack_kwargs`; a model attack may also be '
               'stacked on a data attack with `--model_attack`; registry '
               '`fedrobust.attacks.ATTACKS`). Kind: model (poisons the '
               'updates), data (poisons local training), stateful (a model '
               'attack that keeps state across rounds).'),
      Registry('Models', 'models', 'model', models_lib.MODELS, models_lib,
               ((models_lib, 'MODELS'),),
               intro='Architectures (`--model`, or `--cohorts`; registry '
               '`fedrobust.models.MODELS`).'),
      Registry('Data sets', 'data-sets', 'data set', sources_lib.DATASETS,
               sources_lib, ((sources_lib, 'DATASETS'),),
               intro='Data sets (`--dataset`, read from `--data_dir`; '
               'registry `fedrobust.data.DATASETS`).'),
      Registry('Partitioners', 'partitioners', 'partitioner',
               partition_lib.PARTITIONERS, partition_lib,
               ((partition_lib, 'PARTITIONERS'),),
               intro='How the training data is split over the clients '
               '(`--partition`; registry `fedrobust.data.PARTITIONERS`).'),
  )


def registry_entries(registry: Registry) -> list[Entry]:
  """The registry's entries, sorted by name; names bound to the same
  object list each other as aliases."""
  comments: dict[str, str] = {}
  for module, var in registry.comment_sources:
    for key, text in registry_comments(module, var).items():
      comments.setdefault(key, text)
  out = []
  for name in sorted(registry.entries):
    obj = registry.entries[name]
    aliases = tuple(sorted(n for n, o in registry.entries.items()
                           if o is obj and n != name))
    kind = ', '.join(k for k, members in registry.kinds if name in members)
    out.append(Entry(name, describe(obj, comments.get(name, '')),
                     defined_as(obj, registry.home), aliases, kind))
  return out


class MethodEntry(NamedTuple):
  name: str
  summary: str
  default_rule: str
  own_flags: tuple[str, ...]
  shared_flags: tuple[str, ...]
  server_data: tuple[str, ...]
  doc: str           # docs/methods/<name>.md, relative to docs/, or ''


def method_entries() -> list[MethodEntry]:
  out = []
  for name in sorted(METHODS):
    spec = METHODS[name]
    if spec.uses_aggregator:
      try:
        rule = spec.default_aggregator(defaults(spec.settings))
      except Exception:  # pylint: disable=broad-except
        rule = '?'
    else:
      rule = ''
    own = tuple(sorted(config_lib.method_flag(name, s)
                       for s in spec.settings if not s.shared))
    shared = tuple(sorted(s.name for s in spec.settings if s.shared))
    doc = f'methods/{name}.md'
    out.append(MethodEntry(
        name, spec.summary, rule, own, shared, tuple(spec.server_data),
        doc if os.path.exists(os.path.join(ROOT, 'docs', doc)) else ''))
  return out


class Flag(NamedTuple):
  name: str
  setting: Setting
  owner: str           # 'core', a method's name, 'shared' or 'runner'
  group: str           # a subheading inside the owner ('' for none)
  methods: tuple[str, ...] = ()


def _core_groups() -> dict[str, str]:
  """{core setting: the comment heading its block in config.CORE}."""
  tree, lines = _module_ast(fedrobust_config)
  node = _assigned(tree, 'CORE')
  out: dict[str, str] = {}
  group = ''
  for element in getattr(node, 'elts', ()):
    if (isinstance(element, ast.Call) and element.args and
        isinstance(element.args[0], ast.Constant) and
        isinstance(element.args[0].value, str)):
      comment = _comment_above(lines, element.lineno)
      if comment:
        group = comment.rstrip('.')
      out[element.args[0].value] = group
  return out


def _runner_flags() -> list[Setting]:
  """The flags experiments/main.py defines with literal arguments (those
  that are no Setting, such as --distributed), read from its source: the
  module is not imported, importing it defines the absl flags."""
  path = os.path.join(ROOT, 'experiments', 'main.py')
  with open(path, encoding='utf-8') as f:
    tree = ast.parse(f.read())
  out = []
  for node in tree.body:
    call = node.value if isinstance(node, ast.Expr) else None
    if not (isinstance(call, ast.Call) and
            isinstance(call.func, ast.Attribute) and
            call.func.attr.startswith('DEFINE_')):
      continue
    try:
      args = [ast.literal_eval(a) for a in call.args]
      kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except ValueError:
      continue         # not literal (define_flags' loop)
    names = (('name', 'default', 'enum_values', 'help')
             if call.func.attr == 'DEFINE_enum' else
             ('name', 'default', 'help'))
    values = {**dict(zip(names, args)), **kwargs}
    if isinstance(values.get('name'), str):
      out.append(Setting(values['name'], values.get('default'),
                         values.get('help', ''),
                         choices=tuple(values.get('enum_values', ()))))
  return out


def flag_entries() -> list[Flag]:
  """Every flag: core settings, shared method settings, each method's own,
  and the runner's literal flags."""
  groups = _core_groups()
  settings = config_lib.all_settings()
  core = {s.name for s in config_lib.CORE}
  owners = config_lib.method_settings()
  out = []
  for name, setting in settings.items():
    if name in core:
      out.append(Flag(name, setting, 'core', groups.get(name, '')))
    elif owners[name][1].shared:
      declared = tuple(sorted(m for m, spec in METHODS.items()
                              if owners[name][1] in spec.settings))
      out.append(Flag(name, setting, 'shared', '', declared))
    else:
      out.append(Flag(name, setting, owners[name][0], ''))
  for setting in _runner_flags():
    if setting.name not in settings:
      out.append(Flag(setting.name, setting, 'runner', ''))
  return out


# ---------------------------------------------------------------------------
# Rendering.
# ---------------------------------------------------------------------------


def _choices_cell(choices: tuple[str, ...]) -> str:
  """A flag's choices; a registry's whole key set is named by a link."""
  if not choices:
    return ''
  named = [(set(METHODS), 'a [method](#methods)')]
  for registry in registries():
    article, noun = _article(registry.noun).split(' ', 1)
    named.append((set(registry.entries),
                  f'{article} [{noun}](#{registry.anchor})'))
  named.append((set(attacks_lib.MODEL_ATTACKS),
                '[an attack](#attacks) of kind model'))
  rest = set(choices)
  for keys, text in sorted(named, key=lambda kv: -len(kv[0])):
    if len(keys) > 1 and keys <= rest and len(rest - keys) <= 2:
      extra = [c for c in choices if c not in keys]
      return ', '.join([code(c) for c in extra] + [text])
  return ', '.join(code(c) for c in choices)


def _flag_table(flags: list[Flag], with_methods: bool = False) -> list[str]:
  header = ('Flag', 'Default', 'Choices') + (
      ('Methods',) if with_methods else ()) + ('Help',)
  rows = []
  for f in sorted(flags, key=lambda f: f.name):
    row = (code('--' + f.name), default_cell(f.setting),
           _choices_cell(f.setting.choices))
    if with_methods:
      row += (', '.join(f.methods),)
    rows.append(row + (f.setting.help,))
  return table(header, rows, flexible=len(header) - 1)


def _anchor(heading: str) -> str:
  """GitHub's anchor of a heading."""
  text = re.sub(r'[^\w\- ]', '', heading.lower().replace('`', ''))
  return text.replace(' ', '-')


def _method_flags_heading(method: str) -> str:
  return f'Flags of {method}'


def render() -> str:
  """The reference, as docs/reference.md holds it."""
  methods = method_entries()
  regs = registries()
  reg_entries = {r.title: registry_entries(r) for r in regs}
  flags = flag_entries()

  lines = [
      f'<!-- Generated by `{COMMAND}`; do not edit by hand. -->',
      '',
      '# fedrobust reference',
      '',
  ]
  lines += paragraph(
      f'Generated by `{COMMAND}` from the registries and the `Setting` '
      'declarations; do not edit this file by hand: change the code and '
      'rerun the script (`tests/docs_reference_test.py` fails while this '
      'file is stale). Descriptions are the first sentence of each '
      "entry's docstring (or of the registry's comment on it); help cut "
      f'short is marked {ELLIPSIS}, and `python experiments/main.py '
      '--helpfull` prints it whole.')
  sizes = [('Methods', 'methods', len(methods))] + [
      (r.title, r.anchor, len(reg_entries[r.title])) for r in regs] + [
          ('Flags', 'flags', len(flags))]
  lines += paragraph('Sections: ' + ', '.join(
      f'[{title}](#{anchor}) ({n})' for title, anchor, n in sizes) + '.')

  # Methods.
  lines += ['## Methods', '']
  lines += paragraph('Federated methods (`--method`; registry '
            '`fedrobust.methods.METHODS`). Default rule: the aggregator a '
            'run with `--aggregator=auto` uses (none: the method combines '
            'something other than parameter updates). Flags: the '
            "method's own (`--<method>_<name>`) and the shared ones it "
            'declares.')
  rows = []
  for m in methods:
    flag_cells = []
    if m.own_flags:
      flag_cells.append(f'[{len(m.own_flags)} own](#' + _anchor(
          _method_flags_heading(m.name)) + ')')
    flag_cells += [code('--' + s) for s in m.shared_flags]
    name = code(m.name) + (f' ([doc]({m.doc}))' if m.doc else '')
    rule = code(m.default_rule) if m.default_rule else 'none'
    data = ', '.join(m.server_data) or '-'
    rows.append((name, rule, data, ', '.join(flag_cells) or '-', m.summary))
  lines += table(('Method', 'Default rule', 'Server data', 'Flags',
                  'Description'), rows, flexible=4)
  lines.append('')

  # Registries.
  for r in regs:
    lines += [f'## {r.title}', ''] + paragraph(r.intro)
    with_kind = bool(r.kinds)
    rows = []
    for e in reg_entries[r.title]:
      name = code(e.name) + (
          ' (same as ' + ', '.join(code(a) for a in e.aliases) + ')'
          if e.aliases else '')
      rows.append((name,) + ((e.kind,) if with_kind else ()) +
                  (code(e.defined_as), e.description))
    header = (r.noun.capitalize(),) + (('Kind',) if with_kind else ()) + (
        'Defined as', 'Description')
    lines += table(header, rows, flexible=len(header) - 1)
    lines.append('')

  # Flags.
  lines += ['## Flags', '']
  lines += paragraph('Every flag of `experiments/main.py`: one per core setting '
            '(`fedrobust/config.py`), one per method setting (declared '
            "in the method's registry entry; a setting of another method "
            'than `--method` must stay at its default), and the runner\'s '
            'own. Flagfiles (`--flagfile`) take the same names.')
  core = [f for f in flags if f.owner == 'core']
  lines += ['### Core flags', '']
  group_names = []
  for f in core:
    if f.group not in group_names:
      group_names.append(f.group)
  for group in group_names:
    if group:
      lines += [f'#### {group}', '']
    lines += _flag_table([f for f in core if f.group == group])
    lines.append('')
  shared = [f for f in flags if f.owner == 'shared']
  if shared:
    lines += ['### Shared method flags', '',
              'Declared alike by several methods (bare names).', '']
    lines += _flag_table(shared, with_methods=True)
    lines.append('')
  for m in methods:
    own = [f for f in flags if f.owner == m.name]
    if own:
      lines += [f'### {_method_flags_heading(m.name)}', '']
      lines += _flag_table(own)
      lines.append('')
  runner = [f for f in flags if f.owner == 'runner']
  if runner:
    lines += ['### Runner flags', '',
              'Defined in `experiments/main.py` besides the settings.', '']
    lines += _flag_table(runner)
    lines.append('')
  text = '\n'.join(lines).rstrip('\n') + '\n'
  if ROOT in text:
    raise AssertionError('the reference holds an absolute path')
  return text


def section_names(text: str | None = None) -> dict[str, list[str]]:
  """{section title: the names its table lists} of a rendered reference
  (the first code span of each row; flags without their dashes)."""
  text = render() if text is None else text
  out: dict[str, list[str]] = {}
  section = None
  for line in text.splitlines():
    if line.startswith('## '):
      section = line[3:].strip()
      out[section] = []
    elif section and line.startswith('| `'):
      name = line[3:].split('`', 1)[0]
      out[section].append(name[2:] if name.startswith('--') else name)
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--check', action='store_true',
                      help=f'exit 1 if {OUTPUT} differs from the output')
  args = parser.parse_args(argv)
  path = os.path.join(ROOT, OUTPUT)
  text = render()
  if args.check:
    try:
      with open(path, encoding='utf-8', newline='') as f:
        current = f.read()
    except FileNotFoundError:
      current = None
    if current != text:
      print(f'{OUTPUT} is stale (it differs from what the registries and '
            f'settings generate now); run: {COMMAND}', file=sys.stderr)
      return 1
    print(f'{OUTPUT} is up to date.')
    return 0
  with open(path, 'w', encoding='utf-8', newline='\n') as f:
    f.write(text)
  print(f'wrote {OUTPUT} ({text.count(chr(10))} lines)')
  return 0


if __name__ == '__main__':
  sys.exit(main())
