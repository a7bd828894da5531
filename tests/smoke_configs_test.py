"""Every preset in experiments/configs/ runs one round on small data, as
its documented command, with the runner's own device count (tests/smoke.py
says how the work is shrunk). The presets are dealt to this file and
smoke_configs_more_test.py, so that xdist runs the two halves side by
side."""

import pytest

from tests import smoke

pytestmark = pytest.mark.slow
SHARD = 0


def run_preset(preset, tmp_path):
  cwd = smoke.scratch_dir(str(tmp_path / 'repo'))
  out = smoke.run_segment(smoke.preset_command(preset), cwd, preset)
  assert 'run completed' in out, out[-2000:]


@pytest.mark.parametrize('preset', smoke.preset_shard(SHARD, 2))
def test_preset_runs(preset, tmp_path):
  run_preset(preset, tmp_path)


def test_the_shards_cover_every_preset_once():
  shards = smoke.preset_shard(0, 2) + smoke.preset_shard(1, 2)
  assert sorted(shards) == smoke.presets()
