"""colfunc.hf and the three models against ``transformers`` on the same weights (no network)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colfunc import hf, models, tree

transformers = pytest.importorskip("transformers")

MODULES = {"gpt2": models.gpt, "llama": models.llama, "opt": models.opt}
FEW = settings(max_examples=4, deadline=None)


def _perturbed(model: Any, seed: int) -> Any:
    """``model`` in eval mode with every parameter moved off its init (biases 0, norms 1 would
    hide a swapped or dropped bias or norm weight)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _build(
    kind: str,
    seed: int,
    *,
    n_layer: int,
    n_head: int,
    head_dim: int,
    vocab: int,
    max_pos: int,
    d_ff: int = 24,
    n_kv: int | None = None,
    tie: bool = False,
    theta: float = 10000.0,
    attn: str = "eager",
) -> Any:
    """A random ``transformers`` causal LM of the given kind and sizes."""
    D = n_head * head_dim
    common = dict(vocab_size=vocab, bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    if kind == "gpt2":
        cls = transformers.GPT2LMHeadModel
        cfg = transformers.GPT2Config(
            n_layer=n_layer, n_embd=D, n_head=n_head, n_positions=max_pos, n_inner=d_ff,
            resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, **common,
        )  # fmt: skip
    elif kind == "llama":
        cls = transformers.LlamaForCausalLM
        cfg = transformers.LlamaConfig(
            num_hidden_layers=n_layer, hidden_size=D, num_attention_heads=n_head,
            num_key_value_heads=n_kv or n_head, intermediate_size=d_ff,
            max_position_embeddings=max_pos, rms_norm_eps=1e-5, tie_word_embeddings=tie,
            rope_parameters={"rope_type": "default", "rope_theta": theta}, **common,
        )  # fmt: skip
    else:
        cls = transformers.OPTForCausalLM
        cfg = transformers.OPTConfig(
            num_hidden_layers=n_layer, hidden_size=D, num_attention_heads=n_head, ffn_dim=d_ff,
            max_position_embeddings=max_pos, dropout=0.0, attention_dropout=0.0, pad_token_id=0,
            **common,
        )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return _perturbed(cls(cfg), seed)


@st.composite
def hf_models(draw: st.DrawFn, kind: str) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A random model of ``kind`` with a batch of inputs and labels (some ``-100``)."""
    H = draw(st.sampled_from([1, 2, 4]))
    sizes: dict[str, Any] = dict(
        n_layer=draw(st.integers(1, 2)),
        n_head=H,
        head_dim=draw(st.sampled_from([2, 4, 8])),
        vocab=draw(st.integers(5, 97)),
        max_pos=draw(st.integers(4, 24)),
        d_ff=draw(st.sampled_from([8, 24])),
        attn=draw(st.sampled_from(["eager", "sdpa"])),
    )
    if kind == "llama":
        sizes["n_kv"] = draw(st.sampled_from([k for k in (1, 2, 4) if H % k == 0]))
        sizes["tie"] = draw(st.booleans())
        sizes["theta"] = draw(st.sampled_from([100.0, 10000.0]))
    model = _build(kind, draw(st.integers(0, 2**16)), **sizes)
    B, T = draw(st.integers(1, 2)), draw(st.integers(2, model.config.max_position_embeddings))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    labels = ids.clone()
    labels[torch.rand(B, T, generator=g) < 0.3] = -100
    labels[0, -1] = ids[0, -1]  # at least one counted label, so the mean is defined
    return model, ids, labels


@pytest.mark.parametrize("kind", ["gpt2", "llama", "opt"])
@FEW
@given(data=st.data())
def test_logits_and_loss_match_transformers(kind: str, data: st.DataObject) -> None:
    model, ids, labels = data.draw(hf_models(kind))
    cfg, params = hf.from_hf(model)
    module = MODULES[kind]
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels)
        logits = module.apply(params, ids, cfg)
        loss = module.loss(cfg)(params, {"input_ids": ids, "labels": labels})
    assert logits.dtype == torch.float32
    assert logits.shape == ref.logits.shape
    assert (logits - ref.logits).abs().max().item() <= 1e-4
    assert abs(loss.item() - ref.loss.item()) <= 1e-5


def test_llama_with_grouped_query_attention_matches() -> None:
    # the hypothesis draw may pick n_kv == n_head; pin one case where the heads are grouped
    model = _build("llama", 3, n_layer=2, n_head=4, n_kv=2, head_dim=8, vocab=50, max_pos=16)
    cfg, params = hf.from_hf(model)
    assert isinstance(cfg, models.llama.Config) and cfg.n_kv_heads == 2
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = models.llama.apply(params, ids, cfg) - model(input_ids=ids).logits
    assert diff.abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    ("kind", "sizes"),
    [
        ("gpt2", {}),
        ("llama", {"n_kv": 1}),
        ("llama", {"n_kv": 2, "tie": True}),
        ("opt", {}),
    ],
)
def test_gradients_match_transformers(kind: str, sizes: dict[str, Any]) -> None:
    model = _build(kind, 7, n_layer=2, n_head=2, head_dim=8, vocab=31, max_pos=12, **sizes)
    model.train()  # no dropout configured: train mode only enables the backward
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 31, (2, 12), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    model(input_ids=ids, labels=labels).loss.backward()

    cfg, params = hf.from_hf(model)
    params = tree.map(lambda x: x.requires_grad_(), params)
    module = MODULES[kind]
    loss = module.loss(cfg)(params, {"input_ids": ids, "labels": labels})
    loss.backward()
    grads = hf.to_hf(cfg, tree.map(lambda x: x.grad, params))
    named = dict(model.named_parameters())  # a tied weight appears once, with both uses' grads
    assert set(grads) - set(named) <= {"lm_head.weight"}
    for name, p in named.items():
        assert p.grad is not None, name
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "opt"])
def test_round_trip_from_hugging_face(kind: str) -> None:
    model = _build(kind, 11, n_layer=2, n_head=2, n_kv=1, head_dim=4, vocab=19, max_pos=8)
    ref = model.state_dict()
    cfg, params = hf.from_hf(model)
    state = hf.to_hf(cfg, params)
    assert set(state) == set(ref)
    for key, x in ref.items():
        assert torch.equal(state[key], x), key
    # the exported state loads strictly into a model built from hf_config, which then computes
    # exactly what the original does
    fresh = type(model)(hf.hf_config(cfg, attn_implementation="eager")).eval()
    fresh.load_state_dict(state, strict=True)
    ids = torch.randint(0, 19, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, model(input_ids=ids).logits)
    # params are copies: changing them leaves the model alone
    tree.map(lambda x: x.zero_(), params)
    assert all(torch.equal(model.state_dict()[k], x) for k, x in ref.items())


@pytest.mark.parametrize(
    "cfg",
    [
        models.gpt.Config.tiny(),
        models.llama.Config.tiny(),
        models.llama.Config(n_layer=2, d_model=64, n_head=4, n_kv_heads=1, tie_embeddings=True),
        models.opt.Config.tiny(),
    ],
    ids=["gpt", "llama", "llama-tied", "opt"],
)
def test_round_trip_from_colfunc(cfg: Any) -> None:
    module = {models.gpt.Config: models.gpt, models.llama.Config: models.llama}.get(
        type(cfg), models.opt
    )
    params = module.init(cfg, seed=5)
    hf_cfg = hf.hf_config(cfg)
    model = {
        "gpt2": transformers.GPT2LMHeadModel,
        "llama": transformers.LlamaForCausalLM,
        "opt": transformers.OPTForCausalLM,
    }[hf_cfg.model_type](hf_cfg)
    model.load_state_dict(hf.to_hf(cfg, params), strict=True)
    cfg2, params2 = hf.from_hf(model)
    assert cfg2 == cfg
    flat, flat2 = (
        dict(tree.flatten_with_paths(params)[0]),
        dict(tree.flatten_with_paths(params2)[0]),
    )
    assert set(flat) == set(flat2)
    for path, x in flat.items():
        assert torch.equal(flat2[path], x), path


_TINY = {
    "gpt2": dict(n_layer=1, n_embd=16, n_head=2, vocab_size=11, n_positions=8),
    "llama": dict(
        num_hidden_layers=1, hidden_size=16, intermediate_size=8, num_attention_heads=2,
        vocab_size=11, max_position_embeddings=8,
    ),
    "opt": dict(
        num_hidden_layers=1, hidden_size=16, ffn_dim=8, num_attention_heads=2, vocab_size=11,
        max_position_embeddings=8, pad_token_id=0,
    ),
}  # fmt: skip
_CLASSES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "opt": ("OPTConfig", "OPTForCausalLM"),
}


@pytest.mark.parametrize(
    ("kind", "option", "match"),
    [
        ("gpt2", {"tie_word_embeddings": False}, "tie_word_embeddings"),
        ("gpt2", {"activation_function": "relu"}, "activation_function"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("llama", {"hidden_act": "relu"}, "hidden_act"),
        ("opt", {"word_embed_proj_dim": 8}, "word_embed_proj_dim"),
        ("opt", {"do_layer_norm_before": False}, "do_layer_norm_before"),
        ("opt", {"activation_function": "gelu"}, "activation_function"),
    ],
)  # fmt: skip
def test_unsupported_options_are_refused(kind: str, option: dict[str, Any], match: str) -> None:
    config_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[kind])
    config = config_cls(**_TINY[kind], **option, bos_token_id=0, eos_token_id=0)
    with pytest.raises(ValueError, match=match):
        hf.from_hf(model_cls(config))


def test_models_without_a_language_model_head_are_refused() -> None:
    model = transformers.GPT2Model(
        transformers.GPT2Config(**_TINY["gpt2"], bos_token_id=0, eos_token_id=0)
    )
    with pytest.raises(ValueError, match="GPT2Model"):
        hf.from_hf(model)


def test_to_hf_checks_the_params() -> None:
    cfg = models.gpt.Config(n_layer=1, d_model=16, n_head=2, vocab_size=11, max_seq_len=8)
    params = models.gpt.init(cfg)
    del params["final_norm"]["bias"]
    with pytest.raises(ValueError, match=r"missing \[.final_norm.bias.\]"):
        hf.to_hf(cfg, params)
    params = models.gpt.init(cfg)
    with pytest.raises(ValueError, match=r"embed.tokens"):
        hf.to_hf(
            models.gpt.Config(n_layer=1, d_model=16, n_head=2, vocab_size=12, max_seq_len=8), params
        )
    with pytest.raises(TypeError, match="Config"):
        hf.to_hf({"n_layer": 1}, params)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kind", "tie"), [("gpt2", True), ("llama", False), ("opt", True)])
def test_an_abstract_load_reads_each_parameter_when_made(
    tmp_path: Any, kind: str, tie: bool
) -> None:
    """``hf.load_abstract``: parameters described from the safetensors header, made one at a time
    by reading their tensors; made, each equals ``hf.load``'s bit for bit; and ZeRO-3 on dp=2
    (threads) initialised from them holds exactly the shards of the eager load."""
    import colfunc as cf
    from colfunc import optim, random

    model = _build(kind, 3, n_layer=2, n_head=2, head_dim=8, vocab=40, max_pos=16, tie=tie)
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg, eager = hf.load(str(tmp_path))
    cfg_a, lazy = hf.load_abstract(str(tmp_path))
    assert cfg_a == cfg and random.is_abstract(lazy)
    for (p, a), (_, b) in zip(tree.flatten_with_paths(lazy)[0], tree.flatten_with_paths(eager)[0]):
        assert (a.shape, a.dtype) == (tuple(b.shape), b.dtype), p
        assert torch.equal(a.materialize(), b), p
    module = MODULES[kind]

    def shards(mesh: Any, params: Any) -> Any:
        step = cf.zero(cf.shard(cf.train_step(module.loss(cfg), optim.adamw(1e-3)), mesh), stage=3)
        return [x.clone() for x in tree.tensors(step.init(params).params)]

    from_eager = cf.launch(lambda m: shards(m, eager), {"dp": 2})
    from_lazy = cf.launch(lambda m: shards(m, lazy), {"dp": 2})
    for ra, rb in zip(from_lazy, from_eager):
        assert all(torch.equal(a, b) for a, b in zip(ra, rb))
