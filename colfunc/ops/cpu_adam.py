"""AdamW on the CPU, for optimizer states offloaded to host memory.

Runs the C++ kernel of :mod:`colfunc.kernels.cpu_adam` (AVX2/FMA when the CPU has them, OpenMP
threads), built on first use; where it cannot be built, torch's fused CPU AdamW does the same update
after one warning.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from colfunc import torch_private
from colfunc.kernels import checks
from colfunc.ops.values import AdamWHyper

__all__ = ["cpu_adamw_"]

GRAD_DTYPES = (torch.float32, torch.bfloat16)


def _check_cpu(
    op: str, lists: Sequence[Sequence[torch.Tensor]], params_bf16_out: Sequence[torch.Tensor] | None
) -> None:
    for ts in lists:
        for t in ts:
            if t.device.type != "cpu":
                raise ValueError(
                    f"{op}: a tensor is on {t.device}; every tensor must be on the CPU"
                )
    if params_bf16_out is None:
        return
    params = lists[0]
    if len(params_bf16_out) != len(params):
        raise ValueError(
            f"{op}: params_bf16_out has {len(params_bf16_out)} tensors for {len(params)} params"
        )
    for i, (p, out) in enumerate(zip(params, params_bf16_out)):
        if out.dtype != torch.bfloat16 or out.shape != p.shape or out.device.type != "cpu":
            raise ValueError(
                f"{op}: params_bf16_out[{i}] is {out.dtype} {tuple(out.shape)} on {out.device}; "
                f"expected a bf16 CPU tensor of shape {tuple(p.shape)}"
            )
        if not out.is_contiguous():
            raise ValueError(f"{op}: params_bf16_out[{i}] is not contiguous")


def _torch_fused(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    params_bf16_out: Sequence[torch.Tensor] | None,
    hyper: AdamWHyper,
) -> None:
    """The same update by ``torch._fused_adamw_``, for machines without a C++ compiler."""
    torch_private.fused_adamw_(
        list(params),
        [g.float() for g in grads],
        list(exp_avgs),
        list(exp_avg_sqs),
        [],
        [torch.tensor(float(hyper.step)) for _ in params],
        lr=hyper.lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=False,
    )
    for p, out in zip(params, params_bf16_out or ()):
        out.copy_(p)


@torch.no_grad()
def cpu_adamw_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    hyper: AdamWHyper,
    *,
    params_bf16_out: Sequence[torch.Tensor] | None = None,
    simd: bool = True,
) -> None:
    """One AdamW update in place on CPU tensors, as ``torch.optim.AdamW`` computes it.

    ``params``, ``exp_avgs`` and ``exp_avg_sqs`` are fp32, ``grads`` fp32 or bf16, all contiguous.
    ``params_bf16_out``, if given, receives a bf16 copy of each updated param in the same pass
    (what a device holding bf16 weights fetches). ``simd=False`` runs the portable scalar loop
    even where the CPU has AVX2/FMA.

    >>> cpu_adamw_([p], [p.grad], [m], [v], AdamWHyper(step=1, lr=1e-3, weight_decay=0.01))
    ... # doctest: +SKIP
    """
    op = "cpu_adamw_"
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    checks.adamw_lists(op, *lists, param_dtypes=(torch.float32,), grad_dtypes=GRAD_DTYPES)
    checks.adamw_hyper(op, hyper)
    _check_cpu(op, lists, params_bf16_out)
    if not params:
        return
    from colfunc.kernels import cpu_adam

    ext = cpu_adam.extension()
    if ext is None:
        _torch_fused(*lists, params_bf16_out, hyper)
        return
    outs = [0] * len(params) if params_bf16_out is None else [t.data_ptr() for t in params_bf16_out]
    # Each scalar in double, then rounded to float by pybind11: as torch's kernels receive them.
    h = hyper
    scalars = ext.Hyper(
        decay=1.0 - h.lr * h.weight_decay,
        lerp_weight=1.0 - h.beta1,
        beta2=h.beta2,
        one_minus_beta2=1.0 - h.beta2,
        eps=h.eps,
        neg_step_size=-h.lr / (1.0 - h.beta1**h.step),
        bc2_sqrt=(1.0 - h.beta2**h.step) ** 0.5,
    )
    ext.adamw_step(
        *([t.data_ptr() for t in ts] for ts in lists),
        outs,
        [p.numel() for p in params],
        [g.dtype == torch.bfloat16 for g in grads],
        scalars,
        simd,
        torch.get_num_threads(),
    )
