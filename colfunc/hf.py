"""Hugging Face weights in and out: GPT-2, LLaMA and OPT causal language models.

``from_hf(model) -> (cfg, params)`` reads a ``transformers`` model, ``load(folder)`` and
``read_config(folder)`` a ``save_pretrained`` folder (local files only), ``load_abstract(folder)``
its parameters described and read from the safetensors files one at a time as they are made; ``to_hf(cfg, params)`` writes
the state dict that ``load_state_dict`` takes; ``hf_config(cfg)`` builds the matching
``transformers`` config. The mapping between the two layouts is a table per model: each entry
names a Hugging Face key, the colfunc paths concatenated (along the output dim) to make it, and
whether the weight is transposed (``nn.Linear`` stores ``[out, in]``, colfunc and GPT-2's
``Conv1D`` store ``[in, out]``). The same table serves both directions, so ``to_hf`` also maps any
tree shaped like the params, such as gradients.

Only the weights and the config cross over: nothing here downloads or needs ``transformers``
except :func:`hf_config`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from colfunc import nn, tree
from colfunc.models import gpt, llama, opt

__all__ = [
    "folder_of",
    "from_hf",
    "hf_config",
    "load",
    "load_abstract",
    "read_config",
    "save",
    "to_hf",
]

Config = gpt.Config | llama.Config | opt.Config
Params = dict[str, Any]


class _Entry(NamedTuple):
    key: str  # Hugging Face key; "{i}" stands for the layer index in per-layer entries
    paths: tuple[str, ...]  # colfunc paths, concatenated along the last dim to make the key
    transpose: bool = False  # nn.Linear [out, in] on the Hugging Face side


def _w(key: str, *paths: str) -> _Entry:
    return _Entry(key, paths, transpose=True)


def _gpt2_entries(cfg: gpt.Config) -> tuple[list[_Entry], list[_Entry]]:
    h = "transformer.h.{i}."
    layer = [
        _Entry(h + "ln_1.weight", ("blocks.ln1.weight",)),
        _Entry(h + "ln_1.bias", ("blocks.ln1.bias",)),
        # GPT-2 fuses q, k, v into one Conv1D; colfunc keeps them apart for column parallelism
        _Entry(h + "attn.c_attn.weight", ("blocks.attn.wq", "blocks.attn.wk", "blocks.attn.wv")),
        _Entry(h + "attn.c_attn.bias", ("blocks.attn.bq", "blocks.attn.bk", "blocks.attn.bv")),
        _Entry(h + "attn.c_proj.weight", ("blocks.attn.wo",)),
        _Entry(h + "attn.c_proj.bias", ("blocks.attn.bo",)),
        _Entry(h + "ln_2.weight", ("blocks.ln2.weight",)),
        _Entry(h + "ln_2.bias", ("blocks.ln2.bias",)),
        _Entry(h + "mlp.c_fc.weight", ("blocks.mlp.w_in",)),
        _Entry(h + "mlp.c_fc.bias", ("blocks.mlp.b_in",)),
        _Entry(h + "mlp.c_proj.weight", ("blocks.mlp.w_out",)),
        _Entry(h + "mlp.c_proj.bias", ("blocks.mlp.b_out",)),
    ]
    top = [
        _Entry("transformer.wte.weight", ("embed.tokens",)),
        _Entry("transformer.wpe.weight", ("embed.positions",)),
        _Entry("transformer.ln_f.weight", ("final_norm.weight",)),
        _Entry("transformer.ln_f.bias", ("final_norm.bias",)),
        _Entry("lm_head.weight", ("embed.tokens",)),  # tied
    ]
    return top, layer


def _llama_entries(cfg: llama.Config) -> tuple[list[_Entry], list[_Entry]]:
    h = "model.layers.{i}."
    layer = [
        _Entry(h + "input_layernorm.weight", ("blocks.ln1.weight",)),
        _w(h + "self_attn.q_proj.weight", "blocks.attn.wq"),
        _w(h + "self_attn.k_proj.weight", "blocks.attn.wk"),
        _w(h + "self_attn.v_proj.weight", "blocks.attn.wv"),
        _w(h + "self_attn.o_proj.weight", "blocks.attn.wo"),
        _Entry(h + "post_attention_layernorm.weight", ("blocks.ln2.weight",)),
        _w(h + "mlp.gate_proj.weight", "blocks.mlp.w_gate"),
        _w(h + "mlp.up_proj.weight", "blocks.mlp.w_up"),
        _w(h + "mlp.down_proj.weight", "blocks.mlp.w_down"),
    ]
    top = [
        _Entry("model.embed_tokens.weight", ("embed.tokens",)),
        _Entry("model.norm.weight", ("final_norm.weight",)),
        _Entry("lm_head.weight", ("embed.tokens",))
        if cfg.tie_embeddings
        else _w("lm_head.weight", "head.weight"),
    ]
    return top, layer


def _opt_entries(cfg: opt.Config) -> tuple[list[_Entry], list[_Entry]]:
    h = "model.decoder.layers.{i}."
    layer = [
        _Entry(h + "self_attn_layer_norm.weight", ("blocks.ln1.weight",)),
        _Entry(h + "self_attn_layer_norm.bias", ("blocks.ln1.bias",)),
        _w(h + "self_attn.q_proj.weight", "blocks.attn.wq"),
        _Entry(h + "self_attn.q_proj.bias", ("blocks.attn.bq",)),
        _w(h + "self_attn.k_proj.weight", "blocks.attn.wk"),
        _Entry(h + "self_attn.k_proj.bias", ("blocks.attn.bk",)),
        _w(h + "self_attn.v_proj.weight", "blocks.attn.wv"),
        _Entry(h + "self_attn.v_proj.bias", ("blocks.attn.bv",)),
        _w(h + "self_attn.out_proj.weight", "blocks.attn.wo"),
        _Entry(h + "self_attn.out_proj.bias", ("blocks.attn.bo",)),
        _Entry(h + "final_layer_norm.weight", ("blocks.ln2.weight",)),
        _Entry(h + "final_layer_norm.bias", ("blocks.ln2.bias",)),
        _w(h + "fc1.weight", "blocks.mlp.w_in"),
        _Entry(h + "fc1.bias", ("blocks.mlp.b_in",)),
        _w(h + "fc2.weight", "blocks.mlp.w_out"),
        _Entry(h + "fc2.bias", ("blocks.mlp.b_out",)),
    ]
    top = [
        _Entry("model.decoder.embed_tokens.weight", ("embed.tokens",)),
        _Entry("model.decoder.embed_positions.weight", ("embed.positions",)),
        _Entry("model.decoder.final_layer_norm.weight", ("final_norm.weight",)),
        _Entry("model.decoder.final_layer_norm.bias", ("final_norm.bias",)),
        _Entry("lm_head.weight", ("embed.tokens",)),  # tied
    ]
    return top, layer


def _table(cfg: Any) -> tuple[Any, list[_Entry], list[_Entry]]:
    """``(model module, top-level entries, per-layer entries)`` for a colfunc config."""
    if isinstance(cfg, gpt.Config):
        return (gpt, *_gpt2_entries(cfg))
    if isinstance(cfg, llama.Config):
        return (llama, *_llama_entries(cfg))
    if isinstance(cfg, opt.Config):
        return (opt, *_opt_entries(cfg))
    raise TypeError(
        f"expected a colfunc.models.gpt/llama/opt Config, got {type(cfg).__name__}: {cfg!r}"
    )


def _copy(x: torch.Tensor) -> torch.Tensor:
    # always a fresh contiguous tensor: the result never aliases its source
    return x.clone(memory_format=torch.contiguous_format)


# --- Hugging Face config -> colfunc config, refusing what the colfunc models do not compute ----


def _require(model: str, hf_cfg: Any, option: str, allowed: tuple[Any, ...]) -> None:
    value = getattr(hf_cfg, option, allowed[0])  # absent in this version: the default behaviour
    if value not in allowed:
        raise ValueError(
            f"from_hf: {model} with {option}={value!r} is not supported; colfunc's model "
            f"computes {option} in {allowed!r}"
        )


def _gpt2_config(c: Any) -> gpt.Config:
    _require("GPT-2", c, "activation_function", ("gelu_new", "gelu_pytorch_tanh"))
    _require("GPT-2", c, "scale_attn_weights", (True,))
    _require("GPT-2", c, "scale_attn_by_inverse_layer_idx", (False,))
    _require("GPT-2", c, "add_cross_attention", (False,))
    _require("GPT-2", c, "tie_word_embeddings", (True,))
    return gpt.Config(
        vocab_size=c.vocab_size,
        n_layer=c.n_layer,
        n_head=c.n_head,
        d_model=c.n_embd,
        max_seq_len=c.n_positions,
        d_ff=c.n_inner or 4 * c.n_embd,
        norm_eps=c.layer_norm_epsilon,
    )


def _llama_config(c: Any) -> llama.Config:
    _require("LLaMA", c, "hidden_act", ("silu",))
    _require("LLaMA", c, "attention_bias", (False,))
    _require("LLaMA", c, "mlp_bias", (False,))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head_dim * c.num_attention_heads != c.hidden_size:
        raise ValueError(
            f"from_hf: LLaMA with head_dim={head_dim} and num_attention_heads="
            f"{c.num_attention_heads} != hidden_size={c.hidden_size} is not supported; colfunc's "
            "model uses head_dim = hidden_size / num_attention_heads"
        )
    # transformers 5 keeps rope settings in rope_parameters; 4.x in rope_theta and rope_scaling
    rope = getattr(c, "rope_parameters", None) or {
        "rope_type": (getattr(c, "rope_scaling", None) or {}).get("rope_type", "default"),
        "rope_theta": getattr(c, "rope_theta", 10000.0),
    }
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"from_hf: LLaMA with rope_type={rope['rope_type']!r} is not supported; colfunc's "
            "model computes the default rotary embedding"
        )
    return llama.Config(
        vocab_size=c.vocab_size,
        n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads,
        d_model=c.hidden_size,
        max_seq_len=c.max_position_embeddings,
        n_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        d_ff=c.intermediate_size,
        rope_theta=float(rope["rope_theta"]),
        norm_eps=c.rms_norm_eps,
        tie_embeddings=bool(c.tie_word_embeddings),
    )


def _opt_config(c: Any) -> opt.Config:
    _require("OPT", c, "activation_function", ("relu",))
    _require("OPT", c, "do_layer_norm_before", (True,))
    _require("OPT", c, "_remove_final_layer_norm", (False,))
    _require("OPT", c, "enable_bias", (True,))
    _require("OPT", c, "layer_norm_elementwise_affine", (True,))
    _require("OPT", c, "tie_word_embeddings", (True,))
    proj = getattr(c, "word_embed_proj_dim", None) or c.hidden_size
    if proj != c.hidden_size:
        raise ValueError(
            f"from_hf: OPT with word_embed_proj_dim={proj} != hidden_size={c.hidden_size} "
            "(project_in/project_out, as in opt-350m) is not supported"
        )
    return opt.Config(
        vocab_size=c.vocab_size,
        n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads,
        d_model=c.hidden_size,
        max_seq_len=c.max_position_embeddings,
        d_ff=c.ffn_dim,
        norm_eps=1e-5,  # OPT's LayerNorms use torch's default eps
    )


_FROM_HF_CONFIG: dict[str, Callable[[Any], Any]] = {
    "GPT2LMHeadModel": _gpt2_config,
    "LlamaForCausalLM": _llama_config,
    "OPTForCausalLM": _opt_config,
}


def from_hf(hf_model: Any) -> tuple[Config, Params]:
    """``(cfg, params)`` from a ``transformers`` GPT2LMHeadModel, LlamaForCausalLM or OPTForCausalLM.

    The params are fresh tensors in the model's dtype (never views of its weights). Options
    the colfunc model does not compute (OPT's ``project_in``, LLaMA's scaled rope, ...) raise
    ValueError.

    Example:
        >>> cfg, params = from_hf(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2)))
    """
    name = type(hf_model).__name__
    if name not in _FROM_HF_CONFIG:
        raise ValueError(
            f"from_hf supports {sorted(_FROM_HF_CONFIG)}, got {name}; load the causal-LM class "
            "(e.g. AutoModelForCausalLM)"
        )
    cfg = _FROM_HF_CONFIG[name](hf_model.config)
    return cfg, _from_state_dict(cfg, hf_model.state_dict())


def _from_state_dict(cfg: Any, state: dict[str, torch.Tensor]) -> Params:
    module, top, layer = _table(cfg)
    shapes: dict[str, tuple[int, ...]] = module.param_shapes(cfg)

    def pieces(key: str, entry: _Entry) -> tuple[torch.Tensor, ...]:
        if key not in state:
            raise ValueError(f"from_hf: state dict has no {key!r} (needed for {entry.paths})")
        x = state[key].detach()
        x = x.t() if entry.transpose else x
        sizes = [shapes[p][-1] for p in entry.paths]
        if x.shape[-1] != sum(sizes):
            raise ValueError(
                f"from_hf: {key} has shape {tuple(state[key].shape)}; expected a last dim of "
                f"{sum(sizes)} for {entry.paths}"
            )
        return x.split(sizes, dim=-1)

    flat: dict[str, torch.Tensor] = {}
    for e in top:
        if all(p in flat for p in e.paths):  # a tied alias of a weight already read
            continue
        for p, x in zip(e.paths, pieces(e.key, e)):
            flat[p] = _copy(x)
    for e in layer:
        per_layer = [pieces(e.key.format(i=i), e) for i in range(cfg.n_layer)]
        for j, p in enumerate(e.paths):
            flat[p] = torch.stack([xs[j] for xs in per_layer])
    for p, shape in shapes.items():
        if tuple(flat[p].shape) != shape:
            raise ValueError(f"from_hf: {p} has shape {tuple(flat[p].shape)}, expected {shape}")
    return nn.nest({p: flat[p] for p in shapes})


def to_hf(cfg: Config, params: Params) -> dict[str, torch.Tensor]:
    """The ``transformers`` state dict (every key, tied ones included) for ``params``.

    Works for any tree shaped like the params (gradients, optimizer moments): it only moves,
    concatenates and transposes tensors. The result loads with ``load_state_dict`` into the model
    built from :func:`hf_config`.
    """
    module, top, layer = _table(cfg)
    shapes: dict[str, tuple[int, ...]] = module.param_shapes(cfg)
    flat = dict(tree.flatten_with_paths(params)[0])
    if set(flat) != set(shapes):
        missing, extra = sorted(set(shapes) - set(flat)), sorted(set(flat) - set(shapes))
        raise ValueError(
            f"to_hf: params do not match {type(cfg).__module__}.Config: missing {missing}, "
            f"unexpected {extra}"
        )
    for p, shape in shapes.items():
        if tuple(flat[p].shape) != shape:
            raise ValueError(f"to_hf: {p} has shape {tuple(flat[p].shape)}, expected {shape}")

    def value(xs: list[torch.Tensor], transpose: bool) -> torch.Tensor:
        x = xs[0] if len(xs) == 1 else torch.cat(xs, dim=-1)
        return _copy(x.detach().t() if transpose else x.detach())

    out = {e.key: value([flat[p] for p in e.paths], e.transpose) for e in top}
    for i in range(cfg.n_layer):
        for e in layer:
            out[e.key.format(i=i)] = value([flat[p][i] for p in e.paths], e.transpose)
    return out


def hf_config(cfg: Config, **overrides: Any) -> Any:
    """The ``transformers`` config of the model that :func:`to_hf`'s state dict loads into.

    ``overrides`` go to the config constructor (e.g. ``attn_implementation="eager"``).

    Example:
        >>> model = transformers.GPT2LMHeadModel(hf_config(cfg))
        >>> model.load_state_dict(to_hf(cfg, params))
    """
    import transformers  # only here: the rest of this module needs no transformers

    if isinstance(cfg, gpt.Config):
        kw: dict[str, Any] = dict(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.max_seq_len,
            n_embd=cfg.d_model,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_inner=cfg.d_ff,
            activation_function="gelu_new",
            layer_norm_epsilon=cfg.norm_eps,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=cfg.vocab_size - 1,  # GPT-2 keeps <|endoftext|> as the last token
            eos_token_id=cfg.vocab_size - 1,
            tie_word_embeddings=True,
        )
        return transformers.GPT2Config(**(kw | overrides))
    if isinstance(cfg, llama.Config):
        kw = dict(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            num_key_value_heads=cfg.n_kv_heads,
            max_position_embeddings=cfg.max_seq_len,
            rms_norm_eps=cfg.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            tie_word_embeddings=cfg.tie_embeddings,
        )
        return transformers.LlamaConfig(**(kw | overrides))
    if isinstance(cfg, opt.Config):
        if cfg.norm_eps != 1e-5:
            raise ValueError(
                f"hf_config: OPT's LayerNorms use eps=1e-5 and have no option for it; got "
                f"norm_eps={cfg.norm_eps}"
            )
        kw = dict(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            ffn_dim=cfg.d_ff,
            max_position_embeddings=cfg.max_seq_len,
            dropout=0.0,
            attention_dropout=0.0,
            tie_word_embeddings=True,
        )
        return transformers.OPTConfig(**(kw | overrides))
    raise TypeError(
        f"expected a colfunc.models.gpt/llama/opt Config, got {type(cfg).__name__}: {cfg!r}"
    )


def folder_of(source: str, what: str = "model") -> Path:
    """The folder of ``"hf:FOLDER"`` (or a plain folder path), checked to hold ``config.json``
    (for a model) or a tokenizer."""
    path = Path(source.removeprefix("hf:")).expanduser()
    if what == "model" and not (path / "config.json").is_file():
        raise ValueError(
            f"{source!r} is not a Hugging Face model folder: {str(path)!r} has no config.json "
            "(write one with save_pretrained; nothing is downloaded)"
        )
    if not path.is_dir():
        raise ValueError(f"{source!r}: {str(path)!r} is not a folder")
    return path


def read_config(source: str) -> Config:
    """The colfunc config of a Hugging Face folder's ``config.json`` (GPT-2, LLaMA or OPT)."""
    import transformers

    hf_cfg = transformers.AutoConfig.from_pretrained(folder_of(source), local_files_only=True)
    names = [a for a in (getattr(hf_cfg, "architectures", None) or []) if a in _FROM_HF_CONFIG]
    by_type = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "opt": "OPTForCausalLM"}
    name = names[0] if names else by_type.get(getattr(hf_cfg, "model_type", ""))
    if name is None:
        raise ValueError(
            f"{source!r}: model_type {getattr(hf_cfg, 'model_type', None)!r} is not one colfunc "
            f"reads; it reads {sorted(by_type)}"
        )
    return _FROM_HF_CONFIG[name](hf_cfg)


def _safetensors_keys(folder: Path) -> dict[str, Path]:
    """Every tensor key of the folder's safetensors weights, with the file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        import json

        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: folder / f for k, f in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ValueError(
            f"{str(folder)!r} has no model.safetensors (or index): abstract loading reads "
            "safetensors weights; save the model with safe_serialization=True"
        )
    import safetensors

    with safetensors.safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def load_abstract(source: str) -> tuple[Config, Params]:
    """``(cfg, params)`` of a Hugging Face folder whose parameters are described, not made: each
    is a :class:`colfunc.random.Abstract` that reads its tensors from the safetensors files when
    it is made (one parameter at a time, as :meth:`colfunc.Step.init` makes them, so that a rank
    keeping only its shards never holds the whole model). Made, each equals :func:`load`'s."""
    import safetensors

    from colfunc.random import abstract

    folder = folder_of(source)
    cfg = read_config(source)
    module, top, layer = _table(cfg)
    shapes: dict[str, tuple[int, ...]] = module.param_shapes(cfg)
    where = _safetensors_keys(folder)

    def read(key: str) -> torch.Tensor:
        if key not in where:
            raise ValueError(f"{source!r}: the weights have no {key!r}")
        with safetensors.safe_open(str(where[key]), framework="pt") as f:
            return f.get_tensor(key)

    def piece(entry: _Entry, key: str, j: int) -> torch.Tensor:
        x = read(key)
        x = x.t() if entry.transpose else x
        sizes = [shapes[p][-1] for p in entry.paths]
        return x.split(sizes, dim=-1)[j]

    made: dict[str, Any] = {}
    for e in top:
        for j, p in enumerate(e.paths):
            if p in made:  # a tied alias of a weight already described
                continue
            key = e.key if e.key in where else None
            if key is None:
                continue  # (an alias the file leaves out, such as a tied head)
            made[p] = (e, key, j, None)
    for e in layer:
        for j, p in enumerate(e.paths):
            made[p] = (e, e.key, j, cfg.n_layer)
    missing = sorted(set(shapes) - set(made))
    if missing:
        raise ValueError(f"{source!r}: the weights have nothing for {missing[:3]}")

    dtypes = {
        "F64": torch.float64,
        "F32": torch.float32,
        "BF16": torch.bfloat16,
        "F16": torch.float16,
    }

    def dtype_of(key: str) -> torch.dtype:  # from the file's header, nothing read
        with safetensors.safe_open(str(where[key]), framework="pt") as f:
            name = f.get_slice(key).get_dtype()
        if name not in dtypes:
            raise ValueError(f"{source!r}: {key!r} is stored as {name}, not a float type")
        return dtypes[name]

    def describe(path: str) -> Any:
        e, key, j, n = made[path]

        def make() -> torch.Tensor:
            if n is None:
                return _copy(piece(e, key, j))
            return torch.stack([piece(e, key.format(i=i), j) for i in range(n)])

        return abstract(shapes[path], make, dtype_of(key if n is None else key.format(i=0)))

    return cfg, nn.nest({p: describe(p) for p in shapes})


def load(source: str, dtype: torch.dtype | None = None) -> tuple[Config, Params]:
    """``(cfg, params)`` of a Hugging Face ``save_pretrained`` folder (local files only)."""
    import transformers

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        folder_of(source), local_files_only=True, dtype=dtype
    )
    return from_hf(hf_model)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def save(
    folder: str | Path,
    cfg: Config,
    params: Params,
    *,
    dtype: str | torch.dtype | None = None,
    tokenizer: str | None = None,
) -> Path:
    """Write a Hugging Face ``save_pretrained`` folder (``config.json`` and
    ``model.safetensors``) of ``(cfg, params)``, which ``AutoModelForCausalLM.from_pretrained``
    loads; with the tokenizer of the folder ``tokenizer`` (``"hf:FOLDER"``) beside it.

    ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"`` or a torch dtype) casts the weights;
    None keeps theirs. ``folder`` must not exist, or be empty: nothing is overwritten.
    """
    import transformers

    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(
            f"{str(folder)!r} exists and is not an empty folder; refusing to overwrite it"
        )
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"hf.save: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    state = to_hf(cfg, params)
    with torch.device("meta"):  # no weights made: the state dict's are assigned
        model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg))
    # tied keys (the head shares the embedding) are skipped by save_pretrained
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    if dtype is not None:
        model = model.to(dtype)
    tok = None
    if tokenizer is not None:
        tok = transformers.AutoTokenizer.from_pretrained(
            folder_of(tokenizer, "tokenizer"), local_files_only=True
        )
    model.save_pretrained(folder, safe_serialization=True)
    if tok is not None:
        tok.save_pretrained(folder)
    return folder
