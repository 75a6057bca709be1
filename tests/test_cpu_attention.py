"""The C++ CPU decode attention against plain PyTorch attention, one sequence at a time.

``ops.paged_attention`` on CPU tensors sends its decoding sequences to the C++ kernel (built on
first use, seconds, cached under ~/.cache/colfunc) and its prefill chunks to the reference; both
must equal a dense softmax attention over each sequence's context, gathered by hand.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colfunc import ops
from colfunc.kernels import cpu_attention as kernel
from colfunc.ops import PagedBatch, cpu_attention, reference

TOL = {torch.float32: 2e-6, torch.float64: 1e-12}


def _dense(q, k, v, kc, vc, tables, context_lens, query_lens, window=None, softcap=None):
    """Each sequence alone: its cached keys and values read slot by slot, its new ones after,
    causal softmax attention in fp64 (its last ``window`` tokens; scores soft-capped)."""
    B = kc.shape[1]
    H, K = q.shape[1], k.shape[1]
    out, lo = [], 0
    for s, (c, n) in enumerate(zip(context_lens, query_lens)):
        slots = [(int(tables[s, t // B]), t % B) for t in range(c)]
        keys = torch.stack([kc[b, i] for b, i in slots] + list(k[lo : lo + n])).double()
        vals = torch.stack([vc[b, i] for b, i in slots] + list(v[lo : lo + n])).double()
        keys = keys.repeat_interleave(H // K, dim=1)  # [c + n, H, E]
        vals = vals.repeat_interleave(H // K, dim=1)
        qs = q[lo : lo + n].double()  # [n, H, E]
        scores = torch.einsum("nhe,the->hnt", qs, keys) / q.shape[-1] ** 0.5
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        here = (c + torch.arange(n))[:, None]
        visible = torch.arange(c + n)[None, :] <= here
        if window is not None:
            visible &= torch.arange(c + n)[None, :] > here - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hnt,the->nhe", scores.softmax(-1), vals))
        lo += n
    return torch.cat(out)


def _case(block, heads, head_dim, lens, dtype, seed):
    H, K = heads
    context_lens = [c for c, _ in lens]
    query_lens = [n for _, n in lens]
    N = sum(query_lens)
    M = max(-(-c // block) for c in context_lens) or 1
    C = len(lens) * M + 3
    g = torch.Generator().manual_seed(seed)
    tables = torch.randperm(C, generator=g)[: len(lens) * M].view(len(lens), M).to(torch.int32)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    q, k, v = rand(N, H, head_dim), rand(N, K, head_dim), rand(N, K, head_dim)
    kc, vc = rand(C, block, K, head_dim), rand(C, block, K, head_dim)
    return (q, k, v, kc, vc, tables, context_lens, query_lens)


def _paged(args):
    """``_case``'s arguments as the ops take them: the tensors, then the batch."""
    q, k, v, kc, vc, tables, context_lens, query_lens = args
    return (q, k, v, kc, vc, PagedBatch(tables, context_lens, query_lens))


def _need_kernel():
    if kernel.extension() is None:
        pytest.skip("no C++ compiler: paged_attention decodes by the reference (tested below)")


@settings(max_examples=25)
@given(
    block=st.sampled_from([1, 4, 6, 16]),
    heads=st.sampled_from([(2, 2), (4, 2), (8, 1), (3, 3)]),
    head_dim=st.sampled_from([1, 8, 17, 64]),
    lens=st.lists(
        st.tuples(st.integers(0, 70), st.sampled_from([1, 1, 1, 3])), min_size=1, max_size=6
    ),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_decode_kernel_equals_dense_attention(block, heads, head_dim, lens, dtype, seed) -> None:
    """Decodes (and prefill chunks beside them) over blocks scattered through the cache, any
    block size, grouped-query heads, head dims off the SIMD width, fp32 and fp64."""
    _need_kernel()
    args = _case(block, heads, head_dim, lens, dtype, seed)
    assert cpu_attention.supports(*args[:6])
    got = ops.paged_attention(*_paged(args))
    want = _dense(*args)
    tol = TOL[dtype]
    assert got.dtype == dtype
    assert torch.allclose(got.double(), want, atol=tol, rtol=tol), (got.double() - want).abs().max()


@settings(max_examples=25)
@given(
    block=st.sampled_from([1, 4, 6]),
    heads=st.sampled_from([(2, 2), (4, 2)]),
    lens=st.lists(
        st.tuples(st.integers(0, 40), st.sampled_from([1, 1, 3])), min_size=1, max_size=4
    ),
    window=st.integers(1, 20),
    softcap=st.sampled_from([None, 2.0]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_decode_kernel_slides_and_caps(block, heads, lens, window, softcap, dtype, seed) -> None:
    """Under a sliding window the blocks wholly before each sequence's window are given back
    (-1 in its table) and never read; with soft-capping the scores pass through
    ``cap * tanh(s / cap)``; decodes by the kernel, prefill chunks by the reference, both equal
    to the dense attention."""
    _need_kernel()
    args = _case(block, heads, 8, lens, dtype, seed)
    q, k, v, kc, vc, tables, context_lens, query_lens = args
    given_back = tables.clone()
    for s, c in enumerate(context_lens):
        given_back[s, : max(0, c - window + 1) // block] = -1
    batch = PagedBatch(given_back, context_lens, query_lens)
    got = ops.paged_attention(q, k, v, kc, vc, batch, window=window, softcap=softcap)
    want = _dense(*args, window=window, softcap=softcap)
    tol = TOL[dtype]
    assert torch.allclose(got.double(), want, atol=tol, rtol=tol), (got.double() - want).abs().max()


def test_the_kernel_runs_the_decodes_and_the_reference_the_rest(monkeypatch) -> None:
    """Under ``auto`` decodes reach the kernel; under ``COLFUNC_KERNELS=torch`` nothing does;
    both give the reference's numbers."""
    _need_kernel()
    args = _case(4, (4, 2), 8, [(9, 1), (0, 3), (30, 1)], torch.float64, 0)
    calls = []
    real = cpu_attention.paged_decode_into

    def counted(*a, **kw):
        calls.append(len(a[-1].query_lens))
        return real(*a, **kw)

    monkeypatch.setattr(cpu_attention, "paged_decode_into", counted)
    want = reference.paged_attention(*_paged(args))
    got = ops.paged_attention(*_paged(args))
    assert calls == [3]
    assert torch.allclose(got, want, atol=1e-12, rtol=1e-12)
    monkeypatch.setenv("COLFUNC_KERNELS", "torch")
    assert torch.equal(ops.paged_attention(*_paged(args)), want)
    assert calls == [3]
    monkeypatch.setenv("COLFUNC_KERNELS", "auto")  # a batch of prefill chunks only: no call
    prefill = _case(4, (2, 2), 8, [(5, 2), (0, 4)], torch.float64, 1)
    assert torch.equal(
        ops.paged_attention(*_paged(prefill)), reference.paged_attention(*_paged(prefill))
    )
    assert calls == [3]


def test_what_the_kernel_does_not_take_goes_to_the_reference() -> None:
    args = _case(4, (2, 2), 8, [(9, 1)], torch.float32, 0)
    q, k, v, kc, vc, tables = args[:6]
    assert not cpu_attention.supports(q.bfloat16(), k.bfloat16(), v.bfloat16(), kc, vc, tables)
    assert not cpu_attention.supports(q, k, v, kc.transpose(0, 1), vc.transpose(0, 1), tables)
    assert not cpu_attention.supports(q, k, v, kc, vc, tables.long())
    half = [t.bfloat16() for t in (q, k, v, kc, vc)]
    got = ops.paged_attention(*half, PagedBatch(tables, *args[6:]))
    want = _dense(*half, tables, *args[6:])
    assert torch.allclose(got.double(), want, atol=2e-2, rtol=2e-2)


def test_bad_tables_are_refused_not_read() -> None:
    """Block ids outside the cache, or a context longer than the table: a ValueError, never a
    read out of bounds."""
    _need_kernel()
    q, k, v, kc, vc, tables, ctx, ql = _case(4, (2, 2), 8, [(9, 1), (3, 1)], torch.float32, 0)
    out = torch.empty_like(q)
    bad = tables.clone()
    bad[1, 0] = kc.shape[0]
    with pytest.raises(ValueError, match=r"outside \[0, \d+\): the cache has"):
        cpu_attention.paged_decode_into(out, q, k, v, kc, vc, PagedBatch(bad, ctx, ql))
    bad[1, 0] = -1
    with pytest.raises(ValueError, match="outside"):
        cpu_attention.paged_decode_into(out, q, k, v, kc, vc, PagedBatch(bad, ctx, ql))
    with pytest.raises(ValueError, match="needs more than the block table's"):
        cpu_attention.paged_decode_into(out, q, k, v, kc, vc, PagedBatch(tables, [9, 400], ql))
    with pytest.raises(ValueError, match="must sum to"):
        ops.paged_attention(q, k, v, kc, vc, PagedBatch(tables, ctx, [1, 2]))


def test_without_a_compiler_decoding_runs_the_reference(monkeypatch) -> None:
    def no_compiler() -> None:
        raise OSError("no C++ compiler found")

    monkeypatch.setattr(kernel.cpu_build, "prebuilt", lambda name: None)
    monkeypatch.setattr(kernel.cpu_build, "build", lambda name: no_compiler())
    kernel.extension.cache_clear()
    try:
        args = _case(4, (2, 2), 8, [(9, 1), (0, 2)], torch.float64, 3)
        with pytest.warns(UserWarning, match="cannot build the C\\+\\+ CPU decode attention"):
            got = ops.paged_attention(*_paged(args))
        assert torch.equal(got, reference.paged_attention(*_paged(args)))
    finally:
        kernel.extension.cache_clear()
