"""Every command in README.md and docs/ runs, block by block, as written
(shrunk to small data: tests/smoke.py), with the runner's own device
count. A command added to the docs is tested without being listed."""

import pytest

from tests import smoke

BLOCKS = smoke.doc_blocks()


def test_the_docs_have_commands():
  names = {b.path for b in BLOCKS}
  assert 'README.md' in names
  assert any('experiments/main.py' in c for b in BLOCKS for c in b.commands)


@pytest.fixture(scope='module')
def doc_dirs(tmp_path_factory):
  """One scratch directory per documentation file: its blocks run in
  order in it, so a block finds what an earlier one wrote (a data file,
  a run), as a reader following the page would."""
  made = {}

  def get(path):
    if path not in made:
      made[path] = smoke.scratch_dir(str(tmp_path_factory.mktemp(
          path.replace('/', '_').replace('.', '_'))))
    return made[path]
  return get


@pytest.mark.slow
@pytest.mark.parametrize('block', BLOCKS, ids=[b.name for b in BLOCKS])
def test_documented_block_runs(block, doc_dirs):
  cwd = doc_dirs(block.path)
  if block.kind == 'python':
    smoke.run_python(block.commands[0], cwd, block.name)
    return
  for segment, skip_presets in smoke.block_segments(block):
    smoke.run_segment(segment, cwd, block.name, skip_presets=skip_presets)


class TestExtraction:
  """The extraction itself, on text made here."""

  def test_blocks_join_continuations_and_drop_comments(self):
    text = ('intro\n```bash\n# a comment\npython a.py --x=1 \\\n  --y=2\n\n'
            'python b.py\n```\n```python\nprint(1)\n```\n```py\nx\n```\n')
    found = smoke.blocks(text, 'X.md')
    assert [b.commands for b in found] == [
        ('python a.py --x=1 --y=2', 'python b.py'), ('print(1)\n',)]
    assert [b.kind for b in found] == ['bash', 'python']
    assert found[0].name == 'X.md:2'

  def test_a_python_block_runs_and_its_failure_is_named(self, tmp_path):
    cwd = smoke.scratch_dir(str(tmp_path / 'repo'))
    assert smoke.run_python('import fedrobust\nprint("ok")\n', cwd,
                            'X.md:1').strip() == 'ok'
    with pytest.raises(smoke.CommandError, match='X.md:1.*exited 1'):
      smoke.run_python('raise SystemExit(1)\n', cwd, 'X.md:1')

  def test_setup_and_suite_are_not_run(self):
    assert smoke.prepare('./setup.sh --test', '/tmp')[0] is None
    assert smoke.prepare('.venv/bin/python -m pytest -q', '/tmp')[0] is None
    assert smoke.segments('./setup.sh && python x.py') == [
        './setup.sh', 'python x.py']

  def test_a_bare_preset_is_left_to_the_preset_test_unless_read_later(self):
    block = smoke.Block('X.md', 1, (
        'python experiments/main.py '
        '--flagfile=experiments/configs/fedavg_fmnist.flags',
        'python experiments/main.py '
        '--flagfile=experiments/configs/fedhan_fmnist_quick.flags',
        'python experiments/analysis/fedhan_detection.py '
        '--workdir=runs/fedhan_fmnist_quick'))
    skips = [skip for _, skip in smoke.block_segments(block)]
    # fedavg_fmnist's run is not read later (fedhan_fmnist_quick's is).
    assert skips == [True, False, True]
    alone = smoke.Block('Y.md', 1, block.commands[:1])
    (segment, skip), = smoke.block_segments(alone)
    assert smoke.prepare(segment, '/tmp', skip_presets=skip)[0] is None

  def test_unknown_script_is_named(self):
    with pytest.raises(smoke.CommandError, match='no shrink rule for '
                       'experiments/nope.py'):
      smoke.prepare('.venv/bin/python experiments/nope.py', '/tmp')

  def test_bracketed_optional_argument_is_refused(self):
    with pytest.raises(smoke.CommandError, match=r'\[--a=1\]'):
      smoke.prepare('python benchmarks/scale_model.py [--a=1]', '/tmp')

  def test_main_is_shrunk_to_one_round(self):
    argv, _ = smoke.prepare(
        'python experiments/main.py --num_rounds=50 --local_epochs=2 '
        '--num_clients=1000 --clients_per_round=0', '/tmp')
    assert argv[1:] == ['experiments/main.py', '--clients_per_round=0',
                        '--num_rounds=1', '--local_epochs=1',
                        '--max_train_examples=2000',
                        '--max_test_examples=200', '--num_clients=100']

  def test_the_device_count_is_the_runners(self, monkeypatch):
    monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=4'
                       ' --xla_backend_optimization_level=0')
    assert smoke.environment()['XLA_FLAGS'] == (
        '--xla_backend_optimization_level=0')
