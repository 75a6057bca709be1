"""Feed-forward sub-layers.

Legend: B batch, T sequence, D width, F hidden width of the MLP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from colfunc.nn.dense import linear

__all__ = ["gated", "gelu_tanh", "mlp", "swiglu"]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's ``gelu_new``)."""
    return F.gelu(x, approximate="tanh")


def mlp(
    x_BTD: torch.Tensor,
    p: dict[str, torch.Tensor],
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``activation(x @ w_in + b_in) @ w_out + b_out``; the biases are optional.

    ``p`` holds ``w_in[D, F]``, ``w_out[F, D]`` and optionally ``b_in[F]``, ``b_out[D]``.
    """
    h_BTF = activation(linear(x_BTD, p["w_in"], p.get("b_in")))
    return linear(h_BTF, p["w_out"], p.get("b_out"))


def gated(
    x_BTD: torch.Tensor,
    p: dict[str, torch.Tensor],
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """A gated MLP (Shazeer 2020): ``(activation(x @ w_gate) * (x @ w_up)) @ w_down`` (GeGLU
    with tanh GELU in Gemma, with exact GELU elsewhere)."""
    h_BTF = activation(linear(x_BTD, p["w_gate"])) * linear(x_BTD, p["w_up"])
    return linear(h_BTF, p["w_down"])


def swiglu(x_BTD: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """SwiGLU (Shazeer 2020), as in LLaMA: ``(silu(x @ w_gate) * (x @ w_up)) @ w_down``."""
    return gated(x_BTD, p, F.silu)
