"""The C++ CPU Adam against torch.optim.AdamW, on the AVX2/FMA loop and on the scalar loop.

The extension builds on first use (seconds) and is cached under ~/.cache/colfunc.
"""

import os
import shutil
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colfunc.kernels import cpu_adam
from colfunc.ops import AdamWHyper, cpu_adamw_

# Sizes around the SIMD width (8) and the work chunk (16384 elements).
SHAPES = [(3, 5), (1,), (0,), (8,), (16383,), (2, 16385)]
HP: dict[str, float] = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}


def _run_against_torch(
    steps: int,
    grad_dtype: torch.dtype,
    hp: dict[str, float],
    simd: bool = True,
    seed: int = 0,
    shapes: list[tuple[int, ...]] = SHAPES,
) -> None:
    """``steps`` updates of cpu_adamw_ and of torch.optim.AdamW from the same start; the params
    and both moments agree to 1e-6 after every step, and the bf16 copy is the params rounded."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in shapes]
    ref = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(
        ref,
        lr=hp["lr"],
        betas=(hp["beta1"], hp["beta2"]),
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
    )
    exp_avgs = [torch.zeros(s) for s in shapes]
    exp_avg_sqs = [torch.zeros(s) for s in shapes]
    copies = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    for step in range(1, steps + 1):
        grads = [torch.randn(s, generator=gen).to(grad_dtype) for s in shapes]
        for r, g in zip(ref, grads):
            r.grad = g.float()
        opt.step()
        cpu_adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            AdamWHyper(step=step, **hp),
            params_bf16_out=copies,
            simd=simd,
        )
        for p, r, m, v, c in zip(params, ref, exp_avgs, exp_avg_sqs, copies):
            torch.testing.assert_close(p, r.detach(), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(m, opt.state[r]["exp_avg"], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(v, opt.state[r]["exp_avg_sq"], atol=1e-6, rtol=1e-6)
            assert torch.equal(c, p.to(torch.bfloat16))  # torch rounds to nearest even too


@pytest.mark.parametrize("simd", [True, False], ids=["avx2", "scalar"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ten_steps_equal_torch_optim(simd: bool, grad_dtype: torch.dtype) -> None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: cpu_adamw_ runs torch's fused AdamW (tested below)")
    ext = cpu_adam.extension()
    assert ext is not None, "a C++ compiler is here, yet the CPU Adam did not build"
    if simd and not ext.cpu_has_avx2():
        pytest.skip("this CPU has no AVX2/FMA")
    _run_against_torch(10, grad_dtype, HP, simd=simd)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    lr=st.floats(1e-5, 0.1),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.5, 0.9999),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
    weight_decay=st.floats(0.0, 0.5),
    simd=st.booleans(),
    grad_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_hyperparameters_equal_torch_optim(
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    simd: bool,
    grad_dtype: torch.dtype,
) -> None:
    hp = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    _run_against_torch(3, grad_dtype, hp, simd=simd, shapes=[(37,), (4, 9)])


def test_bf16_copy_rounds_to_nearest_even_and_keeps_nan() -> None:
    """Params placed so that the update lands on bf16 rounding ties and on NaN."""
    p = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, float("nan"), -(2**-130), 3.0e38] * 4)
    zeros = torch.zeros_like(p)
    copy = torch.empty(p.shape, dtype=torch.bfloat16)
    for simd in (True, False):  # lr = 0: the params stay as they are
        cpu_adamw_(
            [p],
            [zeros],
            [zeros.clone()],
            [zeros.clone()],
            AdamWHyper(step=1, lr=0.0, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0),
            params_bf16_out=[copy],
            simd=simd,
        )
        want = p.to(torch.bfloat16)
        assert torch.equal(copy.view(torch.int16)[~p.isnan()], want.view(torch.int16)[~p.isnan()])
        assert copy[p.isnan()].isnan().all()


def test_without_a_compiler_falls_back_to_torch_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compiler() -> None:
        raise OSError("no C++ compiler found")

    monkeypatch.setattr(cpu_adam, "_prebuilt", lambda: None)
    monkeypatch.setattr(cpu_adam, "_build", no_compiler)
    cpu_adam.extension.cache_clear()
    try:
        with pytest.warns(
            UserWarning, match="cannot build the C\\+\\+ CPU Adam.*no C\\+\\+ compiler"
        ):
            assert cpu_adam.extension() is None
        _run_against_torch(3, torch.bfloat16, HP, shapes=[(5,), (2, 3)])
    finally:
        cpu_adam.extension.cache_clear()


def _bad_calls() -> list[tuple[str, dict[str, Any], str]]:
    p = torch.randn(4)
    return [
        ("bf16 param", {"params": [p.bfloat16()]}, "param 0 has dtype torch.bfloat16"),
        ("fp16 grad", {"grads": [p.half()]}, "grad 0 has dtype torch.float16"),
        ("meta", {"exp_avgs": [torch.zeros(4, device="meta")]}, "on the CPU"),
        ("copy dtype", {"params_bf16_out": [p.clone()]}, "params_bf16_out\\[0\\]"),
        ("copy count", {"params_bf16_out": []}, "0 tensors for 1 params"),
        ("strided", {"params": [torch.randn(4, 2)[:, 0]]}, "not contiguous"),
        ("step", {"step": 0}, "step=0"),
        ("eps", {"eps": -1.0}, "eps=-1.0"),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_bad_inputs_raise(case: tuple[str, dict[str, Any], str]) -> None:
    _, override, message = case
    p = torch.randn(4)
    kwargs: dict[str, Any] = {
        "params": [p],
        "grads": [torch.randn(4)],
        "exp_avgs": [torch.zeros(4)],
        "exp_avg_sqs": [torch.zeros(4)],
        "step": 1,
        **HP,
    }
    kwargs.update(override)
    before = p.clone()
    hyper = {k: kwargs.pop(k) for k in ("step", *HP)}
    with pytest.raises(ValueError, match=message):
        cpu_adamw_(**kwargs, hyper=AdamWHyper(**hyper))
    assert torch.equal(p, before)
