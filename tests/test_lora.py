"""LoRA (``cf.lora``) against peft, and peft's adapter folders in and out.

Each family is a tiny random ``transformers`` model in fp64, its RMS norms computed in fp64 (their
own forward upcasts to fp32 even on fp64 inputs, which would cap the agreement at about 5e-9);
peft wraps it with the same rank, alpha and targets and is given the same adapter values
(through colfunc's own peft export, so the export is what makes them agree). The loss on both
sides is the mean next-token cross-entropy in fp64.
"""

from __future__ import annotations

import types

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers

import colfunc as cf
from colfunc import adapters, hf, models, optim, tree

V, T = 64, 12

SIZES = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
# family -> (transformers config, colfunc targets, shared groups, peft target_modules)
FAMILIES = {
    "llama": (
        lambda: transformers.LlamaConfig(**SIZES),
        ["blocks.attn.wq", "blocks.attn.wv", "blocks.mlp.w_down"],
        (),
        ["q_proj", "v_proj", "down_proj"],
    ),
    "qwen2": (
        lambda: transformers.Qwen2Config(**SIZES, tie_word_embeddings=False),
        ["blocks.attn.w*", "blocks.mlp.w*", "head.weight"],
        (),
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
    ),
    "gpt2": (
        lambda: transformers.GPT2Config(
            vocab_size=V,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=32,
        ),
        ["blocks.attn.w*", "blocks.mlp.w_in"],
        (("blocks.attn.wq", "blocks.attn.wk", "blocks.attn.wv"),),
        ["c_attn", "attn.c_proj", "c_fc"],
    ),
}


def _rms_fp64(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _hf_model(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[name][0]()).double()
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = types.MethodType(_rms_fp64, mod)
    return model.eval()


def _ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _problem(name: str, dora: bool = False):
    """(hf model, colfunc cfg, lora step, state with random adapters, config)."""
    model = _hf_model(name)
    cfg, params = hf.from_hf(model)
    _, targets, shared, _ = FAMILIES[name]
    opt = optim.adamw(1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    step = cf.lora(
        cf.train_step(models.of_config(cfg).module.loss(cfg), opt),
        4, 8.0, targets, shared=shared, dora=dora,
    )  # fmt: skip
    state = step.init(params)
    g = torch.Generator().manual_seed(1)  # b random too, so every product is exercised
    ps = tree.map_with_path(
        lambda p, x: (
            torch.randn(x.shape, generator=g, dtype=x.dtype) * 0.2 if adapters.is_adapter(p) else x
        ),
        state.params,
    )
    return model, cfg, step, step.init(ps), adapters.config_of(step)


def _peft(model, name: str, state, cfg, config):
    pc = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=FAMILIES[name][3], lora_dropout=0.0,
        use_dora=config.dora,
    )  # fmt: skip
    pm = peft.get_peft_model(model, pc).double()
    ours = adapters.to_peft(cfg, state.params, config)
    mine = [k for k in peft.get_peft_model_state_dict(pm) if ".lora_" in k]
    assert sorted(ours) == sorted(mine)  # every LoRA weight of peft's, and only those
    result = peft.set_peft_model_state_dict(pm, ours)
    assert not result.unexpected_keys
    return pm


@pytest.mark.parametrize(
    ("name", "dora"), [*((n, False) for n in sorted(FAMILIES)), ("llama", True), ("gpt2", True)]
)
def test_logits_and_adamw_steps_equal_peft(name, dora) -> None:
    """LoRA (and DoRA: a magnitude per output column, the column norms held constant in the
    backward pass) against peft: logits, then five AdamW steps."""
    model, cfg, step, state, config = _problem(name, dora)
    if dora:  # magnitudes away from the base's norms, so that they matter from the start
        g = torch.Generator().manual_seed(2)
        state = step.init(
            tree.map_with_path(
                lambda p, x: x * (1 + 0.3 * torch.rand(x.shape, generator=g, dtype=x.dtype))
                if p.endswith(".m") else x,
                state.params,
            )
        )  # fmt: skip
    module = models.of_config(cfg).module
    base0 = {
        p: x.clone()
        for p, x in tree.flatten_with_paths(state.params)[0]
        if not adapters.is_adapter(p)
    }
    pm = _peft(model, name, state, cfg, config)
    batch = _batch(0)
    ids = batch["input_ids"]
    with torch.no_grad():
        ours = adapters.call(config, module.apply, state.params, ids, cfg)
        theirs = pm(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert (ours - theirs).abs().max() < 1e-12  # fp64: the same products, up to rounding

    torch_opt = torch.optim.AdamW(
        [p for p in pm.parameters() if p.requires_grad],
        lr=1e-2,
        betas=(0.9, 0.99),
        weight_decay=0.1,
    )
    for k in range(5):
        b = _batch(k)
        torch_opt.zero_grad()
        _ce(pm(input_ids=b["input_ids"]).logits, b["input_ids"]).backward()
        torch_opt.step()
        state, _ = step(state, b)
    ours_sd = adapters.to_peft(cfg, state.params, config)
    theirs_sd = peft.get_peft_model_state_dict(pm)
    for k, x in ours_sd.items():
        torch.testing.assert_close(x, theirs_sd[k], rtol=0, atol=1e-9, msg=k)
    for p, x in tree.flatten_with_paths(state.params)[0]:
        if not adapters.is_adapter(p):
            assert torch.equal(x, base0[p]), p  # the base: bit-identical
    held = tree.paths(state.opt_state.exp_avg)
    assert held and all(adapters.is_adapter(p) for p in held)


@pytest.mark.parametrize(("name", "dora"), [("llama", False), ("gpt2", False), ("llama", True)])
def test_exported_folder_loads_in_peft_and_peft_folder_loads_here(name, dora, tmp_path) -> None:
    _, cfg, _, state, config = _problem(name, dora)
    module = models.of_config(cfg).module
    ids = _batch(3)["input_ids"]
    adapters.save_adapter(tmp_path / "out", cfg, state.params, config)
    pm = peft.PeftModel.from_pretrained(_hf_model(name), tmp_path / "out").double()
    with torch.no_grad():
        ours = adapters.call(config, module.apply, state.params, ids, cfg)
        torch.testing.assert_close(pm(input_ids=ids).logits, ours, rtol=0, atol=1e-10)

    # a peft adapter with random values of its own, trained and saved by peft, read back here
    pc = peft.LoraConfig(
        r=4,
        lora_alpha=6,
        target_modules=FAMILIES[name][3],
        lora_dropout=0.0,
        init_lora_weights=False,
        use_rslora=True,
        use_dora=dora,
    )
    torch.manual_seed(5)
    theirs = peft.get_peft_model(_hf_model(name), pc).double()
    trained = [p for p in theirs.parameters() if p.requires_grad]
    peft_opt = torch.optim.AdamW(trained, lr=1e-2)
    for k in range(2):  # trained by peft a little, then saved by it
        peft_opt.zero_grad()
        _ce(
            theirs(input_ids=_batch(10 + k)["input_ids"]).logits, _batch(10 + k)["input_ids"]
        ).backward()
        peft_opt.step()
    theirs.save_pretrained(tmp_path / "peft")
    got, ad = hf.load_adapter(tmp_path / "peft", cfg)
    assert (got.rank, got.alpha, got.rslora, got.dora) == (4, 6.0, True, dora)
    params = adapters.combine(hf.from_hf(_hf_model(name))[1], ad)
    with torch.no_grad():
        ours = adapters.call(got, module.apply, params, ids, cfg)
        torch.testing.assert_close(ours, theirs(input_ids=ids).logits, rtol=0, atol=1e-10)
        # and merged into the weights: the plain model gives the same logits
        merged = adapters.merge(params, got)
        assert not any(adapters.is_adapter(p) for p in tree.paths(merged))
        torch.testing.assert_close(module.apply(merged, ids, cfg), ours, rtol=0, atol=1e-10)
    # training goes on from the loaded adapter: the step keeps its values
    step = cf.lora(cf.train_step(module.loss(cfg), optim.adamw(1e-3)), **got.kwargs())
    state = step.init(params)
    for p, x in tree.flatten_with_paths(ad)[0]:
        assert torch.equal(tree.select(state.params, p)[p], x), p


def test_bad_targets_and_uses_are_named() -> None:
    cfg = models.llama.Config.tiny()
    params = models.llama.init(cfg)
    base = cf.train_step(models.llama.loss(cfg), optim.adamw(1e-3))
    with pytest.raises(ValueError, match=r"target 'blocks\.attn\.nothing' matches no parameter"):
        cf.lora(base, targets=["blocks.attn.nothing"]).init(params)
    with pytest.raises(ValueError, match=r"blocks\.ln1\.weight of shape \[4, 128\], which is not"):
        cf.lora(base, targets=["blocks.ln1.*"]).init(params)
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        cf.lora(base, rank=0)
    with pytest.raises(ValueError, match="dropout must be in"):
        cf.lora(base, dropout=1.0)
    with pytest.raises(ValueError, match="already has lora applied"):
        cf.lora(cf.lora(base))
    # the embedding table is read by a lookup, not a linear map: refused by name when used
    step = cf.lora(base, targets=["embed.tokens"])
    state = step.init(params)
    batch = {
        "input_ids": torch.zeros(1, 4, dtype=torch.long),
        "labels": torch.zeros(1, 4, dtype=torch.long),
    }
    with pytest.raises(ValueError, match=r"adapted weight embed\.tokens in embedding\(\)"):
        step(state, batch)
    # GPT-2 fuses q, k and v in one module with one lora_A: exporting them apart is refused
    gcfg = models.gpt.Config(vocab_size=32, n_layer=1, n_head=2, d_model=8, max_seq_len=8)
    gstep = cf.lora(
        cf.train_step(models.gpt.loss(gcfg), optim.adamw(1e-3)), targets="blocks.attn.wq"
    )
    gstate = gstep.init(models.gpt.init(gcfg))
    with pytest.raises(ValueError, match=r"c_attn holds .* shared=\["):
        adapters.to_peft(gcfg, gstate.params, adapters.config_of(gstep))
    assert adapters.fused_groups(gcfg) == (("blocks.attn.wq", "blocks.attn.wk", "blocks.attn.wv"),)
