"""The seed papers' reported numbers, joined to our runs.

`experiments/reference/paper_results.csv` is a copy of the project's
reference file of Fashion-MNIST numbers (rows: paper, table, method,
setting, metric, value; a metric such as 'A/R/V' packs several values as
'85.10/91.13/88.11'). RFD-LoRA reports GLUE only; its rows are in
`rfd_lora_glue.csv`, and HiLoRA's (DomainNet, ViT-B) in `hilora.csv`, in
the same format (`PATHS`).

A run is matched to a row by its paper-side method name (given per sweep
cell, see sweep.py --axes) and by a setting string built from the run's own
config.json, so the join cannot silently use a flag the run did not have.
"""

from __future__ import annotations

import csv
import os

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'reference')
PATH = os.path.join(_DIR, 'paper_results.csv')
# Papers whose rows live in a file of their own.
PATHS = {'RFD-LoRA': os.path.join(_DIR, 'rfd_lora_glue.csv'),
         'HiLoRA': os.path.join(_DIR, 'hilora.csv')}

# Paper metric name -> the metrics.jsonl key it corresponds to.
METRIC_KEYS = {'A': 'test_accuracy', 'R': 'backdoor_failure_rate',
               'V': 'tradeoff_v', 'acc': 'test_accuracy',
               'global_acc': 'test_accuracy', 'local': 'local_accuracy',
               'CA': 'test_accuracy', 'RA': 'robust_accuracy',
               'ASR': 'attack_success_rate',
               'Mean': 'personal_accuracy', 'Worst': 'personal_accuracy_p10',
               'Unseen': 'unseen_accuracy'}

# Tables whose single metric packs one value per column of a setting:
# (paper, table) -> (the column's name in the setting string, its values).
COLUMNS = {('Horus', 'TableI'): ('alpha', ('0.1', '0.3', '0.5'))}

# Our attack names -> the Horus paper's.
HORUS_ATTACKS = {'label_flip': 'label-flip', 'lie': 'LIE',
                 'min_max': 'min-max', 'min_sum': 'min-sum',
                 'fang_trim': 'Fang', 'fang_krum': 'Fang',
                 'agr_tailored': 'AGR-tailored'}


def _sdfc_setting(config: dict) -> str:
  pct = round(100 * config['malicious_fraction'])
  beta = f"{config['dirichlet_alpha']:g}"
  beta += '' if '.' in beta else '.0'        # the paper writes 1.0
  return f'beta={beta} malicious={pct}%'


def _horus_setting(config: dict) -> str:
  if config.get('attack', 'none') == 'none':
    return (f"alpha={config['dirichlet_alpha']:g} heterogeneous FL no "
            'attack')
  attack = HORUS_ATTACKS.get(config['attack'], config['attack'])
  return f"{attack} alpha={config['dirichlet_alpha']:g}"


def _rfd_lora_setting(config: dict) -> str:
  skew = 'IID' if config['partition'] == 'iid' else 'non-IID'
  return f"{skew} rho={config['malicious_fraction']:.2f}"


def _hilora_setting(config: dict) -> str:
  """Table 2's domain skew, or Table 1's label-skew partitions."""
  return {'group_dirichlet': 'domain skew', 'dirichlet': 'GL-Dir',
          'superclass_dirichlet': 'SC-Dir',
          'pathological': 'Patho'}.get(config['partition'],
                                       config['partition'])


# paper -> config -> the paper's setting string.
SETTINGS = {'SDFC': _sdfc_setting, 'Horus': _horus_setting,
            'RFD-LoRA': _rfd_lora_setting, 'HiLoRA': _hilora_setting}


def path_of(paper: str) -> str:
  """The reference file that holds `paper`'s rows."""
  return PATHS.get(paper, PATH)


def load(paper: str, table: str, path: str | None = None
         ) -> dict[tuple[str, str], dict[str, float]]:
  """{(method, setting): {our metric key: value in [0, 1]}}."""
  path = path or path_of(paper)
  out: dict[tuple[str, str], dict[str, float]] = {}
  with open(path) as f:
    rows = csv.reader(line for line in f if not line.startswith('#'))
    for row in rows:
      if len(row) != 6:
        raise ValueError(f'{path}: {row!r} is not paper,table,method,'
                         'setting,metric,value (quote a name with commas)')
      if row[0] != paper or row[1] != table:
        continue
      _, _, method, setting, metric, value = row
      names, values = metric.split('/'), value.split('/')
      if (paper, table) in COLUMNS and len(names) == 1:
        column, keys = COLUMNS[(paper, table)]
        if len(values) != len(keys):
          raise ValueError(f'{path}: {value!r} is not one value per '
                           f'{column} in {keys}')
        for key, v in zip(keys, values):
          out.setdefault((method, f'{setting} {column}={key}'), {})[
              METRIC_KEYS.get(names[0], names[0])] = float(v) / 100
        continue
      if len(names) != len(values):
        raise ValueError(f'{path}: {metric!r} does not match {value!r}')
      entry = out.setdefault((method, setting), {})
      for name, v in zip(names, values):
        entry[METRIC_KEYS.get(name, name)] = float(v) / 100
  return out


def setting_of(paper: str, config: dict) -> str:
  if paper not in SETTINGS:
    raise ValueError(f'--reference: no setting rule for paper {paper!r}; '
                     f'known: {sorted(SETTINGS)}')
  return SETTINGS[paper](config)


def cell_values(cell: dict) -> dict[str, float | None]:
  """The paper's numbers (fractions) for a paper-suite cell's metrics, by
  our metric key (experiments/suites/paper_suite.json)."""
  table = load(cell['paper'], cell['table'])
  row = table.get((cell['paper_method'], cell['paper_setting']))
  if row is None:
    raise ValueError(f"{cell['name']}: no reference row for "
                     f"{cell['paper_method']!r}, {cell['paper_setting']!r} "
                     f"in {cell['paper']} {cell['table']}")
  names = cell.get('paper_metrics', {})
  # reference.load reads percent; a table that reports fractions says so.
  scale = 100.0 if cell.get('paper_unit') == 'fraction' else 1.0
  return {m: None if row.get(names.get(m, m)) is None else
          scale * row[names.get(m, m)] for m in cell['metrics']}
