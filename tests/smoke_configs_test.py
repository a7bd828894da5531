"""Every preset in experiments/configs/ runs one round on small data, as
its documented command, with the runner's own device count (tests/smoke.py
says how the work is shrunk)."""

import pytest

from tests import smoke

pytestmark = pytest.mark.slow


@pytest.mark.parametrize('preset', smoke.presets())
def test_preset_runs(preset, tmp_path):
  cwd = smoke.scratch_dir(str(tmp_path / 'repo'))
  out = smoke.run_segment(smoke.preset_command(preset), cwd, preset)
  assert 'run completed' in out, out[-2000:]
