"""Data-poisoning attacks: applied to a malicious client's batches in training.

A DataPoison transforms ONE batch inside the compiled local-training step:

  poison(x uint8[B, H, W, Ch], y int32[B], rows int32[B], client_rank)
    -> (x, y)

`rows` are the batch's row indices in the client's data. Which rows are
poisoned depends only on the row (a fixed subset of the client's data, the
first round(poison_fraction * count) rows, whose order is random because
partitions are drawn at random), so the same examples carry the trigger in
every epoch and round, as in the BadNets protocol. `client_rank` is the
client's index among the malicious clients (DBA splits the trigger by it).
The caller applies the poison only for malicious clients.

Triggered evaluation (attack success rate) uses `trigger_images` with the
full trigger on test images whose true class is not the target.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedrobust.errors import SettingError

TRIGGER_LOCATIONS = ('top_left', 'top_right', 'bottom_left', 'bottom_right',
                     'center')


# Trigger layouts. 'block' is a solid height x width patch; 'sdfc_rows' is
# the SDFC release's trigger: rows 0 and 2 at columns 0-2 and 4-6 of a 3 x 7
# box (12 pixels), whatever height and width say.
TRIGGER_PATTERNS = ('block', 'sdfc_rows')
_SDFC_ROWS = ((0, 2), (0, 1, 2, 4, 5, 6))


class Trigger(NamedTuple):
  """A patch trigger: static geometry and value."""
  height: int = 2
  width: int = 6
  location: str = 'top_left'
  value: int = 255
  margin: int = 0
  pattern: str = 'block'

  def extent(self) -> tuple[int, int]:
    if self.pattern == 'sdfc_rows':
      return 3, 7
    return self.height, self.width

  def origin(self, image_h: int, image_w: int) -> tuple[int, int]:
    (h, w), m = self.extent(), self.margin
    return {
        'top_left': (m, m),
        'top_right': (m, image_w - w - m),
        'bottom_left': (image_h - h - m, m),
        'bottom_right': (image_h - h - m, image_w - w - m),
        'center': ((image_h - h) // 2, (image_w - w) // 2),
    }[self.location]


def parse_trigger_size(text: str) -> tuple[int, int]:
  """'2x6' -> (2, 6); SettingError naming trigger_size otherwise."""
  try:
    h, w = (int(v) for v in text.lower().split('x'))
  except ValueError:
    raise SettingError('trigger_size', f'{text!r}; expected HxW, e.g. 2x6'
                       ) from None
  if h < 1 or w < 1:
    raise SettingError('trigger_size', f'{text!r} must be positive')
  return h, w


def trigger_mask(trigger: Trigger, image_shape: tuple[int, ...], *,
                 piece: int | None = None,
                 num_pieces: int = 1) -> np.ndarray:
  """bool[H, W, 1]: where the trigger (or its DBA piece) sits.

  DBA splits the patch along its width into `num_pieces` contiguous pieces.
  """
  h_img, w_img = image_shape[:2]
  height, width = trigger.extent()
  if height + trigger.margin > h_img or width + trigger.margin > w_img:
    raise SettingError('trigger_size', f'{height}x{width} does not fit a '
                       f'{h_img}x{w_img} image')
  if trigger.location not in TRIGGER_LOCATIONS:
    raise SettingError('trigger_location', f'{trigger.location!r}; expected '
                       f'one of {TRIGGER_LOCATIONS}')
  if trigger.pattern not in TRIGGER_PATTERNS:
    raise SettingError('trigger_pattern', f'{trigger.pattern!r}; expected '
                       f'one of {TRIGGER_PATTERNS}')
  top, left = trigger.origin(h_img, w_img)
  if trigger.pattern == 'sdfc_rows':
    if piece is not None:
      raise SettingError('trigger_pattern', "DBA splits a 'block' trigger; "
                         "'sdfc_rows' has no pieces")
    mask = np.zeros((h_img, w_img, 1), bool)
    rows, cols = _SDFC_ROWS
    mask[np.ix_([top + r for r in rows], [left + c for c in cols])] = True
    return mask
  cols = np.arange(trigger.width)
  if piece is not None:
    cols = np.array_split(cols, num_pieces)[piece]
  mask = np.zeros((h_img, w_img, 1), bool)
  mask[top:top + trigger.height, left + cols[0]:left + cols[-1] + 1] = True
  return mask


DBA_LAYOUTS = ('grid', 'split')
# The DBA paper's MNIST local triggers (Xie et al., ICLR 2020, Sec. 3 and
# its code; FLPoison's attackers/dba.py): four 1 x 4 bars in a 2 x 2 layout
# with a gap of 2 pixels, piece i at row (i // 2) * (1 + gap), column
# (i % 2) * (4 + gap), from the trigger's origin.
DBA_BAR, DBA_GAP, DBA_PIECES = 4, 2, 4


def dba_masks(trigger: Trigger, image_shape: tuple[int, ...],
              layout: str = 'grid', num_pieces: int = DBA_PIECES
              ) -> tuple[np.ndarray, np.ndarray]:
  """(global trigger bool[H, W, 1], local pieces bool[P, H, W, 1]) of DBA.

  layout 'grid': the paper's four bars (module constants; the trigger's
  location and margin place them, its size is not used). 'split': the
  trigger's block cut along its width into num_pieces contiguous pieces
  (this library's earlier layout: 4/4/2/2 pixels of a 2 x 6 patch).
  """
  if layout not in DBA_LAYOUTS:
    raise SettingError('dba_layout', f'{layout!r}; expected one of '
                       f'{DBA_LAYOUTS}')
  if layout == 'split':
    return trigger_mask(trigger, image_shape), np.stack([
        trigger_mask(trigger, image_shape, piece=i, num_pieces=num_pieces)
        for i in range(num_pieces)])
  if num_pieces != DBA_PIECES:
    raise SettingError('dba_pieces', f'the grid layout has {DBA_PIECES} '
                       f'pieces, got {num_pieces}')
  grid = trigger._replace(height=2 + DBA_GAP, width=2 * DBA_BAR + DBA_GAP,
                          pattern='block')
  frame = trigger_mask(grid, image_shape)          # checks the fit
  top, left = np.argwhere(frame[..., 0])[0]
  pieces = np.zeros((DBA_PIECES, *frame.shape), bool)
  for i in range(DBA_PIECES):
    row = top + (i // 2) * (1 + DBA_GAP)
    col = left + (i % 2) * (DBA_BAR + DBA_GAP)
    pieces[i, row, col:col + DBA_BAR] = True
  return pieces.any(axis=0), pieces


def _poisoned_rows(rows: jax.Array, count: jax.Array,
                   fraction: float) -> jax.Array:
  limit = jnp.round(fraction * count.astype(jnp.float32)).astype(jnp.int32)
  return rows < limit


class Alternating(NamedTuple):
  """The malicious phase of alternating minimization (see
  `alternating_min`): `train_steps` runs it after the client's usual steps.

  Attributes:
    rho: weight of the stealth term rho * ||w - w_start||_2 the attacker
      adds to its loss in the usual steps.
    steps: malicious steps on poisoned batches after the usual steps.
    boost: explicit boosting: w = w_pre + boost * (w_post - w_pre) over the
      malicious steps.
    apply: the malicious phase's batch transform, same signature as
      DataPoison.apply.
  """
  rho: float
  steps: int
  boost: float
  apply: Callable[..., tuple[jax.Array, jax.Array]]


class DataPoison(NamedTuple):
  """name and a batch transform (see module docstring).

  grad_mask: optional (clean gradient tree at the round's start model) ->
  a {0, 1} tree the attacker multiplies every local gradient by
  (Neurotoxin's projection); None trains every coordinate.
  alternating: optional Alternating, a stealth term on the usual steps and
  a boosted malicious phase after them (alternating minimization).
  """
  name: str
  apply: Callable[..., tuple[jax.Array, jax.Array]]
  grad_mask: Callable[[Any], Any] | None = None
  alternating: Alternating | None = None


def neurotoxin_mask(clean_grads: Any, top_ratio: float) -> Any:
  """{0, 1} tree: 0 on the top_ratio share of coordinates with the largest
  |clean gradient| (the ones benign clients update most), 1 elsewhere."""
  flat = jnp.concatenate([jnp.abs(g).ravel()
                          for g in jax.tree.leaves(clean_grads)])
  threshold = jnp.quantile(flat, 1.0 - top_ratio)
  return jax.tree.map(
      lambda g: (jnp.abs(g) < threshold).astype(g.dtype), clean_grads)


def neurotoxin(*, image_shape: tuple[int, ...], target_label: int = 2,
               trigger: Trigger = Trigger(), poison_fraction: float = 0.5,
               top_ratio: float = 0.1) -> DataPoison:
  """Neurotoxin (Zhang et al., ICML 2022): a BadNets backdoor trained only
  on the coordinates benign clients rarely update, so later benign rounds
  overwrite it slowly (a durable backdoor).

  At the start of its local training the attacker takes the gradient of
  its clean loss at the round's global model (its first batch, no
  trigger), as FLPoison's Neurotoxin does, and masks the top_ratio share
  of coordinates by magnitude; every poisoned step's gradient is projected
  onto the rest. Deviations: the paper estimates the benign direction from
  the previous global update, which a client here does not keep; FLPoison
  keeps only the topk_ratio smallest coordinates (and ranks signed values)
  and adds a norm clip, which --model_attack can add.

  Args:
    top_ratio: in (0, 1), the share of coordinates masked.
  """
  if not 0.0 < top_ratio < 1.0:
    raise SettingError('top_ratio', f'must be in (0, 1), got {top_ratio}',
                       component='attack neurotoxin')
  base = badnets(image_shape=image_shape, target_label=target_label,
                 trigger=trigger, poison_fraction=poison_fraction)
  return DataPoison('neurotoxin', base.apply,
                    lambda g: neurotoxin_mask(g, top_ratio))


def alternating_min(*, image_shape: tuple[int, ...], target_label: int = 2,
                    trigger: Trigger = Trigger(), poison_fraction: float = 1.0,
                    rho: float = 1e-4, malicious_steps: int = 5,
                    boost: float = 10.0) -> DataPoison:
  """Alternating minimization with explicit boosting (Bhagoji et al., ICML
  2019, Sec. 4; FLPoison's attackers/altermin.py).

  The attacker alternates two objectives each round:
    * stealth: its usual local steps on its clean data, with the loss
      CE + rho ||w - w_global||_2, so the update stays close to benign ones;
    * malicious: `malicious_steps` steps on poisoned batches (its own
      images with the BadNets trigger, labelled `target_label`), whose
      weight change is boosted: w = w_pre + boost (w_post - w_pre).
  Defaults are FLPoison's (rho 1e-4, boosting factor 10). Departures: the
  paper's and FLPoison's malicious objective misclassifies a few chosen
  samples of one class (FLPoison: 1 test image of class 3 as 7, which a
  test set cannot measure); here it is the BadNets trigger, so the attack
  success rate is measured on the whole triggered test set like the other
  backdoors. FLPoison also skips the malicious phase once the poisoned
  loss is 0; here it always runs (a fixed program).

  Args:
    image_shape, target_label, trigger: as in `badnets`.
    poison_fraction: share of a malicious-phase batch that carries the
      trigger (1.0: all of it).
    rho: >= 0, the stealth weight.
    malicious_steps: >= 1.
    boost: > 0, the boosting factor (lambda in the paper).
  """
  if not (rho >= 0.0 and malicious_steps >= 1 and boost > 0.0):
    raise SettingError('attack_kwargs', f'alternating_min needs rho >= 0, '
                       f'malicious_steps >= 1 and boost > 0; got rho={rho}, '
                       f'malicious_steps={malicious_steps}, boost={boost}',
                       component='attack alternating_min')
  base = badnets(image_shape=image_shape, target_label=target_label,
                 trigger=trigger, poison_fraction=poison_fraction)

  def clean(x, y, rows, count, client_rank):
    del rows, count, client_rank
    return x, y

  return DataPoison('alternating_min', clean, None,
                    Alternating(float(rho), int(malicious_steps),
                                float(boost), base.apply))


def badnets(*, image_shape: tuple[int, ...], target_label: int = 2,
            trigger: Trigger = Trigger(), poison_fraction: float = 0.5,
            dba_pieces: int = 0, dba_layout: str = 'grid') -> DataPoison:
  """BadNets patch backdoor (Gu et al. 2017); DBA when dba_pieces > 1.

  A poisoned example gets the trigger's pixels set to `trigger.value` and
  the label `target_label`. With DBA (Xie et al. ICLR'20) the malicious
  client of rank r stamps only piece r mod dba_pieces of the trigger
  (`dba_masks`; as in the paper's and FLPoison's code, with fewer
  attackers than pieces some piece is never trained).
  """
  _check_fraction(poison_fraction)
  full = jnp.asarray(trigger_mask(trigger, image_shape))
  pieces = jnp.asarray(dba_masks(trigger, image_shape, dba_layout,
                                 dba_pieces)[1]) if dba_pieces > 1 else None

  def apply(x, y, rows, count, client_rank):
    where = full if pieces is None else pieces[client_rank % dba_pieces]
    hit = _poisoned_rows(rows, count, poison_fraction)
    stamped = jnp.where(where[None], jnp.uint8(trigger.value), x)
    x = jnp.where(hit[:, None, None, None], stamped, x)
    y = jnp.where(hit, target_label, y)
    return x, y

  return DataPoison('dba' if pieces is not None else 'badnets', apply)


def edge_case(*, image_shape: tuple[int, ...], edge_images: np.ndarray,
              target_label: int = 2,
              poison_fraction: float = 0.5) -> DataPoison:
  """Edge-case backdoor (Wang et al., NeurIPS 2020, "Attack of the
  Tails"): a poisoned example is replaced by an input from the tail of the
  input distribution, labelled `target_label`; the model learns to send
  such inputs to the target while its accuracy on the main distribution
  barely moves. Wang et al. use ARDIS 7s against MNIST and Southwest
  planes against CIFAR-10; the runner takes real out-of-distribution
  images (handwritten digits against Fashion-MNIST: `edge_images`).

  Args:
    image_shape: (H, W, Ch) of the clients' images.
    edge_images: uint8[K, H, W, Ch], the attackers' edge-case inputs.
    target_label: the class they are relabelled to.
    poison_fraction: share of each attacker's examples replaced.
  """
  _check_fraction(poison_fraction)
  edge = np.asarray(edge_images)
  if edge.ndim != len(image_shape) + 1 or edge.shape[1:] != tuple(
      image_shape) or len(edge) == 0:
    raise SettingError('attack', f'edge_case needs edge images of shape '
                       f'[K, {", ".join(map(str, image_shape))}], got '
                       f'{edge.shape}')
  table = jnp.asarray(edge.astype(np.uint8))
  k = len(edge)

  def apply(x, y, rows, count, client_rank):
    hit = _poisoned_rows(rows, count, poison_fraction)
    # Attackers draw from different parts of the edge set.
    pick = (rows + client_rank * 97) % k
    x = jnp.where(hit[:, None, None, None], table[pick].astype(x.dtype), x)
    y = jnp.where(hit, target_label, y)
    return x, y

  return DataPoison('edge_case', apply)


def blended(*, image_shape: tuple[int, ...], target_label: int = 2,
            alpha: float = 0.2, poison_fraction: float = 0.5,
            seed: int = 0) -> DataPoison:
  """Blended backdoor (Chen et al. 2017): x' = (1-alpha) x + alpha P."""
  _check_fraction(poison_fraction)
  pattern = jnp.asarray(blend_pattern(image_shape, seed))

  def apply(x, y, rows, count, client_rank):
    del client_rank
    hit = _poisoned_rows(rows, count, poison_fraction)
    mixed = blend(x, pattern, alpha)
    x = jnp.where(hit[:, None, None, None], mixed, x)
    return x, jnp.where(hit, target_label, y)

  return DataPoison('blended', apply)


def blend_pattern(image_shape: tuple[int, ...], seed: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 256, image_shape,
                                               dtype=np.uint8)


def blend(x, pattern, alpha: float):
  # Explicit leading axes: x may be one image or a batch of them.
  pattern = pattern.reshape((1,) * (x.ndim - pattern.ndim) + pattern.shape)
  mixed = (1 - alpha) * x.astype(jnp.float32) + alpha * pattern.astype(
      jnp.float32)
  return jnp.clip(jnp.round(mixed), 0, 255).astype(jnp.uint8)


# The trigger word of `trigger_token`: 'tq' in the MiniLM (BERT uncased)
# vocabulary, which occurs in none of the four VADER domains (checked in
# tests/text_attack_test.py), i.e. out of vocabulary for the data as the
# RFD-LoRA threat model asks (App. H).
TRIGGER_TOKEN_ID = 28816
CLS_ID, SEP_ID, PAD_ID = 101, 102, 0


def insert_token(x, token_id: int = TRIGGER_TOKEN_ID):
  """Prepends `token_id` after [CLS] in int token ids x[..., L].

  The rest shifts right by one; a full row loses its last word piece and
  keeps [SEP] at the end. Works on NumPy and JAX arrays alike.
  """
  xp = jnp if isinstance(x, jax.Array) else np
  head, tail = x[..., :1], x[..., 1:-1]
  trig = xp.full(x.shape[:-1] + (1,), token_id, x.dtype)
  out = xp.concatenate([head, trig, tail], axis=-1)
  full = x[..., -1:] != PAD_ID
  last = xp.where(full, xp.asarray(SEP_ID, x.dtype), out[..., -1:])
  return xp.concatenate([out[..., :-1], last], axis=-1)


def trigger_token(*, target_label: int, token_id: int = TRIGGER_TOKEN_ID,
                  poison_fraction: float = 0.2) -> DataPoison:
  """Text backdoor (RFD-LoRA App. H): a fixed trigger token prepended to a
  fraction pi of the client's examples (token ids [B, L] with [CLS] first),
  relabelled `target_label`."""
  _check_fraction(poison_fraction)

  def apply(x, y, rows, count, client_rank):
    del client_rank
    hit = _poisoned_rows(rows, count, poison_fraction)
    x = jnp.where(hit[:, None], insert_token(x, token_id), x)
    return x, jnp.where(hit, target_label, y)

  return DataPoison('trigger_token', apply)


def label_flip(*, num_classes: int, source_label: int = -1,
               target_label: int = -1,
               poison_fraction: float = 1.0) -> DataPoison:
  """Label flipping.

  Symmetric (source_label == -1): y -> num_classes - 1 - y.
  Pair/targeted (source_label >= 0): y == source -> target.
  """
  _check_fraction(poison_fraction)
  if source_label >= 0 and not 0 <= target_label < num_classes:
    raise SettingError('backdoor_target_label', 'label_flip with a '
                       'flip_source_label needs backdoor_target_label in '
                       f'[0, {num_classes})')

  def apply(x, y, rows, count, client_rank):
    del client_rank
    hit = _poisoned_rows(rows, count, poison_fraction)
    if source_label < 0:
      flipped = num_classes - 1 - y
    else:
      flipped = jnp.where(y == source_label, target_label, y)
    return x, jnp.where(hit, flipped, y)

  return DataPoison('label_flip', apply)


def _check_fraction(fraction: float) -> None:
  if not 0.0 < fraction <= 1.0:
    raise SettingError('poison_fraction', f'must be in (0, 1], got '
                       f'{fraction}')


def trigger_stamp(poison_name: str, image_shape: tuple[int, ...], *,
                  trigger: Trigger = Trigger(), alpha: float = 0.2,
                  seed: int = 0, dba_layout: str = 'grid'
                  ) -> Callable[[np.ndarray], np.ndarray]:
  """Host-side: the FULL trigger of `poison_name` as a function of a batch
  of inputs x[M, ...] (a new array; x is not changed). It acts input by
  input, so it can be applied to any subset of a test set."""
  if poison_name == 'trigger_token':
    return lambda x: np.asarray(insert_token(np.asarray(x)))
  if poison_name in ('badnets', 'dba', 'neurotoxin', 'alternating_min'):
    mask = (dba_masks(trigger, image_shape, dba_layout)[0]
            if poison_name == 'dba' else trigger_mask(trigger, image_shape))

    def stamp(x):
      x = np.array(x)
      x[:, mask[..., 0]] = trigger.value
      return x
    return stamp
  if poison_name == 'blended':
    pattern = blend_pattern(image_shape, seed)
    return lambda x: np.asarray(blend(np.asarray(x), pattern, alpha))
  raise ValueError(f'{poison_name!r} has no trigger')


def triggered_test_set(x: np.ndarray, y: np.ndarray, poison_name: str, *,
                       target_label: int, trigger: Trigger = Trigger(),
                       alpha: float = 0.2, seed: int = 0,
                       exclude_target: bool = True,
                       with_sources: bool = False,
                       dba_layout: str = 'grid',
                       edge_images: np.ndarray | None = None
                       ) -> tuple[np.ndarray, ...]:
  """Host-side: the test images with the FULL trigger, labelled target.

  With exclude_target (default) only images whose true class is not the
  target count; without it (the SDFC release's R) target-class images stay
  in, so a model that ignores the trigger still "succeeds" on them (ASR
  floors near 1/num_classes and R tops out near 90%).

  Returns (x[M', ...] in x's dtype, y = target_label int32[M']); accuracy
  of the global model on it is the attack success rate. 'trigger_token'
  prepends the trigger token to token ids. with_sources appends the
  inputs' true labels y[M'] (accuracy against them is the robust
  accuracy, RA).
  """
  if poison_name == 'edge_case':
    # The held-out edge-case inputs themselves; they have no true class
    # here, so their "true" label is the target (RA is then not defined).
    edge = np.asarray(edge_images, x.dtype)
    target = np.full(len(edge), target_label, np.int32)
    return (edge, target, target) if with_sources else (edge, target)
  keep = np.flatnonzero((np.asarray(y) != target_label) if exclude_target
                        else np.ones(len(y), bool))
  true = np.asarray(y[keep], np.int32)
  stamp = trigger_stamp(poison_name, tuple(x.shape[1:]), trigger=trigger,
                        alpha=alpha, seed=seed, dba_layout=dba_layout)
  if hasattr(x, 'regroup'):
    # A lazy test set (data.RowTable) stays lazy: the trigger is stamped
    # on the rows a process builds for its own devices.
    x = x.regroup(keep, 1).mapped(stamp)
  else:
    x = stamp(np.asarray(x[keep]))
  target = np.full(len(x), target_label, np.int32)
  return (x, target, true) if with_sources else (x, target)
