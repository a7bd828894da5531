"""The round users run today, in PyTorch: clients trained one after another.

This is the baseline fedrobust is measured against: the same
FedAvg round as `fedrobust.methods.fedavg` on the same shapes, written the
way Flower/FedML clients and the seed papers' reference code write it:

  for each client:  load the global weights into a local model, make a
                    fresh SGD(momentum, weight decay) optimizer, run the
                    local steps on shuffled mini-batches, send w_k - w
  server:           mean or coordinate-wise median of the flat deltas,
                    w <- w + server_lr * aggregate

Models match fedrobust's SimpleCNN and MLP layer for layer (flattening in
NHWC order, so weights can be copied across and results compared; see
`load_flax_params` and tests/torch_reference_test.py). torch is optional:
`pip install -e .[bench]`.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


class SimpleCNN(nn.Module):
  """conv6-pool-conv16-pool-fc120-fc84-fc84-fc256-fc (5x5 VALID convs)."""

  def __init__(self, num_classes: int = 10, in_channels: int = 1):
    super().__init__()
    self.conv1 = nn.Conv2d(in_channels, 6, 5)
    self.conv2 = nn.Conv2d(6, 16, 5)
    widths = (16 * 4 * 4, 120, 84, 84, 256)
    self.fcs = nn.ModuleList(nn.Linear(a, b)
                             for a, b in zip(widths[:-1], widths[1:]))
    self.out = nn.Linear(256, num_classes)

  def forward(self, x):                  # x: [N, C, H, W]
    x = F.max_pool2d(F.relu(self.conv1(x)), 2)
    x = F.max_pool2d(F.relu(self.conv2(x)), 2)
    x = x.permute(0, 2, 3, 1).flatten(1)   # NHWC order, as flax flattens
    for fc in self.fcs:
      x = F.relu(fc(x))
    return self.out(x)


class MLP(nn.Module):
  """784-200-200-classes with ReLU (the FedAvg '2NN')."""

  def __init__(self, num_classes: int = 10, in_features: int = 784,
               hidden: tuple[int, ...] = (200, 200)):
    super().__init__()
    widths = (in_features,) + tuple(hidden)
    self.fcs = nn.ModuleList(nn.Linear(a, b)
                             for a, b in zip(widths[:-1], widths[1:]))
    self.out = nn.Linear(widths[-1], num_classes)

  def forward(self, x):
    x = x.permute(0, 2, 3, 1).flatten(1)
    for fc in self.fcs:
      x = F.relu(fc(x))
    return self.out(x)


MODELS = {'simple_cnn': SimpleCNN, 'mlp': MLP}


def load_flax_params(module: nn.Module, params) -> None:
  """Copies a fedrobust SimpleCNN/MLP param tree into `module` in place.

  Flax Conv kernels are HWIO and Dense kernels [in, out]; torch wants OIHW
  and [out, in]. Layers are matched in creation order.
  """
  flat = params['params'] if 'params' in params else params
  layers = [flat[k] for k in sorted(flat, key=lambda k: (
      k.split('_')[0], int(k.split('_')[-1])))]
  convs = [l for l in layers if np.ndim(l['kernel']) == 4]
  denses = [l for l in layers if np.ndim(l['kernel']) == 2]
  targets_conv = [m for m in module.modules() if isinstance(m, nn.Conv2d)]
  targets_dense = [m for m in module.modules() if isinstance(m, nn.Linear)]
  if len(convs) != len(targets_conv) or len(denses) != len(targets_dense):
    raise ValueError('flax and torch models have different layer counts')
  with torch.no_grad():
    for src, dst in zip(convs, targets_conv):
      dst.weight.copy_(torch.from_numpy(
          np.asarray(src['kernel']).transpose(3, 2, 0, 1).copy()))
      dst.bias.copy_(torch.from_numpy(np.array(src['bias'])))
    for src, dst in zip(denses, targets_dense):
      dst.weight.copy_(torch.from_numpy(np.asarray(src['kernel']).T.copy()))
      dst.bias.copy_(torch.from_numpy(np.array(src['bias'])))


def normalize(x_uint8: torch.Tensor) -> torch.Tensor:
  """uint8 [N, H, W, C] -> float [N, C, H, W], (x/255 - 0.5) / 0.5."""
  return (x_uint8.permute(0, 3, 1, 2).float() / 255.0 - 0.5) / 0.5


def local_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                steps: int, batch_size: int, lr: float, momentum: float,
                weight_decay: float, generator: torch.Generator | None = None,
                batches: list[np.ndarray] | None = None) -> None:
  """`steps` SGD steps on shuffled mini-batches of (x, y), in place.

  `batches` (index arrays) overrides the shuffling, for exact comparisons.
  """
  opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                        weight_decay=weight_decay)
  n = x.shape[0]
  # On CUDA the generator lives on the device, so indices never cross.
  device = generator.device if generator is not None else x.device
  perm = torch.randperm(n, generator=generator, device=device)
  for s in range(steps):
    if batches is not None:
      idx = torch.from_numpy(np.asarray(batches[s]))
    else:
      start = (s * batch_size) % n
      if start + batch_size > n:
        perm = torch.randperm(n, generator=generator, device=device)
        start = 0
      idx = perm[start:start + batch_size]
    idx = idx.to(x.device)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(normalize(x[idx])), y[idx])
    loss.backward()
    opt.step()


def flat_params(model: nn.Module) -> torch.Tensor:
  return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def median(stacked: torch.Tensor) -> torch.Tensor:
  """Coordinate-wise median over dim 0, averaging the two middle values
  for an even count (numpy's definition; torch.median takes the lower)."""
  s, _ = torch.sort(stacked, dim=0)
  c = s.shape[0]
  return s[c // 2] if c % 2 else 0.5 * (s[c // 2 - 1] + s[c // 2])


AGGREGATIONS = {'mean': lambda d: d.mean(0), 'median': median}


def fedavg_round(global_model: nn.Module, local_model: nn.Module,
                 xs: torch.Tensor, ys: torch.Tensor, *, steps: int,
                 batch_size: int, lr: float = 0.01, momentum: float = 0.9,
                 weight_decay: float = 1e-5, server_lr: float = 1.0,
                 aggregation: str = 'mean',
                 generator: torch.Generator | None = None) -> None:
  """One round over clients xs[k], ys[k] (sequential), updating in place.

  Clients hold equal data, so the size-weighted mean is the plain mean.
  """
  w = flat_params(global_model)
  deltas = []
  for k in range(xs.shape[0]):
    local_model.load_state_dict(global_model.state_dict())
    local_train(local_model, xs[k], ys[k], steps=steps,
                batch_size=batch_size, lr=lr, momentum=momentum,
                weight_decay=weight_decay, generator=generator)
    deltas.append(flat_params(local_model) - w)
  update = AGGREGATIONS[aggregation](torch.stack(deltas))
  torch.nn.utils.vector_to_parameters(w + server_lr * update,
                                      global_model.parameters())


class Round:
  """A timed, repeatable reference round on fixed synthetic client data."""

  def __init__(self, model: str, clients: int, local_steps: int,
               batch_size: int, aggregation: str = 'mean', seed: int = 0,
               device: str = 'cpu'):
    torch.manual_seed(seed)
    self.device = torch.device(device)
    self.global_model = MODELS[model]().to(self.device)
    self.local_model = MODELS[model]().to(self.device)
    rng = np.random.default_rng(seed)
    n = local_steps * batch_size
    # The data stay on the device, as fedrobust's do.
    self.xs = torch.from_numpy(rng.integers(0, 256, (clients, n, 28, 28, 1),
                                            dtype=np.uint8)).to(self.device)
    self.ys = torch.from_numpy(rng.integers(0, 10, (clients, n))).to(
        self.device)
    self.kwargs = dict(steps=local_steps, batch_size=batch_size,
                       aggregation=aggregation,
                       generator=torch.Generator(
                           device=self.device).manual_seed(seed))
    self.samples = clients * n

  def __call__(self) -> float:
    """Runs one round; returns its wall seconds."""
    t0 = time.perf_counter()
    fedavg_round(self.global_model, self.local_model, self.xs, self.ys,
                 **self.kwargs)
    if self.device.type == 'cuda':
      torch.cuda.synchronize(self.device)
    return time.perf_counter() - t0
