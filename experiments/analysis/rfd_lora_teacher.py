r"""RFD-LoRA's teacher against its student, from a run's checkpoints.

  python experiments/main.py --flagfile=experiments/configs/rfd_lora_movies_quick.flags \
      --checkpoint_every=1 --checkpoints_keep=3 --workdir=RUN
  python experiments/analysis/rfd_lora_teacher.py --workdir=RUN

RFD-LoRA's global model (the student W0 + S) learns the task only from the
clients' logits on the public anchors (Algorithm 1). Its clean accuracy
can fall short of a parameter-averaging baseline for two different
reasons: the clients' own models are weak (the teacher is), or the
anchors carry their knowledge to the student badly (the transfer is).
This tool tells them apart for round R (the run's last, or --round):
it restores the student the clients received in round R (step R - 1)
and the adapters they trained in it (step R), rebuilds every client's
model z_k(x) = x(W0 + S + alpha/r_k B_k A_k) (rfd_lora.client_model in
fedrobust.methods) and scores on the run's clean and triggered test sets:
- each client's model (clean accuracy, ASR; mean, min and max);
- the teacher: the server's consensus (rfd_distill.consensus with the
  run's settings) of the clients' clipped logits, taken on the test
  inputs as if they were anchors, and the plain mean of the logits;
- the student after round R's distillation (step R), and how often it
  gives a test input the teacher's class.

Checks that the analysis sees what the run saw: `student_matches_run`
(the student's clean accuracy against metrics.jsonl at round R) and
`anchor_share_gap` (each client's share of anchors in its top class,
recomputed, against the run's per-client log; 0 when every client's
upload is rebuilt, up to the log's float32 rounding). Nothing is written
to the workdir.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import config as config_lib
from experiments import train
from experiments import workdir as workdir_lib
from fedrobust.checkpoint import Checkpointer
from fedrobust.cohort import member_positions
from fedrobust.engine.evaluate import backdoor_rates, pad_to_batches
from fedrobust.methods.rfd_lora import distill as rfd_distill
from fedrobust.methods.rfd_lora import (client_model, cohort_specs,
                                        label_prior_offset, top_class_share)


def _confusion(pred: np.ndarray, true: np.ndarray, c: int) -> np.ndarray:
  out = np.zeros((c, c))
  np.add.at(out, (true, pred), 1.0)
  return out


def analyze(workdir: str, round_: int | None = None,
            key: int = 0) -> dict[str, Any]:
  """The teacher and student of the RFD-LoRA run in `workdir` at round
  `round_` (default: its last saved step); see the module doc.

  Raises:
    ValueError: the workdir holds no RFD-LoRA run, or lacks the steps R
      and R - 1 (the run must save every round: --checkpoint_every=1).
  """
  config, program, fresh, template = train.open_run(workdir, 'rfd_lora')
  cohort = program.cohorts[0]
  transform = cohort.transform
  settings = config_lib.settings_of('rfd_lora', config)
  store = Checkpointer(os.path.join(workdir, 'checkpoints'))
  steps = store.steps()
  r = steps[-1] if round_ is None and steps else round_
  if r is None or r < 1 or r not in steps or (r > 1 and r - 1 not in steps):
    raise ValueError(
        f'--workdir={workdir}: round {r} needs the steps {r} and {r - 1} '
        f'(the student the clients received; round 1 needs only step 1), '
        f'and the run kept {steps}; rerun it with --checkpoint_every=1')
  after = store.restore(r, template)
  before = (store.restore(r - 1, template) if r > 1 else None)
  store.close()
  base = after.method_state.base
  student_in = (before.params[0] if before is not None else
                train.initial_server_state(
                    program, config, fresh, data=program.setup.train,
                    server_data=program.server_data).params[0])
  student_out = after.params[0]

  # The runner's own reader of its logs (a line cut by a kill is dropped;
  # rewrite=False leaves the files as they are).
  log = lambda name: {row['round']: row for row in workdir_lib.read_metrics(
      os.path.join(workdir, name), r, rewrite=False)}
  rows = log('rounds.jsonl')
  logged = rows.get(r, {}).get('clients', {})
  ids = np.asarray(logged.get('id', np.arange(config['num_clients'])),
                   np.int32)
  specs = cohort_specs(cohort)
  positions = np.asarray(member_positions(program.cohorts)[0])
  adapters = after.method_state.adapters

  @jax.jit
  def client_logits(base, student, own, spec, xb):
    apply, own = client_model(transform, base, student, own, spec,
                                 jnp.int32(r))
    return jax.lax.map(lambda b: apply(own, b), xb).astype(jnp.float32)

  @jax.jit
  def student_logits(base, student, xb):
    full = transform.merge(base, student, None)
    return jax.lax.map(lambda b: cohort.model.apply(full, b),
                       xb).astype(jnp.float32)

  x, y, mask = (np.asarray(a) for a in program.setup.test)
  keep = mask.reshape(-1)
  y = y.reshape(-1)[keep]
  if program.threat.triggered_test is None:
    raise ValueError(f'--workdir={workdir} ran without a backdoor attack '
                     '(no triggered test set to score the ASR on)')
  tx, target, ttrue = program.threat.triggered_test
  target = int(target[0])
  exclude = not np.any(ttrue == target)
  # Built here in full (the triggered inputs are lazy: data.RowTable).
  tb = tuple(np.asarray(a) for a in pad_to_batches(tx, ttrue, x.shape[1]))
  tkeep = tb[2].reshape(-1)
  anchors = program.server_data['anchors']
  ab = pad_to_batches(np.asarray(anchors), np.zeros(len(anchors), np.int32),
                      x.shape[1])
  akeep = ab[2].reshape(-1)
  flat = lambda z, k: np.asarray(z).reshape((-1,) + z.shape[2:])[k]

  clean, trig, anch = [], [], []
  for i in ids:
    own = jax.tree.map(lambda a, p=positions[i]: a[p], adapters)
    spec = None if specs is None else specs[i]
    clean.append(flat(client_logits(base, student_in, own, spec, x), keep))
    trig.append(flat(client_logits(base, student_in, own, spec, tb[0]),
                     tkeep))
    anch.append(flat(client_logits(base, student_in, own, spec, ab[0]),
                     akeep))
  clean, trig, anch = (np.stack(a) for a in (clean, trig, anch))
  c = clean.shape[-1]
  if settings['prior_correction']:      # as the clients' uploads are
    train_y, count = program.setup.train.y, program.setup.train.count
    offset = np.stack([np.asarray(label_prior_offset(
        jnp.asarray(train_y[i]), jnp.asarray(count[i]), c)) for i in ids])
    clean, trig, anch = (z - offset[:, None, :] for z in (clean, trig, anch))

  def scores(pred_clean, pred_trig):
    rates = backdoor_rates(_confusion(pred_clean, y, c),
                           _confusion(pred_trig, ttrue, c), target,
                           exclude_target=exclude)
    return {'clean_accuracy': float(np.mean(pred_clean == y)),
            'attack_success_rate': float(rates['attack_success_rate']),
            'clean_target_rate': float(rates['clean_target_rate'])}

  per = [scores(np.argmax(a, -1), np.argmax(b, -1))
         for a, b in zip(clean, trig)]
  kwargs = dict(aggregator=settings['consensus'], groups=settings['groups'],
                clip=settings['clip'], temperature=settings['temperature'],
                kappa=settings['kappa'], tau=settings['tau'],
                rho=settings['rho'], cat=settings['cat'], dis=settings['dis'])
  present = jnp.ones(len(ids), bool)
  # Jitted as in the server step: run eagerly, its per-anchor vmap lowers
  # every operation on its own (minutes for a few hundred inputs).
  consensus = jax.jit(lambda key, z: rfd_distill.consensus(
      key, z, present, **kwargs).logits)

  def teacher(z, k):
    return np.argmax(np.asarray(consensus(jax.random.key(k),
                                          jnp.asarray(z))), -1)

  clip = lambda z: np.clip(z, -settings['clip'], settings['clip'])
  mean_pred = lambda z: np.argmax(clip(z).mean(0), -1)
  t_clean, t_trig = teacher(clean, key), teacher(trig, key + 1)
  s_clean = flat(student_logits(base, student_out, x), keep)
  s_trig = flat(student_logits(base, student_out, tb[0]), tkeep)
  s_pred = np.argmax(s_clean, -1)
  student = scores(s_pred, np.argmax(s_trig, -1))
  run_ca = log('metrics.jsonl').get(r, {}).get('test_accuracy')

  out: dict[str, Any] = {
      'round': r, 'clients': ids.tolist(),
      'malicious': logged.get('malicious'),
      'clients_clean_accuracy': [p['clean_accuracy'] for p in per],
      'clients_attack_success_rate': [p['attack_success_rate'] for p in per],
      'client_mean': {k: float(np.mean([p[k] for p in per])) for k in per[0]},
      'client_min_clean_accuracy': float(min(p['clean_accuracy']
                                             for p in per)),
      'client_max_clean_accuracy': float(max(p['clean_accuracy']
                                             for p in per)),
      'teacher': scores(t_clean, t_trig),
      'teacher_mean_logits': scores(mean_pred(clean), mean_pred(trig)),
      'student': student,
      'student_teacher_agreement': float(np.mean(s_pred == t_clean)),
      'student_matches_run': (None if run_ca is None else
                              bool(abs(run_ca - student['clean_accuracy'])
                                   < 1e-6)),
      'run_test_accuracy': run_ca}
  if 'anchor_top_share' in logged:
    shares = [float(top_class_share(jnp.asarray(clip(a)))) for a in anch]
    out['anchor_share_gap'] = float(np.max(np.abs(
        np.asarray(shares) - np.asarray(logged['anchor_top_share']))))
  return out


def main(argv):
  del argv
  f = flags.FLAGS
  print(json.dumps(analyze(f.workdir, f.round, f.key), indent=1))


if __name__ == '__main__':
  # Defined here, not at import: the runner's flags (experiments/main.py)
  # also have --workdir, and tests import both modules.
  flags.DEFINE_string('workdir', None, 'An RFD-LoRA run directory, saved '
                      'every round (--checkpoint_every=1).')
  flags.DEFINE_integer('round', None, "The round (default: the run's last "
                       'saved step).')
  flags.DEFINE_integer('key', 0, "PRNG seed of the teacher's MoM groups.")
  flags.mark_flag_as_required('workdir')
  app.run(main)
