"""The Triton kernels against the fp32 PyTorch references, run by Triton's interpreter on the CPU.

Triton reads TRITON_INTERPRET when a kernel is decorated, that is when its module is imported, so
this file sets it before anything imports the kernel modules and is meant to be their only
importer in a test run. Shapes are tiny (the interpreter runs every block operation in numpy) and
bf16 is not run (the interpreter's bf16 arithmetic is wrong). Outputs and every gradient must match
the reference run on fp32 copies of the inputs: fp32 within 1e-4, fp16 within 2e-3.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any colfunc.kernels Triton module is imported

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

import itertools

import colfunc.ops as ops
from colfunc.kernels import (
    adamw,
    attention,
    cross_entropy,
    grouped_matmul,
    norms,
    paged_attention,
    quant,
    rope,
)
from colfunc.ops import AdamWHyper, PagedBatch, reference

_STALE = [
    m.__name__
    for m in (adamw, attention, cross_entropy, grouped_matmul, norms, paged_attention, quant, rope)
    if not m.INTERPRETED
]
if _STALE:
    pytest.skip(
        f"{_STALE} were imported before TRITON_INTERPRET=1 was set, so they cannot run on the CPU; "
        "run this file in its own process: pytest tests/test_kernels_triton.py",
        allow_module_level=True,
    )

TOL = {torch.float32: 1e-4, torch.float16: 2e-3}  # absolute and relative
DTYPES = st.sampled_from([torch.float32, torch.float16])
FEW = settings(max_examples=10, deadline=None, derandomize=True)  # per head dim: 40 in all
MORE = settings(max_examples=25, deadline=None, derandomize=True)


def assert_matches_reference(
    kernel: Callable[..., torch.Tensor],
    ref: Callable[..., torch.Tensor],
    args: Sequence[Any],
    dtype: torch.dtype,
    seed: int = 0,
) -> None:
    """``kernel(*args)`` against ``ref`` on fp32 copies: the output and the gradient of every
    argument that requires one, for a random output gradient."""
    out = kernel(*args)
    gen = torch.Generator().manual_seed(seed)
    dy = torch.randn(out.shape, generator=gen).to(out.dtype)
    diff = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(out, diff, dy)

    def fp32(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.detach().float().requires_grad_(a.requires_grad)
        return a

    ref_args = [fp32(a) for a in args]
    ref_out = ref(*ref_args)
    ref_diff = [a for a in ref_args if isinstance(a, torch.Tensor) and a.requires_grad]
    ref_grads = torch.autograd.grad(ref_out, ref_diff, dy.float())
    assert out.dtype == ref(*args).dtype  # the kernel keeps the reference's output dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
    for g, ref_g in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.float(), ref_g, atol=tol, rtol=tol)


def randn(*shape: int, dtype: torch.dtype, seed: int, grad: bool = True) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return x.requires_grad_(grad)


@pytest.mark.parametrize("D", [16, 32, 64, 128])
@FEW
@given(
    B=st.integers(1, 2),
    Hkv=st.integers(1, 2),
    G=st.sampled_from([1, 2, 3]),
    T=st.integers(1, 40),
    S=st.integers(1, 40),
    causal=st.booleans(),
    dtype=DTYPES,
)
@example(B=1, Hkv=1, G=4, T=1, S=37, causal=True, dtype=torch.float32)  # decoding, multi-query
def test_attention(
    D: int, B: int, Hkv: int, G: int, T: int, S: int, causal: bool, dtype: torch.dtype
) -> None:
    if causal and T > S:
        T, S = S, T  # bottom-right causal attention needs T <= S
    q = randn(B, Hkv * G, T, D, dtype=dtype, seed=1)
    k = randn(B, Hkv, S, D, dtype=dtype, seed=2)
    v = randn(B, Hkv, S, D, dtype=dtype, seed=3)
    assert_matches_reference(
        lambda q, k, v: attention.attention(q, k, v, causal),
        lambda q, k, v: reference.attention(q, k, v, causal),
        [q, k, v],
        dtype,
    )


@FEW
@given(
    G=st.sampled_from([1, 2]),
    T=st.integers(1, 40),
    extra=st.integers(0, 9),
    window=st.one_of(st.none(), st.integers(1, 20)),
    softcap=st.sampled_from([None, 1.5]),
    dtype=DTYPES,
)
@example(G=2, T=40, extra=3, window=3, softcap=None, dtype=torch.float32)  # windows inside tiles
@example(G=1, T=33, extra=0, window=17, softcap=1.5, dtype=torch.float32)
def test_attention_windows_and_soft_caps(G, T, extra, window, softcap, dtype) -> None:
    """Causal attention (``S = T + extra``, aligned bottom-right) under a sliding window and
    with soft-capped scores, the output and every gradient against the reference. (fp16 with a
    window of 1, where each query sees only itself, is left out: the true dK is 0 and the fp16
    output that the softmax backward's row term is taken from leaves ~2e-3 of it.)"""
    if dtype == torch.float16 and window == 1:
        window = 2
    if window is None and softcap is None:
        window = 5
    S = T + extra
    q = randn(1, 2 * G, T, 16, dtype=dtype, seed=7)
    k = randn(1, 2, S, 16, dtype=dtype, seed=8)
    v = randn(1, 2, S, 16, dtype=dtype, seed=9)
    assert_matches_reference(
        lambda q, k, v: attention.attention(q, k, v, True, window=window, softcap=softcap),
        lambda q, k, v: reference.attention(q, k, v, True, window=window, softcap=softcap),
        [q, k, v],
        dtype,
    )


def test_attention_strided_inputs_odd_head_dim_and_scale() -> None:
    """q, k, v as transposed views of [B, T, H, D] (what a model's projection gives), D = 40."""
    B, T, H, D = 2, 19, 4, 40
    qkv = randn(B, T, 3 * H, D, dtype=torch.float32, seed=4, grad=False)
    q, k, v = (t.transpose(1, 2).requires_grad_() for t in qkv.split(H, dim=2))
    assert not q.is_contiguous()
    assert_matches_reference(
        lambda q, k, v: attention.attention(q, k, v, True, scale=0.3),
        lambda q, k, v: reference.attention(q, k, v, True, scale=0.3),
        [q, k, v],
        torch.float32,
    )


@FEW
@given(
    G=st.sampled_from([1, 2]),
    T=st.integers(1, 33),
    S=st.integers(1, 33),
    causal=st.booleans(),
    D=st.sampled_from([16, 32]),
)
def test_attention_lse_and_its_gradient(G: int, T: int, S: int, causal: bool, D: int) -> None:
    """The log-sum-exp output (natural log, fp32) and gradients through out and lse both."""
    if causal and T > S:
        T, S = S, T
    q = randn(1, 2 * G, T, D, dtype=torch.float32, seed=1)
    k = randn(1, 2, S, D, dtype=torch.float32, seed=2)
    v = randn(1, 2, S, D, dtype=torch.float32, seed=3)
    out, lse = attention.attention_lse(q, k, v, causal)
    ref_out, ref_lse = reference.attention_lse(q, k, v, causal)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    gen = torch.Generator().manual_seed(5)
    d_out, d_lse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    grads = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), (q, k, v))
    want = torch.autograd.grad((ref_out * d_out).sum() + (ref_lse * d_lse).sum(), (q, k, v))
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@FEW
@given(T=st.integers(1, 24), S=st.integers(1, 24), causal=st.booleans())
def test_attention_block_forward_and_backward(T: int, S: int, causal: bool) -> None:
    """Ring attention's two block kernels against the reference's, with a whole attention's
    log-sum-exp and delta."""
    if causal and T > S:
        T, S = S, T
    q = randn(2, 4, T, 16, dtype=torch.float32, seed=1, grad=False)
    k = randn(2, 2, S, 16, dtype=torch.float32, seed=2, grad=False)
    v = randn(2, 2, S, 16, dtype=torch.float32, seed=3, grad=False)
    out, lse = attention.attention_block(q, k, v, causal, 0.5)
    ref_out, ref_lse = reference.attention_block(q, k, v, causal, 0.5)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    dout = randn(2, 4, T, 16, dtype=torch.float32, seed=4, grad=False)
    delta = (dout * out).sum(-1)
    got = attention.attention_block_backward(q, k, v, dout, lse, delta, causal, 0.5)
    want = reference.attention_block_backward(q, k, v, dout, lse, delta, causal, 0.5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@MORE
@given(
    lead=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    C=st.integers(1, 70),
    with_weight=st.booleans(),
    with_bias=st.booleans(),
    dtype=DTYPES,
    fp32_weight=st.booleans(),
)
def test_norms(
    lead: list[int],
    C: int,
    with_weight: bool,
    with_bias: bool,
    dtype: torch.dtype,
    fp32_weight: bool,
) -> None:
    x = randn(*lead, C, dtype=dtype, seed=5)
    w_dtype = torch.float32 if fp32_weight else dtype
    w = (randn(C, dtype=w_dtype, seed=6, grad=False) + 1).requires_grad_() if with_weight else None
    b = randn(C, dtype=w_dtype, seed=7) if with_bias else None
    assert_matches_reference(norms.rms_norm, reference.rms_norm, [x, w, 1e-6], dtype)
    if fp32_weight and dtype != torch.float32:
        return  # torch's layer_norm does not mix dtypes on the CPU: no reference to compare with
    assert_matches_reference(norms.layer_norm, reference.layer_norm, [x, w, b, 1e-5], dtype)


@MORE
@given(
    N=st.integers(1, 9),
    V=st.integers(1, 300),
    ignored=st.floats(0.0, 0.7),
    dtype=DTYPES,
    int32_labels=st.booleans(),
)
def test_cross_entropy(
    N: int, V: int, ignored: float, dtype: torch.dtype, int32_labels: bool
) -> None:
    gen = torch.Generator().manual_seed(8)
    logits = (3 * randn(N, V, dtype=torch.float32, seed=9, grad=False)).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[torch.rand(N, generator=gen) < ignored] = -100
    labels[0] = 0  # at least one kept label: an all-ignored batch is nan, checked below
    labels = labels.to(torch.int32 if int32_labels else torch.int64)
    assert_matches_reference(
        cross_entropy.cross_entropy,
        lambda x, y: reference.cross_entropy(x, y.long()),
        [logits, labels],
        dtype,
    )


def test_cross_entropy_all_ignored_is_nan_like_torch() -> None:
    logits = torch.randn(3, 7)
    labels = torch.full((3,), -1, dtype=torch.int64)
    got = cross_entropy.cross_entropy(logits, labels, ignore_index=-1)
    assert math.isnan(got.item()) and math.isnan(reference.cross_entropy(logits, labels, -1).item())


@MORE
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    T=st.integers(1, 20),
    K=st.integers(1, 32),
    dtype=DTYPES,
)
def test_rope(lead: list[int], T: int, K: int, dtype: torch.dtype) -> None:
    x = randn(*lead, T, 2 * K, dtype=dtype, seed=10)
    angle = randn(T, K, dtype=torch.float32, seed=11, grad=False) * 3
    assert_matches_reference(rope.rope, reference.rope, [x, angle.cos(), angle.sin()], dtype)


SHAPES = [(3, 5), (63,), (64,), (65,), (1,), (0,), (7, 31)]  # around the interpreter's 64-chunk


def _adamw_hparams(beta1: float = 0.9) -> dict[str, float]:
    return {"lr": 1e-2, "beta1": beta1, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}


@pytest.mark.parametrize("beta1", [0.9, 0.3])  # torch's lerp rounds differently past weight 0.5
def test_adamw_equals_torch_optim(beta1: float) -> None:
    """fp32: three steps of the fused kernel against torch.optim.AdamW."""
    gen = torch.Generator().manual_seed(12)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    ref = [p.clone().requires_grad_() for p in params]
    hp = _adamw_hparams(beta1)
    opt = torch.optim.AdamW(
        ref,
        lr=hp["lr"],
        betas=(hp["beta1"], hp["beta2"]),
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
    )
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    for step in range(1, 4):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        adamw.adamw_(params, grads, exp_avgs, exp_avg_sqs, AdamWHyper(step=step, **hp))
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r.detach(), atol=1e-6, rtol=1e-6)
    for m, r in zip(exp_avgs, ref):
        torch.testing.assert_close(m, opt.state[r]["exp_avg"], atol=1e-6, rtol=1e-6)


def test_adamw_low_precision_params_and_grads() -> None:
    """fp16 params and grads with fp32 moments, mixed with fp32 tensors (two dtype groups)."""
    gen = torch.Generator().manual_seed(13)
    dtypes = [torch.float16 if i % 2 else torch.float32 for i in range(len(SHAPES))]
    params = [torch.randn(s, generator=gen).to(d) for s, d in zip(SHAPES, dtypes)]
    ref_params = [p.clone() for p in params]
    states = [[torch.zeros(s) for s in SHAPES] for _ in range(4)]
    for step in range(1, 4):
        grads = [torch.randn(s, generator=gen).to(d) for s, d in zip(SHAPES, dtypes)]
        hyper = AdamWHyper(step=step, **_adamw_hparams())
        adamw.adamw_(params, grads, states[0], states[1], hyper)
        reference.adamw_(ref_params, grads, states[2], states[3], hyper)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, atol=1e-3, rtol=0)  # one fp16 rounding of the same value
    for m, r in zip(states[0], states[2]):
        torch.testing.assert_close(m, r, atol=1e-6, rtol=1e-6)


def test_dispatcher_reaches_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """COLFUNC_KERNELS=triton sends CPU tensors to the kernels under the interpreter; auto does
    not (CPU tensors get the reference)."""
    q = randn(1, 2, 5, 16, dtype=torch.float32, seed=14)
    x = randn(3, 8, dtype=torch.float32, seed=15)
    logits, labels = randn(4, 11, dtype=torch.float32, seed=16), torch.tensor([1, 2, -100, 3])
    angle = randn(5, 8, dtype=torch.float32, seed=17, grad=False)
    calls = {
        "_Attention": lambda: ops.attention(q, q, q),
        "_RMSNorm": lambda: ops.rms_norm(x, None),
        "_LayerNorm": lambda: ops.layer_norm(x, None, None),
        "_CrossEntropy": lambda: ops.cross_entropy(logits, labels),
        "_Rope": lambda: ops.rope(q, angle.cos(), angle.sin()),
    }
    for choice in ("triton", "auto"):
        monkeypatch.setenv("COLFUNC_KERNELS", choice)
        for name, call in calls.items():
            out = call()
            assert out.grad_fn is not None
            assert (name in type(out.grad_fn).__name__) == (choice == "triton"), (choice, name)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    block=st.sampled_from([4, 8, 16]),
    heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
    head_dim=st.sampled_from([16, 32]),
    lens=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 6)), min_size=1, max_size=4),
    dtype=DTYPES,
    data=st.data(),
)
def test_paged_attention_matches_the_reference(block, heads, head_dim, lens, dtype, data) -> None:
    """Decodes and prefill chunks mixed, over blocks scattered through the cache in any order;
    under a drawn sliding window (the blocks wholly before every new token's window given back,
    -1 in the table) and soft-capped scores or not."""
    H, K = heads
    context_lens = [c for c, _ in lens]
    query_lens = [q for _, q in lens]
    N = sum(query_lens)
    M = max(-(-c // block) for c in context_lens) or 1
    C = len(lens) * M + 3
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    perm = torch.randperm(C, generator=g)[: len(lens) * M].view(len(lens), M).to(torch.int32)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k, v = rand(N, H, head_dim), rand(N, K, head_dim), rand(N, K, head_dim)
    kc, vc = rand(C, block, K, head_dim), rand(C, block, K, head_dim)
    window = data.draw(st.one_of(st.none(), st.integers(1, 12)), label="window")
    softcap = data.draw(st.sampled_from([None, 1.5]), label="softcap")
    if window is not None:
        for s, c in enumerate(context_lens):
            perm[s, : max(0, c - window + 1) // block] = -1  # given back, never read
    batch = PagedBatch(perm, context_lens, query_lens)
    got = paged_attention.paged_attention(q, k, v, kc, vc, batch, window=window, softcap=softcap)
    f32 = [t.float() for t in (q, k, v, kc, vc)]
    want = reference.paged_attention(*f32, batch, window=window, softcap=softcap)
    tol = TOL[dtype]
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol), (got.float() - want).abs().max()


@pytest.mark.parametrize(("window", "softcap"), [(2, None), (3, 1.5), (1, None)])
def test_paged_attention_windows_inside_a_prefill_chunk(window, softcap) -> None:
    """A window shorter than the chunk of new tokens: each new token's window ends among the
    new tokens themselves (and, after a context, starts inside the cache)."""
    g = torch.Generator().manual_seed(window)
    H, K, E, B = 4, 2, 16, 4
    context_lens, query_lens = [0, 5, 9], [6, 4, 1]
    N = sum(query_lens)
    q, k, v = (torch.randn(N, n, E, generator=g) for n in (H, K, K))
    kc, vc = (torch.randn(8, B, K, E, generator=g) for _ in range(2))
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 1]], dtype=torch.int32)
    batch = PagedBatch(tables, context_lens, query_lens)
    got = paged_attention.paged_attention(q, k, v, kc, vc, batch, window=window, softcap=softcap)
    want = reference.paged_attention(q, k, v, kc, vc, batch, window=window, softcap=softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_paged_attention_refuses_what_it_cannot_take() -> None:
    q = torch.zeros(3, 2, 16)
    kv = torch.zeros(3, 2, 16)
    cache = torch.zeros(4, 6, 2, 16)  # a block size that is not a power of two
    tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="power-of-two block size"):
        paged_attention.paged_attention(q, kv, kv, cache, cache, PagedBatch(tables, [4], [3]))
    cache = torch.zeros(4, 4, 2, 16)
    with pytest.raises(ValueError, match="sum to 3"):
        paged_attention.paged_attention(q, kv, kv, cache, cache, PagedBatch(tables, [4], [2]))
    with pytest.raises(ValueError, match="longer than its block table"):
        paged_attention.paged_attention(q, kv, kv, cache, cache, PagedBatch(tables, [9], [3]))


def test_varlen_attention_is_each_sequence_alone() -> None:
    g = torch.Generator().manual_seed(0)
    lens = [3, 7, 1, 5]
    N = sum(lens)
    q, k, v = (torch.randn(N, 4, 16, generator=g) for _ in range(3))
    bounds = [0, 3, 10, 11, 16]
    for choice in ("torch", "triton"):
        os.environ["COLFUNC_KERNELS"] = choice
        try:
            got = ops.varlen_attention(q, k, v, bounds)
        finally:
            del os.environ["COLFUNC_KERNELS"]
        for a, b in itertools.pairwise(bounds):
            want = torch.nn.functional.scaled_dot_product_attention(
                q[a:b].transpose(0, 1),
                k[a:b].transpose(0, 1),
                v[a:b].transpose(0, 1),
                is_causal=True,
            ).transpose(0, 1)
            assert torch.allclose(got[a:b], want, atol=1e-5), choice
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.varlen_attention(q, k, v, [0, 3, 15])


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    lead=st.sampled_from([(), (3,), (2, 5)]),
    blocks=st.integers(0, 40),  # blocks of 64 values: up to 2 programs of 1024 bytes
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_nf4_dequantization_equals_the_reference(lead, blocks, dtype, seed) -> None:
    """QLoRA's base, dequantized by the kernel: every value equal to the reference's."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (*lead, 32 * blocks), generator=g, dtype=torch.uint8)
    absmax = torch.rand((*lead, blocks), generator=g) * 4
    got = quant.dequantize_nf4(packed, absmax, dtype)
    want = reference.dequantize_nf4(packed, absmax, dtype)
    assert got.dtype == dtype and got.shape == want.shape == (*lead, 64 * blocks)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="codes must be uint8 and absmax float32"):
        quant.dequantize_nf4(packed.int(), absmax, dtype)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    counts=st.lists(st.integers(0, 20), min_size=1, max_size=4),
    n_in=st.integers(1, 40),
    n_out=st.integers(1, 40),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_grouped_matmul_equals_the_reference(counts, n_in, n_out, dtype, seed) -> None:
    """A mixture's rows, sorted by expert, times each expert's weight: the kernel's output and
    both gradients against one matmul per expert (tiles that straddle no expert's end; the
    last rows of an expert in a tile of their own)."""
    from colfunc.ops import moe

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), n_in, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(len(counts), n_in, n_out, generator=g) / 4).to(dtype).requires_grad_()
    assert_matches_reference(
        lambda a, b: grouped_matmul.grouped_matmul(a, b, counts),
        lambda a, b: moe._blocks(a, b, counts),
        [x, w],
        dtype,
        seed,
    )
    with pytest.raises(ValueError, match="counts summing to"):
        grouped_matmul.grouped_matmul(x, w, [c + 1 for c in counts])
