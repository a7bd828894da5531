"""Engine: local training, client execution, the round step, evaluation."""

from fedrobust.engine.evaluate import evaluate, evaluate_clients
from fedrobust.engine.execution import (STRATEGIES, client_mesh,
                                        default_strategy, map_clients,
                                        run_clients)
from fedrobust.engine.local import (LocalConfig, classification_loss,
                                    make_batch_plan, sgd, train_steps)
from fedrobust.engine.round import (Method, RoundConfig, Threat,
                                    init_server_state,
                                    make_round_step, sample_clients)
