"""QLoRA: the frozen base in 4-bit NormalFloat (or int8), dequantized one layer at a time.

NF4's code values are those of the paper's construction; the quantization error per block is
bounded by half the largest gap between neighbouring codes times the block's absmax; a QLoRA
step equals a LoRA step on the dequantized base; under every transform it equals the single
device; the packed base costs its codes and scales in host memory under offload.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import adapters, models, optim, tree
from colfunc.adapters import quant


def test_nf4_codes_are_the_papers() -> None:
    """Dettmers et al. 2023 (appendix E): 8 positive and 7 negative quantiles of N(0, 1) at
    evenly spaced probabilities from 0.5 to offset 0.9677083 (the mean of the two choices that
    make the ends exact), and zero; normalised to [-1, 1]."""
    offset = 0.9677083
    normal = torch.distributions.Normal(0.0, 1.0)
    pos = normal.icdf(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -normal.icdf(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    values = values / values.max()
    torch.testing.assert_close(
        torch.tensor(quant.NF4, dtype=torch.float64), values, rtol=0, atol=1e-6
    )
    assert len(set(quant.NF4)) == 16 and quant.NF4[7] == 0.0


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 6),
    blocks=st.integers(1, 4),
    lead=st.sampled_from([(), (2,)]),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_quantization_error_per_block_is_bounded(rows, blocks, lead, scale, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn((*lead, rows, blocks * quant.BLOCK), generator=g) * scale
    w.view(-1)[0] = 0.0  # an exact zero stays one
    gaps = [b - a for a, b in zip(quant.NF4[:-1], quant.NF4[1:])]
    for fmt, half in (("nf4", max(gaps) / 2), ("int8", 0.5 / 127)):
        q = quant.quantize(w, fmt)
        back = quant.dequantize(q, torch.float32)
        assert back.shape == w.shape and back.view(-1)[0] == 0.0
        err = (back - w).abs().unflatten(-1, (-1, quant.BLOCK))
        absmax = w.abs().unflatten(-1, (-1, quant.BLOCK)).amax(-1, keepdim=True)
        assert (err <= half * absmax * (1 + 1e-6) + 1e-12).all(), fmt
        # and each value takes the nearest code: no other code is closer
        codes = torch.tensor(quant.NF4) if fmt == "nf4" else torch.arange(-127, 128) / 127
        scaled = (w.unflatten(-1, (-1, quant.BLOCK)) / absmax.clamp_min(1e-30)).unsqueeze(-1)
        nearest = (scaled - codes).abs().amin(-1)
        got = back.unflatten(-1, (-1, quant.BLOCK)) / absmax.clamp_min(1e-30) - scaled[..., 0]
        assert (got.abs() <= nearest + 1e-5).all(), fmt


def test_bad_base_dtype_and_unaligned_weights_are_named() -> None:
    cfg = models.llama.Config(vocab_size=32, n_layer=1, n_head=2, n_kv_heads=2, d_model=48)
    base = cf.train_step(models.llama.loss(cfg), optim.adamw(1e-3))
    with pytest.raises(ValueError, match=r"base_dtype must be None or one of \('nf4', 'int8'\)"):
        cf.lora(base, base_dtype="fp4")
    with pytest.raises(ValueError, match=r"blocks\.attn\.wq has 48 outputs, not a multiple of"):
        cf.lora(base, base_dtype="nf4", targets="blocks.attn.wq").init(models.llama.init(cfg))


def _problem(d_model: int = 128, dtype: torch.dtype = torch.float32):
    cfg = models.llama.Config(
        vocab_size=32, n_layer=2, n_head=2, n_kv_heads=2, d_model=d_model, d_ff=2 * d_model,
        max_seq_len=8,
    )  # fmt: skip
    params = tree.map(lambda x: x.to(dtype), models.llama.init(cfg, seed=0))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 32, (4, 8), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    return cfg, params, batches


@pytest.mark.parametrize(("fmt", "dora"), [("nf4", False), ("int8", False), ("nf4", True)])
def test_a_qlora_step_equals_a_lora_step_on_the_dequantized_base(fmt, dora) -> None:
    cfg, params, batches = _problem()
    kw = dict(rank=4, alpha=8.0, targets=["blocks.attn.w*", "blocks.mlp.w*"], dora=dora)
    opt = optim.adamw(1e-2)
    q_step = cf.lora(cf.train_step(models.llama.loss(cfg), opt), base_dtype=fmt, **kw)
    q_state = q_step.init(params)
    # the same adapters on the base the quantized one stands for
    packed = dict(tree.flatten_with_paths(q_state.params)[0])
    flat = {}
    for path, x in packed.items():
        w, _, leaf = path.rpartition(".")
        if leaf in quant.FORMATS:
            flat[w] = quant.dequantize({leaf: x, "absmax": packed[w + ".absmax"]}, torch.float32)
        elif leaf != "absmax":
            flat[path] = x
    dense = cf.nn.nest(flat)
    step = cf.lora(cf.train_step(models.llama.loss(cfg), opt), **kw)
    state = step.init(dense)
    for b in batches:
        q_state, qm = q_step(q_state, b)
        state, m = step(state, b)
        torch.testing.assert_close(qm["loss"], m["loss"], rtol=0, atol=1e-6)
    got = {p: x for p, x in tree.flatten_with_paths(q_state.params)[0] if adapters.is_adapter(p)}
    want = {p: x for p, x in tree.flatten_with_paths(state.params)[0] if adapters.is_adapter(p)}
    assert got.keys() == want.keys()
    for p in got:
        torch.testing.assert_close(got[p], want[p], rtol=0, atol=1e-6, msg=p)


# (mesh, composition); d_model 256 so that a tensor-parallel half of every output is whole blocks
CASES = {
    "tp2": ({"tp": 2}, lambda s, m: cf.shard(s, m, plan=models.llama.tp_plan)),
    "dp2xtp2-zero3": (
        {"dp": 2, "tp": 2},
        lambda s, m: cf.zero(cf.shard(s, m, plan=models.llama.tp_plan), 3),
    ),
    "pp2": ({"pp": 2}, lambda s, m: cf.pipeline(s, 2, 2)),
    "offload-zero3": (
        {"dp": 2},
        lambda s, m: cf.offload(cf.zero(cf.shard(s, m), 3), "host", "64MiB"),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_qlora_under_transforms_equals_one_device(case) -> None:
    cfg, params, batches = _problem(256, torch.float64)
    kw = dict(rank=2, alpha=4.0, targets=["blocks.attn.w*", "blocks.mlp.w*"], base_dtype="nf4")
    ref = cf.lora(cf.train_step(models.llama.loss(cfg), optim.adamw(1e-2)), **kw)
    mesh_shape, compose = CASES[case]

    def main(mesh: cf.Mesh):
        step = compose(ref, mesh)
        cf.testing.assert_equivalent(step, ref, params, batches[:2], rtol=1e-9, atol=1e-9)
        state = step.init(params)
        state, _ = step(state, batches[0])
        return cf.full_state(state)

    packed0 = ref.init(params).params
    for final in cf.launch(main, mesh=mesh_shape):
        for (p, x), (_, y) in zip(
            tree.flatten_with_paths(final.params)[0], tree.flatten_with_paths(packed0)[0]
        ):
            if not adapters.is_adapter(p):
                assert torch.equal(x, y), p  # codes and scales: bit-identical


def test_offloaded_packed_base_costs_its_codes_and_scales() -> None:
    """Under offload the host holds the packed base: within 1% of numel / 2 bytes of codes plus
    the fp32 scales (one per 64 values), against 4 bytes a value for the fp32 base."""
    cfg, params, batches = _problem(256)
    targets = ["blocks.attn.w*", "blocks.mlp.w*"]
    numel = sum(
        x.numel() for p, x in tree.flatten_with_paths(params)[0]
        if any(tree.match(t, p) for t in targets)
    )  # fmt: skip
    step = cf.offload(
        cf.lora(cf.train_step(models.llama.loss(cfg), optim.adamw(1e-3)), targets=targets,
                base_dtype="nf4"),
        "host", "64MiB",
    )  # fmt: skip
    state = step.init(params)
    state, _ = step(state, batches[0])
    off = state.extra["offload"]
    host = 0  # the code chunks whole (padding included), the scales' pieces of theirs
    for chunk in off.layout.chunks:
        if chunk.dtype == torch.uint8:
            host += chunk.nbytes
        for piece in chunk.pieces:
            if off.paths[piece.leaf].endswith(".absmax"):
                host += piece.numel * chunk.dtype.itemsize
    want = quant.packed_bytes(numel, "nf4")
    assert abs(host - want) <= 0.01 * want, (host, want)
    assert want < 0.16 * 4 * numel  # an eighth of fp32, plus the scales
