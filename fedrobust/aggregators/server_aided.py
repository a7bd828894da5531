"""Server-data and history-based robust aggregation rules.

  agg = SERVER_AIDED[name](num_byzantine=f, **hparams)
  state = agg.init(params)            # params: the current GLOBAL model
  update, state, info = agg.aggregate(updates, mask, state, key)

| name       | needs                       | state                          |
|------------|-----------------------------|--------------------------------|
| fltrust    | server_data, apply_fn       | params                         |
| foolsgold  | num_clients (slots)         | per-slot update history        |
| foolsgold_ids | num_clients (N, by id)   | per-client update history      |
| rlr        | -                           | () (stateless)                 |
| crfl       | -                           | params                         |
| fldetector | num_clients (K, by id)      | params + per-client history    |
| lasa       | -                           | () (stateless)                 |
| sageflow   | server_data, apply_fn       | params                         |
| finetune   | server_data, apply_fn       | params                         |
| deepsight  | apply_fn, input_shape       | () (reads the `params` extra)  |
| flare      | server_data, apply_fn       | () (reads the `params` extra)  |

Global-model contract (fltrust, crfl, fldetector, sageflow, finetune):
  * `init(params)` stores the global model w_0 in `state.params`.
  * `aggregate` reads w_t from `state.params` and returns the update u_t
    with a state whose params are w_t + u_t (leafwise add, in the params'
    dtype). That is exactly the model a server holds if it applies
    w_{t+1} = w_t + u_t, i.e. server learning rate 1 and nothing else
    touching the model between rounds.
  * A method that applies a different step (server lr != 1, momentum,
    rollback) must re-sync before the next call:
    `state = state._replace(params=actual_global_params)` (every such
    state is a NamedTuple with a `params` field). Otherwise the rule scores
    and trains against a model the clients never saw.
  * The returned update is the full server step: for crfl and finetune it
    already contains the clipping/noise or the fine-tuning, so scaling it by
    a server lr != 1 changes the method.

Slot-indexed history (foolsgold): per-client history is indexed by slot
position c in [0, C) and is meaningful only when slot c holds the same
client in every round, i.e. full participation with a stable order (the
SDFC setting, where the engine's sorted ids make the order stable). Pass
num_clients=C so that the state has its final shape from init (otherwise
it is sized, once, by the first aggregate call). FLDetector reads the
`ids` extra instead and indexes its history by client id (num_clients=K):
it follows a client across slots and runs on any group of clients. Its
tracked `params` enter only through w_t - w_{t-1}, so starting it from
zeros (a cohort group's init) changes nothing.

Server data: `server_data=(x uint8[V, H, W, Ch], y int32[V])`, `apply_fn`
the model's pure apply (params, x float) -> logits. Images are normalised
and batched with the same helpers as client training (fedrobust.local). The
arrays are closed over, i.e. embedded as constants in the jitted program:
keep U small (the papers use ~100 examples).

Every rule is pure and jittable with fixed shapes; masked slots (mask
False) are selected away before any arithmetic and never change a result;
a real client whose update holds NaN or Inf is excluded (weight 0); all
norms are overflow safe, so finite 1e30 updates leave outputs finite. What
each rule cannot guarantee is listed in its module docstring.
"""

from __future__ import annotations

import functools
from typing import Callable

from fedrobust.aggregators.base import Aggregator
from fedrobust.aggregators.crfl import crfl
from fedrobust.aggregators.finetune import finetune
from fedrobust.aggregators.fldetector import fldetector
from fedrobust.aggregators.fltrust import fltrust
from fedrobust.aggregators.foolsgold import foolsgold
from fedrobust.aggregators.inspection import INSPECTION
from fedrobust.aggregators.lasa import lasa
from fedrobust.aggregators.rlr import rlr
from fedrobust.aggregators.sageflow import sageflow

SERVER_AIDED: dict[str, Callable[..., Aggregator]] = {
    'fltrust': fltrust,
    'foolsgold': foolsgold,
    'foolsgold_ids': functools.partial(foolsgold, by_client_id=True),
    'rlr': rlr,
    'crfl': crfl,
    'fldetector': fldetector,
    'lasa': lasa,
    'sageflow': sageflow,
    'finetune': finetune,
    **INSPECTION,
}
