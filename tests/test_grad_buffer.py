"""Data-parallel gradients are views into one flat buffer per dtype (DDP's gradient_as_bucket_view).

Each bucket handed to the ``all_reduce`` is a view of the buffer the returned gradients live in
(nothing packed it), the buckets tile that buffer, and on gloo, which reduces in place, the only
copies written into the buffer are the gradients themselves, once each (nothing copies results
back). The values are checked against the reduction after the backward pass and the
single-device step, on a toy model with two dtypes, a stacked leaf no layer uses, and a
conditioning carry.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import core, optim, torch_private
from colfunc.transforms import buckets as buckets_module

pytestmark = pytest.mark.timeout(240)

D, N_LAYER = 8, 3


def _toy():
    """A scanned model whose blocks hold fp32 weights, fp64 biases and an unused leaf."""
    g = torch.Generator().manual_seed(3)
    params = {
        "embed": torch.randn(D, D, generator=g),
        "blocks": {
            "w": torch.randn(N_LAYER, D, D, generator=g) / D**0.5,
            "b": torch.randn(N_LAYER, D, generator=g, dtype=torch.float64),
            "unused": torch.randn(N_LAYER, 2, generator=g),
        },
        "head": torch.randn(D, generator=g, dtype=torch.float64),
    }

    def pre(p, batch):
        return batch["x"] @ p["embed"]

    def block(layer, h):
        return torch.tanh(h @ layer["w"] + layer["b"].float())

    def post(p, h, batch):
        return ((h.double() @ p["head"] - batch["y"]) ** 2).mean()

    gen = torch.Generator().manual_seed(4)
    batches = [
        {"x": torch.randn(8, D, generator=gen), "y": torch.randn(8, generator=gen).double()}
        for _ in range(2)
    ]
    return core.layered(pre, block, post, name="toy"), params, batches


def _storages(grads) -> dict[torch.dtype, set[int]]:
    out: dict[torch.dtype, set[int]] = {}
    for g in cf.tree.tensors(grads):
        out.setdefault(g.dtype, set()).add(g.untyped_storage().data_ptr())
    return out


@settings(max_examples=6, deadline=None)
@given(bucket_mb=st.sampled_from([1e-6, 1e-3, 25.0]), dp=st.sampled_from([2, 4]))
def test_buckets_are_views_that_tile_one_buffer_per_dtype(bucket_mb, dp) -> None:
    loss, params, batches = _toy()
    ref = cf.train_step(loss, optim.sgd(0.1))
    handed: dict[int, list[torch.Tensor]] = {}
    start = buckets_module.comm.all_reduce_async

    def spy(x, axis, op="sum", mesh=None):
        handed.setdefault(mesh.rank, []).append(x)
        return start(x, axis, op, mesh)

    def main(mesh):
        step = cf.shard(ref, mesh, bucket_mb=bucket_mb)
        state = step.init(params)
        _, grads = step.forward_backward(state.params, batches[0], state.extra)
        first = list(handed[mesh.rank])
        after = cf.shard(ref, mesh, overlap=False)
        cf.testing.assert_equivalent(step, after, params, batches)  # bit for bit
        cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-6, atol=1e-7)
        return grads, first

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(buckets_module.comm, "all_reduce_async", spy)
        results = cf.launch(main, mesh={"dp": dp})
    for grads, first in results:
        storages = _storages(grads)
        assert {d: len(s) for d, s in storages.items()} == {torch.float32: 1, torch.float64: 1}
        # the buckets of that forward_backward: views of the returned gradients' buffers
        per_storage: dict[int, int] = {}
        for x in first:
            ptr = x.untyped_storage().data_ptr()
            assert any(ptr in s for s in storages.values()), "a bucket was packed, not a view"
            per_storage[ptr] = per_storage.get(ptr, 0) + x.numel() * x.element_size()
        sizes = {
            g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
            for g in cf.tree.tensors(grads)
        }
        assert per_storage == sizes  # the buckets tile each buffer exactly
        assert cf.tree.map(lambda g: g.is_contiguous(), grads)["blocks"]["w"] is False


def _copies_into_the_buffer(mesh):
    loss, params, batches = _toy()
    ref = cf.train_step(loss, optim.adamw(1e-2))
    step = cf.shard(ref, mesh, bucket_mb=1e-3)
    state = step.init(params)
    written: list[tuple[int, int]] = []

    class Count(torch_private.get("TorchDispatchMode")):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.copy_.default:
                dst = args[0]
                written.append((dst.untyped_storage().data_ptr(), dst.numel() * dst.element_size()))
            return out

    with Count():
        _, grads = step.forward_backward(state.params, batches[0], state.extra)
    grads_ = cf.tree.tensors(grads)
    ptrs = {g.untyped_storage().data_ptr() for g in grads_}
    into = sum(n for ptr, n in written if ptr in ptrs)
    grad_bytes = sum(g.numel() * g.element_size() for g in grads_)
    sizes = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads_}
    buffer_bytes = sum(sizes.values())
    # rows of the unused leaf get no gradient and are zeroed, not copied
    unused = params["blocks"]["unused"]
    cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-6, atol=1e-7)
    slot = grads_[0].element_size()  # the loss, reduced in the last bucket
    return (
        into,
        grad_bytes - unused.numel() * unused.element_size() + slot,
        buffer_bytes,
        grad_bytes + slot,
    )


def test_on_gloo_each_gradient_is_written_once_and_reduced_in_place() -> None:
    """Each gradient (and the loss, which the last bucket carries) is copied into the buffer
    once, and the buffer holds nothing else."""
    for into, expected, buffer_bytes, held in cf.launch(
        _copies_into_the_buffer, mesh={"dp": 2}, backend="gloo", timeout=120
    ):
        assert into == expected
        assert buffer_bytes == held  # one buffer per dtype: the gradients and the loss's slot
