"""A new aggregation rule in one file: written, checked, registered, run.

  python examples/custom_rule.py [--rounds=3] [--examples=6000]

The rule, `sign_vote`, keeps per coordinate only the clients whose update
has the majority's sign, and averages those (a coordinate-wise cousin of
signSGD's majority vote). `fedrobust.testing.check_rule` runs the library's
conformance checks on it; `fedrobust.register_rule` makes it a choice of
the `aggregator` setting, for a Federation here and for the runner:

  python experiments/main.py --plugins=examples.custom_rule \
    --aggregator=sign_vote --attack=lie --malicious_fraction=0.2
"""

import argparse

import jax
import jax.numpy as jnp

import fedrobust
from fedrobust.testing import check_rule


def sign_vote(*, num_byzantine: int = 0) -> fedrobust.Aggregator:
  """Majority-sign coordinate-wise mean.

  For each coordinate d, with s_d = sign(sum_k sign(u_kd)) over the real
  clients k, the result is the mean of {u_kd : sign(u_kd) = s_d}. Masked
  slots and non-finite values take no part.
  """
  del num_byzantine   # the vote needs no bound on the attackers

  def aggregate(updates, mask, state, key):
    """updates: leaves [C, ...]; mask: bool[C] -> one client's tree."""
    del key

    def leaf(u):
      keep = mask.reshape((-1,) + (1,) * (u.ndim - 1)) & jnp.isfinite(u)
      u = jnp.where(keep, u, 0.0)
      vote = jnp.sign(jnp.sum(jnp.sign(u), axis=0))
      agree = keep & (jnp.sign(u) == vote) & (u != 0)
      count = jnp.sum(agree, axis=0)
      return jnp.sum(jnp.where(agree, u, 0.0), axis=0) / jnp.maximum(
          count, 1)

    weights = mask.astype(jnp.float32) / jnp.maximum(jnp.sum(mask), 1)
    return jax.tree.map(leaf, updates), state, {'weights': weights}

  return fedrobust.Aggregator(init=lambda params: (), aggregate=aggregate)


fedrobust.register_rule('sign_vote', sign_vote, replace=True)


def main(rounds: int, examples: int) -> dict[str, float]:
  check_rule(sign_vote)            # raises, naming the failed check
  accuracy = {}
  for attack in ('sign_flip', 'lie', 'min_max'):
    fed = fedrobust.Federation(
        aggregator='sign_vote', attack=attack, malicious_fraction=0.2,
        num_clients=10, max_train_examples=examples, max_test_examples=2000,
        local_lr=0.02, momentum=0.9, num_rounds=rounds)
    _, history = fed.run()
    accuracy[attack] = history[-1]['test_accuracy']
    print(f'sign_vote under {attack:9s} test accuracy '
          f'{accuracy[attack]:.4f}')
  return accuracy


if __name__ == '__main__':
  parser = argparse.ArgumentParser()
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--examples', type=int, default=6000)
  args = parser.parse_args()
  main(args.rounds, args.examples)
