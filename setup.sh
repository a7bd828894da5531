#!/usr/bin/env bash
# Sets up fedrobust on a fresh Debian machine: Fashion-MNIST, venv, install.
#   ./setup.sh          runtime dependencies (add --test for the test extras)
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")"

extras=""
[[ "${1:-}" == "--test" ]] && extras="[test]"

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
if [[ ! -x .venv/bin/python ]]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${extras}"
echo "setup: done ($(.venv/bin/python -c 'import jax; print("jax", jax.__version__, jax.default_backend())'))"
