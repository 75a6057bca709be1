"""The op dispatcher (COLFUNC_KERNELS), the checks made before any launch, and the AdamW reference.

Nothing here imports a Triton kernel module: where a kernel would run, a stand-in records the call
(tests/test_kernels_triton.py runs the kernels themselves).
"""

import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import colfunc.ops as ops
from colfunc.kernels import checks
from colfunc.ops import dispatch, reference

KERNEL_MODULES = {
    "attention": "attention",
    "rms_norm": "norms",
    "layer_norm": "norms",
    "cross_entropy": "cross_entropy",
    "rope": "rope",
    "adamw_": "adamw",
}


def _inputs() -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:
    """Valid arguments for each op, small and on the CPU."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 16, generator=g)
    kv = torch.randn(1, 2, 7, 16, generator=g)
    x = torch.randn(3, 8, generator=g)
    angle = torch.randn(5, 8, generator=g)
    params = [torch.randn(4, generator=g), torch.randn(2, 3, generator=g)]
    hp = {"step": 2, "lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}
    return {
        "attention": ((q, kv, kv), {"causal": True}),
        "rms_norm": ((x, torch.ones(8), 1e-6), {}),
        "layer_norm": ((x, torch.ones(8), torch.zeros(8), 1e-5), {}),
        "cross_entropy": ((torch.randn(4, 11, generator=g), torch.tensor([1, 2, -100, 3])), {}),
        "rope": ((q, angle.cos(), angle.sin()), {}),
        "adamw_": (
            (
                params,
                [p.clone() for p in params],
                [torch.zeros_like(p) for p in params],
                [torch.ones_like(p) for p in params],
                ops.AdamWHyper(**hp),
            ),
            {},
        ),
    }


class KernelRecorder:
    """Stands in for ``dispatch._kernel``: records which kernel module an op asked for."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, module: str) -> Any:
        def run(*args: Any, **kwargs: Any) -> str:
            self.calls.append(module)
            return "kernel"

        return SimpleNamespace(**{op: run for op in KERNEL_MODULES})


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> KernelRecorder:
    rec = KernelRecorder()
    monkeypatch.setattr(dispatch, "_kernel", rec)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors are eligible for the kernels
    return rec


@pytest.mark.parametrize("op", sorted(KERNEL_MODULES))
def test_torch_and_auto_on_cpu_use_the_reference(
    op: str, recorder: KernelRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    for choice in ("torch", "auto", None):
        if choice is None:
            monkeypatch.delenv("COLFUNC_KERNELS", raising=False)
        else:
            monkeypatch.setenv("COLFUNC_KERNELS", choice)
        args, kwargs = _inputs()[op]
        got = getattr(ops, op)(*args, **kwargs)
        ref_args, ref_kwargs = _inputs()[op]
        want = getattr(reference, op)(*ref_args, **ref_kwargs)
        if op == "adamw_":  # in place: compare the updated params
            got, want = (
                torch.cat([p.flatten() for p in args[0]]),
                torch.cat([p.flatten() for p in ref_args[0]]),
            )
        if choice != "torch" and op in ("rms_norm", "rope"):  # (colfunc.ops.cpu_rows: no
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)  # gradient wanted)
        else:
            assert torch.equal(got, want)
    assert recorder.calls == []


@pytest.mark.parametrize("op", sorted(KERNEL_MODULES))
def test_triton_choice_calls_the_kernel(
    op: str, recorder: KernelRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLFUNC_KERNELS", "triton")
    args, kwargs = _inputs()[op]
    getattr(ops, op)(*args, **kwargs)
    assert recorder.calls == [KERNEL_MODULES[op]]


@pytest.mark.parametrize("value", ["cuda", "Triton", "", "reference"])
def test_bad_colfunc_kernels_raises(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLFUNC_KERNELS", value)
    for op, (args, kwargs) in _inputs().items():
        with pytest.raises(ValueError, match="COLFUNC_KERNELS"):
            getattr(ops, op)(*args, **kwargs)


class _Subclass(torch.Tensor):
    """A tensor subclass (as a ShardedTensor is): it has no memory of its own to launch on."""


def _bad_calls() -> list[tuple[str, Callable[[], Any], str]]:
    q = torch.randn(1, 4, 5, 16)
    kv = torch.randn(1, 2, 7, 16)
    x = torch.randn(3, 8)
    cos = torch.randn(5, 8)
    p = [torch.randn(4)]
    hp: dict[str, Any] = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.0}
    H = ops.AdamWHyper  # built inside each call: a bad value is refused there
    return [
        ("head dim 8", lambda: ops.attention(q[..., :8], kv[..., :8], kv[..., :8]), "head dim 8"),
        ("head dim 256", lambda: ops.attention(*(torch.randn(1, 1, 2, 256),) * 3), "head dim 256"),
        ("3-d q", lambda: ops.attention(q[0], kv, kv), "q\\[B,H,T,D\\]"),
        ("heads 3 vs 2", lambda: ops.attention(q[:, :3], kv, kv), "multiple"),
        ("k, v shapes", lambda: ops.attention(q, kv, kv[:, :, :3]), "expects"),
        ("T > S causal", lambda: ops.attention(q, kv[:, :, :3], kv[:, :, :3]), "T <= S"),
        ("mixed dtypes", lambda: ops.attention(q, kv.half(), kv), "dtypes differ"),
        ("fp64", lambda: ops.attention(q.double(), kv.double(), kv.double()), "float64"),
        ("int x", lambda: ops.rms_norm(torch.ones(3, 8, dtype=torch.int32), None), "int32"),
        ("weight shape", lambda: ops.rms_norm(x, torch.ones(7)), "\\(7,\\)"),
        ("bias shape", lambda: ops.layer_norm(x, None, torch.ones(9)), "\\(9,\\)"),
        ("huge row", lambda: ops.layer_norm(torch.ones(1, 40000), None, None), "40000"),
        ("float labels", lambda: ops.cross_entropy(x, torch.zeros(3)), "labels"),
        ("1-d logits", lambda: ops.cross_entropy(x[0], torch.zeros(8).long()), "logits\\[N,V\\]"),
        ("odd D", lambda: ops.rope(torch.randn(2, 5, 7), cos[:, :3], cos[:, :3]), "even D"),
        ("cos shape", lambda: ops.rope(q, cos[:4], cos[:4]), "cos and sin"),
        ("cos grad", lambda: ops.rope(q, cos.clone().requires_grad_(), cos), "no gradient"),
        ("lengths", lambda: ops.adamw_(p, [], p, p, H(step=1, **hp)), "lengths"),
        ("fp16 moments", lambda: ops.adamw_(p, p, [p[0].half()], p, H(step=1, **hp)), "fp32"),
        ("strided", lambda: ops.adamw_(*[[x.t()]] * 4, H(step=1, **hp)), "contiguous"),
        ("step 0", lambda: ops.adamw_(p, p, p, p, H(step=0, **hp)), "step=0"),
        ("beta1 1", lambda: ops.adamw_(p, p, p, p, H(step=1, **{**hp, "beta1": 1.0})), "beta1"),
        ("meta device", lambda: ops.rms_norm(torch.ones(2, 8, device="meta"), None), "meta"),
        ("subclass", lambda: ops.rms_norm(x.as_subclass(_Subclass), None), "_Subclass"),
        (
            "torch.func",
            lambda: torch.func.grad(lambda t: ops.rms_norm(t, None).sum())(x),
            "torch.func",
        ),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_bad_inputs_raise_before_launch(
    case: tuple[str, Callable[[], Any], str],
    recorder: KernelRecorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLFUNC_KERNELS", "triton")
    _, call, message = case
    with pytest.raises(ValueError, match=message):
        call()
    assert recorder.calls == []


def test_cpu_tensors_need_the_interpreter(
    recorder: KernelRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLFUNC_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    (args, kwargs) = _inputs()["attention"]
    with pytest.raises(ValueError, match=r"TRITON_INTERPRET=1.*device cpu"):
        ops.attention(*args, **kwargs)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # set, but after the module was decorated
    with pytest.raises(ValueError, match="after the Triton kernels were imported"):
        checks.device("attention", args[0], interpreted=False)
    assert recorder.calls == []


def test_importing_ops_imports_no_triton_and_builds_nothing() -> None:
    code = (
        "import sys, colfunc.ops\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] == 'triton' or m.startswith("
        "'colfunc.kernels.') and m != 'colfunc.kernels.checks']\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_reference_adamw_equals_torch_optim() -> None:
    """The reference does what torch.optim.AdamW does, to the bit, over five steps."""
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(5, 3, generator=g), torch.randn(17, generator=g)]
    ref = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(ref, lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(1, 6):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for r, grad in zip(ref, grads):
            r.grad = grad.clone()
        opt.step()
        reference.adamw_(
            params,
            grads,
            m,
            v,
            ops.AdamWHyper(step=step, lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.05),
        )
        for p, r in zip(params, ref):
            assert torch.equal(p, r.detach())


def test_reference_adamw_rounds_low_precision_params_once() -> None:
    """A bf16 param is updated in fp32 and rounded back: one step equals the fp32 step rounded."""
    p32 = torch.randn(64, generator=torch.Generator().manual_seed(2))
    grad = torch.randn(64, generator=torch.Generator().manual_seed(3))
    p16 = p32.to(torch.bfloat16)
    start = p16.float()
    states = [[torch.zeros(64)] for _ in range(4)]
    hp: dict[str, Any] = {
        "step": 1,
        "lr": 0.1,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    h = ops.AdamWHyper(**hp)
    reference.adamw_([p16], [grad.to(torch.bfloat16)], states[0], states[1], h)
    reference.adamw_([start], [grad.to(torch.bfloat16).float()], states[2], states[3], h)
    assert p16.dtype == torch.bfloat16
    assert torch.equal(p16, start.to(torch.bfloat16))
