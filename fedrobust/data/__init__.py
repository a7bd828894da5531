"""Data: sources, server/client splits, partitioners, fixed-shape stacking."""

from fedrobust.data.arrays import from_arrays, load_npz, save_npz
from fedrobust.data.federated import (ClientRows, EvalSet, FederatedSetup,
                                      RowTable, build_federated_setup,
                                      hold_out, select_clients, stack_clients,
                                      stack_eval_sets, subsample,
                                      subsample_test,
                                      unseen_clients, unused_rows)
from fedrobust.data.partition import PARTITIONERS, class_histograms
from fedrobust.data.sources import (DATASETS, DEFAULT_FASHION_MNIST_DIR,
                                    DataNotFoundError, Dataset,
                                    RecordImages, load_dataset)
from fedrobust.data.splits import (ServerSplits, local_train_test_split,
                                   make_server_splits)
