"""Rewrites tests/slow_tests.txt from a timed run of the whole suite.

  .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=0 \
      -p no:cacheprovider > /tmp/durations.log
  .venv/bin/python tests/update_slow_tests.py /tmp/durations.log

A test whose setup, call and teardown took THRESHOLD_S or more in that run
is listed, and conftest.py marks it `slow`: the fast tier
(`pytest -m "not slow"`) leaves it out, the full suite (CI) runs it. Whole
files and classes can also carry `pytest.mark.slow` themselves (the smoke
tests do); a new test is fast until the list is regenerated.
"""

import collections
import re
import sys

THRESHOLD_S = 3.0
HEADER = """\
# Tests marked `slow` by conftest.py: setup + call + teardown took >= {t} s
# in a timed run of the whole suite on the 2-core box. Regenerate with
# tests/update_slow_tests.py (its docstring has the commands).
"""


def slow_ids(log: str, threshold: float = THRESHOLD_S) -> list[str]:
  totals = collections.Counter()
  for line in log.splitlines():
    match = re.match(r'^([\d.]+)s (?:call|setup|teardown)\s+(\S+::\S+)',
                     line)
    if match:
      totals[match[2]] += float(match[1])
  return sorted(nid for nid, t in totals.items() if t >= threshold)


def main(argv):
  path = argv[1] if len(argv) > 1 else '/dev/stdin'
  with open(path) as f:
    ids = slow_ids(f.read())
  out = __file__.replace('update_slow_tests.py', 'slow_tests.txt')
  with open(out, 'w') as f:
    f.write(HEADER.format(t=THRESHOLD_S) + ''.join(i + '\n' for i in ids))
  print(f'{len(ids)} slow tests written to {out}')


if __name__ == '__main__':
  main(sys.argv)
