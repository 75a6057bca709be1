"""RMSNorm, the rotary embedding and the few-row product by the compiled CPU kernels
(:mod:`colfunc.ops.cpu_rows`), which ``ops.rms_norm``, ``ops.rope`` and ``nn.linear`` take for
plain CPU tensors whose gradient is not wanted:
against the PyTorch reference on drawn shapes, fp32 and fp64, with and without a weight, in the
layouts the attention makes (a decode step's ``[H, N, E]`` view, a batch's ``[B, H, T, E]``), the
result laid out as the reference's; rows shared over threads give the same bits as one thread;
anything else (a gradient wanted, another dtype, a subclass, a strided input) goes to the
reference. The product is checked against an fp64 one within fp32's rounding of each sum, in
both stored layouts of the weight, with and without a bias."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colfunc import nn, ops
from colfunc.ops import cpu_rows, reference

TOL = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.float64: dict(rtol=1e-13, atol=1e-13)}


@settings(max_examples=40, deadline=None)
@given(
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    dim=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    weighted=st.booleans(),
    eps=st.sampled_from([1e-6, 1e-5]),
)
def test_rms_norm_equals_the_reference(lead, dim, dtype, weighted, eps) -> None:
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(*lead, dim, generator=g, dtype=dtype) * 3
    w = torch.randn(dim, generator=g, dtype=dtype) if weighted else None
    got = cpu_rows.rms_norm(x, w, eps)
    assert got is not None and got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, reference.rms_norm(x, w, eps), **TOL[dtype])
    with torch.no_grad():  # what ops.rms_norm takes without a gradient
        torch.testing.assert_close(ops.rms_norm(x, w, eps), got, rtol=0, atol=0)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 5),
    length=st.integers(1, 9),
    half=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    paged=st.booleans(),
)
def test_rope_equals_the_reference_in_the_attention_layouts(
    batch, heads, length, half, dtype, paged
) -> None:
    g = torch.Generator().manual_seed(half)
    E = 2 * half
    # heads split from a projection: [B, T, H*E] viewed [B, H, T, E] (a decode step: [H, N, E])
    proj = torch.randn(batch, length, heads * E, generator=g, dtype=dtype)
    x = proj.unflatten(-1, (heads, E)).transpose(1, 2)
    if paged:
        x = x[0]
    angle = torch.randn(length, half, generator=g, dtype=torch.float64)
    cos, sin = angle.cos(), angle.sin()  # (fp64 tables: cast to x's dtype, as the reference)
    got = cpu_rows.rope(x, cos, sin)
    want = reference.rope(x, cos, sin)
    assert got is not None and got.stride() == want.stride()
    torch.testing.assert_close(got, want, **TOL[dtype])
    with torch.inference_mode():
        torch.testing.assert_close(ops.rope(x, cos, sin), got, rtol=0, atol=0)


def test_rows_over_threads_give_the_bits_of_one_thread() -> None:
    before = torch.get_num_threads()
    x = torch.randn(600, 256)  # (over the size that shares rows out)
    q = torch.randn(600, 4, 64).transpose(0, 1)
    angle = torch.randn(600, 32)
    try:
        torch.set_num_threads(1)
        one = (cpu_rows.rms_norm(x, x[0], 1e-6), cpu_rows.rope(q, angle.cos(), angle.sin()))
        torch.set_num_threads(2)
        two = (cpu_rows.rms_norm(x, x[0], 1e-6), cpu_rows.rope(q, angle.cos(), angle.sin()))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


class _Subclass(torch.Tensor):
    pass


def test_anything_else_goes_to_the_reference() -> None:
    x, w = torch.randn(4, 8), torch.randn(8)
    q = torch.randn(3, 4, 8).transpose(0, 1)  # [H=4, T=3, E=8] from a projection
    cos = torch.randn(3, 4)
    wanted = x.clone().requires_grad_()
    assert cpu_rows.rms_norm(wanted, w, 1e-6) is None
    assert ops.rms_norm(wanted, w).grad_fn is not None  # (the reference: differentiable)
    with torch.no_grad():
        assert cpu_rows.rms_norm(wanted, w, 1e-6) is not None  # (no gradient under no_grad)
    assert cpu_rows.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6) is None
    assert cpu_rows.rms_norm(x, w.double(), 1e-6) is None
    assert cpu_rows.rms_norm(x.t(), None, 1e-6) is None  # (strided rows)
    assert cpu_rows.rms_norm(x.as_subclass(_Subclass), None, 1e-6) is None
    assert cpu_rows.rms_norm(x, torch.randn(7), 1e-6) is None
    assert cpu_rows.rope(q.contiguous(), cos, cos) is None  # (not a projection's layout)
    assert cpu_rows.rope(q, cos, cos) is not None
    assert cpu_rows.rope(q, cos[:2], cos[:2]) is None  # (tables of another length)
    assert cpu_rows.rope(torch.randn(2, 4, 3, 7), cos, cos) is None  # (odd head dim)
    grad = torch.func.grad(lambda t: ops.rms_norm(t, None).sum())(x)  # (under torch.func)
    torch.testing.assert_close(
        grad, torch.func.grad(lambda t: reference.rms_norm(t, None).sum())(x)
    )


@pytest.mark.parametrize("choice", ["torch", "auto"])
def test_the_reference_stays_chosen_by_name(choice, monkeypatch) -> None:
    monkeypatch.setenv("COLFUNC_KERNELS", choice)
    x = torch.randn(3, 16)
    with torch.no_grad():
        got = ops.rms_norm(x, None)
    want = reference.rms_norm(x, None)
    if choice == "torch":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, **TOL[torch.float32])


linear_kernel = pytest.mark.skipif(
    cpu_rows._linear_extension() is None, reason="no AVX-512 or AVX2 with FMA on this CPU"
)


def _product_bound(x: torch.Tensor, w_IO: torch.Tensor) -> float:
    """fp32's rounding of sums of |x| |w| terms: a bound on any order's error."""
    return 1e-6 * float((x.abs().double() @ w_IO.abs().double()).max()) + 1e-6


@linear_kernel
@settings(max_examples=60, deadline=None)
@given(
    lead=st.lists(st.integers(1, 4), min_size=1, max_size=2).filter(
        lambda s: s[0] * (s[1] if len(s) > 1 else 1) <= cpu_rows.MAX_ROWS
    ),
    K=st.integers(1, 300),
    N=st.integers(1, 300),
    stored_out_in=st.booleans(),
    biased=st.booleans(),
    threads=st.sampled_from([1, 2]),
)
def test_linear_equals_a_float64_product(lead, K, N, stored_out_in, biased, threads) -> None:
    g = torch.Generator().manual_seed(K * 1000 + N)
    x = torch.randn(*lead, K, generator=g)
    # [in, out] as colfunc stores a weight, or the transpose of an [out, in] one (Hugging Face)
    w = torch.randn(N, K, generator=g).t() if stored_out_in else torch.randn(K, N, generator=g)
    b = torch.randn(N, generator=g) if biased else None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = cpu_rows.linear(x, w, b)
    finally:
        torch.set_num_threads(before)
    assert got is not None and got.shape == (*lead, N) and got.dtype == torch.float32
    want = x.double() @ w.double() + (b.double() if b is not None else 0)
    assert float((got.double() - want).abs().max()) <= _product_bound(x, w)
    with torch.no_grad():  # what nn.linear takes without a gradient
        assert torch.equal(nn.linear(x, w, b), got)


@linear_kernel
def test_linear_over_threads_gives_the_bits_of_one_thread() -> None:
    before = torch.get_num_threads()
    x, w = torch.randn(11, 256), torch.randn(256, 4000)
    try:
        torch.set_num_threads(1)
        one = (cpu_rows.linear(x, w, None), cpu_rows.linear(x, w.t().contiguous().t(), w[0]))
        torch.set_num_threads(2)
        two = (cpu_rows.linear(x, w, None), cpu_rows.linear(x, w.t().contiguous().t(), w[0]))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two):
        assert a is not None and b is not None and torch.equal(a, b)


@linear_kernel
def test_linear_leaves_everything_else_to_torch(monkeypatch) -> None:
    x, w, b = torch.randn(3, 8), torch.randn(8, 5), torch.randn(5)
    assert cpu_rows.linear(x, w, b) is not None
    wanted = x.clone().requires_grad_()
    assert cpu_rows.linear(wanted, w, b) is None
    assert nn.linear(wanted, w, b).grad_fn is not None  # (torch's: differentiable)
    with torch.no_grad():
        assert cpu_rows.linear(wanted, w, b) is not None
    assert cpu_rows.linear(x, w.requires_grad_(), None) is None
    w = w.detach()
    assert cpu_rows.linear(x.double(), w.double(), None) is None
    assert cpu_rows.linear(x.bfloat16(), w.bfloat16(), None) is None
    assert cpu_rows.linear(x, w, b.double()) is None
    assert cpu_rows.linear(x, w, torch.randn(4)) is None  # (a bias of another width)
    assert cpu_rows.linear(torch.randn(cpu_rows.MAX_ROWS + 1, 8), w, None) is None
    assert cpu_rows.linear(torch.randn(8, 3).t(), w, None) is None  # (strided rows)
    assert cpu_rows.linear(x, torch.randn(8, 10)[:, ::2], None) is None  # (neither layout)
    assert cpu_rows.linear(x, torch.randn(2, 8, 5), None) is None
    assert cpu_rows.linear(x.as_subclass(_Subclass), w, None) is None
    assert cpu_rows.linear(torch.randn(3, 0), torch.randn(0, 5), None) is None
    # under torch.func the product stays torch's, and differentiable
    grad = torch.func.grad(lambda t: nn.linear(t, w, b).sum())(x)
    torch.testing.assert_close(grad, w.sum(1).expand(3, 8))
    monkeypatch.setenv("COLFUNC_KERNELS", "torch")  # (chosen by name: torch's own product)
    with torch.no_grad():
        assert torch.equal(nn.linear(x, w, b), torch.nn.functional.linear(x, w.t(), b))
