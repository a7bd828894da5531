"""The other half of the presets (see smoke_configs_test.py)."""

import pytest

from tests import smoke
from tests.smoke_configs_test import run_preset

pytestmark = pytest.mark.slow


@pytest.mark.parametrize('preset', smoke.preset_shard(1, 2))
def test_preset_runs(preset, tmp_path):
  run_preset(preset, tmp_path)
