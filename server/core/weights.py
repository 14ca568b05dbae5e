"""Model weights: safetensors in, shapes checked; the reference defaults; a state-dict converter."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from voxserve.kernels import reference_weights

from .errors import StartupError

WEIGHT_KEY = "conv.weight"
BIAS_KEY = "conv.bias"
# Key spellings accepted from a PyTorch state dict, in order of preference.
_STATE_DICT_KEYS = ((WEIGHT_KEY, BIAS_KEY), ("conv_weight", "conv_bias"))
MAX_KERNEL_SIZE = 7
MAX_CHANNELS = 1024


class WeightsError(StartupError, ValueError):
    """A weights file that cannot serve the model; the message says what is wrong."""


@dataclass(frozen=True)
class Weights:
    weight: torch.Tensor  # (Cout, Cin, k, k, k) float32
    bias: torch.Tensor  # (Cout,) float32
    source: str  # where they came from, for logs and metadata

    @property
    def cout(self) -> int:
        return int(self.weight.shape[0])

    @property
    def cin(self) -> int:
        return int(self.weight.shape[1])

    @property
    def k(self) -> int:
        return int(self.weight.shape[2])


def check(weight: torch.Tensor, bias: torch.Tensor, source: str) -> Weights:
    """Validate shapes, dtype and values; return contiguous float32 Weights."""
    if weight.dim() != 5 or not (weight.shape[2] == weight.shape[3] == weight.shape[4]):
        raise WeightsError(f"{source}: {WEIGHT_KEY} must have shape (Cout, Cin, k, k, k); got {tuple(weight.shape)}")
    cout, cin, k = (int(v) for v in weight.shape[:3])
    if not (1 <= k <= MAX_KERNEL_SIZE):
        raise WeightsError(f"{source}: kernel size k={k} is outside 1..{MAX_KERNEL_SIZE}")
    if not (1 <= cout <= MAX_CHANNELS and 1 <= cin <= MAX_CHANNELS):
        raise WeightsError(f"{source}: channels Cout={cout}, Cin={cin} must each be in 1..{MAX_CHANNELS}")
    if tuple(bias.shape) != (cout,):
        raise WeightsError(
            f"{source}: {BIAS_KEY} must have shape ({cout},) to match {WEIGHT_KEY}; got {tuple(bias.shape)}")
    for name, t in ((WEIGHT_KEY, weight), (BIAS_KEY, bias)):
        if not t.is_floating_point():
            raise WeightsError(f"{source}: {name} must be floating point; got {t.dtype}")
        if not bool(torch.isfinite(t).all()):
            raise WeightsError(f"{source}: {name} holds NaN or infinite values")
    return Weights(weight.detach().to(torch.float32).contiguous(), bias.detach().to(torch.float32).contiguous(), source)


def default_weights() -> Weights:
    """The reference instance's weights (Cin=3, Cout=16, k=3)."""
    weight, bias = reference_weights()
    return check(weight, bias, "default reference weights")


def load(path: str | Path) -> Weights:
    """Read a safetensors file holding conv.weight and conv.bias."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightsError(f"{path}: not a readable safetensors file ({exc})") from exc
    missing = [key for key in (WEIGHT_KEY, BIAS_KEY) if key not in tensors]
    if missing:
        raise WeightsError(f"{path}: missing tensor(s) {', '.join(missing)}; found {sorted(tensors) or 'none'}")
    return check(tensors[WEIGHT_KEY], tensors[BIAS_KEY], str(path))


def save(weights: Weights, path: str | Path) -> None:
    """Write ``weights`` as safetensors, readable as any file this process creates (its umask): safetensors
    itself writes 0600, which a container's non-root user cannot read from a mounted file."""
    save_file({WEIGHT_KEY: weights.weight, BIAS_KEY: weights.bias}, str(path))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def convert_state_dict(src: str | Path, dst: str | Path) -> Weights:
    """Convert a PyTorch state dict (conv.weight/conv.bias or conv_weight/conv_bias) to safetensors.

    The file is read with ``weights_only=True``: tensors only, never code.
    """
    try:
        state = torch.load(str(src), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad pickle
        raise WeightsError(f"{src}: not a loadable PyTorch state dict ({exc})") from exc
    if not isinstance(state, dict):
        raise WeightsError(f"{src}: expected a state dict (a mapping of names to tensors); got {type(state).__name__}")
    for wkey, bkey in _STATE_DICT_KEYS:
        if wkey in state and bkey in state:
            weights = check(state[wkey], state[bkey], str(src))
            save(weights, dst)
            return weights
    raise WeightsError(f"{src}: needs conv.weight and conv.bias (or conv_weight and conv_bias); found {sorted(state)}")
