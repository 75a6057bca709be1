"""``ops.cross_entropy``'s path for plain CPU tensors that need a gradient
(:mod:`colfunc.ops.cpu_loss`) against ``F.cross_entropy``: the same loss and gradient, drawn
shapes, labels to ignore, dtypes; the cases it leaves to the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc.ops as ops
from colfunc.ops import cpu_loss


def _both(x: torch.Tensor, y: torch.Tensor, ignore: int = -100):
    """(loss, grad) from ops.cross_entropy and from F.cross_entropy on the widened logits."""
    out = []
    for fn in (ops.cross_entropy, None):
        leaf = x.detach().clone().requires_grad_()
        if fn is None:
            wide = leaf if leaf.dtype == torch.float64 else leaf.float()
            loss = F.cross_entropy(wide, y.long(), ignore_index=ignore)
        else:
            loss = fn(leaf, y, ignore)
        (loss * 1.7).backward()  # an upstream gradient other than one
        out.append((loss.detach(), leaf.grad))
    return out


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    v=st.integers(1, 300),
    ignored=st.floats(0, 1),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_equals_torch(n: int, v: int, ignored: float, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g, dtype=torch.float64) * 4).to(dtype)
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < ignored] = -100
    (got, ggot), (want, gwant) = _both(x, y)
    assert got.dtype == want.dtype and ggot.dtype == gwant.dtype == dtype
    if bool((y == -100).all()):  # nothing to average: nan, as torch gives
        assert got.isnan() and want.isnan()
        return
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(ggot, gwant, rtol=tol, atol=tol)
    assert bool((ggot[y == -100] == 0).all())  # an ignored row gets no gradient


def test_the_path_is_taken_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 9, requires_grad=True)
    y = torch.tensor([1, 2, -100, 3])
    calls: list[int] = []
    real = cpu_loss.cross_entropy
    monkeypatch.setattr(cpu_loss, "cross_entropy", lambda *a: calls.append(1) or real(*a))
    ops.cross_entropy(x, y)
    assert calls == [1]
    with torch.no_grad():  # no gradient wanted: the reference
        ops.cross_entropy(x, y)
    ops.cross_entropy(x.detach(), y)
    torch.func.grad(lambda t: ops.cross_entropy(t, y))(x.detach())  # under torch.func
    ops.cross_entropy(x, y.float().long()[None].expand(1, 4)[0])  # (a view: still plain)
    monkeypatch.setenv("COLFUNC_KERNELS", "torch")
    ops.cross_entropy(x, y)
    assert calls == [1, 1]
    monkeypatch.delenv("COLFUNC_KERNELS")
    with pytest.raises(ValueError, match="logits\\[N,V\\]"):  # bad shapes: the reference refuses
        ops.cross_entropy(x[0], y)


def test_int32_labels_and_out_of_range_labels() -> None:
    x = torch.randn(3, 5)
    (got, ggot), (want, gwant) = _both(x, torch.tensor([0, 4, 2], dtype=torch.int32))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(ggot, gwant)
    with pytest.raises((RuntimeError, IndexError), match="out of bounds"):
        ops.cross_entropy(x.requires_grad_(), torch.tensor([0, 5, 1]))


def test_a_second_backward_through_the_graph_is_refused() -> None:
    x = torch.randn(3, 5, requires_grad=True)
    loss = ops.cross_entropy(x, torch.tensor([0, 4, 2]))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
