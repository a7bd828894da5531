"""Shared check: a lowered program's LAPACK calls each take one matrix.

On CPU, batched LAPACK kernels can deadlock XLA's intra-op pool
(spectral.per_matrix); the Horus and HiLoRA tests assert their programs
make none.
"""

import re


def assert_unbatched_lapack(test, lowered_text: str) -> None:
  calls = re.findall(r'custom_call @(lapack_\w+)\(.*?:\s*\((tensor<[^>]*>)',
                     lowered_text)
  test.assertNotEmpty(calls)
  for target, operand in calls:
    dims = operand[len('tensor<'):-1].split('x')[:-1]
    test.assertLen(dims, 2, f'{target} takes a batch: {operand}')
