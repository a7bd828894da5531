"""Every setting of a run, declared once; config keys (and flags) derive.

The core settings (data, engine, threat model, run) are declared here; each
method declares its own in its registry entry (`fedrobust.methods`), and
`all_settings()` names those `<method>_<name>` (or the bare name for a
setting several methods share). A run's config is a plain dict with one
key per setting: `defaults()` gives every key, `fedrobust.Federation`
takes such a dict, and the command-line runner defines one flag per key.

The choices of the registry-backed settings (method, aggregator, attack,
model_attack) are read from the registries when `all_settings()` is
called, so a rule registered after import is a valid choice.
"""

from __future__ import annotations

from typing import Any

from fedrobust.aggregators import AGGREGATORS, PRE_AGGREGATORS
from fedrobust.attacks import ATTACKS, MODEL_ATTACKS
from fedrobust.data import DATASETS, PARTITIONERS
from fedrobust.engine.delay import DELAY_KINDS
from fedrobust.engine.execution import CLIENT_DATA, STRATEGIES
from fedrobust.errors import SettingError
from fedrobust.local import LOCAL_OPTIMIZERS
from fedrobust.methods import METHODS
from fedrobust.models import COMPUTE_DTYPES, CONV_IMPLS, MODELS, PIPELINES
from fedrobust.settings import Setting
from fedrobust.transforms import TRANSFORMS

S = Setting
CORE: tuple[Setting, ...] = (
    # What runs.
    S('method', 'fedavg', 'Federated method.', choices=tuple(sorted(
        METHODS))),
    S('dataset', 'fashion_mnist', 'Dataset (fashion_mnist and idx read IDX '
      'files, mnist_5k the MNIST subset ./setup.sh fetches, vader_* the '
      'text corpora of ./setup.sh --text; the others read prepared TFDS '
      'data from --data_dir).',
      choices=tuple(sorted(DATASETS))),
    S('data_dir', None, "Dataset directory (default: the dataset's standard "
      'location).'),
    S('model', 'simple_cnn', 'Architecture (one cohort; see --cohorts).',
      choices=tuple(sorted(MODELS))),
    S('input_pipeline', 'native', 'How stored images reach the model: '
      'native ((x/255-0.5)/0.5) or sdfc_release (resize to 32x32, '
      'normalise by 0.1307/0.3081, random crops while training).',
      choices=tuple(sorted(PIPELINES))),
    S('cohorts', '', 'Several architectures in one federation: '
      'model:share,... (e.g. simple_cnn:0.5,row_lstm:0.5); clients are '
      'assigned by a seeded draw, recorded in client_histograms.json. '
      'Empty: one cohort of --model.'),
    # Federation and data.
    S('num_clients', 10, 'Clients in the federation (K).'),
    S('clients_per_round', 0, 'Clients sampled per round (C); 0 means all. '
      'With --cohorts each cohort gets its share.'),
    S('sample_strata', 1, 'Split the client ids into this many equal '
      'contiguous blocks and draw clients_per_round / strata from each '
      'block every round (uniform within a block); 1: one uniform draw. '
      '--client_data=sharded needs a multiple of the device count.'),
    S('partition', 'dirichlet', 'How training data is split over clients.',
      choices=tuple(sorted(PARTITIONERS))),
    S('dirichlet_alpha', 0.5, 'Dirichlet label-skew alpha.'),
    S('classes_per_client', 2, 'Pathological partition k.'),
    S('quantity_alpha', 0.5, 'Dirichlet alpha of client sizes '
      '(quantity_skew).'),
    S('validation_fraction', 0.0, 'Share of the training split held out as '
      'the server validation reserve (SDFC: 0.1).'),
    S('validation_size', 0, 'Clean server validation samples drawn from the '
      'reserve (SDFC: 256).'),
    S('public_size', 0, 'Public examples carved from the training split '
      '(central pretraining, distillation).'),
    S('local_test_fraction', 0.1, "Share of each client's data kept as its "
      'local test split (Horus uses 0.2).'),
    S('unseen_clients', 0, 'Newcomers: this many more clients are '
      'partitioned with the --num_clients that train, never take part, and '
      'after the last round each adapts the model a new client gets '
      '(fresh adapter on it) for --unseen_epochs on its own data; '
      'unseen_accuracy is their mean on their own test splits (HiLoRA '
      'Sec. 5.1 holds out 20%). Spread over the domains when the '
      'partition has them.'),
    S('unseen_epochs', 5, "Newcomers' local fine-tuning epochs."),
    S('max_train_examples', 0, 'Subsample the training split (0: use all).'),
    S('max_test_examples', 0, 'Evaluate on a seeded random subset of this '
      'many examples of the test split (0: all of it), for quick runs.'),
    S('global_test_per_class', 0, 'Evaluate on a seeded, class-balanced '
      'sample of this many test images per class (Horus); 0: the whole '
      'test split.'),
    # Parameter transform (what clients train and send).
    S('transform', 'identity', 'What clients train: identity (the full '
      'model), lora (frozen model + LoRA factors), select (the full '
      'parameters of chosen layers), width (HeteroFL submodels).',
      choices=tuple(sorted(TRANSFORMS))),
    S('lora_ranks', '8', 'LoRA rank, or comma-separated ranks assigned to '
      'clients by a seeded draw (heterogeneous ranks).'),
    S('lora_alpha', 0.0, 'LoRA alpha (scale alpha/r); 0: the largest rank.'),
    S('lora_targets', 'all', 'Layers that get LoRA: roles (first, head), '
      'all, random2 (two fixed random middle layers) or globs over module '
      'paths, comma-separated.'),
    S('select_targets', 'first,head', 'Layers whose full parameters '
      '--transform=select trains (roles, all, random2 or globs).'),
    S('width_ratios', '1', 'Width ratio(s) p in (0, 1] of --transform=width, '
      'comma-separated; assigned to clients by a seeded draw.'),
    S('width_variant', 'heterofl', 'Width slicing: heterofl (a prefix of '
      'every layer), fedrolex (a window rolling by one unit per round) or '
      'fjord (ordered dropout: each local step trains the prefix of a width '
      "drawn from the ratios up to the client's).",
      choices=('heterofl', 'fedrolex', 'fjord')),
    S('width_redraw', False, 'Each client draws its width ratio from '
      "--width_ratios afresh every round (FedHAN's d_{t,i}) instead of "
      'keeping the one it was dealt.'),
    S('pretrain_epochs', 0, 'Epochs of central training on the public split '
      '(--public_size) before federated training (the frozen base of '
      '--transform=lora).'),
    S('pretrain_lr', 0.0, 'Learning rate of the central pretraining (the '
      '--local_optimizer kind); 0: --local_lr.'),
    S('pretrained_dir', '', 'Keep centrally pretrained models here (orbax, '
      'verified by a content hash): the first run with --pretrain_epochs '
      'stores its model, and every later run that would pretrain the same '
      'one (same public examples, model, optimiser, epochs and seed) reads '
      'it back instead. Empty: pretrain in the run, store nothing.'),
    S('client_delay', 'none', 'Semi-asynchronous rounds: none, uniform:MAX '
      'or exponential:MEAN[:MAX] rounds of delay per update (' +
      '|'.join(DELAY_KINDS) + ').'),
    S('max_arrivals', 0, 'With --client_delay: the server takes at most '
      'this many of the updates due in a round (per cohort), oldest first; '
      'the rest wait a round longer. The aggregator then works on these '
      'rows only instead of the whole in-flight buffer (faster when the '
      'buffer is large). 0: every due update. At least clients_per_round.'),
    S('train_on_arrival', False, 'With --client_delay and --max_arrivals: '
      'train each client in the round its update is taken, from the stored '
      'global model of the round it started in. Same math; the state keeps '
      'a ticket per client and --max_staleness + 1 models instead of '
      '(max_delay + 1) * clients_per_round updates, so every client can be '
      'in flight (--clients_per_round=0) with the server taking '
      "--max_arrivals a round: FedHAN's N/K staleness."),
    S('max_staleness', 0, 'With --train_on_arrival: updates older than this '
      'many rounds when taken are dropped (the model ring keeps this many + '
      '1 global models; 0: the delay cap).'),
    # Local and server optimisation.
    S('num_rounds', 20, 'Communication rounds.'),
    S('local_epochs', 1, 'Local epochs per round.'),
    S('batch_size', 64, 'Local batch size.'),
    S('local_optimizer', 'sgd', 'Client optimizer: sgd (PyTorch-style, with '
      '--momentum) or adamw (decoupled --weight_decay, linear warm-up over '
      '--warmup_fraction of the local steps).',
      choices=LOCAL_OPTIMIZERS),
    S('local_lr', 0.02, 'Client learning rate.'),
    S('momentum', 0.9, 'Client SGD momentum.'),
    S('weight_decay', 1e-5, 'Client weight decay (SGD: added to the '
      'gradient; AdamW: decoupled).'),
    S('warmup_fraction', 0.0, 'AdamW: share of the local steps of a round '
      'over which the learning rate rises linearly from 0.'),
    S('server_lr', 1.0, 'Server step on the aggregated update.'),
    # Threat model and aggregation.
    S('aggregator', 'auto', "Server aggregation rule; auto: the method's "
      '(FedAvg: weighted_mean, by client size; SDFC: fdagg).',
      choices=('auto',) + tuple(sorted(AGGREGATORS))),
    S('aggregator_kwargs', '{}', 'JSON object of extra aggregator settings, '
      'e.g. {"m": 5}.'),
    S('pre_aggregator', 'none', 'A pre-aggregation step composed with any '
      'rule: nearest-neighbour mixing (nnm), bucketing, or adaptive robust '
      'clipping (arc).', choices=('none',) + tuple(sorted(PRE_AGGREGATORS))),
    S('pre_aggregator_kwargs', '{}', 'JSON object of extra pre-aggregator '
      'settings, e.g. {"bucket_size": 2}.'),
    S('num_byzantine', -1, 'f the aggregator tolerates (-1: the expected '
      'attackers among the sampled clients).'),
    S('attack', 'none', 'Attack run by the malicious clients.',
      choices=('none',) + tuple(sorted(ATTACKS))),
    S('attack_kwargs', '{}', 'JSON object of extra attack settings, e.g. '
      '{"direction": "sign"}.'),
    S('malicious_fraction', 0.0, 'Share of clients that are malicious.'),
    S('resample_malicious', False, 'Draw the malicious set afresh every '
      'round instead of fixing it.'),
    S('exclude_malicious', False, 'The malicious clients never take part: '
      'the Retrain baseline of recovery (training from scratch without '
      'the attackers, same data split and schedule).'),
    S('attack_start_round', 1, 'First round attackers act (Horus: 20).'),
    S('attacker_every_round', False, 'From --attack_start_round on, every '
      "round's sample holds at least one attacker (FedHAN's detector "
      'setting); needs a fixed malicious set.'),
    S('attacker_knowledge', 'benign_stats', 'What model-poisoning attackers '
      'may read: every benign update (benign_stats, or its other name '
      "omniscient: NDSS'21's full knowledge), only their own honest "
      "updates (partial, NDSS'21's partial knowledge), or nothing beyond "
      'their own update (own_updates_only).',
      choices=('benign_stats', 'omniscient', 'partial', 'own_updates_only')),
    S('model_attack', 'none', 'A model-space attack applied to the updates '
      'of a data attack\'s clients (e.g. --attack=badnets '
      '--model_attack=scaling: a boosted backdoor).',
      choices=('none',) + tuple(sorted(MODEL_ATTACKS))),
    S('model_attack_kwargs', '{}', 'JSON object of --model_attack settings, '
      'e.g. {"factor": 5}.'),
    S('backdoor_target_label', 2, 'Backdoor / targeted-flip target class.'),
    S('trigger_location', 'top_left', 'Where the BadNets/DBA trigger sits.',
      choices=('top_left', 'top_right', 'bottom_left', 'bottom_right',
               'center')),
    S('trigger_size', '2x6', 'Trigger HxW in pixels (the block pattern).'),
    S('trigger_pattern', 'block', 'Trigger layout: a solid block, or the '
      "SDFC release's rows 0 and 2 at columns 0-2 and 4-6 (sdfc_rows).",
      choices=('block', 'sdfc_rows')),
    S('backdoor_eval', 'exclude_target', 'Attack success rate over triggered '
      'test images of other classes (exclude_target), or over all of them '
      "(all; the SDFC release's R).", choices=('exclude_target', 'all')),
    S('trigger_value', 255, 'Trigger pixel value.'),
    S('poison_fraction', 0.5, "Share of a malicious client's data that is "
      'poisoned.'),
    S('flip_source_label', -1, 'Label flip: -1 flips every label y -> '
      'classes-1-y; >= 0 flips this class to --backdoor_target_label.'),
    S('blend_alpha', 0.2, 'Blended-trigger opacity.'),
    S('neurotoxin_mask', 0.0, "Neurotoxin's masking on top of any data "
      "attack: the attackers project every local gradient off this share of "
      'coordinates, those the clean gradient at the round\'s start moves '
      "most (0: off; --attack=neurotoxin is BadNets with 0.1)."),
    # Run, evaluation, checkpoints.
    S('eval_every', 1, 'Evaluate every this many rounds.'),
    S('log_clients', True, 'Log per-client values in metrics.jsonl (id, '
      'attacking, aggregation weight, per-client metrics such as SDFC\'s '
      'T_k) with their AUC against the attackers, and plot clients.png.'),
    S('tensorboard', True, 'Write every metrics row as TensorBoard scalars '
      'under <workdir>/tensorboard/ (tensorboard --logdir reads them).'),
    S('eval_batch_size', 500, 'Evaluation batch size.'),
    S('checkpoint_every', 5, 'Checkpoint every this many rounds (and always '
      'at the end).'),
    S('checkpoints_keep', 2, 'Checkpoints kept on disk.'),
    S('checkpoint_compress', False, 'zstd-compress new checkpoints: smaller '
      'files (much smaller for a state of mostly zeros, such as a young '
      'FedHAN cache), but a save then holds about 1.8x the state in '
      'memory; either kind restores.'),
    S('seed', 0, 'Seed of the partition, sampling and init.'),
    S('num_seeds', 1, 'Replicas of the federation run as one compiled '
      'program, with seeds seed, seed+1, ..., seed+num_seeds-1 (each its '
      'own partition, attackers, initial model and sampling); results are '
      "each replica's, their mean and std."),
    S('replica_batch', 0, 'Replicas a step runs side by side (vmapped); '
      'the others run one after another inside the program. 0: auto, 1 '
      'on CPU (bitwise the single runs), all of them on GPU/TPU.'),
    S('workdir', None, 'Run directory (default: '
      'runs/<method>_<dataset>_<model>_s<seed>).'),
    S('overwrite', False, 'Discard an existing run in --workdir whose config '
      "differs (only the runner's own files are removed), or start over "
      'when none of its checkpoints is good.'),
    S('force_overwrite', False, "With --overwrite: remove the runner's files "
      'even when the workdir also holds other files (those stay).'),
    S('on_divergence', 'stop', 'When the aggregated global model is not '
      'finite: stop (exit non-zero, the diverged round is not '
      "checkpointed), skip_round (drop the round's update and count it), "
      'or continue (the run then ends as diverged).',
      choices=('stop', 'skip_round', 'continue')),
    # Execution (never changes the math beyond float reassociation).
    S('client_execution', 'auto', 'How clients run: vmap, chunked vmap or '
      'sequential lax.map; auto picks per backend.',
      choices=('auto',) + STRATEGIES),
    S('chunk_size', 0, 'Clients per chunk (chunked); 0 picks min(C, 16).'),
    S('scan_unroll', 1, 'Unroll factor of the local-step scan (0: fully '
      'unrolled).'),
    S('conv_impl', 'auto', 'Convolution lowering; auto picks per backend.',
      choices=('auto',) + CONV_IMPLS),
    S('compute_dtype', 'auto', 'Activation/matmul dtype (params and '
      'optimizer stay float32); auto: bfloat16 on TPU, float32 elsewhere.',
      choices=('auto',) + COMPUTE_DTYPES),
    S('num_devices', 0, 'Devices the client axis is sharded over (0: all '
      'of them, every process\'s under --distributed).'),
    S('client_data', 'replicated', "Clients' training data on the mesh: "
      'replicated (every device holds all of it) or sharded (each device '
      'holds its block of client ids, and under --distributed each process '
      'places only its own devices\' rows). Sharded needs --sample_strata '
      'a multiple of the device count; same results as replicated data '
      'with the same strata.', choices=CLIENT_DATA),
    S('cpu_devices', 0, 'XLA devices the host CPU is split into when '
      'running on CPU (0: auto, up to one per available core: the fewest '
      'that give the shortest round, and with sharded client data a '
      'divisor of --sample_strata); clients on different devices train '
      'side by side.'),
)

# Changing these on resume is not a config change.
RESUMABLE_KEYS = frozenset({
    'num_rounds', 'eval_every', 'eval_batch_size', 'checkpoint_every',
    'checkpoints_keep', 'checkpoint_compress', 'workdir', 'overwrite',
    'force_overwrite',
    'on_divergence', 'log_clients', 'unseen_epochs', 'tensorboard'})
# Changing these on resume is allowed (same math, other program), but the
# final parameters then match an uninterrupted run only within float
# tolerance, not bitwise. Method settings declared with execution=True
# join them (EXECUTION_KEYS, below).
_CORE_EXECUTION_KEYS = frozenset({
    'client_execution', 'chunk_size', 'scan_unroll', 'conv_impl',
    'num_devices', 'cpu_devices', 'pretrained_dir', 'client_data',
    'replica_batch'})


def method_flag(method: str, setting: Setting) -> str:
  return setting.name if setting.shared else f'{method}_{setting.name}'


def method_settings() -> dict[str, tuple[str, Setting]]:
  """flag -> (owning method, Setting) for every method's declared setting.

  A shared setting is owned by the first method declaring it; every method
  that declares it must declare it alike.
  """
  out: dict[str, tuple[str, Setting]] = {}
  for method, spec in METHODS.items():
    for setting in spec.settings:
      flag = method_flag(method, setting)
      if flag in out and out[flag][1] != setting:
        raise AssertionError(f'setting {flag} is declared differently by '
                             f'{out[flag][0]} and {method}')
      out.setdefault(flag, (method, setting))
  return out


def execution_keys() -> frozenset[str]:
  """Settings that only change how a result is computed (a resume may
  change them): the core ones and every registered method's, as the
  registry is now."""
  return _CORE_EXECUTION_KEYS | frozenset(
      flag for flag, (_, setting) in method_settings().items()
      if setting.execution)


# The built-in methods' (execution_keys() also sees registered ones).
EXECUTION_KEYS = execution_keys()


def _registry_choices() -> dict[str, tuple[str, ...]]:
  return {'method': tuple(sorted(METHODS)),
          'aggregator': ('auto',) + tuple(sorted(AGGREGATORS)),
          'attack': ('none',) + tuple(sorted(ATTACKS)),
          'model_attack': ('none',) + tuple(sorted(MODEL_ATTACKS))}


def core_settings() -> tuple[Setting, ...]:
  """CORE, with the registry-backed choices as the registries are now."""
  fresh = _registry_choices()
  return tuple(s._replace(choices=fresh[s.name]) if s.name in fresh else s
               for s in CORE)


def all_settings() -> dict[str, Setting]:
  """config key -> Setting, core and method settings together."""
  out = {s.name: s for s in core_settings()}
  for flag, (_, setting) in method_settings().items():
    if flag in out:
      raise AssertionError(f'method setting {flag} clashes with a core flag')
    out[flag] = setting._replace(name=flag)
  return out


def defaults() -> dict[str, Any]:
  """The default config: one key per flag."""
  return {name: s.default for name, s in all_settings().items()}


def settings_of(method: str, config: dict[str, Any]) -> dict[str, Any]:
  """{factory kwarg: value} of `method`'s declared settings in `config`."""
  spec = METHODS[method]
  return {s.kwarg: config[method_flag(method, s)] for s in spec.settings}


def check_foreign_settings(config: dict[str, Any]) -> None:
  """A setting of another method, changed from its default, is refused."""
  method = config['method']
  own = {method_flag(method, s) for s in METHODS[method].settings}
  for flag, (owner, setting) in method_settings().items():
    if flag not in own and config.get(flag, setting.default) != \
        setting.default:
      raise SettingError(flag, f'is a setting of method={owner}, not '
                         f'method={method}')
