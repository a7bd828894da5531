"""Horus (Horus paper Sec. V, Algorithm 1): robust FL under
hyper-heterogeneity, as a composition of engine pieces.

  * clients of different architectures (cohorts: CNN and row-LSTM);
  * each client warms up locally into a private backbone (Sec. VI-A, 10
    epochs), which stays frozen; LoRA of rank r sits on its feature-first
    and classifier layers (the 'first' and 'head' roles), and only LoRA
    factors leave the client (`--transform=lora --lora_targets=first,head`);
  * the server aligns every client's A and B to the largest shape with
    masks (Sec. V-C.1, fedrobust.cohort) and applies the 'horus' rule
    (aggregators/horus.py): HOPS on LoRA-A, the percentile threshold,
    projection-guided weights and the masked weighted mean (Eq. 2-9);
  * each client trims the new global factors to its own shape.

So Horus is FedAvg's client and cohort machinery with private backbones
and the 'horus' aggregator: `--method=horus` selects that rule by default
and declares its hyperparameters, and `--method=horus --aggregator=median`
(or `--method=fedavg --aggregator=median` on the same flags) runs a robust
baseline through exactly the same LoRA and alignment pipeline, as the
paper's comparison does. The Table III variants are flags: layers
(`--lora_targets=all|random2`, or `--transform=select --select_targets=
first,head` and `--transform=identity` for the full-parameter s_all and
a_all), `--horus_detect=b|ab` and `--nohorus_projection`.
"""

from __future__ import annotations

from fedrobust.aggregators.horus import DETECT
from fedrobust.aggregators.spectral import SV_CHOICES
from fedrobust.methods.fedavg import fedavg_with_rule
from fedrobust.settings import Setting

HOPS_SETTINGS = (
    Setting('hops_lambda', 0.5, "HOPS's lambda (Eq. 4): weight of the top-k "
            'energy term against the entropy term.', arg='lam'),
    Setting('top_k', 5, 'k of the top-k energy ratio (Eq. 3).'),
    Setting('percentile', 95.0, 'Detection threshold: the p-th percentile of '
            "the round's HOPS scores (Eq. 5)."),
    Setting('detect', 'a', 'Which LoRA factor HOPS reads: a (Horus), b or '
            'ab (Table III).', choices=DETECT),
    Setting('projection', True, 'Projection-guided weights (Eq. 8); off is '
            'Table III\'s "w/o weight".'),
    Setting('exclude_ties', True, 'Exclude clients with S >= theta, as '
            "Algorithm 1's benign set {c | S_c < theta} does (identical "
            'colluders that tie at the top go together; never a client at '
            "the round's lowest score); off: Eq. 5's prose, S > theta."),
    Setting('sv_method', 'auto', 'How the server takes singular values and '
            'first directions: svd (one SVD per client matrix), gram (a '
            'batched eigh of the smaller Gram matrix; equal within float32 '
            'error) or auto: svd on CPU, gram on GPU/TPU, where it is 66x '
            'faster at C = 100.', choices=SV_CHOICES, execution=True),
)


horus, HORUS = fedavg_with_rule(
    'horus', 'horus', HOPS_SETTINGS,
    summary='Horus: LoRA on stable layers of private backbones, HOPS '
    'detection on LoRA-A, projection-guided aligned aggregation.')

# A bare --method=horus starts from the paper's setting.
HORUS = HORUS._replace(preset='horus_fmnist_paper.flags')
