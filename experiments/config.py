"""The command line's view of the run settings (fedrobust/config.py).

Flags are the settings' config keys. Library errors name factory arguments
(`fedrobust.errors.SettingError`); `describe_error` reports them under the
flag that set the argument, and flagfiles are read into config dicts here.
"""

from __future__ import annotations

import re
from typing import Any

from fedrobust.config import (CORE, EXECUTION_KEYS, RESUMABLE_KEYS,  # noqa
                              all_settings, check_foreign_settings,
                              core_settings, defaults, execution_keys,
                              method_flag,
                              method_settings, settings_of)
from fedrobust.errors import SettingError
from fedrobust.methods import METHODS


def flag_for(argument: str, component: str, method: str) -> str:
  """The flag (as typed) that sets library argument `argument`."""
  for s in METHODS[method].settings:
    if argument == s.kwarg:
      return '--' + method_flag(method, s)
  core = {s.name for s in CORE}
  if component.startswith('aggregator ') and argument not in core:
    return f'--aggregator_kwargs {argument}'
  if component.startswith('attack ') and argument not in core:
    return f'--attack_kwargs {argument}'
  aliases = {'ranks': 'lora_ranks', 'targets': 'lora_targets',
             'alpha': 'lora_alpha', 'ratios': 'width_ratios'}
  return '--' + aliases.get(argument, argument)


def describe_error(err: SettingError, method: str) -> str:
  """The error as a user reads it: under the flag, with flags in the text.

  'num_byzantine=1' in the message becomes '--num_byzantine=1' when
  num_byzantine is a flag; a bare setting name with an underscore
  ('set max_train_examples below 40') is unambiguous and becomes a flag
  too.
  """
  flag = flag_for(err.argument, err.component, method)
  message = err.message
  for s in sorted(all_settings(), key=len, reverse=True):
    tail = '' if '_' in s else '='
    message = re.sub(rf'(?<![-\w]){re.escape(s)}{tail}(?![\w])' if not tail
                     else rf'(?<![-\w]){re.escape(s)}=', f'--{s}{tail}',
                     message)
  where = f' ({err.component})' if err.component else ''
  return f'{flag}{where}: {message}'


_TRUE, _FALSE = ('true', 't', '1', 'yes'), ('false', 'f', '0', 'no')


def parse_value(name: str, text: str) -> Any:
  """The value of `--name=text`, typed by the setting's default."""
  setting = all_settings()[name]
  default = setting.default
  if setting.choices and text not in setting.choices:
    raise ValueError(f'--{name}={text}: expected one of '
                     f'{list(setting.choices)}')
  if isinstance(default, bool):
    if text.lower() not in _TRUE + _FALSE:
      raise ValueError(f'--{name}={text}: expected true or false')
    return text.lower() in _TRUE
  if isinstance(default, int):
    return int(text)
  if isinstance(default, float):
    return float(text)
  return text


def read_flagfile(path: str) -> dict[str, Any]:
  """{setting: parsed value} of a flagfile (nested --flagfile expanded).

  Lines are --name=value, --name or --noname (booleans), blank or # notes;
  a name that is no setting is an error that names the file and line.
  """
  settings = all_settings()
  values: dict[str, Any] = {}
  with open(path) as f:
    lines = [line.strip() for line in f]
  for number, line in enumerate(lines, 1):
    if not line or line.startswith('#'):
      continue
    name, has_value, text = line.lstrip('-').partition('=')
    if name == 'flagfile':
      values.update(read_flagfile(text))
    elif name in settings and has_value:
      values[name] = parse_value(name, text)
    elif name in settings and isinstance(settings[name].default, bool):
      values[name] = True
    elif (name.startswith('no') and not has_value and name[2:] in settings
          and isinstance(settings[name[2:]].default, bool)):
      values[name[2:]] = False
    else:
      raise ValueError(f'{path}:{number}: unknown flag --{name}')
  return values
