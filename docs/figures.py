"""Draws the docs' figures from checked-in result tables.

  .venv/bin/python docs/figures.py

docs/img/untargeted_heatmap.png: final test accuracy of each robust rule
(rows) under each untargeted attack (columns) on Fashion-MNIST, from
experiments/results/untargeted_fmnist.csv (one seed per cell).
"""

import csv
import os

import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, 'experiments', 'results', 'untargeted_fmnist.csv')
OUT = os.path.join(ROOT, 'docs', 'img', 'untargeted_heatmap.png')


def heatmap(source: str = SOURCE, out: str = OUT) -> None:
  with open(source) as f:
    rows = [r for r in csv.DictReader(f) if r['status'] == 'ok']
  attacks = ['none'] + sorted({r['attack'] for r in rows} - {'none'})
  counts = {}
  for r in rows:
    counts[r['aggregator']] = counts.get(r['aggregator'], 0) + 1
  rules = sorted(a for a, n in counts.items() if n >= 4)
  grid = np.full((len(rules), len(attacks)), np.nan)
  for r in rows:
    if r['aggregator'] in rules:
      grid[rules.index(r['aggregator']),
           attacks.index(r['attack'])] = 100 * float(r['test_accuracy'])
  fig, ax = plt.subplots(figsize=(1.1 * len(attacks) + 2,
                                  0.38 * len(rules) + 1.5))
  image = ax.imshow(grid, cmap='viridis', vmin=10, vmax=90, aspect='auto')
  ax.set_xticks(range(len(attacks)), attacks, rotation=30, ha='right')
  ax.set_yticks(range(len(rules)), rules)
  for i in range(len(rules)):
    for j in range(len(attacks)):
      if not np.isnan(grid[i, j]):
        ax.text(j, i, f'{grid[i, j]:.0f}', ha='center', va='center',
                fontsize=7, color='white' if grid[i, j] < 60 else 'black')
  ax.set_title('Test accuracy (%) of robust rules under untargeted attacks\n'
               'Fashion-MNIST, 20% attackers, one seed per cell')
  fig.colorbar(image, ax=ax, shrink=0.8)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)


if __name__ == '__main__':
  heatmap()
  print(OUT)
