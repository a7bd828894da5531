"""FedHAN (paper 004, Algorithm 1): semi-asynchronous FL with
width-heterogeneous clients and attack detection, as a composition of
engine pieces.

  * width customisation (Def. 2): `--transform=width` with the clients'
    width ratios (`--width_ratios`, the paper's mask levels 0.5 / 0.2);
    each client trains w * m^{d_i} and uploads its sparse update with its
    mask (the `coverage` extra);
  * semi-asynchronous reception: `--client_delay` (each arrival carries its
    staleness tau);
  * the server round is the 'fedhan' rule (methods/fedhan/rule.py): the
    per-client cache and imputation (Eq. 3-6), historical selection
    (Eq. 7-8), and detection by DBSCAN + 2-means on the suspicion scores
    (Sec. 3.5.3).

So FedHAN is FedAvg's client and engine machinery with the 'fedhan' rule
by default; `--method=fedhan --aggregator=NAME` runs another rule on the
same width-heterogeneous, semi-asynchronous pipeline. Detection triggers
the rollback-and-replay recovery (Sec. 3.5.4) inside the same rule.
"""

from __future__ import annotations

from fedrobust.methods.fedhan.rule import (CACHE_DTYPES, LBFGS_PAIRS,
                                          SCORE_SETS)
from fedrobust.methods.fedavg import fedavg_with_rule
from fedrobust.settings import Setting
from fedrobust.aggregators import needs as needs_lib
from fedrobust.aggregators import register_rule
from fedrobust.methods.fedhan import rule

# FedHAN's rule: detection state per client id, tracking the global model;
# told the attackers only in the told recovery mode (unlearn_round > 0).
register_rule('fedhan', rule.fedhan, needs=needs_lib.Needs(
    tracks_model=True, per_client='id',
    derive=needs_lib.told_when_unlearning), replace=True)

FEDHAN_SETTINGS = (
    Setting('beta', 0.9, 'Staleness decay of the weight matrix (Eq. 4).'),
    Setting('alpha', 0.2, 'Weight of the unupdated parts (Eq. 5) and of the '
            'historical aggregate (Eq. 8).'),
    Setting('sim_min', 0.5, 'Cosine threshold for cached updates of '
            'non-arriving clients (Eq. 7).'),
    Setting('tau_max', 10, 'Staleness limit (rounds) of cached updates '
            'that may be selected (Eq. 7).'),
    Setting('eps', 0.5, "DBSCAN's radius on the suspicion scores divided "
            'by their median (Sec. 3.5.3).'),
    Setting('min_samples', 2, "DBSCAN's core size (a point counts "
            'itself).'),
    Setting('min_flag_score', 0.0, 'A member of the high cluster is '
            'flagged only if its suspicion is at least this multiple of the '
            "clustered scores' median (the paper names a score threshold "
            'but gives none); 0: off.'),
    Setting('score_set', 'arrivals', "The suspicion scores S_j that DBSCAN "
            "and 2-means cluster (Sec. 3.5.3): 'arrivals', the round's "
            "arrivals; 'clients', every unbanned client's latest score "
            '(flagging the arrivals in the high cluster).',
            choices=SCORE_SETS),
    Setting('detect', True, 'Detect and ban attackers (Sec. 3.5.3).'),
    Setting('ban_after', 1, 'Rounds a client must be flagged in before it '
            'is banned and a recovery starts (a flagged client always '
            'misses that round; 1 bans at the first flag).'),
    Setting('detect_start', 1, 'First round whose arrivals may be flagged '
            "(the paper's detector setting: 50)."),
    Setting('rollback', 5, 'Recovery (Sec. 3.5.4): rounds rolled back and '
            'replayed with L-BFGS-corrected updates when attackers are '
            'detected; 0 turns recovery off.'),
    Setting('recovery_slots', 16, 'Kept arrivals stored per round for the '
            'recovery replay.'),
    Setting('exact_warmup', 0, 'T_w: the first replayed rounds of a '
            'recovery in which the kept clients retrain from the replayed '
            'model (exact updates, Sec. 3.5.4); 0: none.'),
    Setting('exact_every', 0, 'T_c: after the warm-up, every T_c-th '
            'replayed round is exact; 0: none.'),
    Setting('lbfgs_pairs', 'exact', "Eq. 10's L-BFGS pairs: 'exact' from "
            'the exact replayed rounds (none without them: the stored '
            "updates are replayed uncorrected), 'trajectory' from the "
            'recorded trajectory (the earlier default).',
            choices=LBFGS_PAIRS),
    Setting('unlearn_round', 0, 'Told mode of the recovery experiments '
            '(as FedEraser and Crab are told): in this round the server '
            'learns who the attackers are, bans them and rolls back '
            '`rollback` rounds without them (rollback = this round - 1 '
            'replays from the initial model); 0: off.'),
    Setting('cache_dtype', 'float32', 'Storage type of the per-client cache '
            'and the recovery record.', choices=tuple(CACHE_DTYPES)),
)


fedhan, FEDHAN = fedavg_with_rule(
    'fedhan', 'fedhan', FEDHAN_SETTINGS,
    summary='FedHAN: semi-asynchronous, width-heterogeneous FL with a '
    'per-client imputation cache, historical selection, DBSCAN '
    'detection and rollback/L-BFGS recovery.')

# A bare --method=fedhan starts from the paper's setting.
FEDHAN = FEDHAN._replace(preset='fedhan_fmnist_paper.flags')
