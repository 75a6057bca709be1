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
from colfunc.transforms.data_parallel import buckets as buckets_module
from colfunc.transforms.data_parallel import grad_layout

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


def _spy_on_buckets(mp: pytest.MonkeyPatch) -> dict[int, list[torch.Tensor]]:
    """Each rank's tensors handed to ``all_reduce_async`` by the buckets, in order, while
    ``mp`` is in effect."""
    handed: dict[int, list[torch.Tensor]] = {}
    start = buckets_module.comm.all_reduce_async

    def spy(x, axis, op="sum", mesh=None):
        handed.setdefault(mesh.rank, []).append(x)
        return start(x, axis, op, mesh)

    mp.setattr(buckets_module.comm, "all_reduce_async", spy)
    return handed


@settings(max_examples=6, deadline=None)
@given(bucket_mb=st.sampled_from([1e-6, 1e-3, 25.0]), dp=st.sampled_from([2, 4]))
def test_buckets_are_views_that_tile_one_buffer_per_dtype(bucket_mb, dp) -> None:
    loss, params, batches = _toy()
    ref = cf.train_step(loss, optim.sgd(0.1))

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
        handed = _spy_on_buckets(mp)
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
            # a gradient is written by a copy (a layer's together), or divided into place
            dsts = []
            if func is torch.ops.aten.copy_.default:
                dsts = [args[0]]
            elif func is torch.ops.aten._foreach_copy_.default:
                dsts = list(args[0])
            elif func is torch.ops.aten.mul.out:
                dsts = [(kwargs or {})["out"]]
            for dst in dsts:
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


def _buffers_between_steps(mesh):
    loss, params, batches = _toy()
    step = cf.shard(cf.train_step(loss, optim.adamw(1e-2)), mesh)
    state = step.init(params)
    _, first = step.forward_backward(state.params, batches[0], state.extra)
    first_ptrs = _storages(first)
    kept = cf.tree.map(lambda g: g.clone(), first)
    # the first step's gradients are still held: the second must not write over them
    _, second = step.forward_backward(state.params, batches[1], state.extra)
    held_apart = all(
        a.isdisjoint(b) for a, b in zip(first_ptrs.values(), _storages(second).values())
    )
    unchanged = all(
        torch.equal(a, b) for a, b in zip(cf.tree.tensors(first), cf.tree.tensors(kept))
    )
    second_ptrs = _storages(second)
    del first, second
    # nothing refers to the buffers any more: the next step writes into one of them again
    _, third = step.forward_backward(state.params, batches[0], state.extra)
    reused = all(_storages(third)[d] <= first_ptrs[d] | second_ptrs[d] for d in first_ptrs)
    same = all(torch.equal(a, b) for a, b in zip(cf.tree.tensors(third), cf.tree.tensors(kept)))
    return held_apart, unchanged, reused, same


def test_buffers_are_kept_between_steps_but_never_written_over_while_held() -> None:
    """The flat buffers are reused from step to step (no fresh pages to fault in), but only
    when nothing refers to them: gradients a caller keeps (as ``optim.accumulate`` does) stay
    as they were, and a step whose buffer is free again gets the same numbers."""
    for held_apart, unchanged, reused, same in cf.launch(_buffers_between_steps, mesh={"dp": 2}):
        assert held_apart and unchanged
        assert reused and same


def test_buffer_pool_hands_out_a_buffer_only_when_nothing_refers_to_it() -> None:
    pool = grad_layout.BufferPool()
    a = pool.empty("k", 16, torch.float32, torch.device("cpu"))
    ptr = a.data_ptr()
    b = pool.empty("k", 16, torch.float32, torch.device("cpu"))
    assert b.data_ptr() != ptr  # ``a`` still refers to the first
    view = a[4:]
    del a, b
    c = pool.empty("k", 16, torch.float32, torch.device("cpu"))
    assert c.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    del c, view
    d = pool.empty("k", 16, torch.float32, torch.device("cpu"))
    assert d.data_ptr() == ptr  # free again: the first is handed out again
    assert pool.empty("other", 4, torch.float64, torch.device("cpu")).dtype == torch.float64


def test_buffer_pool_keeps_the_views_it_built_and_they_do_not_hold_the_buffer() -> None:
    pool = grad_layout.BufferPool()
    cpu = torch.device("cpu")
    specs = [(torch.float32, cpu, 12), (torch.float64, cpu, 4)]
    built: list[int] = []

    def build(buffers):
        built.append(len(built))
        return {"rows": buffers[0].view(3, 4).unbind(0), "tail": buffers[1][1:]}

    views, leases = pool.take("k", specs, build)
    ptr = leases[0].data_ptr()
    # while the leases live the buffers are in use: another caller gets new ones, built anew
    other, other_leases = pool.take("k", specs, build)
    assert other_leases[0].data_ptr() != ptr and other is not views and built == [0, 1]
    del leases, other, other_leases
    # the kept views alone do not hold a buffer: the next caller gets it, views and all
    again, leases = pool.take("k", specs, build)
    assert again is views and leases[0].data_ptr() == ptr and built == [0, 1]
    # a tensor cut from a kept view and handed out (a gradient) holds it, as a lease does
    grad = again["rows"][1].view_as(again["rows"][1])
    del leases
    fresh, fresh_leases = pool.take("k", specs, build)
    assert fresh is not views and fresh_leases[0].data_ptr() != ptr and built == [0, 1]
    del grad, fresh, fresh_leases
    last, leases = pool.take("k", specs, build)
    assert last is views and leases[0].data_ptr() == ptr and built == [0, 1]


def test_narrowing_weights_are_column_major_under_data_parallelism_and_so_are_their_grads():
    """``shard``'s matmul order: a stacked weight ``[L, in, out]`` with ``in > out`` (GPT's MLP
    down projection) is kept column-major per layer, the others row-major; its gradient comes
    back from the flat buffer laid out as the parameter (no transposing copy anywhere), and
    the steps equal the single-device ones (fp64 AdamW, moments included)."""
    cfg = cf.models.gpt.Config(vocab_size=64, n_layer=2, n_head=2, d_model=16, max_seq_len=16)
    params = cf.tree.map(lambda x: x.double(), cf.models.gpt.init(cfg, seed=0))
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=gen)
        batches.append({"input_ids": ids, "labels": ids})
    ref = cf.train_step(cf.models.gpt.loss(cfg), optim.adamw(1e-2), donate=True)

    def main(mesh):
        step = cf.shard(ref, mesh)
        state = step.init(params)
        w_out, w_in = state.params["blocks"]["mlp"]["w_out"], state.params["blocks"]["mlp"]["w_in"]
        _, grads = step.forward_backward(state.params, batches[0], state.extra)
        g_out = grads["blocks"]["mlp"]["w_out"]
        layouts = (w_out.stride()[1:], w_in.stride()[1:], g_out.stride()[1:])
        moments = state.opt_state.exp_avg["blocks"]["mlp"]["w_out"].stride()
        cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)
        return layouts, moments

    (w_out, w_in, g_out), moments = cf.launch(main, mesh={"dp": 2})[0]
    F, D = 4 * 16, 16
    assert w_out == (1, F) and g_out == (1, F)  # [F, D] column-major, gradient alike
    assert w_in == (F, 1)  # [D, F] widens: row-major
    assert moments == (F * D, 1, F)


def test_a_cpu_buffer_within_one_bucket_is_reduced_in_one_call() -> None:
    """DDP's small first bucket starts the reduction early on an accelerator and on a CPU buffer
    larger than one bucket; a CPU buffer that fits in one bucket is reduced in one call per
    dtype, at the end of the backward pass (a collective there shares the cores with it)."""
    cpu, gpu, mb = torch.device("cpu"), torch.device("cuda"), 2**20
    first = grad_layout.FIRST_BUCKET_BYTES
    assert grad_layout.first_bucket_bytes(cpu, 25 * mb, 3 * mb) == 25 * mb
    assert grad_layout.first_bucket_bytes(cpu, 25 * mb, 25 * mb) == 25 * mb
    assert grad_layout.first_bucket_bytes(cpu, 25 * mb, 43 * mb) == first
    assert grad_layout.first_bucket_bytes(gpu, 25 * mb, 3 * mb) == first
    assert grad_layout.first_bucket_bytes(cpu, mb // 2, 3 * mb) == mb // 2
    loss, params, batches = _toy()
    ref = cf.train_step(loss, optim.sgd(0.1))

    def main(mesh):
        step = cf.shard(ref, mesh, bucket_mb=24.5)
        cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-6, atol=1e-7)

    with pytest.MonkeyPatch.context() as mp:
        started = _spy_on_buckets(mp)
        # a first bucket smaller than one layer of the toy: it would cut one off on its own
        mp.setattr(grad_layout, "FIRST_BUCKET_BYTES", 64)
        cf.launch(main, mesh={"dp": 2})
    for rank in (0, 1):  # one fp32 and one fp64 buffer, each whole, per step
        dtypes = [x.dtype for x in started[rank]]
        assert dtypes.count(torch.float32) == dtypes.count(torch.float64) == len(batches), dtypes
