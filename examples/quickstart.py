"""FedAvg, the coordinate-wise median, and the median under LIE on
Fashion-MNIST, from Python.

  python examples/quickstart.py [--rounds=3] [--examples=6000]
"""

import argparse

import fedrobust


def main(rounds: int, examples: int) -> dict[str, float]:
  data = dict(dataset='fashion_mnist', num_clients=10, dirichlet_alpha=0.5,
              max_train_examples=examples, max_test_examples=2000,
              local_lr=0.02, momentum=0.9, num_rounds=rounds)
  runs = {
      'fedavg': dict(aggregator='weighted_mean'),
      'median': dict(aggregator='median', num_byzantine=2),
      'median under LIE': dict(aggregator='median', attack='lie',
                               malicious_fraction=0.2),
  }
  accuracy = {}
  for name, settings in runs.items():
    _, history = fedrobust.Federation(**data, **settings).run()
    accuracy[name] = history[-1]['test_accuracy']
    print(f'{name:18s} test accuracy {accuracy[name]:.4f}')
  return accuracy


if __name__ == '__main__':
  parser = argparse.ArgumentParser()
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--examples', type=int, default=6000)
  args = parser.parse_args()
  main(args.rounds, args.examples)
