"""A run's summary: summary.json's content, the plots and the printed table.

`summarize` gathers the final metrics, the status, the cohorts' bytes, the
method's own description, timings, versions and the model's hash;
`write_outputs` writes summary.json and the curves; `format_summary` is what
the command line prints.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedrobust import Federation
from fedrobust.cohort import Cohort
from fedrobust.checkpoint import is_primary
from fedrobust.engine.round import all_finite
from fedrobust.federation import combine_rows
from fedrobust.methods import METHODS, fedlora
from fedrobust.transforms.base import get_path


PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'chex',
            'numpy', 'tensorflow-datasets', 'absl-py')


def upload_bytes(cohort: Cohort, template: Any) -> dict[str, int]:
  """Bytes a client of each spec uploads per round (float32 coordinates it
  owns), keyed by spec ('' without specs)."""
  t = cohort.transform
  values = t.spec_values or (None,)
  out = {}
  for v in values:
    cov = t.coverage(template, None if v is None else jnp.float32(v),
                     jnp.int32(0))
    if cov is None:
      count = sum(int(np.prod(leaf.shape)) for leaf in
                  jax.tree.leaves(template))
    else:
      count = int(sum(float(jnp.sum(c)) for c in jax.tree.leaves(cov)))
    out['' if v is None else f'{t.spec_name}={v:g}'] = 4 * count
  return out


def lora_communication(method: str, cohort: Cohort, template: Any, *,
                       anchors: int, classes: int) -> dict[str, Any] | None:
  """Per-round (upload, download) bytes of one client, by rank, for the
  federated-LoRA methods (fedlora.communication_bytes; RFD-LoRA Table 2);
  None for other methods or transforms."""
  if cohort.transform.name != 'lora':
    return None
  modules = {p: (int(get_path(template, p)['a'].shape[0]),
                 int(get_path(template, p)['b'].shape[1]))
             for p in fedlora.lora_modules(template)}
  r_max = int(get_path(template, next(iter(modules)))['a'].shape[1])
  ranks = [int(v) for v in cohort.specs] if cohort.transform.spec_values \
      else [r_max] * len(cohort.members)
  # FLoRA's download is the stack of the round's adapters: the mean
  # client's rank times the clients a round.
  per_round = (tuple(ranks) if cohort.clients_per_round == len(ranks) else
               (float(np.mean(ranks)),) * cohort.clients_per_round)
  out, up, down = {}, [], []
  for r in sorted(set(ranks)):
    u, d = fedlora.communication_bytes(
        method, modules, rank=r, round_ranks=per_round,
        head=(cohort.model.roles or {}).get('head'), anchors=anchors,
        classes=classes)
    out[f'rank={r}'] = {'upload': int(u), 'download': int(d)}
  for r in ranks:
    up.append(out[f'rank={r}']['upload'])
    down.append(out[f'rank={r}']['download'])
  out['mean'] = {'upload': float(np.mean(up)), 'download': float(np.mean(down))}
  return out


def params_sha256(params: Any) -> str:
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
  return digest.hexdigest()


def package_versions() -> dict[str, str]:
  out = {}
  for name in PACKAGES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = 'not installed'
  return out


def device_info() -> dict[str, Any]:
  devices = jax.devices()
  return {'backend': jax.default_backend(), 'device_kind':
          devices[0].device_kind, 'device_count': len(devices),
          'process_count': jax.process_count()}


def plot_clients(path: str, rows: list[dict[str, Any]], title: str) -> None:
  """Per-client values by round (red: attacking): the aggregation weight
  share and, where the method has one, its score (SDFC's T_k)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows = [r for r in rows if 'clients' in r]
  panels = [k for k in ('weight', 'fisher_discrepancy',
                        'fisher_discrepancy_incoming')
            if k in rows[0]['clients']]
  if not panels:
    return
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6),
                           squeeze=False)
  for ax, key in zip(axes[0], panels):
    for r in rows:
      c = r['clients']
      values = np.asarray(c[key], np.float64)
      if key == 'weight' and values.sum() > 0:
        values = values / values.sum()
      colors = ['tab:red' if m else 'tab:blue' for m in c['malicious']]
      ax.scatter([r['round']] * len(values), values, c=colors, s=12)
    ax.set_xlabel('round')
    ax.set_ylabel('weight share' if key == 'weight' else key)
    ax.grid(alpha=0.3)
  axes[0][0].set_title(f'{title}: red = attacking', fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_curves(path: str, rows: list[dict[str, Any]], title: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  rounds = [r['round'] for r in rows]
  keys = [('test_accuracy', 'global test'),
          ('local_accuracy', 'local test (mean over clients)'),
          ('attack_success_rate', 'attack success')]
  variants = sorted({k.split('/', 1)[1] for r in rows for k in r
                     if k.startswith('test_accuracy/')})
  keys += [(f'test_accuracy/{v}', f'global test: {v}') for v in variants]
  for key, label in keys:
    values = [r.get(key) for r in rows]
    if any(v is not None for v in values):
      line, = ax.plot(rounds, values, marker='.', label=label)
      spread = [r.get(key + '_std') for r in rows]
      if all(v is not None for v in values + spread):
        # Replicas (--num_seeds): the mean and a band of one std.
        mean, std = np.asarray(values), np.asarray(spread)
        ax.fill_between(rounds, mean - std, mean + std, alpha=0.2,
                        color=line.get_color(), linewidth=0)
  ax.set_xlabel('round')
  ax.set_ylabel('accuracy')
  ax.set_ylim(0, 1)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


HEADLINE = ('test_accuracy', 'local_accuracy', 'local_accuracy_p10',
            'personal_accuracy', 'personal_accuracy_p10',
            'attack_success_rate',
            'backdoor_failure_rate', 'tradeoff_v', 'robust_accuracy',
            'clean_target_rate')


def _last5(rows: list[dict[str, Any]]) -> dict[str, float]:
  """The headline metrics' means over the last 5 evaluated rounds (the
  SDFC paper reports A, R and V so)."""
  out = {}
  keys = sorted({k for r in rows[-5:] for k in r
                 if k.split('/', 1)[0] in HEADLINE})
  for key in keys:
    values = [r[key] for r in rows[-5:] if r.get(key) is not None]
    if values:
      out[key] = float(np.mean(values))
  return out


def _cohort_summary(fed: Federation, state) -> dict[str, Any]:
  """Per cohort: model, clients, transform, bytes uploaded and (LoRA
  methods) communicated."""
  program = fed.program
  trainables = jax.eval_shape(lambda s: s.params, state)
  full = fed.param_shapes()
  spec = METHODS[fed.config['method']]
  anchors = (int(program.server_data['anchors'].shape[0])
             if 'anchors' in program.server_data else 0)
  cohorts = {c.name: {'model': c.model.name, 'clients': len(c.members),
                      'clients_per_round': c.clients_per_round,
                      'transform': c.transform.name,
                      'upload_bytes_per_client': upload_bytes(
                          c, trainables[j]),
                      'full_model_bytes': 4 * sum(
                          int(np.prod(l.shape))
                          for l in jax.tree.leaves(full[j]))}
             for j, c in enumerate(program.cohorts)}
  communication = {
      c.name: (lora_communication(
          fed.config['method'], c, trainables[j], anchors=anchors,
          classes=int(program.setup.num_classes))
               if spec.lora_communication else None)
      for j, c in enumerate(program.cohorts)}
  return {'cohorts': cohorts, 'communication': communication}


def replica_rows(rows: list[dict[str, Any]], num_seeds: int
                 ) -> list[list[dict[str, Any]]]:
  """Each replica's own rows of a run's (combined) rows."""
  if num_seeds == 1:
    return [rows]
  return [[r['replicas'][i] for r in rows if 'replicas' in r]
          for i in range(num_seeds)]


def summarize(fed: Federation, state, progress,
             timing: dict[str, Any]) -> dict[str, Any]:
  """summary.json's content. With replicas (--num_seeds) 'final' and
  'final_mean_last5' hold the means over the replicas with '<key>_std'
  beside them, 'replicas' each replica's own summary (seed, status,
  finals, params_sha256) and 'params_sha256' one hash per replica."""
  config, program = fed.config, fed.program
  workdir = config['workdir']
  each = [_replica_summary(fed.replica(i), fed.replica_state(state, i),
                           own, progress.skipped_each[i],
                           progress.diverged_each[i], progress)
          for i, own in enumerate(replica_rows(progress.rows,
                                                fed.num_seeds))]
  if fed.num_seeds == 1:
    first = each[0]
  else:
    first = {
        'status': next((e['status'] for e in each
                        if e['status'] not in ('completed', 'stopped')),
                       'completed'),
        'final_mean_last5': combine_rows(
            [e['final_mean_last5'] for e in each], fed.seeds),
        'params_sha256': [e['params_sha256'] for e in each],
        'replicas': [dict(e, seed=seed, client_size=size)
                     for e, seed, size in zip(each, fed.seeds,
                                              fed.client_sizes)]}
    first['final_mean_last5'].pop('replicas', None)
  one = fed.replica(0)
  return {
      'status': first['status'],
      'final': progress.rows[-1] if progress.rows else {},
      'final_mean_last5': first['final_mean_last5'],
      'rounds_completed': int(np.max(np.asarray(state.round))),
      'skipped_rounds': progress.skipped,
      'diverged_round': progress.diverged_at,
      'config': {k: v for k, v in config.items()
                 if k not in ('overwrite', 'force_overwrite')},
      'resolved': {k: v for k, v in program.resolved.items()
                   if k != 'backend'},
      **_cohort_summary(one, fed.replica_state(state, 0)),
      **{k: v for k, v in first.items()
         if k not in ('status', 'final_mean_last5')},
      **timing,
      'packages': package_versions(),
      'device': device_info(),
      'files': {name: os.path.abspath(os.path.join(workdir, file))
                for name, file in (('summary', 'summary.json'),
                                   ('curves', 'curves.png'),
                                   ('metrics', 'metrics.jsonl'))},
  }


def _replica_summary(fed: Federation, state, rows, skipped, diverged_at,
                     progress) -> dict[str, Any]:
  """One replica's status, finals, method description, newcomers and
  params hash."""
  program = fed.program
  final_finite = bool(jax.device_get(all_finite(state.params)))
  status = 'completed' if final_finite and not (
      diverged_at and fed.config['on_divergence'] == 'stop') else 'diverged'
  if status == 'completed' and progress.preempted_at:
    status = 'preempted'
  if (status == 'completed' and progress.diverged_at and
      fed.config['on_divergence'] == 'stop'):
    status = 'stopped'           # another replica diverged: all stopped
  newcomers = {}
  if program.unseen is not None and status == 'completed':
    newcomers = fed.adapt_unseen(state)
  describe = program.method.describe
  return {
      'status': status,
      'final': rows[-1] if rows else {},
      'final_mean_last5': _last5(rows),
      'skipped_rounds': skipped,
      'diverged_round': diverged_at,
      **(describe(state.method_state, program.setup.client_groups)
         if describe is not None else {}),
      **newcomers,
      'params_sha256': params_sha256(state.params)}


def client_aucs(clients: dict[str, list]) -> dict[str, float | None]:
  """For each per-client score s: P(s of a malicious client > s of a
  benign one), ties 1/2 (None without both kinds). For 'weight' it is the
  chance an attacker outweighs a benign client (low is good); for SDFC's
  T (fisher_discrepancy) high means T flags attackers."""
  mal = np.asarray(clients['malicious'], bool)
  out = {}
  for name, values in clients.items():
    if name in ('id', 'malicious'):
      continue
    v = np.asarray(values, np.float64)
    if not mal.any() or mal.all() or not np.all(np.isfinite(v)):
      out[name] = None
      continue
    diff = v[mal][:, None] - v[~mal][None, :]
    out[name] = float(np.mean((diff > 0) + 0.5 * (diff == 0)))
  return out


def _fmt(value: float | None) -> str:
  return 'nan' if value is None or not np.isfinite(value) else f'{value:.4f}'


def format_summary(summary: dict[str, Any]) -> str:
  """The few lines a run ends with: outcome, metrics, time, files."""
  final, last5 = summary['final'], summary['final_mean_last5']
  names = (('test_accuracy', 'A (global test acc)'),
           ('local_accuracy', 'local test acc'),
           ('attack_success_rate', 'ASR'),
           ('backdoor_failure_rate', 'R = 1 - ASR'),
           ('tradeoff_v', 'V = (A + R) / 2'),
           ('robust_accuracy', 'RA (triggered, true labels)'),
           ('clean_target_rate', 'clean target rate (ASR floor)'))
  lines = [f"run {summary['status']}: {summary['rounds_completed']} rounds "
           f"in {summary['wall_seconds']:.0f} s"]
  if summary['skipped_rounds']:
    lines[0] += (f" ({len(summary['skipped_rounds'])} skipped as "
                 f"non-finite: {summary['skipped_rounds']})")
  def value(row, key):
    out = _fmt(row.get(key))
    if row.get(key + '_std') is not None:
      out += f" ± {_fmt(row[key + '_std'])}"
    return out

  seeds = final.get('seeds')
  if seeds:
    lines.append(f'  {len(seeds)} seeds {seeds}: mean ± std (ddof 1) over '
                 'them')
  for key, label in names:
    if final.get(key) is not None or last5.get(key) is not None:
      lines.append(f'  {label:<30} final {value(final, key)}   last-5 '
                   f'mean {value(last5, key)}')
  files = summary['files']
  lines.append(f"  summary  {files['summary']}")
  lines.append(f"  curves   {files['curves']}")
  return '\n'.join(lines)


def write_outputs(fed: Federation, summary: dict[str, Any], rows,
                  writers) -> None:
  """summary.json (through the run's writers) and, on the primary
  process, curves.png and clients.png."""
  config = fed.config
  workdir = config['workdir']
  writers.json(os.path.join(workdir, 'summary.json'), summary)
  if rows and is_primary():
    title = (f"{config['method']} / {config['dataset']} / "
             f"{config['cohorts'] or config['model']}")
    plot_curves(os.path.join(workdir, 'curves.png'), rows, title + (
        f' ({fed.num_seeds} seeds, mean ± std)' if fed.num_seeds > 1
        else ''))
    first = replica_rows(rows, fed.num_seeds)[0]     # the first seed's
    if any('clients' in r for r in first):
      plot_clients(os.path.join(workdir, 'clients.png'), first,
                   title + (f" seed {config['seed']}" if fed.num_seeds > 1
                            else ''))
