"""Engine: local training, client execution, the round step, evaluation."""

from fedrobust.engine.delay import DelayModel, parse_delay
from fedrobust.engine.evaluate import evaluate, evaluate_clients
from fedrobust.engine.execution import (CLIENT_DATA, STRATEGIES, client_mesh,
                                        default_strategy, map_clients,
                                        place_clients, run_clients)
from fedrobust.local import (LocalConfig, classification_loss,
                                    make_batch_plan, sgd, train_steps)
from fedrobust.engine.round import (CohortSlots, RoundConfig, Threat,
                                    distinct_buffers,
                                    init_server_state, make_round_step,
                                    make_setup_step, sample_clients,
                                    sample_cohort)
from fedrobust.types import Method
