"""experiments/sweep.py: named axes and the paper-reference join."""

import json
import os

import pytest

from experiments import reference, sweep


def _restore_flags():
  """Undoes a test's sweep.FLAGS(...) parse. unparse_flags alone leaves
  absl's global flags unparsed, and a later test file in the same worker
  then fails on --test_tmpdir (create_tempdir); conftest marks them
  parsed, and so does this."""
  sweep.FLAGS.unparse_flags()
  sweep.FLAGS.mark_as_parsed()


AXES = {'defense': {'SDFC': {'flags': ['--method=sdfc'], 'paper': 'SDFC'},
                    'Median': {'flags': ['--method=fedavg',
                                         '--aggregator=median']}}}


def test_named_axis_expands_to_its_flags():
  cells = sweep.parse_grid('defense=SDFC,Median;dirichlet_alpha=0.5,1.0')
  assert len(cells) == 4
  assert sweep.cell_flags(cells[0], AXES) == ['--method=sdfc',
                                              '--dirichlet_alpha=0.5']
  assert sweep.cell_flags(cells[3], AXES) == [
      '--method=fedavg', '--aggregator=median', '--dirichlet_alpha=1.0']
  assert sweep.paper_name(cells[0], AXES) == 'SDFC'
  assert sweep.paper_name(cells[2], AXES) is None
  with pytest.raises(ValueError, match='defense=Krum'):
    sweep.cell_flags({'defense': 'Krum'}, AXES)


def test_grid_union_of_products_in_order_without_repeats():
  cells = sweep.parse_grid('m=A,B;rho=0.3 | m=A;rho=0.1,0.3')
  assert cells == [{'m': 'A', 'rho': '0.3'}, {'m': 'B', 'rho': '0.3'},
                   {'m': 'A', 'rho': '0.1'}]
  with pytest.raises(ValueError, match='must name the flags'):
    sweep.parse_grid('m=A;rho=0.3 | rho=0.1;m=A')


def test_load_axes_rejects_a_value_without_flags(tmp_path):
  path = tmp_path / 'axes.json'
  path.write_text(json.dumps({'defense': {'X': {'paper': 'X'}}}))
  with pytest.raises(ValueError, match='defense=X'):
    sweep.load_axes(str(path))


def test_load_axes_rejects_a_value_the_grid_cannot_name(tmp_path):
  path = tmp_path / 'axes.json'
  path.write_text(json.dumps({'cat': {'T0 1, kappa 0': {'flags': []}}}))
  with pytest.raises(ValueError, match="'T0 1, kappa 0' of axis 'cat'"):
    sweep.load_axes(str(path))
  # Every shipped axes file names its values so that --grid can.
  folder = os.path.join(sweep.ROOT, 'experiments', 'sweeps')
  for name in sorted(os.listdir(folder)):
    if name.endswith('.json'):
      for values in sweep.load_axes(os.path.join(folder, name)).values():
        for value in values:
          assert sweep.parse_grid(f'a={value}') == [{'a': value}], name


def test_reference_rows_and_setting():
  rows = reference.load('SDFC', 'Table5')
  sdfc = rows[('SDFC', 'beta=0.5 malicious=30%')]
  assert sdfc['test_accuracy'] == pytest.approx(0.8510)
  assert sdfc['backdoor_failure_rate'] == pytest.approx(0.9113)
  assert sdfc['tradeoff_v'] == pytest.approx(0.8811)
  assert reference.setting_of('SDFC', {'dirichlet_alpha': 1.0,
                                       'malicious_fraction': 0.5}) == (
                                           'beta=1.0 malicious=50%')
  with pytest.raises(ValueError, match='FedHAN'):
    reference.setting_of('FedHAN', {})


def test_horus_table_columns_are_one_value_per_alpha():
  rows = reference.load('Horus', 'TableI')
  assert rows[('Horus', 'LIE alpha=0.5')]['test_accuracy'] == (
      pytest.approx(0.6735))
  assert rows[('Krum', 'label-flip alpha=0.1')]['test_accuracy'] == (
      pytest.approx(0.4312))
  assert reference.setting_of('Horus', {'attack': 'fang_trim',
                                        'dirichlet_alpha': 0.3}) == (
                                            'Fang alpha=0.3')
  table2 = reference.load('Horus', 'TableII')
  horus = table2[('Horus', 'alpha=0.5 heterogeneous FL no attack')]
  assert horus == pytest.approx({'local_accuracy': 0.8947,
                                 'test_accuracy': 0.7266})


def test_paper_columns_read_the_runs_own_config(tmp_path):
  workdir = tmp_path / 'cell'
  os.makedirs(workdir)
  (workdir / 'config.json').write_text(json.dumps(
      {'dirichlet_alpha': 0.5, 'malicious_fraction': 0.3}))
  rows = reference.load('SDFC', 'Table5')
  out = sweep.paper_columns({'defense': 'SDFC'}, str(workdir), AXES, 'SDFC',
                            rows, ['test_accuracy', 'tradeoff_v'])
  assert out['paper_setting'] == 'beta=0.5 malicious=30%'
  assert out['paper_test_accuracy'] == pytest.approx(0.8510)
  (workdir / 'config.json').write_text(json.dumps(
      {'dirichlet_alpha': 0.3, 'malicious_fraction': 0.3}))
  out = sweep.paper_columns({'defense': 'SDFC'}, str(workdir), AXES, 'SDFC',
                            rows, ['test_accuracy'])
  assert out['paper_test_accuracy'] is None      # no such paper setting


def test_sweep_names_are_safe_file_names():
  from absl import app  # pylint: disable=g-import-not-at-top
  for good in ('backdoor_fmnist', 'sdfc-table5.v2'):
    sweep.check_name('name', good)
  for bad in ('../evil', 'a/b', '.hidden', 'x y', '', 'x\n'):
    with pytest.raises(app.UsageError, match='--name'):
      sweep.check_name('name', bad)


def test_upload_bytes_is_the_client_weighted_mean_over_cohorts(tmp_path):
  """A cohort's specs count alike; cohorts weigh by their client count."""
  (tmp_path / 'metrics.jsonl').write_text(
      json.dumps({'round': 1, 'test_accuracy': 0.5}) + '\n')
  (tmp_path / 'summary.json').write_text(json.dumps({'cohorts': {
      'cnn': {'clients': 3, 'upload_bytes_per_client': {'rank=2': 100,
                                                        'rank=8': 300}},
      'lstm': {'clients': 1, 'upload_bytes_per_client': {'': 1000}}}}))
  out = sweep.read_final(str(tmp_path), ['test_accuracy', 'upload_bytes',
                                         'download_bytes'], 1)
  assert out['test_accuracy'] == 0.5
  assert out['upload_bytes'] == (3 * 200 + 1 * 1000) / 4
  # Without the method's own count a client downloads what it trains.
  assert out['download_bytes'] == out['upload_bytes']
  os.remove(tmp_path / 'summary.json')
  assert sweep.read_final(str(tmp_path), ['upload_bytes'], 1) == {
      'upload_bytes': None}


def test_run_level_figures_come_from_the_summary(tmp_path):
  """cluster_ari and unseen_accuracy are written once, to summary.json;
  a metric in metrics.jsonl wins over a summary key of the same name."""
  (tmp_path / 'metrics.jsonl').write_text(
      json.dumps({'round': 1, 'personal_accuracy': 0.7}) + '\n')
  (tmp_path / 'summary.json').write_text(json.dumps(
      {'cluster_ari': 0.25, 'unseen_accuracy': 0.8, 'personal_accuracy': 0.1,
       'cluster_assignment': [0, 1]}))
  out = sweep.read_final(str(tmp_path), ['personal_accuracy', 'cluster_ari',
                                         'unseen_accuracy',
                                         'cluster_assignment'], 1)
  assert out == {'personal_accuracy': 0.7, 'cluster_ari': 0.25,
                 'unseen_accuracy': 0.8, 'cluster_assignment': None}


def test_hilora_axes_name_each_baseline_its_own_paper_row():
  axes = sweep.load_axes(os.path.join(sweep.ROOT, 'experiments', 'sweeps',
                                      'hilora.json'))
  assert sweep.paper_name({'method': 'FedIT', 'variant': 'full'},
                          axes) == 'FedIT'
  assert sweep.paper_name({'method': 'HiLoRA', 'variant': 'full'},
                          axes) == 'HiLoRA'
  rows = reference.load('HiLoRA', 'Table2')
  setting = reference.setting_of('HiLoRA', {'partition': 'group_dirichlet'})
  assert rows[('FlexLoRA', setting)]['unseen_accuracy'] == 0.84


def test_hilora_label_skew_rows_follow_the_partition():
  axes = sweep.load_axes(os.path.join(sweep.ROOT, 'experiments', 'sweeps',
                                      'hilora_label_skew.json'))
  assert sweep.paper_name({'method': 'FedDPA-T', 'partition': 'SC-Dir(3)',
                           'variant': 'full'}, axes) == 'FedDPA-T'
  rows = reference.load('HiLoRA', 'Table1')
  want = {'dirichlet': ('GL-Dir', 0.846), 'superclass_dirichlet':
          ('SC-Dir', 0.934), 'pathological': ('Patho', 0.941)}
  for partition, (setting, mean) in want.items():
    assert reference.setting_of('HiLoRA', {'partition': partition}) == setting
    assert rows[('HiLoRA', setting)]['personal_accuracy'] == pytest.approx(
        mean)
  assert rows[('FedDPA-T', 'SC-Dir')]['unseen_accuracy'] == pytest.approx(
      0.738)
  assert len(rows) == 30


def test_rfd_lora_reference_and_the_variant_names_the_paper_row():
  axes = sweep.load_axes(os.path.join(sweep.ROOT, 'experiments', 'sweeps',
                                      'rfd_lora.json'))
  cell = {'method': 'RFD-LoRA', 'variant': 'consensus: median'}
  assert sweep.paper_name(cell, axes) == 'Coord. Median'
  assert sweep.paper_name({'method': 'FedIT'}, axes) == 'FedIT'
  config = {'partition': 'iid', 'malicious_fraction': 0.3}
  assert reference.setting_of('RFD-LoRA', config) == 'IID rho=0.30'
  table1 = reference.load('RFD-LoRA', 'Table1')
  row = table1[('LoRA-Fair', 'IID rho=0.30')]
  assert row == pytest.approx({'test_accuracy': 0.897,
                               'robust_accuracy': 0.833,
                               'attack_success_rate': 0.189})
  non_iid = dict(config, partition='dirichlet', malicious_fraction=0.1)
  assert table1[('RFD-LoRA', reference.setting_of('RFD-LoRA', non_iid))][
      'attack_success_rate'] == pytest.approx(0.064)
  table3 = reference.load('RFD-LoRA', 'Table3')
  assert table3[('Coord. Median', 'IID rho=0.30')][
      'attack_success_rate'] == pytest.approx(0.162)


def test_a_diverged_run_is_a_failure_not_its_last_accuracy(tmp_path):
  """A run that stopped on a non-finite model at its last round has
  rounds_completed == num_rounds; a re-run sweep must still report it
  failed instead of reading its final (10%) accuracy."""
  def write(name, **summary):
    workdir = tmp_path / name
    workdir.mkdir()
    (workdir / 'summary.json').write_text(json.dumps(
        dict(summary, config={'num_rounds': 5})))
    return str(workdir)

  status, note = sweep.finished(write('diverged', rounds_completed=5,
                                      status='diverged', diverged_round=5))
  assert status == 'failed' and 'round 5' in note
  assert sweep.finished(write('done', rounds_completed=5,
                              status='completed')) == ('ok', '')
  assert sweep.finished(write('partial', rounds_completed=3,
                              status='running')) is None
  assert sweep.finished(str(tmp_path / 'absent')) is None


def test_merge_keeps_the_papers_columns_and_integer_bytes(tmp_path):
  with_paper = tmp_path / 'a.csv'
  with_paper.write_text(
      'method,test_accuracy,paper_test_accuracy,upload_bytes,'
      'paper_upload_bytes,status,note,paper_method,paper_setting\n'
      'FedIT,0.8,0.89,307264,,ok,,FedIT,IID rho=0.30\n')
  without = tmp_path / 'b.csv'
  without.write_text('method,test_accuracy,upload_bytes,status,note\n'
                     'FLoRA,0.7975,307264,ok,\n')
  rows, _ = sweep.merged_rows([str(with_paper), str(without)],
                              ['test_accuracy', 'upload_bytes'])
  cells = {r['method']: r for r in rows}
  assert cells['FedIT']['paper_test_accuracy'] == pytest.approx(0.89)
  assert cells['FedIT']['paper_upload_bytes'] is None
  assert cells['FedIT']['paper_setting'] == 'IID rho=0.30'
  assert 'paper_method' not in cells['FLoRA']
  assert cells['FLoRA']['upload_bytes'] == 307264
  assert isinstance(cells['FLoRA']['upload_bytes'], int)
  sweep.FLAGS(['sweep', '--name=merged_paper', f'--out={tmp_path}'])
  try:
    sweep.write_outputs('merged_paper', rows, ['method', 'source'],
                        ['test_accuracy', 'upload_bytes'], with_paper=True)
  finally:
    _restore_flags()
  table = (tmp_path / 'merged_paper.md').read_text()
  assert '| FedIT | a | 80.00 | 89.00 | 307264 |  |' in table
  assert '| FLoRA | b | 79.75 |  | 307264 |  |' in table


def test_merge_keeps_each_cell_once_and_marks_cells(tmp_path):
  """--merge tabulates earlier sweeps' CSVs; --marks flags cells."""
  first = tmp_path / 'a.csv'
  first.write_text('attack,aggregator,test_accuracy,status,note\n'
                   'lie,mean,0.80,ok,\nlie,krum,0.64,ok,\n'
                   'lie,bulyan,,error,needs n >= 4f+3\n')
  second = tmp_path / 'b.csv'
  second.write_text('attack,aggregator,test_accuracy,cumulative_'
                    'detection_recall,status,note\n'
                    'lie,krum,0.99,1.0,ok,\nfang_trim,flare,0.72,0.5,ok,\n')
  rows, keys = sweep.merged_rows([str(first), str(second)],
                                 ['test_accuracy',
                                  'cumulative_detection_recall'])
  assert keys == ['attack', 'aggregator', 'source']
  cells = {(r['attack'], r['aggregator']): r for r in rows}
  assert len(rows) == 4                       # lie/krum kept once
  assert cells[('lie', 'krum')]['test_accuracy'] == pytest.approx(0.64)
  assert cells[('lie', 'krum')]['source'] == 'a'
  assert cells[('lie', 'krum')]['cumulative_detection_recall'] is None
  assert cells[('fang_trim', 'flare')]['cumulative_detection_recall'] == (
      pytest.approx(0.5))
  assert cells[('lie', 'bulyan')]['status'] == 'error'
  # A CSV without a key column: its rows take the given default.
  third = tmp_path / 'c.csv'
  third.write_text('aggregator,test_accuracy,status,note\nmean,0.81,ok,\n'
                   'krum,0.67,ok,\n')
  rows3, _ = sweep.merged_rows([str(third), str(first)], ['test_accuracy'],
                               {'attack': 'lie'})
  assert {(r['attack'], r['aggregator'], r['source']) for r in rows3} == {
      ('lie', 'mean', 'c'), ('lie', 'krum', 'c'), ('lie', 'bulyan', 'a')}
  rows4, _ = sweep.merged_rows([str(third), str(first)], ['test_accuracy'])
  assert {r['attack'] for r in rows4 if r['source'] == 'c'} == {'-'}
  # A CSV's own key values win over the defaults.
  rows5, _ = sweep.merged_rows([(str(third), {'attack': '3dfed'}),
                                str(first)], ['test_accuracy'],
                               {'attack': 'lie'})
  assert {r['attack'] for r in rows5 if r['source'] == 'c'} == {'3dfed'}
  # A merged CSV merged again keeps each row's first source.
  merged = tmp_path / 'ab.csv'
  merged.write_text('attack,aggregator,source,test_accuracy,status,note\n'
                    'lie,mean,a,0.80,ok,\nfang_trim,flare,b,0.72,ok,\n')
  rows6, keys6 = sweep.merged_rows([str(merged), str(third)],
                                   ['test_accuracy'], {'attack': 'lie'})
  assert keys6 == ['attack', 'aggregator', 'source']
  assert {(r['aggregator'], r['source']) for r in rows6} == {
      ('mean', 'a'), ('flare', 'b'), ('krum', 'c')}
  assert sweep.parse_assignments('a=1; b = x', 'w') == {'a': '1', 'b': 'x'}
  with pytest.raises(ValueError, match='is not flag=v'):
    sweep.parse_assignments('a', 'w')
  marks_path = tmp_path / 'marks.json'
  marks_path.write_text(json.dumps({'aggregator=krum': 'one client kept',
                                    'attack=x;aggregator=mean': 'unused'}))
  marks = sweep.load_marks(str(marks_path))
  assert sweep.mark_of(cells[('lie', 'krum')], marks) == 1
  assert sweep.mark_of(cells[('lie', 'mean')], marks) == 0
  bad = tmp_path / 'bad.json'
  bad.write_text(json.dumps({'krum': 'no flag'}))
  with pytest.raises(ValueError, match='flag=v'):
    sweep.load_marks(str(bad))
  # The table: the mark beside the first metric, the reason below.
  sweep.FLAGS(['sweep', '--name=merged', f'--out={tmp_path}',
               f'--marks={marks_path}'])
  try:
    sweep.write_outputs('merged', rows, keys, ['test_accuracy'])
  finally:
    _restore_flags()
  table = (tmp_path / 'merged.md').read_text()
  assert '| lie | krum | a | 64.00 (!1) |' in table
  assert '1. aggregator=krum: one client kept' in table
  assert 'unused' not in table
  assert 'implausible: one client kept' in (tmp_path / 'merged.csv'
                                            ).read_text()


def test_a_finished_cell_is_reused_only_with_its_own_flags(tmp_path):
  """Re-running a sweep under the same --runs_name with other base flags
  (or an edited flagfile) is refused before anything runs, naming the
  cell and the flags; with the same flags the finished cell is reused."""
  flagfile = tmp_path / 'base.flags'
  flagfile.write_text('--num_rounds=5\n')
  runs = tmp_path / 'runs'

  def sweep_with(base_flags):
    sweep.FLAGS(['sweep', '--name=s', f'--out={tmp_path}',
                 f'--runs_dir={runs}', f'--base_flagfile={flagfile}',
                 f'--base_flags={base_flags}', '--grid=aggregator=mean',
                 '--metrics=test_accuracy'])
    try:
      sweep.main([])
    finally:
      _restore_flags()

  workdir = runs / 's' / 'aggregator-mean'
  workdir.mkdir(parents=True)
  (workdir / 'summary.json').write_text(json.dumps(
      {'rounds_completed': 5, 'status': 'completed',
       'config': {'num_rounds': 5}}))
  (workdir / 'metrics.jsonl').write_text(json.dumps(
      {'round': 5, 'test_accuracy': 0.5}) + '\n')
  sweep.FLAGS(['sweep', '--name=s', f'--base_flagfile={flagfile}',
               '--base_flags=--malicious_fraction=0.3'])
  try:
    record = sweep.cell_flags_record(['--aggregator=mean'])
  finally:
    _restore_flags()
  (workdir / sweep.CELL_RECORD).write_text(json.dumps(record))
  sweep_with('--malicious_fraction=0.3')          # same flags: reused
  assert '50.00' in (tmp_path / 's.md').read_text()
  with pytest.raises(sweep.app.UsageError,
                     match=r"aggregator-mean: it ran with "
                           r"\['--malicious_fraction=0.3'\], this sweep asks"
                           r" for \['--malicious_fraction=0.4'\]"):
    sweep_with('--malicious_fraction=0.4')
  flagfile.write_text('--num_rounds=6\n')
  with pytest.raises(sweep.app.UsageError, match='is not the file'):
    sweep_with('--malicious_fraction=0.3')


def test_a_crash_is_named_by_its_fatal_line_not_the_module_list():
  stderr = ('Fatal Python error: Aborted\n\nThread 0x01 (most recent call '
            'first):\n  File "main.py", line 9 in <module>\n\n'
            'Extension modules: jaxlib.cpu_feature_guard, numpy.core '
            '(total: 2)\n')
  status, note = sweep.failure(-6, stderr)
  assert status == 'failed'
  assert note.startswith('signal 6: Fatal Python error: Aborted')
  assert sweep.CELL_STDERR in note
  xla = ('I1127 10:35:11.87 1 train.py:1086] compiled\n'
         'F1127 10:44:57.653862 8658 rendezvous.cc:161] [id=0] Termination '
         'timeout for `all gather` of 40 seconds exceeded.\n' + stderr)
  _, note = sweep.failure(-6, xla)
  assert note.startswith('signal 6: Fatal Python error: Aborted after XLA: '
                         '[id=0] Termination timeout for `all gather` of 40')
  status, note = sweep.failure(1, 'Traceback:\nValueError: bad | value\n')
  assert (status, note.split(' (whole')[0]) == ('failed',
                                                'ValueError: bad / value')
  assert sweep.failure(2, 'error: --rounds must be > 0\n') == (
      'refused', '--rounds must be > 0')


def test_seeds_give_mean_and_std_in_tables_csv_and_bars(tmp_path):
  """A cell run with --num_seeds: each seed's mean over the last k rounds,
  then their mean and sample std; the table prints 'mean ± std'."""
  rows = []
  for rnd, accs in ((1, (0.5, 0.6, 0.7)), (2, (0.7, 0.8, 0.9))):
    rows.append({'round': rnd, 'test_accuracy': sum(accs) / 3,
                 'replicas': [{'round': rnd, 'test_accuracy': a, 'seed': s}
                              for s, a in enumerate(accs)]})
  (tmp_path / 'metrics.jsonl').write_text(
      ''.join(json.dumps(r) + '\n' for r in rows))
  (tmp_path / 'summary.json').write_text(json.dumps(
      {'replicas': [{'seed': s, 'unseen_accuracy': u}
                    for s, u in enumerate((0.2, 0.4, 0.6))]}))
  out = sweep.read_final(str(tmp_path), ['test_accuracy',
                                         'unseen_accuracy'], 2)
  # Seed means over rounds 1-2: 0.6, 0.7, 0.8.
  assert out['test_accuracy'] == pytest.approx(0.7)
  assert out['test_accuracy_std'] == pytest.approx(0.1)
  assert out['unseen_accuracy'] == pytest.approx(0.4)
  assert out['unseen_accuracy_std'] == pytest.approx(0.2)
  assert out['seeds'] == 3
  result = dict(out, aggregator='median', status='ok', note='')
  sweep.FLAGS(['sweep', '--name=seeded', f'--out={tmp_path}'])
  try:
    sweep.write_outputs('seeded', [result], ['aggregator'],
                        ['test_accuracy'])
  finally:
    _restore_flags()
  assert '| median | 70.00 ± 10.00 |' in (tmp_path / 'seeded.md').read_text()
  csv_text = (tmp_path / 'seeded.csv').read_text().splitlines()
  assert csv_text[0] == ('aggregator,test_accuracy,test_accuracy_std,'
                         'status,note,seeds')
  assert (tmp_path / 'seeded.png').exists()
  merged, keys = sweep.merged_rows([str(tmp_path / 'seeded.csv')],
                                   ['test_accuracy'])
  assert keys == ['aggregator', 'source']
  assert merged[0]['test_accuracy_std'] == pytest.approx(0.1)
