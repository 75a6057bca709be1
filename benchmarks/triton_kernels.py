"""The Triton kernels on a GPU, against torch's own kernels and against the device's peaks.

- attention forward and backward: TFLOP/s of ours and of ``scaled_dot_product_attention`` with the
  flash backend, and their share of the device's dense bf16 peak. FLOPs: 4·B·H·T·S·D for the
  forward (two matmuls), halved when causal; 2.5 times that for the backward (five matmuls, two
  of them recomputation).
- fused AdamW, RMSNorm, LayerNorm, cross-entropy, rotary embedding: effective GB/s (bytes each
  must read and write once, over time) of ours and of the torch op a model would otherwise call,
  and their share of the device's peak memory bandwidth.

Every kernel is first checked against torch on the benchmark's own inputs (the max abs error is
printed). Timings are medians from ``triton.testing.do_bench``. Runs in a few minutes (mostly the
attention autotuner); on a machine without a CUDA GPU it says so and exits 0.

    python benchmarks/triton_kernels.py [--peak-tflops 989] [--peak-gbps 4800]
    colfunc bench triton_kernels
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# Dense bf16 tensor-core TFLOP/s and HBM GB/s from the vendor's data sheets, by device name.
PEAKS = {
    "H200": (989.0, 4800.0),
    "H100 PCIe": (756.0, 2000.0),
    "H100": (989.0, 3350.0),
    "A100-SXM4-80GB": (312.0, 2039.0),
    "A100": (312.0, 1555.0),
    "L4": (121.0, 300.0),
}
DTYPE = torch.bfloat16
DEVICE = "cuda"
# (B, H, Hkv, T=S, D, causal): one autotuner key each, so a few compiles per case
ATTENTION_CASES = [
    (4, 32, 32, 2048, 64, False),
    (4, 32, 32, 2048, 64, True),
    (4, 32, 8, 2048, 128, True),
]
ADAMW_TENSORS = (64, 4 * 2**20)  # count, params each (fp32)
NORM_SHAPE = (16384, 4096)  # tokens, features
CE_SHAPE = (8192, 128256)  # tokens, vocabulary (LLaMA 3)
ROPE_SHAPE = (8, 32, 2048, 128)  # B, H, T, D


def _time_ms(fn: Callable[[], Any], grad_to_none: list[torch.Tensor] | None = None) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, grad_to_none=grad_to_none, return_mode="median"))


def _share(value: float, peak: float | None) -> str:
    return f"{value / peak:6.1%}" if peak else "   n/a"


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def attention_rows(peak_tflops: float | None) -> None:
    print(f"\nattention, {DTYPE}: TFLOP/s (share of peak); err = max |ours - sdpa| of out, dq")
    print(f"{'B,H,Hkv,T,D,causal':>24} {'pass':>4} {'ours':>14} {'sdpa flash':>14} {'err':>9}")
    for case in ATTENTION_CASES:
        _attention_case(*case, peak_tflops=peak_tflops)


def _attention_case(
    B: int, H: int, Hkv: int, T: int, D: int, causal: bool, peak_tflops: float | None
) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from colfunc.kernels import attention

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (
        torch.randn(B, h, T, D, device=DEVICE, dtype=DTYPE, generator=gen).requires_grad_()
        for h in (H, Hkv, Hkv)
    )
    # the peer gets the key/value heads already repeated (not timed), so that its flash backend
    # applies whatever its support for grouped-query attention
    k_rep, v_rep = (t.detach().repeat_interleave(H // Hkv, dim=1).requires_grad_() for t in (k, v))
    do = torch.randn(B, H, T, D, device=DEVICE, dtype=DTYPE, generator=gen)

    def ours() -> torch.Tensor:
        out: torch.Tensor = attention.attention(q, k, v, causal)
        return out

    def sdpa() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=causal)

    o_ours, o_sdpa = ours(), sdpa()
    (dq_ours,) = torch.autograd.grad(o_ours, q, do, retain_graph=True)
    (dq_sdpa,) = torch.autograd.grad(o_sdpa, q, do, retain_graph=True)
    err = max(_err(o_ours, o_sdpa), _err(dq_ours, dq_sdpa))
    flops = 4 * B * H * T * T * D * (0.5 if causal else 1.0)
    fwd = (_time_ms(ours), _time_ms(sdpa))
    bwd = (
        _time_ms(lambda: o_ours.backward(do, retain_graph=True), [q, k, v]),
        _time_ms(lambda: o_sdpa.backward(do, retain_graph=True), [q, k_rep, v_rep]),
    )
    name = f"{B},{H},{Hkv},{T},{D},{causal}"
    for label, times, f in (("fwd", fwd, flops), ("bwd", bwd, 2.5 * flops)):
        tflops = [f / (t * 1e-3) / 1e12 for t in times]
        cells = [f"{x:6.1f} ({_share(x, peak_tflops)})" for x in tflops]
        print(f"{name:>24} {label:>4} {cells[0]:>14} {cells[1]:>14} {err:9.2e}")


def _bandwidth_row(
    name: str,
    nbytes: int,
    ours: Callable[[], Any],
    theirs: Callable[[], Any],
    peak_gbps: float | None,
    err: float,
    grads: list[torch.Tensor] | None = None,
) -> None:
    cells = []
    for fn in (ours, theirs):
        gbps = nbytes / (_time_ms(fn, grads) * 1e-3) / 1e9
        cells.append(f"{gbps:7.0f} ({_share(gbps, peak_gbps)})")
    print(f"{name:>34} {cells[0]:>16} {cells[1]:>16} {err:9.2e}")


def _randn(*shape: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return torch.randn(shape, device=DEVICE, dtype=dtype)


def _adamw_row(peak_gbps: float | None) -> None:
    """AdamW over many fp32 tensors; the peer is torch's fused AdamW."""
    from colfunc import ops
    from colfunc.kernels import adamw

    hp = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
    count, size = ADAMW_TENSORS
    params = [_randn(size, dtype=torch.float32) for _ in range(count)]
    grads = [_randn(size, dtype=torch.float32) for _ in range(count)]
    states = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    theirs = [p.clone().requires_grad_() for p in params]
    for t, g in zip(theirs, grads):
        t.grad = g.clone()
    opt = torch.optim.AdamW(
        theirs,
        fused=True,
        lr=hp["lr"],
        betas=(hp["beta1"], hp["beta2"]),
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
    )
    adamw.adamw_(params, grads, *states, ops.AdamWHyper(step=1, **hp))
    opt.step()
    err = max(_err(p, t) for p, t in zip(params, theirs))
    step = [1]

    def ours() -> None:
        step[0] += 1
        adamw.adamw_(params, grads, *states, ops.AdamWHyper(step=step[0], **hp))

    n = count * size
    _bandwidth_row(f"adamw_ {count} x {size} fp32", 28 * n, ours, opt.step, peak_gbps, err)


def _norm_rows(peak_gbps: float | None) -> None:
    """Forward reads x, writes y; backward reads x and dy, writes dx (weights are negligible)."""
    from colfunc.kernels import norms

    N, C = NORM_SHAPE
    x = _randn(N, C).requires_grad_()
    w, b = _randn(C).requires_grad_(), _randn(C).requires_grad_()
    dy = _randn(N, C)
    nx = x.numel() * x.element_size()
    cases: list[tuple[str, Callable[[], torch.Tensor], Callable[[], torch.Tensor]]] = [
        ("rms_norm", lambda: norms.rms_norm(x, w), lambda: F.rms_norm(x, (C,), w, 1e-6)),
        ("layer_norm", lambda: norms.layer_norm(x, w, b), lambda: F.layer_norm(x, (C,), w, b)),
    ]
    for name, ours, theirs in cases:
        y_ours, y_theirs = ours(), theirs()
        err = _err(y_ours, y_theirs)
        _bandwidth_row(f"{name} fwd {N}x{C}", 2 * nx, ours, theirs, peak_gbps, err)
        _bandwidth_row(
            f"{name} bwd {N}x{C}",
            3 * nx,
            functools.partial(y_ours.backward, dy, retain_graph=True),
            functools.partial(y_theirs.backward, dy, retain_graph=True),
            peak_gbps,
            err,
            [x, w, b],
        )


def _cross_entropy_rows(peak_gbps: float | None) -> None:
    """Forward reads the logits; backward reads them and writes their gradient."""
    from colfunc.kernels import cross_entropy
    from colfunc.ops import reference

    N, V = CE_SHAPE
    logits = _randn(N, V).requires_grad_()
    labels = torch.randint(0, V, (N,), device=DEVICE)
    nl = logits.numel() * logits.element_size()
    loss_ours = cross_entropy.cross_entropy(logits, labels)
    loss_ref = reference.cross_entropy(logits, labels)
    err = _err(loss_ours, loss_ref)
    _bandwidth_row(
        f"cross_entropy fwd {N}x{V}",
        nl,
        lambda: cross_entropy.cross_entropy(logits, labels),
        lambda: reference.cross_entropy(logits, labels),
        peak_gbps,
        err,
    )
    _bandwidth_row(
        f"cross_entropy bwd {N}x{V}",
        2 * nl,
        lambda: loss_ours.backward(retain_graph=True),
        lambda: loss_ref.backward(retain_graph=True),
        peak_gbps,
        err,
        [logits],
    )


def _rope_row(peak_gbps: float | None) -> None:
    """Reads x, writes the rotated x (the tables are negligible)."""
    from colfunc.kernels import rope
    from colfunc.ops import reference

    x = _randn(*ROPE_SHAPE).requires_grad_()
    angle = _randn(ROPE_SHAPE[2], ROPE_SHAPE[3] // 2, dtype=torch.float32)
    cos, sin = angle.cos(), angle.sin()
    err = _err(rope.rope(x, cos, sin), reference.rope(x, cos, sin))
    shape = "x".join(map(str, ROPE_SHAPE))
    _bandwidth_row(
        f"rope fwd {shape}",
        2 * x.numel() * x.element_size(),
        lambda: rope.rope(x, cos, sin),
        lambda: reference.rope(x, cos, sin),
        peak_gbps,
        err,
    )


def bandwidth_rows(peak_gbps: float | None) -> None:
    print("\nmemory-bound kernels: GB/s (share of peak); peer = the torch op a model would call")
    print(f"{'op':>34} {'ours':>16} {'torch':>16} {'err':>9}")
    for rows in (_adamw_row, _norm_rows, _cross_entropy_rows, _rope_row):
        rows(peak_gbps)  # each frees its buffers on return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak, if not in the table")
    parser.add_argument(
        "--peak-gbps", type=float, help="memory bandwidth peak, if not in the table"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels benchmark: no CUDA GPU on this machine; nothing to measure")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("kernels benchmark: Triton is not installed (pip install triton); nothing to measure")
        return 0
    name = torch.cuda.get_device_name()
    table = next((peaks for key, peaks in PEAKS.items() if key in name), (None, None))
    peak_tflops = args.peak_tflops or table[0]
    peak_gbps = args.peak_gbps or table[1]
    print(f"{name}: peak {peak_tflops or '?'} TFLOP/s bf16, {peak_gbps or '?'} GB/s")
    attention_rows(peak_tflops)
    bandwidth_rows(peak_gbps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
