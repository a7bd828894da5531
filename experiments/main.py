r"""fedrobust experiment runner: the only module that defines flags.

  python experiments/main.py --method=fedavg --num_clients=10 \
    --partition=dirichlet --dirichlet_alpha=0.5 --num_rounds=20

Flags are built from the settings' declarations (fedrobust/config.py for
the core ones, each method's registry entry for its own). A bare
--method=NAME starts from the method's paper preset, when it has one
(its registry entry's `preset`); flags given explicitly win. Presets live in
experiments/configs/*.flags (use --flagfile=...). Running the same command
on the same --workdir resumes; see experiments/train.py.
"""

from __future__ import annotations

import logging as py_logging
import os
import sys

from absl import app, flags
from absl import logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import plugins
# User components register before the flags' choices are read.
plugins.load(sys.argv)
from experiments import config as config_lib
from experiments import preemption
from experiments import train
from fedrobust.methods import METHODS

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs')


def define_flags(settings: dict) -> None:
  """One absl flag per setting, typed by its default."""
  for name, s in settings.items():
    default = s.default
    if name in flags.FLAGS and flags.FLAGS[name].default == default:
      continue      # sweep.py's --num_seeds, where both are imported
    if s.choices:
      flags.DEFINE_enum(name, default, list(s.choices), s.help)
    elif isinstance(default, bool):
      flags.DEFINE_boolean(name, default, s.help)
    elif isinstance(default, int):
      flags.DEFINE_integer(name, default, s.help)
    elif isinstance(default, float):
      flags.DEFINE_float(name, default, s.help)
    else:
      flags.DEFINE_string(name, default, s.help)


define_flags(config_lib.all_settings())
flags.DEFINE_string('plugins', '', 'Comma-separated Python modules to '
                    'import first: the rules, attacks and methods they '
                    'register are taken by name (experiments/plugins.py).')
flags.DEFINE_boolean('distributed', False, 'Call jax.distributed.initialize() '
                     'first (multi-host TPU/GPU). Start the same command '
                     'on every host with one --workdir that all of them '
                     'see: every process runs the rounds and joins each '
                     'checkpoint, process 0 writes the files. Each process '
                     'loads the whole dataset (tests/multiprocess_test.py; '
                     'BUILD_NOTES.md, "Multi-process").')

FLAGS = flags.FLAGS


class _QuietLibraries(py_logging.Filter):
  """Drops orbax's per-save INFO chatter; warnings still show."""

  def filter(self, record):
    return record.levelno >= py_logging.WARNING or (
        '/orbax/' not in record.pathname)


def build_config() -> dict[str, object]:
  """The run config from the parsed flags (plus a bare method's preset)."""
  config = {name: FLAGS[name].value for name in config_lib.all_settings()}
  # The paper setting a bare --method=NAME runs (its MethodSpec's preset,
  # a flagfile in CONFIGS).
  preset = METHODS[FLAGS.method].preset
  if preset:
    values = config_lib.read_flagfile(os.path.join(CONFIGS, preset))
    for name, value in values.items():
      if not FLAGS[name].present:
        config[name] = value
  return config


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.get_absl_handler().addFilter(_QuietLibraries())
  # JAX probes for a TPU on every start and logs the failure at INFO; on a
  # machine without one that line only alarms a newcomer.
  py_logging.getLogger('jax._src.xla_bridge').setLevel(py_logging.WARNING)
  if FLAGS.distributed:
    import jax  # pylint: disable=g-import-not-at-top
    jax.distributed.initialize()
  config = build_config()
  try:
    summary = train.run(config)
  except train.DivergenceError as err:
    print(train.format_summary(err.summary))
    print(f'error: {err}', file=sys.stderr)
    sys.exit(3)
  except preemption.Preempted as err:
    print(train.format_summary(err.summary))
    print(f'stopped: {err}', file=sys.stderr)
    sys.exit(preemption.EXIT_CODE)
  except (ValueError, train.DataNotFoundError) as err:
    print(f'error: {err}', file=sys.stderr)
    sys.exit(2)
  print(train.format_summary(summary))


if __name__ == '__main__':
  app.run(main)
