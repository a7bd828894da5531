"""Evaluation of a model on padded, masked example sets."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from fedrobust.engine.execution import CLIENT_AXIS


Params = Any


def regroup(a: Any, index: np.ndarray, lead: int) -> Any:
  """Host-side: the array whose first axes are `index` (any shape) over
  a's first `lead` axes flattened; a negative entry gives a zero entry
  (False for a mask). A lazy array (data.RowTable, with a `regroup`
  method) re-cuts its index table instead, so evaluation sets stay lazy
  through pad_to_batches, rebatch and pad_leading until a process builds
  its own devices' block (engine.place_clients)."""
  index = np.asarray(index, np.int64)
  if hasattr(a, 'regroup'):
    return a.regroup(index, lead)
  a = np.asarray(a)
  flat = a.reshape((-1, *a.shape[lead:]))
  out = np.zeros((*index.shape, *flat.shape[1:]), a.dtype)
  real = index >= 0
  out[real] = flat[index[real]]
  return out


def compose_index(table: np.ndarray, index: np.ndarray,
                  lead: int) -> np.ndarray:
  """Host-side: `regroup` of an index table (negative entries: padding),
  with the padding kept negative: entries `index` of `table`'s first
  `lead` axes flattened, -1 where either is negative."""
  return regroup(np.asarray(table, np.int64) + 1, index, lead) - 1


def _batch_index(m: int, batch_size: int, batches: int = 0) -> np.ndarray:
  """[T, B] positions 0 .. m - 1 in order, then -1: T = ceil(m / B) (at
  least 1), or `batches` when that is more."""
  t = max(1, -(-m // batch_size), batches)
  index = np.full(t * batch_size, -1, np.int64)
  index[:m] = np.arange(m)
  return index.reshape(t, batch_size)


def pad_to_batches(x: np.ndarray, y: np.ndarray, batch_size: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Host-side: [M, ...] -> [T, B, ...] plus mask [T, B] (a lazy x stays
  lazy: `regroup`)."""
  index = _batch_index(len(y), batch_size)
  return regroup(x, index, 1), regroup(y, index, 1), index >= 0


def evaluate_sums(apply_fn: Callable, params: Params, x: jax.Array,
                  y: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
  """The sums behind `evaluate`: {'correct', 'loss', 'count'} float32
  scalars (correct predictions, summed CE, unmasked examples) and
  'confusion' float32[C, C], over the unmasked examples of [T, B] batches.
  Sums of disjoint example sets add up, which is what lets the batches
  split over devices (`evaluations`)."""
  def batch_stats(batch):
    xb, yb, mb = batch
    logits = apply_fn(params, xb)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
    pred = jnp.argmax(logits, -1)
    c = logits.shape[-1]
    confusion = jnp.einsum(
        'bi,bj->ij', jax.nn.one_hot(yb, c) * mb[:, None],
        jax.nn.one_hot(pred, c))
    return (jnp.sum(jnp.where(mb, pred == yb, False)).astype(jnp.float32),
            jnp.sum(jnp.where(mb, ce, 0.0)), jnp.sum(mb).astype(jnp.float32),
            confusion)

  correct, loss, count, confusion = jax.lax.map(batch_stats, (x, y, mask))
  return {'correct': jnp.sum(correct), 'loss': jnp.sum(loss),
          'count': jnp.sum(count), 'confusion': jnp.sum(confusion, 0)}


def from_sums(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """`evaluate`'s metrics from `evaluate_sums`' (leading axes kept)."""
  n = jnp.maximum(sums['count'], 1.0)
  return {'accuracy': sums['correct'] / n, 'loss': sums['loss'] / n,
          'count': sums['count'], 'confusion': sums['confusion']}


def evaluate(apply_fn: Callable, params: Params, x: jax.Array, y: jax.Array,
             mask: jax.Array) -> dict[str, jax.Array]:
  """Accuracy and mean CE over the unmasked examples.

  Args:
    apply_fn: model apply.
    params: one model.
    x: uint8[T, B, H, W, Ch] batches.
    y: int32[T, B].
    mask: bool[T, B].

  Returns:
    {'accuracy', 'loss', 'count'} float32 scalars and 'confusion'
    float32[C, C]: counts of (true class, predicted class).
  """
  return from_sums(evaluate_sums(apply_fn, params, x, y, mask))


def backdoor_rates(clean: np.ndarray, triggered: np.ndarray, target: int, *,
                   exclude_target: bool = True) -> dict[str, np.ndarray]:
  """Backdoor metrics from confusion matrices [..., C, C] (true, predicted).

  clean: the clean test set's; triggered: the triggered test set's, scored
  against the inputs' TRUE labels. Returns float arrays [...]:
    attack_success_rate  triggered inputs predicted as the target;
    robust_accuracy      triggered inputs predicted as their true class (RA);
    clean_target_rate    clean test inputs predicted as the target: the ASR
                         a model without any backdoor already has. It is
                         estimated on the clean test set's rows (the
                         runner's evaluation sample), which are a sample of
                         the inputs the triggered set is built from (the
                         whole test split), so no extra pass is needed.
  exclude_target drops true-target rows from the clean rate, as the
  triggered set does (attacks.triggered_test_set).
  """
  clean = np.asarray(clean, np.float64)
  triggered = np.asarray(triggered, np.float64)
  rows = np.ones(clean.shape[-1], bool)
  if exclude_target:
    rows[target] = False
  n_trig = np.maximum(triggered.sum((-2, -1)), 1.0)
  n_clean = np.maximum(clean[..., rows, :].sum((-2, -1)), 1.0)
  return {
      'attack_success_rate': triggered[..., :, target].sum(-1) / n_trig,
      'robust_accuracy': np.trace(triggered, axis1=-2, axis2=-1) / n_trig,
      'clean_target_rate': clean[..., rows, target].sum(-1) / n_clean}


def evaluate_clients(apply_fn: Callable, params: Params, x: jax.Array,
                     y: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
  """Per-client evaluation of one model on each client's local test split.

  Args:
    x: uint8[K, T, B, H, W, Ch]; y: int32[K, T, B]; mask: bool[K, T, B].

  Returns:
    {'accuracy': float[K], 'loss': float[K], 'count': float[K]}.
  """
  return jax.lax.map(lambda a: evaluate(apply_fn, params, *a), (x, y, mask))


def rebatch(x: np.ndarray, y: np.ndarray, mask: np.ndarray, multiple: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Host-side: an evaluation set [T, B, ...] re-cut into T' batches, T' a
  multiple of `multiple`, of B' <= B examples, so that T' / multiple
  batches go to each device. The unmasked examples keep their order;
  padding is masked. T' = multiple * ceil(T / multiple) and
  B' = ceil(M / T') for M examples, so at most multiple - 1 batches'
  worth of padding is added where the example count does not split. A
  lazy x stays lazy (`regroup`)."""
  mask = np.asarray(mask)
  t = mask.shape[0]
  if t % multiple == 0:
    return x, y, mask
  keep = np.flatnonzero(mask.reshape(-1))
  t_new = multiple * -(-t // multiple)
  cut = _batch_index(len(keep), max(1, -(-len(keep) // t_new)), t_new)
  index = compose_index(keep, cut, 1)
  return regroup(x, index, 2), regroup(y, index, 2), index >= 0


def pad_leading(tree: Any, multiple: int) -> Any:
  """Host-side: every leaf's leading axis zero-padded (False for masks) to
  a multiple of `multiple` (a lazy leaf stays lazy: `regroup`). Padded
  clients have no unmasked example, so their count is 0."""
  def pad(a):
    extra = -a.shape[0] % multiple
    if not extra:
      return a
    return regroup(a, np.concatenate([np.arange(a.shape[0]),
                                      np.full(extra, -1)]), 1)
  return jax.tree.map(pad, tree)


def evaluations(apply_fn: Callable, mesh: Any = None,
                axis: str = CLIENT_AXIS) -> dict[str, Callable]:
  """The jitted evaluations of one forward `apply_fn`.

    'test'(params, x, y, mask): one model on one set [T, B, ...];
    'rows'(params, x, y, mask): each row of a stacked model set [R, ...]
        on one set, metrics [R];
    'clients'(params, x, y, mask): one model on each client's set
        [K, T, B, ...], metrics [K];
    'own'(params, index, (x, y, mask)): client k's row params[index[k]]
        on client k's set, metrics [K].

  Without a mesh (or on one device) every evaluation runs whole on the
  device. On a mesh the work splits over `axis` instead of being repeated
  on every device: the sets' batches ('test', 'rows'; T a multiple of the
  mesh size, see `rebatch`) or clients ('clients', 'own'; K a multiple,
  see `pad_leading`), with the models replicated. Batch sums are added
  across devices, so accuracy and counts are the same numbers as
  unsplit; the summed loss may differ in the last bits (another order of
  float additions). Per-client outputs stay split over the mesh.
  """
  test_sums = functools.partial(evaluate_sums, apply_fn)

  def rows_sums(params, x, y, mask):
    return jax.lax.map(lambda p: test_sums(p, x, y, mask), params)

  clients = functools.partial(evaluate_clients, apply_fn)

  def own(params, index, local):
    def one(args):
      k, lx, ly, lm = args
      p = jax.tree.map(lambda leaf: leaf[k], params)
      return evaluate(apply_fn, p, lx, ly, lm)
    return jax.lax.map(one, (index, *local))

  if mesh is None or mesh.size == 1:
    return {'test': jax.jit(lambda *a: from_sums(test_sums(*a))),
            'rows': jax.jit(lambda *a: from_sums(rows_sums(*a))),
            'clients': jax.jit(clients), 'own': jax.jit(own)}

  split, whole = P(axis), P()
  # check_vma=False: the forward pass is any flax module, and a module that
  # builds a scan carry from constants (a recurrent layer's zero state) would
  # otherwise fail shard_map's varying-axes check, since the carry turns
  # device-varying once it meets the split inputs. Nothing here relies on
  # that check: the sums are psum'd explicitly and per-client outputs stay
  # split, as in the clients' own shard_map (execution.run_clients).
  shard = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)

  def summed(fn):
    """fn's sums over this device's batches, added over the mesh."""
    local = shard(lambda *a: jax.lax.psum(fn(*a), axis),
                  in_specs=(whole, split, split, split), out_specs=whole)
    return jax.jit(lambda *a: from_sums(local(*a)))

  return {'test': summed(test_sums), 'rows': summed(rows_sums),
          'clients': jax.jit(shard(
              clients, in_specs=(whole, split, split, split),
              out_specs=split)),
          'own': jax.jit(shard(
              own, in_specs=(whole, split, (split,) * 3),
              out_specs=split))}
