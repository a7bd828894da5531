"""A small Vision Transformer for the LoRA methods' vision variants.

RFD-LoRA's vision setting and HiLoRA's label-skew setting put LoRA on the
query and value projections of a ViT. The papers' ViT-Base checkpoints
cannot be downloaded here, so this one is small and trained inside the
project (central pretraining on a public split, `fedrobust.pretrain`):

  image [N, H, W, Ch] -> non-overlapping p x p patches -> Dense(dim)
  ('patch_embed') -> [CLS] + learned positions -> LayerNorm -> the BERT
  encoder of fedrobust.models.bert (post-LN layers, GELU FFN; paths
  encoder/layer_i/attention/{query,key,value}) -> head on [CLS].

Reusing the BERT layers keeps one transformer implementation in the
project, so the LoRA targets `encoder/*/attention/query` and `.../value`
(bert.QV_TARGETS) address both models alike. Defaults: 4 x 4 patches
(49 on 28 x 28), dim 64, 4 layers, 4 heads, FFN 128: 0.2M parameters.

References: Dosovitskiy et al., "An Image is Worth 16x16 Words", ICLR 2021.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from fedrobust.models.layers import ConvImpl, Dense


def patches(x: jax.Array, size: int) -> jax.Array:
  """[N, H, W, C] -> [N, (H/p)(W/p), p*p*C], row-major over the patches."""
  n, h, w, c = x.shape
  if h % size or w % size:
    raise ValueError(f'image {h}x{w} is not divisible into {size}x{size} '
                     'patches')
  x = x.reshape(n, h // size, size, w // size, size, c)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(
      n, (h // size) * (w // size), size * size * c)


class ViT(nn.Module):
  """See the module docstring."""
  num_classes: int
  patch: int = 4
  dim: int = 64
  depth: int = 4
  heads: int = 4
  mlp: int = 128
  conv_impl: ConvImpl = 'xla'     # unused (no convolutions); zoo interface
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    from fedrobust.models import bert  # pylint: disable=g-import-not-at-top
    tokens = patches(x, self.patch)
    n, count, _ = tokens.shape
    h = Dense(self.dim, dtype=self.dtype, name='patch_embed')(tokens)
    init = nn.initializers.normal(0.02)
    cls = self.param('cls', init, (1, 1, self.dim))
    position = self.param('position', init, (1, count + 1, self.dim))
    h = jnp.concatenate([jnp.broadcast_to(cls, (n, 1, self.dim)),
                         h.astype(jnp.float32)], axis=1) + position
    h = nn.LayerNorm(epsilon=1e-6, name='embed_norm')(h)
    config = bert.BertConfig(hidden_size=self.dim, num_layers=self.depth,
                             num_heads=self.heads,
                             intermediate_size=self.mlp,
                             max_positions=count + 1, layer_norm_eps=1e-6)
    h = bert.BertEncoder(config, self.dtype, name='encoder')(
        h, jnp.ones((n, count + 1), bool), train)
    return Dense(self.num_classes, dtype=self.dtype, name='head')(
        h[:, 0].astype(jnp.float32)).astype(jnp.float32)

  def roles(self):
    return {'first': 'patch_embed', 'head': 'head'}

  def width_units(self, shapes):
    del shapes
    return None      # no width slicing (HeteroFL/FedRolex) for attention
