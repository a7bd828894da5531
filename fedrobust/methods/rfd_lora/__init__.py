"""RFD-LoRA: robust federated distillation for LoRA (Algorithm 1).

Clients hold their own LoRA adapters, of different ranks r_k, and never
send them: after local training each client sends its logits on a public
anchor set, clipped to [-c, c] (Sec. 3.1, Eq. 4). The server turns the
round's logits into per-anchor targets with Median-of-Means, CAT, MMD
moments and DIS (fedrobust.methods.rfd_lora.distill, Eq. 5-9) and takes
gradient steps on the global student's adapter over the anchors
(Algorithm 1's last line).

As modules of the engine, on one cohort with the LoRA transform
(`--transform=lora --lora_ranks=2,4,8,16`):

  global params   the student's adapter S (the transform's trainable tree
                  at the largest rank, scale alpha / r_max); the global
                  model is W = W0 + S, the frozen base plus S merged
  client state    client k's own adapter (A_k, B_k) at its rank r_k,
                  "initialised, then continued" across rounds (Alg. 1)
  client update   E local epochs on z_k(x) = x(W + alpha/r_k B_k A_k)
                  (Alg. 1; the optimizer is the run's, App. G: AdamW with
                  a 10% warm-up), then the clipped logits on the anchors;
                  the upload is {'logits': [A, C]}, rank independent
  server update   consensus over the arrivals (rfd_distill.consensus),
                  then `server_steps` steps of SGD with lr gamma on
                  L_RFD(S) (rfd_distill.rfd_loss) over the anchors

Evaluated model: the global student W0 + S (CA, and ASR on triggered
inputs).

Deviations and assumptions (say so in results):
  * The paper freezes the task head; here the head is whatever the
    transform targets (the presets put LoRA on q, v and the head, for
    every method alike), since a fresh random head cannot be left frozen
    on a 2-class task with a small encoder.
  * "one gradient step per round" (App. G) is `server_steps` = 1 by
    default; its gamma (3e-5 for RoBERTa-large) is a setting to tune.
  * The anchors come from a domain the clients do not hold (App. G:
    "public corpora disjoint from private data"); the runner builds them
    (experiments/train.py, server data 'anchors'). Not in the paper: the
    clients' own dataset may be named, and then the anchors are training
    rows that no client holds (in-domain public data).
  * `prior_correction` (off by default; not in the paper): each client
    subtracts the centred log of its own label shares from its anchor
    logits before clipping (logit adjustment, Menon et al., ICLR 2021).
    Under label skew the consensus is otherwise a vote among the
    clients' label priors (BUILD_NOTES §3e).

References:
  RFD-LoRA (under review), Sec. 3-4, Algorithm 1, Appendix G-H.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedrobust.cohort import Cohort, member_positions
from fedrobust.engine.execution import spread_batch
from fedrobust.errors import SettingError
from fedrobust.local import LocalConfig, classification_loss, local_sgd
from fedrobust.methods.rfd_lora import distill as rfd_distill
from fedrobust.methods.base import MethodSpec, eval_models_of
from fedrobust.settings import Setting
from fedrobust.transforms.base import masked
from fedrobust.tree import gather_clients, scatter_clients
from fedrobust.types import ClientOutput, Method

Params = Any


def _class_counts(logits: jax.Array) -> jax.Array:
  """How many rows [A, C] have each class as their argmax: float[C]."""
  c = logits.shape[-1]
  return jnp.sum(jax.nn.one_hot(jnp.argmax(logits, -1), c), axis=0)


def top_class_share(logits: jax.Array) -> jax.Array:
  """The share of rows [A, C] whose argmax is the most frequent class: 1
  when a model gives every anchor the same class (collapse), 1/C at best
  balance."""
  return jnp.max(_class_counts(logits)) / logits.shape[0]


def top_class(logits: jax.Array) -> jax.Array:
  """The most frequent argmax class of rows [A, C] (the lower on a tie),
  as float32 for the metrics: which way a leaning model leans."""
  return jnp.argmax(_class_counts(logits)).astype(jnp.float32)


def label_prior_offset(y: jax.Array, count: jax.Array,
                       num_classes: int) -> jax.Array:
  """The centred log label shares of one client's first `count` labels
  y [N]: log p_c - mean_c log p_c, with p add-one smoothed so an absent
  class stays finite. Subtracted from logits it removes the client's
  label prior (logit adjustment); zero for balanced labels."""
  valid = jnp.arange(y.shape[0]) < count
  counts = jnp.sum(jax.nn.one_hot(y, num_classes) * valid[:, None], axis=0)
  log_p = jnp.log((counts + 1.0) / (count.astype(jnp.float32) + num_classes))
  return log_p - jnp.mean(log_p)


class RFDState(NamedTuple):
  base: Any            # the frozen base W0 (full params)
  adapters: Any        # every client's own adapter, leaves [K, ...]


def anchor_logits(apply_fn, params, anchors: jax.Array,
                  batch: int) -> jax.Array:
  """apply_fn(params, x) over anchors [A, ...] in batches -> [A, C]."""
  a = anchors.shape[0]
  batch = min(batch, a)
  t = -(-a // batch)
  pad = t * batch - a
  x = jnp.concatenate([anchors, jnp.zeros((pad,) + anchors.shape[1:],
                                          anchors.dtype)])
  # Under the round's device mesh each device takes its share of every
  # anchor batch (the server's distillation would otherwise run whole on
  # every device); the clients' own calls run inside their shard_map and
  # are left as they are.
  out = jax.lax.map(lambda xb: apply_fn(params, spread_batch(xb)),
                    x.reshape((t, batch) + anchors.shape[1:]))
  return out.reshape((t * batch,) + out.shape[2:])[:a]


def cohort_specs(cohort: Cohort) -> jax.Array | None:
  """The members' transform specs (LoRA ranks) as float32 [K], or None
  when the transform takes none."""
  return (jnp.asarray(cohort.specs, jnp.float32)
          if cohort.transform.spec_name and len(cohort.specs) else None)


def client_model(transform, base, student, own, spec, round_number):
  """Client k's model of Algorithm 1 and Eq. 4, z_k(x) = x(W + alpha/r_k
  B_k A_k) with W = W0 + S the merged student it received.

  Returns (apply, start): apply(t, x, *, train, key) runs the model with
  adapter t masked to the client's rank (its coverage), and start is its
  own adapter `own` so masked, where its local training begins.
  """
  cov = transform.coverage(own, spec, round_number)
  merged = transform.merge(base, student, None)

  def apply(t, x, *, train=False, key=None):
    return transform.apply(merged, masked(t, cov), x, spec=spec,
                           train=train, key=key)

  return apply, masked(own, cov)


def rfd_lora(*, cohorts: tuple[Cohort, ...], local: LocalConfig,
             optimizer: optax.GradientTransformation, aggregator=None,
             server_lr: float = 1.0, num_clients: int = 0,
             clip: float = 10.0, groups: int = 5, consensus: str = 'mom',
             temperature: float = 2.0, kappa: float = 2.0, tau: float = 0.7,
             lam: float = 0.1, rho: float = 1.0, cat: bool = True,
             mmd: str = 'mean_var', dis: bool = True,
             distill_lr: float = 3e-5, distill_steps: int = 1,
             distill_optimizer: str = 'sgd',
             anchor_batch: int = 128, anchor_dataset: str = 'vader_amazon',
             anchor_fraction: float = 0.1,
             prior_correction: bool = False) -> Method:
  """RFD-LoRA on one LoRA cohort.

  Args:
    cohorts: one cohort with the LoRA transform (ranks may differ).
    local, optimizer: the clients' local training.
    aggregator, server_lr: unused (the server distils; there is no
      parameter aggregate).
    num_clients: K (unused).
    clip: c (App. G: 10).
    groups, consensus: MoM's M (5) and 'mom' | 'mean' | 'median' (Table 3).
    temperature, kappa, tau, cat: CAT's T0, kappa, tau (Eq. 5; 2, 2, 0.7).
    lam, mmd: MMD-KD's lambda (0.1) and 'mean_var' | 'mean' | 'none'.
    rho, dis: DIS's rho (1) and switch.
    distill_lr, distill_steps: gamma and the server's gradient steps a
      round.
    distill_optimizer: 'sgd' (Algorithm 1's W <- W - gamma grad) or 'adam'
      (fresh state every round; a departure for small step budgets).
    anchor_batch: anchors per forward pass.
    anchor_dataset, anchor_fraction: read by the runner to build the
      anchors (server data 'anchors').
    prior_correction: subtract each client's centred log label shares
      from its anchor logits (label_prior_offset; not in the paper).
  """
  del aggregator, server_lr, num_clients, anchor_dataset
  if len(cohorts) != 1 or cohorts[0].transform.name != 'lora':
    raise SettingError('transform', 'rfd_lora trains LoRA adapters: it '
                       'takes one cohort with --transform=lora')
  rfd_distill.check_settings(aggregator=consensus, groups=groups, mmd=mmd,
                             temperature=temperature, kappa=kappa, tau=tau,
                             rho=rho, lam=lam, clip=clip)
  for name, value, ok in (('distill_lr', distill_lr, distill_lr >= 0),
                          ('distill_steps', distill_steps,
                           distill_steps >= 0),
                          ('anchor_batch', anchor_batch, anchor_batch >= 1),
                          ('distill_optimizer', distill_optimizer,
                           distill_optimizer in ('sgd', 'adam')),
                          ('anchor_fraction', anchor_fraction,
                           0 < anchor_fraction <= 1)):
    if not ok:
      raise SettingError(name, f'out of range: {value!r}',
                         component='method rfd_lora')
  cohort = cohorts[0]
  transform = cohort.transform
  specs = cohort_specs(cohort)
  positions = member_positions(cohorts)[0]

  def init(params, num_clients, key):
    del num_clients
    base, student = transform.init(params[0], jax.random.fold_in(key, 0))
    # Each client's own adapter: fresh A (its own draw), B = 0.
    own = [transform.init(params[0], jax.random.fold_in(key, 1 + m))[1]
           for m in cohort.members]
    own = jax.tree.map(lambda *leaves: jnp.stack(leaves), *own)
    return (student,), RFDState(base, own)

  def broadcast(state, j):
    del j
    return (state.method_state.base, state.params[0], state.round + 1)

  def client_state(method_state, j, ids):
    del j
    spec = () if specs is None else specs[ids]
    return spec, gather_clients(method_state.adapters, positions[ids])

  def client_update(j, broadcast, state, data, key, server_data):
    del j
    base, student, round_number = broadcast
    spec, own = state
    spec = None if isinstance(spec, tuple) else spec
    apply, start = client_model(transform, base, student, own, spec,
                                round_number)
    new, metrics = local_sgd(classification_loss(apply), start, data, key,
                             optimizer=optimizer, config=local)
    z = anchor_logits(apply, new, server_data['anchors'],
                      anchor_batch).astype(jnp.float32)
    if prior_correction:
      z = z - label_prior_offset(data.y[data.row], data.count,
                                 z.shape[-1])[None, :]
    z = jnp.clip(z, -clip, clip)
    metrics = {**metrics, 'anchor_top_share': top_class_share(z),
               'anchor_top_class': top_class(z)}
    return ClientOutput(delta={'logits': z},
                        weight=data.count.astype(jnp.float32),
                        client_state=new, metrics=metrics)

  def server_update(state, arrivals, key, server_data):
    arr = arrivals[0]
    base, student = state.method_state.base, state.params[0]
    anchors = server_data['anchors']
    target = rfd_distill.consensus(
        key, arr.outputs.delta['logits'], arr.mask, aggregator=consensus,
        groups=groups, clip=clip, temperature=temperature, kappa=kappa,
        tau=tau, rho=rho, cat=cat, dis=dis)

    def student_logits(s):
      return anchor_logits(
          lambda p, x: transform.apply(base, p, x, spec=None), s, anchors,
          anchor_batch)

    def loss(s):
      return rfd_distill.rfd_loss(student_logits(s), target, lam=lam,
                                  mmd=mmd)

    opt = (optax.adam(distill_lr) if distill_optimizer == 'adam' else
           optax.sgd(distill_lr))

    def step(_, carry):
      s, opt_state = carry
      update, opt_state = opt.update(jax.grad(loss)(s), opt_state, s)
      return optax.apply_updates(s, update), opt_state

    before = loss(student)
    student, _ = jax.lax.fori_loop(0, distill_steps, step,
                                   (student, opt.init(student)))
    # How far the steps got: the loss after them, and the share of anchors
    # whose class the student now gives as the consensus does.
    fitted = student_logits(student)
    after = rfd_distill.rfd_loss(fitted, target, lam=lam, mmd=mmd)
    agree = jnp.mean((jnp.argmax(fitted, -1) ==
                      jnp.argmax(target.logits, -1)).astype(jnp.float32))
    adapters = scatter_clients(state.method_state.adapters,
                               positions[arr.ids], arr.outputs.client_state,
                               arr.mask)
    info = {'distill_loss': before,
            'distill_loss_after': after,
            'distill_agreement': agree,
            'consensus_top_share': top_class_share(target.logits),
            'student_top_share': top_class_share(fitted),
            'consensus_top_class': top_class(target.logits),
            'student_top_class': top_class(fitted),
            'anchor_spread': jnp.mean(target.spread),
            'anchor_temperature': jnp.mean(target.temperature),
            'anchor_weight': jnp.mean(target.weight)}
    return (student,), RFDState(base, adapters), info

  def eval_models(state):
    return eval_models_of(cohorts, (state.method_state.base,), state.params)

  return Method('rfd_lora', init, broadcast, client_state, client_update,
                server_update, eval_models, provides=frozenset())


def _validate(settings: dict, aggregator: str) -> None:
  if aggregator not in ('auto', 'mean'):   # 'auto' resolves to 'mean'
    raise SettingError('aggregator', 'rfd_lora combines logits with its own '
                       'consensus (--rfd_lora_consensus=mom|mean|median); '
                       f'it takes no --aggregator, got {aggregator!r}')


RFD_LORA = MethodSpec(
    build=rfd_lora,
    lora_communication=True,
    summary='RFD-LoRA: clients with their own LoRA ranks send clipped anchor '
    'logits; the server distils a robust consensus (MoM, CAT, MMD, DIS).',
    settings=(
        Setting('clip', 10.0, 'Logit clipping radius c.'),
        Setting('groups', 5, "Median-of-Means groups M."),
        Setting('consensus', 'mom', 'Logit consensus: mom, mean or median '
                '(Table 3).', choices=rfd_distill.AGGREGATORS),
        Setting('temperature', 2.0, 'CAT base temperature T0.'),
        Setting('kappa', 2.0, 'CAT confidence scaling kappa.'),
        Setting('tau', 0.7, 'CAT confidence threshold tau.'),
        Setting('cat', True, 'Confidence-adaptive temperature (off: T = '
                'T0).'),
        Setting('lambda', 0.1, 'MMD-KD weight lambda.', arg='lam'),
        Setting('mmd', 'mean_var', 'MMD-KD moments: mean_var, mean or none.',
                choices=rfd_distill.MMD_MODES),
        Setting('rho', 1.0, 'DIS strength rho.'),
        Setting('dis', True, 'Disagreement suppression (off: w = 1).'),
        Setting('distill_lr', 3e-5, 'Server distillation learning rate '
                'gamma.'),
        Setting('distill_steps', 1, 'Server distillation steps a round.'),
        Setting('distill_optimizer', 'sgd', 'Server distillation optimizer: '
                'sgd (Algorithm 1) or adam (fresh state each round).',
                choices=('sgd', 'adam')),
        Setting('anchor_batch', 128, 'Anchors per forward pass.'),
        Setting('anchor_dataset', 'vader_amazon', 'Dataset the public '
                'anchors are drawn from: a domain the clients do not hold, '
                "or the clients' own dataset, whose training rows that "
                '--max_train_examples leaves out then serve as in-domain '
                'anchors (not in the paper).'),
        Setting('anchor_fraction', 0.1, 'Anchors as a share of the training '
                'examples (App. G: 10%).'),
        Setting('prior_correction', False, "Not in the paper: each client "
                "subtracts the centred log of its own label shares from its "
                "anchor logits before clipping (logit adjustment), so that "
                "under label skew the consensus is not a vote among the "
                "clients' label priors."),
    ),
    default_aggregator=lambda s: 'mean',   # built by the runner, unused
    validate=_validate,
    uses_aggregator=False,
    server_data=('anchors',))
