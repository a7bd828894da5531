r"""Which presets, rules and attacks run as replicas (--num_seeds).

  python experiments/analysis/replica_coverage.py --out=/tmp/coverage.json

For every preset flagfile (shrunk to small data as the smoke tests shrink
it), every registered rule (on threat_untargeted.flags) and every attack
(on threat_untargeted.flags, or threat_backdoor.flags for a backdoor),
builds `fedrobust.Replicas` of two seeds, which traces both seeds' setup
step and round and checks they share one program. Nothing is compiled or
run. Each entry is 'ok', 'refused' (the replica refusal, with its reason)
or 'invalid' (the single-seed run refuses the settings too).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
# pylint: disable=g-import-not-at-top,wrong-import-position
import fedrobust
from experiments import config as config_lib
from fedrobust.attacks import ATTACK_ENTRIES
from tests import smoke

flags.DEFINE_string('out', None, 'JSON file for the results.')
flags.DEFINE_string('only', '', "Comma-separated kinds: preset,rule,attack.")
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


def small_config(flagfile: str, **extra) -> dict:
  argv = [f'--flagfile={flagfile}'] + [f'--{k}={v}' for k, v in
                                       extra.items()]
  config = config_lib.defaults()
  config.update(config_lib.read_flagfile(os.path.join(ROOT, flagfile)))
  config.update({k: config_lib.parse_value(k, str(v))
                 for k, v in extra.items()})
  config.update({k: config_lib.parse_value(k, v) for k, v in
                 smoke.small_values(argv, ROOT).items() if v is not None})
  config.pop('workdir', None)
  config['num_devices'] = 1
  return config


def check(config: dict) -> tuple[str, str]:
  try:
    fedrobust.Federation(config)
  except Exception as err:  # pylint: disable=broad-except
    return 'invalid', f'{type(err).__name__}: {err}'[:300]
  try:
    fedrobust.Replicas(config, num_seeds=2)
  except fedrobust.SettingError as err:
    return 'refused', str(err)[:400]
  except Exception as err:  # pylint: disable=broad-except
    return 'error', f'{type(err).__name__}: {err}'[:400]
  return 'ok', ''


def main(argv):
  del argv
  kinds = set(FLAGS.only.split(',')) if FLAGS.only else {
      'preset', 'rule', 'attack'}
  cases = []
  if 'preset' in kinds:
    for path in sorted(glob.glob(os.path.join(ROOT, 'experiments', 'configs',
                                              '*.flags'))):
      rel = os.path.relpath(path, ROOT)
      cases.append((f'preset {os.path.basename(path)}', rel, {}))
  if 'rule' in kinds:
    for name in sorted(fedrobust.AGGREGATORS):
      cases.append((f'rule {name}',
                    'experiments/configs/threat_untargeted.flags',
                    {'aggregator': name}))
  if 'attack' in kinds:
    for name, entry in sorted(ATTACK_ENTRIES.items()):
      base = ('text_movies_quick' if entry.needs.inputs == 'text' else
              'threat_backdoor' if entry.needs.backdoor else
              'threat_untargeted')
      cases.append((f'attack {name}', f'experiments/configs/{base}.flags',
                    {'attack': name}))
  results = {}
  for label, flagfile, extra in cases:
    t0 = time.time()
    try:
      status, why = check(small_config(flagfile, **extra))
    except Exception as err:  # pylint: disable=broad-except
      status, why = 'invalid', f'{type(err).__name__}: {err}'[:300]
    results[label] = {'status': status, 'why': why,
                      'seconds': round(time.time() - t0, 1)}
    print(f'{label}: {status} {why[:200]}', flush=True)
  counts = {}
  for r in results.values():
    counts[r['status']] = counts.get(r['status'], 0) + 1
  print(json.dumps(counts))
  if FLAGS.out:
    with open(FLAGS.out, 'w') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  app.run(main)
