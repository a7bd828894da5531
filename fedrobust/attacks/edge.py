"""The edge-case backdoor's out-of-distribution inputs."""

from __future__ import annotations

import numpy as np

from fedrobust.data.sources import load_mnist5k_arrays
from fedrobust.errors import SettingError


def edge_case_images(input_shape: tuple[int, ...], digit: int
                     ) -> tuple[np.ndarray, np.ndarray]:
  """The MNIST 5k subset's images of `digit` (handwritten digits are out of
  distribution for Fashion-MNIST, as ARDIS 7s are for MNIST in Wang et
  al.), split in two: the attackers' half and the held-out half the attack
  success is measured on."""
  if tuple(input_shape) != (28, 28, 1):
    raise SettingError('attack', f"'edge_case' draws 28x28 grey digits; "
                       f'the dataset has inputs of shape '
                       f'{tuple(input_shape)}')
  if not (isinstance(digit, int) and 0 <= digit <= 9):
    raise SettingError('attack_kwargs', f'edge_digit must be a digit 0-9, '
                       f'got {digit!r}')
  x, y = load_mnist5k_arrays()
  x = x[y == digit]
  return x[:len(x) // 2], x[len(x) // 2:]
