"""Checks that need an NVIDIA GPU (``pytest -m gpu``; each skips without one): the Triton kernels
against their references on CUDA tensors, offload within its device budget as
``torch.cuda.max_memory_allocated`` measures it, and the engine's greedy tokens on the GPU against
``transformers``. ``benchmarks/gpu/run.sh`` runs them with the GPU benchmarks."""

from __future__ import annotations

import pytest
import torch

import colfunc as cf
from colfunc import hf, models, ops, optim
from colfunc.inference import Engine, SamplingParams
from colfunc.ops import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

CUDA = torch.device("cuda")
TOL = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _randn(*shape: int, dtype: torch.dtype, seed: int, grad: bool = False) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(device=CUDA, dtype=dtype)
    return x.requires_grad_(grad)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.fixture
def triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLFUNC_KERNELS", "triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_kernel_forward_and_backward(triton_kernels, dtype, causal) -> None:
    q = _randn(2, 4, 128, 64, dtype=dtype, seed=0, grad=True)
    k = _randn(2, 2, 128, 64, dtype=dtype, seed=1, grad=True)
    v = _randn(2, 2, 128, 64, dtype=dtype, seed=2, grad=True)
    out = ops.attention(q, k, v, causal=causal)
    dout = _randn(*out.shape, dtype=dtype, seed=3)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = reference.attention(qr, kr, vr, causal=causal)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), dout.float())
    _close(out, ref, dtype)
    for g, r in zip(grads, ref_grads):
        _close(g, r, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_and_cross_entropy_kernels(triton_kernels, dtype) -> None:
    x = _randn(64, 256, dtype=dtype, seed=4)
    w = _randn(256, dtype=dtype, seed=5)
    _close(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x.float(), w.float(), 1e-6), dtype)
    b = _randn(256, dtype=dtype, seed=11)
    _close(
        ops.layer_norm(x, w, b, 1e-5),
        reference.layer_norm(x.float(), w.float(), b.float(), 1e-5),
        dtype,
    )
    logits = _randn(64, 1000, dtype=dtype, seed=6)
    labels = torch.randint(0, 1000, (64,), device=CUDA)
    _close(
        ops.cross_entropy(logits, labels), reference.cross_entropy(logits.float(), labels), dtype
    )
    q = _randn(2, 4, 32, 64, dtype=dtype, seed=7)
    angle = _randn(32, 32, dtype=torch.float32, seed=8)
    _close(
        ops.rope(q, angle.cos(), angle.sin()),
        reference.rope(q.float(), angle.cos(), angle.sin()),
        dtype,
    )


def test_fused_adamw_kernel_equals_torch_optim(triton_kernels) -> None:
    params = [
        _randn(1000, dtype=torch.float32, seed=9),
        _randn(33, 7, dtype=torch.float32, seed=10),
    ]
    ref = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(1, 4):
        grads = [_randn(*p.shape, dtype=torch.float32, seed=20 + step) for p in params]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        h = ops.AdamWHyper(step=step, lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1)
        ops.adamw_(params, grads, m, v, h)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_kernel_and_a_qlora_step_on_the_gpu(triton_kernels, dtype) -> None:
    """QLoRA's dequantization kernel equals the reference bit for bit; a QLoRA step on the GPU
    equals the same step on the CPU (fp32, 1e-4)."""
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (4, 96, 512), generator=g, dtype=torch.uint8)
    absmax = torch.rand(4, 96, 16, generator=g)
    got = ops.dequantize_nf4(packed.to(CUDA), absmax.to(CUDA), dtype)
    assert torch.equal(got.cpu(), reference.dequantize_nf4(packed, absmax, dtype))
    cfg = models.llama.Config(vocab_size=64, n_layer=2, n_head=4, n_kv_heads=2, d_model=128,
                              d_ff=256, max_seq_len=32)  # fmt: skip
    params = models.llama.init(cfg)
    ids = torch.randint(0, 64, (2, 32), generator=g)
    losses = []
    for device in ("cpu", CUDA):
        step = cf.lora(cf.train_step(models.llama.loss(cfg), optim.adamw(1e-3)), base_dtype="nf4")
        on = {k: v.to(device) for k, v in {"input_ids": ids, "labels": ids}.items()}
        state = step.init(cf.tree.map(lambda x, d=device: x.to(d), params))
        for _ in range(2):
            state, metrics = step(state, on)
        losses.append(float(metrics["loss"]))
    assert abs(losses[0] - losses[1]) < 1e-4, losses


def test_offload_stays_within_its_device_budget() -> None:
    cfg = models.gpt.Config(vocab_size=256, n_layer=8, n_head=8, d_model=512, max_seq_len=256)
    params = models.gpt.init(cfg)
    budget = 64 * 2**20
    ref = cf.train_step(models.gpt.loss(cfg), optim.adamw(1e-3))
    step = cf.offload(ref, "auto", budget)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, 256), generator=g)
    batch = {"input_ids": ids.to(CUDA), "labels": ids.to(CUDA)}
    state = step.init(params)
    state, _ = step(state, batch)  # the warm-up step records the schedule
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    state, metrics = step(state, batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    assert peak <= budget * 1.10, (peak, budget)  # (the allocator's rounding aside)
    assert float(metrics["offload/device_peak_bytes"]) <= budget
    assert torch.isfinite(metrics["loss"])


def test_engine_greedy_tokens_equal_transformers_on_the_gpu() -> None:
    transformers = pytest.importorskip("transformers")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=96,
        max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(config).to(CUDA).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    cfg, params = hf.from_hf(model)
    engine = Engine(models.llama, cfg, params, block_size=16)
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 9]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
    assert got == cf.testing.hf_greedy(model, prompts, 12)
