"""The model as plain PyTorch: the definition every fast path is checked against.

    y = mean_{d,h,w} softmax_c( relu( hardswish( conv3d(x, weight, bias) ) ) )

x: (N, Cin, D, H, W); weight: (Cout, Cin, k, k, k); bias: (Cout,); stride 1, no
padding, so D, H, W >= k. Output (N, Cout), each row a probability vector.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Compute the model in x's dtype, exactly as the model is defined."""
    y = F.conv3d(x, weight, bias)
    y = F.hardswish(y)
    y = torch.relu(y)
    y = torch.softmax(y, dim=1)
    return y.mean(dim=(2, 3, 4))


def reference_float64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The model in float64 on the CPU: the yardstick for error bounds."""
    cpu = torch.device("cpu")
    return reference(x.to(cpu, torch.float64), weight.to(cpu, torch.float64), bias.to(cpu, torch.float64))


def reference_weights(cin: int = 3, cout: int = 16, k: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference instance's deterministic weights.

    nn.Conv3d's default initialisation (uniform in +-1/sqrt(fan_in) for weight
    and bias), drawn from a generator seeded with ``seed``, with 0.02 added to
    every bias. Bit-identical to the reference module's ``reference_weights``.
    """
    g = torch.Generator().manual_seed(seed)
    bound = 1.0 / (cin * k**3) ** 0.5
    weight = torch.empty(cout, cin, k, k, k).uniform_(-bound, bound, generator=g)
    bias = torch.empty(cout).uniform_(-bound, bound, generator=g) + 0.02
    return weight, bias
