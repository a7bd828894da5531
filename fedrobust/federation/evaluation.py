"""Evaluation of a federation's models: global, local and backdoor metrics.

`Evaluator` places the test sets on the devices once and evaluates every
model a method reports (`Method.eval_models`); `adapt_unseen` scores the
newcomers that never took part.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from fedrobust import adapt
from fedrobust.engine import place_clients
from fedrobust.engine.evaluate import (backdoor_rates, evaluations,
                                       pad_leading, pad_to_batches, rebatch)
from fedrobust.federation.builder import Program


def _fmt(value: float | None) -> str:
  return 'n/a' if value is None else f'{value:.4f}'


def no_local(n: int) -> dict[str, np.ndarray]:
  """The per-client local metrics of clients without a local test split."""
  return {'count': np.zeros(n), 'accuracy': np.zeros(n)}


class Evaluator:
  """Global, local and backdoor accuracy of every model a method reports.

  For one cohort the headline model's metrics are `test_accuracy`,
  `local_accuracy`, ...; other models (width submodels, cohorts) add
  `<metric>/<label>`. With several cohorts the headline numbers are the
  member-weighted means over the cohorts' global models, and
  local_accuracy is the mean over all clients of their own cohort's model.
  A per-client model set (private backbones) is evaluated client by
  client, as Horus does: global accuracy is the mean over clients of their
  own model's accuracy on the global test set, local accuracy the mean of
  their own model on their own local test split.

  With a mesh of several devices the evaluations split over it
  (engine.evaluate.evaluations): the global and triggered sets' batches,
  and the clients of the local test splits, each device evaluating its
  share once instead of every device evaluating everything. The sets'
  inputs are lazy (data.RowTable) through the padding and re-cuts, so
  under several processes each process builds, and sends to its devices,
  only its own share of the global, triggered and local test sets; the
  labels and masks (small) are whole on every process.
  """

  def __init__(self, program: Program, put, eval_batch_size: int,
               mesh=None):
    self.cohorts = program.cohorts
    self.num_clients = program.setup.train.count.shape[0]
    self.mesh = mesh if mesh is not None and mesh.size > 1 else None
    self.test = self.place_set(program.setup.test, put)
    lt = program.setup.local_test
    self.local_tests = [self.place_local(tuple(a[np.asarray(c.members)]
                                                 for a in lt), put)
                        for c in self.cohorts]
    # Without local test splits (local_test_fraction=0) the per-client
    # local evaluation would run every client over padding: skip it.
    self.has_local = [bool(np.any(np.asarray(lt[2])[np.asarray(c.members)]))
                      for c in self.cohorts]
    self._fns = [self._compile(c.model.apply) for c in self.cohorts]
    self._own_apply: dict[Any, dict[str, Any]] = {}
    # The triggered inputs, scored against their true labels: one pass
    # gives ASR and RA (engine.evaluate's confusion); the clean target rate
    # comes from the clean test pass.
    self.triggered = None
    if program.threat.triggered_test is not None:
      x, target, true = program.threat.triggered_test
      self.target = int(target[0]) if len(target) else 0
      # Edge-case inputs have no true class (their "true" label is the
      # target): no RA, and the clean floor over non-target inputs.
      self.no_true_class = bool(len(true)) and bool(np.all(true ==
                                                           self.target))
      self.exclude_target = (self.no_true_class or
                             not np.any(true == self.target))
      self.triggered = self.place_set(pad_to_batches(
          x, true, eval_batch_size), put)

  def place_set(self, batches, put):
    """One evaluation set [T, B, ...] on the devices: whole (`put`), or
    with its batches split over the mesh."""
    if self.mesh is None:
      return put(tuple(map(jnp.asarray, batches)))
    return place_clients(rebatch(*batches, self.mesh.size), self.mesh,
                         'sharded')

  def place_local(self, tree, put):
    """Per-client sets [K, ...] on the devices: whole (`put`), or split
    over the mesh by client, padded with empty clients to a multiple of
    its size (`clients` and `own` cut outputs back to K)."""
    if self.mesh is None:
      return put(jax.tree.map(jnp.asarray, tree))
    return place_clients(pad_leading(tree, self.mesh.size), self.mesh,
                         'sharded')

  @staticmethod
  def _fetch(tree, k: int) -> dict[str, np.ndarray]:
    """Per-client outputs [K', ...] to the host, cut to the first k; a
    split output is gathered from every process."""
    if jax.process_count() > 1:
      tree = multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree.map(lambda a: np.asarray(a)[:k], jax.device_get(tree))

  def clients(self, fns, params, local, k: int) -> dict[str, np.ndarray]:
    """One model on k clients' placed local sets (`place_local`)."""
    return self._fetch(fns['clients'](params, *local), k)

  def own(self, fns, params, index, local, k: int) -> dict[str, np.ndarray]:
    """Row index[i] of a stacked model set on client i's placed local set,
    for k clients."""
    index = self.place_local(np.asarray(index, np.int32), jnp.asarray)
    return self._fetch(fns['own'](params, index, local), k)

  def _compile(self, apply) -> dict[str, Any]:
    """The jitted evaluations of one forward `apply`: 'test' (a model on
    one set), 'clients' (a model on every client's local test), 'rows'
    (each row of a stacked model set on one set) and 'own' (client k's row
    on its own local test); engine.evaluate.evaluations."""
    return evaluations(apply, self.mesh)

  def for_cohort(self, j: int) -> dict[str, Any]:
    """The evaluations of cohort j's Model."""
    return self._fns[j]

  def fns(self, m) -> dict[str, Any]:
    """The evaluations for EvalModel m: its cohort Model's, or those of
    the method's own forward (m.apply), compiled once."""
    if m.apply is None:
      return self.for_cohort(m.cohort)
    if m.apply not in self._own_apply:
      self._own_apply[m.apply] = self._compile(m.apply)
    return self._own_apply[m.apply]

  def __call__(self, models) -> dict[str, Any]:
    row: dict[str, Any] = {}
    own_local: dict[int, float] = {}
    per_cohort: dict[int, dict[str, float]] = {}
    for m in models:
      c = self.cohorts[m.cohort]
      members = list(c.members)
      if m.per_client:
        values = self._per_client(m)
        suffix = f'/{m.label}' if m.label else ''
        row.update({k + suffix: v for k, v in values.items()
                    if k != '_own'})
        per_cohort[m.cohort] = values
        own_local.update(values['_own'])
        continue
      test = jax.device_get(self.fns(m)['test'](m.params, *self.test))
      local = (self.clients(self.fns(m), m.params,
                            self.local_tests[m.cohort], len(members))
               if self.has_local[m.cohort] else no_local(len(members)))
      wanted = set(m.clients) if m.clients is not None else set(members)
      pick = np.array([i in wanted for i in members])
      has = (np.asarray(local['count']) > 0) & pick
      values = {'test_accuracy': float(test['accuracy']),
                'test_loss': float(test['loss']),
                'local_accuracy': (float(np.mean(local['accuracy'][has]))
                                   if has.any() else None)}
      if self.triggered is not None:
        trig = jax.device_get(self.fns(m)['test'](m.params,
                                                      *self.triggered))
        values.update(self._backdoor(values['test_accuracy'],
                                     test['confusion'], trig['confusion']))
      suffix = f'/{m.label}' if m.label else ''
      row.update({k + suffix: v for k, v in values.items()})
      if m.clients is None:
        per_cohort[m.cohort] = values
        for i, ok, acc in zip(members, np.asarray(local['count']) > 0,
                              np.asarray(local['accuracy'])):
          if ok:
            own_local[i] = float(acc)
    # Personalisation (the personalised-FL papers' "mean" and "worst
    # 10%"), comparable across methods: every client's accuracy on its own
    # test split with its own model (the last per-client model a method
    # reports), else with its cohort's global model.
    mine = np.array(list(own_local.values()), np.float64)
    if mine.size:
      row['personal_accuracy'] = float(np.mean(mine))
      row['personal_accuracy_p10'] = float(np.percentile(mine, 10))
    if len(self.cohorts) > 1:
      share = np.array([len(c.members) for c in self.cohorts], np.float64)
      share /= share.sum()
      for key in ('test_accuracy', 'test_loss', 'attack_success_rate',
                  'backdoor_failure_rate', 'tradeoff_v', 'robust_accuracy',
                  'clean_target_rate'):
        if key in per_cohort[0]:
          row[key] = float(sum(s * per_cohort[j][key]
                               for j, s in enumerate(share)))
      row['local_accuracy'] = (float(np.mean(list(own_local.values())))
                               if own_local else None)
    return row


  def _per_client(self, m) -> dict[str, Any]:
    """A model per client: mean over clients of their own model's global
    accuracy (and ASR), and of its accuracy on their own local test. With
    `m.index` clients share rows (one submodel per width), so each
    distinct model is evaluated on the global sets once."""
    members = list(self.cohorts[m.cohort].members)
    index = (np.arange(len(members), dtype=np.int32) if m.index is None
             else np.asarray(m.index, np.int32))
    rows_fn = self.fns(m)['rows']
    global_m = jax.device_get(rows_fn(m.params, *self.test))
    local_m = (self.own(self.fns(m), m.params, index,
                        self.local_tests[m.cohort], len(members))
               if self.has_local[m.cohort] else no_local(len(members)))
    has = np.asarray(local_m['count']) > 0
    values = {'test_accuracy': float(np.mean(global_m['accuracy'][index])),
              'test_loss': float(np.mean(global_m['loss'][index])),
              'local_accuracy': (float(np.mean(local_m['accuracy'][has]))
                                 if has.any() else None),
              # The personalisation papers' tail: the 10th percentile of
              # the clients' own accuracies (HiLoRA's "worst 10%").
              'local_accuracy_p10': (float(np.percentile(
                  local_m['accuracy'][has], 10)) if has.any() else None),
              '_own': {i: float(a) for i, a, ok in zip(
                  members, np.asarray(local_m['accuracy']), has) if ok}}
    if self.triggered is not None:
      trig = jax.device_get(rows_fn(m.params, *self.triggered))
      values.update(self._backdoor(
          values['test_accuracy'],
          np.asarray(global_m['confusion'])[index],
          np.asarray(trig['confusion'])[index]))
    return values

  def _backdoor(self, test_accuracy: float, clean, triggered
                ) -> dict[str, float]:
    """ASR, RA and the clean target rate (means over leading rows)."""
    rates = {k: float(np.mean(v)) for k, v in backdoor_rates(
        clean, triggered, self.target,
        exclude_target=self.exclude_target).items()}
    asr = rates['attack_success_rate']
    if self.no_true_class:
      rates.pop('robust_accuracy')
    return dict(rates, backdoor_failure_rate=1 - asr,
                tradeoff_v=(test_accuracy + 1 - asr) / 2)


def adapt_unseen(program: Program, state, evaluator: 'Evaluator', put,
                 config: dict[str, Any]) -> dict[str, Any]:
  """The newcomers (unseen_clients): each adapts the model the method
  gives a new client for unseen_epochs on its own data
  (fedrobust.adapt) and is scored on its own test split. Returns
  summary entries: unseen_accuracy (mean over newcomers), its 10th
  percentile, the per-newcomer accuracies and, for a clustering method,
  the cluster each was routed to and unseen_route_accuracy (the share
  routed to a cluster whose members' majority domain is theirs)."""
  unseen = program.unseen
  t0 = time.perf_counter()
  local = program.local._replace(num_epochs=config['unseen_epochs'],
                                 unroll=1, poison=None)
  fn = jax.jit(functools.partial(
      adapt.adapt_newcomers, program.method, program.cohorts,
      local=local, optimizer=program.optimizer))
  params, info = fn(state, put(jax.tree.map(jnp.asarray, unseen.train)),
                    jax.random.key(config['seed'] + 7))
  k = unseen.train.count.shape[0]
  scores = evaluator.own(evaluator.for_cohort(0), params, np.arange(k),
                         evaluator.place_local(tuple(unseen.local_test),
                                                 put), k)
  has = np.asarray(scores['count']) > 0
  acc = np.asarray(scores['accuracy'])
  out = {'unseen_accuracy': float(np.mean(acc[has])) if has.any() else None,
         'unseen_accuracy_p10': (float(np.percentile(acc[has], 10))
                                 if has.any() else None),
         'unseen_client_accuracy': [float(a) for a in acc],
         'unseen_seconds': time.perf_counter() - t0}
  info = jax.device_get(info)
  if 'cluster' in info:
    routes = np.asarray(info['cluster']).astype(int)
    out['unseen_cluster'] = routes.tolist()
    assign = np.asarray(jax.device_get(state.method_state.assign))
    truth = program.setup.client_groups
    if unseen.client_groups is not None and truth is not None:
      majority = {j: np.bincount(truth[assign == j]).argmax()
                  for j in set(assign.tolist()) if j >= 0}
      out['unseen_groups'] = unseen.client_groups.tolist()
      out['unseen_route_accuracy'] = float(np.mean(
          [majority.get(r, -1) == g
           for r, g in zip(routes, unseen.client_groups)]))
  logging.info('newcomers: %d adapted for %d epochs, accuracy %s (%.1fs)',
               k, config['unseen_epochs'], _fmt(out['unseen_accuracy']),
               out['unseen_seconds'])
  return out
