"""Paged decode attention on the CPU, by the C++ kernel of :mod:`colfunc.kernels.cpu_attention`.

The reference (:func:`colfunc.ops.reference.paged_attention`) gathers the decoding sequences'
blocks into one padded batch and runs a masked attention over it; this kernel reads each block
where it lies, once, one sequence per work item over the OpenMP threads. It
takes fp32 and fp64 tensors, contiguous caches and an int32 block table; anything else (or a
machine that cannot compile it) runs the reference.
"""

from __future__ import annotations

import torch

from colfunc.ops.values import PagedBatch

__all__ = ["checked_tables", "paged_decode_into", "supports"]

DTYPES = (torch.float32, torch.float64)


def supports(
    q_NHE: torch.Tensor,
    k_NKE: torch.Tensor,
    v_NKE: torch.Tensor,
    k_cache_CBKE: torch.Tensor,
    v_cache_CBKE: torch.Tensor,
    block_tables_SM: torch.Tensor,
) -> bool:
    """Whether the kernel takes these tensors (it is then built, or found unbuildable, here)."""
    ts = (q_NHE, k_NKE, v_NKE, k_cache_CBKE, v_cache_CBKE)
    if any(type(t) is not torch.Tensor for t in (*ts, block_tables_SM)):
        return False
    if any(t.device.type != "cpu" or t.dtype != q_NHE.dtype for t in ts):
        return False
    if q_NHE.dtype not in DTYPES or block_tables_SM.dtype != torch.int32:
        return False
    if not (k_cache_CBKE.is_contiguous() and v_cache_CBKE.is_contiguous()):
        return False
    if k_cache_CBKE.shape != v_cache_CBKE.shape or q_NHE.shape[1] % k_NKE.shape[1]:
        return False
    from colfunc.kernels import cpu_attention

    return cpu_attention.extension() is not None


def checked_tables(
    block_tables_SM: torch.Tensor,
    contexts: list[int],
    blocks: int,
    block_size: int,
    window: int | None = None,
) -> torch.Tensor:
    """The block table, contiguous, once these ``contexts`` are known to fit its width and its
    ids the cache's ``blocks`` (a ValueError naming the value otherwise): what the kernel reads
    without checking."""
    M = block_tables_SM.shape[1]
    longest = max(contexts)
    if longest > M * block_size:
        raise ValueError(
            f"paged_attention: a context of {longest} tokens needs more than the block table's "
            f"{M} blocks of {block_size} slots"
        )
    tables = block_tables_SM.contiguous()
    # (a block given back before a window reads as -1: only the blocks a window reaches count)
    if tables.numel() and (
        int(tables.max()) >= blocks or (window is None and int(tables.min()) < 0)
    ):
        raise ValueError(
            f"paged_attention: block_tables hold ids outside [0, {blocks}): the cache has "
            f"{blocks} blocks"
        )
    return tables


@torch.no_grad()
def paged_decode_into(
    out_NHE: torch.Tensor,
    q_NHE: torch.Tensor,
    k_NKE: torch.Tensor,
    v_NKE: torch.Tensor,
    k_cache_CBKE: torch.Tensor,
    v_cache_CBKE: torch.Tensor,
    batch: PagedBatch,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Write the rows of the sequences with one new token (``query_lens[s] == 1``) into the
    contiguous ``out_NHE``, as :func:`colfunc.ops.reference.paged_decode_into` computes them
    (a sliding ``window``, soft-capped scores). Call :func:`supports` first."""
    block_tables_SM, context_lens, query_lens = (
        batch.block_tables,
        batch.context_lens,
        batch.query_lens,
    )
    from colfunc.kernels import cpu_attention

    seqs = [s for s, n in enumerate(query_lens) if n == 1]
    if not seqs:
        return
    ext = cpu_attention.extension()
    assert ext is not None and out_NHE.is_contiguous()
    C, B, K, E = k_cache_CBKE.shape
    M = block_tables_SM.shape[1]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    contexts = [int(context_lens[s]) for s in seqs]
    tables = checked_tables(block_tables_SM, contexts, C, B, window)
    if window is not None:
        for s, c in zip(seqs, contexts, strict=True):
            reached = tables[s, max(0, c - window + 1) // B : -(-c // B)]
            if reached.numel() and int(reached.min()) < 0:
                raise ValueError(
                    f"paged_attention: sequence {s}'s window of {window} reaches a block given "
                    "back (-1 in its table)"
                )
    q, k, v = q_NHE.contiguous(), k_NKE.contiguous(), v_NKE.contiguous()
    ext.paged_decode(
        out_NHE.data_ptr(),
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        k_cache_CBKE.data_ptr(),
        v_cache_CBKE.data_ptr(),
        tables.data_ptr(),
        seqs,
        [starts[s] for s in seqs],
        contexts,
        q.shape[1],
        K,
        E,
        B,
        M,
        q.dtype == torch.float64,
        E**-0.5,
        int(window or 0),
        float(softcap or 0.0),
        torch.get_num_threads(),
    )
