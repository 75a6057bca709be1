"""Cross-entropy with a backward that reuses the memory it saved: the path of ``ops.cross_entropy``
for plain tensors that need a gradient off the accelerator (``COLFUNC_KERNELS=auto``).

``F.cross_entropy``'s backward zero-fills a vocabulary-wide tensor, scatters the upstream
gradient into it and runs ``log_softmax``'s backward over it into a third: five passes over
``[N, V]``, about a tenth of a small language model's training step on the CPU. Here the backward
turns the saved log-probabilities into ``softmax - onehot`` in place and scales them: two passes,
the same memory, the same numbers to rounding (tested against ``F.cross_entropy``).
"""

from __future__ import annotations

from typing import Any

import torch

from colfunc import torch_private
from colfunc.kernels import checks

__all__ = ["applies", "cross_entropy"]


def applies(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> bool:
    """Whether :func:`cross_entropy` takes these: plain tensors (not a subclass such as a
    ShardedTensor, nor ones under a ``torch.func`` transform), logits ``[N, V]`` of a float dtype
    whose gradient is wanted and integer labels ``[N]``, N and V at least 1. Anything else goes to
    the reference, which checks it."""
    if (
        type(logits_NV) not in (torch.Tensor, torch.nn.Parameter)
        or type(labels_N) is not torch.Tensor
    ):
        return False
    if not (logits_NV.requires_grad and torch.is_grad_enabled()):
        return False
    try:
        checks.cross_entropy(logits_NV, labels_N)
    except ValueError:
        return False
    return not torch_private.are_functorch_transforms_active()


def cross_entropy(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """Mean cross-entropy over the labels that are not ``ignore_index``, computed in fp32 (fp64
    logits in fp64): ``F.cross_entropy``'s value, ``nan`` when every label is ignored, as there."""
    wide = logits_NV if logits_NV.dtype == torch.float64 else logits_NV.float()  # never narrow
    out: torch.Tensor = _SoftmaxLoss.apply(wide, labels_N.long(), ignore_index)
    return out


class _SoftmaxLoss(torch.autograd.Function):
    """The saved log-probabilities become the gradient, so a second backward through the same
    graph (``retain_graph``) is refused."""

    @staticmethod
    def forward(ctx: Any, x_NV: torch.Tensor, y_N: torch.Tensor, ignore: int) -> torch.Tensor:
        logp_NV = torch.log_softmax(x_NV, -1)
        keep_N = y_N != ignore
        n = keep_N.sum()
        picked_N = logp_NV.gather(1, y_N.masked_fill(~keep_N, 0)[:, None])[:, 0]
        ctx.save_for_backward(logp_NV, y_N, keep_N, n)
        ctx.spent = False
        return -(picked_N * keep_N).sum() / n

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.spent:
            raise RuntimeError(
                "cross_entropy: a second backward through the same graph (retain_graph): the "
                "first one turned the log-probabilities it saved into the gradient. Compute the "
                "loss again, or set COLFUNC_KERNELS=torch for F.cross_entropy"
            )
        ctx.spent = True
        logp_NV, y_N, keep_N, n = ctx.saved_tensors
        grad_NV = logp_NV.exp_()  # the softmax, in place of the log-probabilities
        rows = torch.arange(len(y_N), device=y_N.device)
        grad_NV[rows, y_N.masked_fill(~keep_N, 0)] -= 1
        grad_NV.mul_((g / n * keep_N).to(grad_NV.dtype)[:, None])
        return grad_NV, None, None
