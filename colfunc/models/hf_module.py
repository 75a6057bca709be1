"""Any Hugging Face causal LM through its own ``transformers`` module, as a pure function over
stacked layers.

A ``transformers`` model is a pure function of its parameters through
``torch.func.functional_call``, and a decoder whose layers all have the same parameters is a scan
over them stacked. :func:`config_of` reads a ``transformers`` config, builds the model once on the
meta device (no weights; its buffers, such as rotary frequencies, made for real) and finds where
its forward can be cut:

- ``pre``: the model's own forward up to its first decoder layer (the embedding, rotary tables,
  whatever it computes once); the layer slots are stand-ins that record what each layer is
  called with and stop the forward at the last one;
- ``block``: decoder layer ``i`` (its own module, so per-layer settings such as sliding windows
  hold) called by ``functional_call`` with the stacked parameters' row ``i``;
- ``post``: the model's forward again with every layer slot handing back the final hidden state
  (the embedding skipped: ``inputs_embeds`` of zeros), so the final norm, the head and whatever
  the model does to its logits (scales, soft-caps) are its own; then the shifted cross-entropy.

Attention runs :func:`colfunc.ops.attention` through ``transformers``' attention interface
(registered as ``"colfunc"``), so sequence-parallel frames and the kernels apply; in the engine
it reads and writes the paged KV cache (:func:`paged_forward`). The tensor-parallel plan comes
from the config's ``base_model_tp_plan`` (:func:`tp_plan`).

A model whose layers differ in shape, whose forward does not call its layers one after another,
or whose attention does not go through the interface is refused, naming the architecture and the
reason. Parameters keep their ``transformers`` names (``model.embed_tokens.weight``), the layers'
stacked under ``blocks`` (``blocks.self_attn.q_proj.weight``, ``[layers, out, in]``).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from typing import Any

import torch

from colfunc import core, nn, random, tree
from colfunc.models.family import Family, HFWeight, KVCacheSpec, make_params
from colfunc.models.hf_cut import (
    ATTENTION,
    PAGED,
    Config,
    Runtime,
    Stop,
    config_of,
    runtime,
    split_kwargs,
)

__all__ = [
    "ATTENTION",
    "Config",
    "apply",
    "config_of",
    "family",
    "from_state",
    "init",
    "loss",
    "paged_forward",
    "param_shapes",
    "tp_plan",
    "weights",
]

Params = dict[str, Any]


def _local(x: Any) -> torch.Tensor:
    return getattr(x, "_local", x)


def _top(params: Params) -> dict[str, Any]:
    flat, _ = tree.flatten_with_paths({k: v for k, v in params.items() if k != "blocks"})
    return dict(flat)


# --- the model as a pure function ----------------------------------------------------------------


def _record(params: Params, cfg: Config, **inputs: Any) -> tuple[Runtime, torch.Tensor, list[Any]]:
    """The model's forward on ``inputs`` up to its layers: this thread's runtime, the first
    layer's hidden state, and each set of the layers' tensor arguments (``cfg.kw_of_layer``)."""
    from torch.func import functional_call

    top = _top(params)
    rt = runtime(cfg, next(iter(top.values())))
    rt.box["mode"], rt.box["calls"] = "record", []
    with contextlib.suppress(Stop):
        functional_call(rt.model, top, (), {**inputs, "use_cache": False})
    calls, rt.box["calls"] = rt.box["calls"], []
    if len(calls) != cfg.n_layer:
        raise ValueError(
            f"{cfg.architecture}: its forward called {len(calls)} layers, not {cfg.n_layer}"
        )
    kw: list[Any] = [None] * len(cfg.statics)
    for i, j in enumerate(cfg.kw_of_layer):
        if kw[j] is None:
            kw[j] = split_kwargs(calls[i][2], cfg.architecture)[0]
    return rt, calls[0][1], kw


def _pre(params: Params, batch: Any, cfg: Config) -> dict[str, Any]:
    ids = nn.batch_field(batch, "input_ids")
    nn.check_input_ids(ids, cfg.max_seq_len, cfg.vocab_size)
    # the position each index holds (zigzag ring attention stores the sequence reordered)
    positions = core.positions(ids.shape[1], device=_local(ids).device)[None]
    _, h, kw = _record(params, cfg, input_ids=ids, position_ids=positions)
    return {"h": h, "kw": kw}


def _block(layer: Params, carry: dict[str, Any], x: torch.Tensor, cfg: Config) -> Any:
    from torch.func import functional_call

    i = int(x)
    j = cfg.kw_of_layer[i]
    flat = dict(tree.flatten_with_paths(layer)[0])
    rt = runtime(cfg, carry["h"])
    kwargs = {**cfg.statics[j], **carry["kw"][j]}
    with _linears():
        out = functional_call(rt.layers[i], flat, (carry["h"],), kwargs)
    h = out[0] if isinstance(out, tuple) else out
    return {**carry, "h": h}, None


class _Linears(torch.overrides.TorchFunctionMode):
    """The module's ``F.linear`` calls run as :func:`colfunc.nn.linear` (which keeps the batch
    and sequence dims of a sequence split apart, where ``F.linear`` folds them together)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, w, *rest = args
            return nn.linear(x, w.t(), rest[0] if rest else kwargs.get("bias"))
        return func(*args, **kwargs)


def _linears() -> Any:
    """Within a long-sequence split, :class:`_Linears`; else nothing."""
    return _Linears() if core.sequence_split() else contextlib.nullcontext()


def _head(params: Params, h: torch.Tensor, cfg: Config) -> torch.Tensor:
    """The model's forward after its layers on the hidden state ``h[..., D]``: logits."""
    from torch.func import functional_call

    lead = h.shape[:-1]
    h3 = h.reshape(1, -1, h.shape[-1]) if h.dim() != 3 else h
    top = _top(params)
    rt = runtime(cfg, h)
    rt.box["mode"], rt.box["h"] = "inject", h3
    zeros = torch.zeros(tuple(h3.shape), dtype=h3.dtype, device=_local(h3).device)
    try:
        out = functional_call(rt.model, top, (), {"inputs_embeds": zeros, "use_cache": False})
    finally:
        rt.box["mode"], rt.box["h"] = "record", None
    logits: torch.Tensor = out.logits
    return logits.reshape(*lead, logits.shape[-1])


def _xs(params: Params, batch: Any, cfg: Config) -> torch.Tensor:
    return torch.arange(cfg.n_layer)


def loss(cfg: Config) -> core.Layered:
    """The mean next-token cross-entropy of the model, as ``layered(pre, block, post)`` with the
    layer index as the scan's ``xs`` (each layer runs its own module)."""

    def post(params: Params, carry: Any, batch: Any, ys: Any = None) -> torch.Tensor:
        head = lambda h: _head(params, h, cfg)  # noqa: E731
        return nn.causal_lm_loss(head, carry["h"], nn.batch_field(batch, "labels"))

    block: Any = lambda layer, carry, x: _block(layer, carry, x, cfg)  # noqa: E731
    return core.layered(
        lambda params, batch: _pre(params, batch, cfg),
        block,
        post,
        name=f"hf:{cfg.architecture}",
        divisors={"num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_heads},
        sequence_dims={"h": 1},
        xs=lambda params, batch: _xs(params, batch, cfg),
    )


def apply(params: Params, input_ids_BT: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Logits ``[B, T, V]`` of the token ids."""
    carry = _pre(params, {"input_ids": input_ids_BT}, cfg)
    carry, _ = core.scan_layers(
        lambda layer, c, x: _block(layer, c, x, cfg),
        carry,
        params["blocks"],
        xs=_xs(params, None, cfg),
    )
    return _head(params, carry["h"], cfg)


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Every parameter's dotted path and shape: the model's own names outside the layers, one
    layer's under ``blocks`` with the layer count in front."""
    shapes = dict(cfg.top)
    shapes.update({f"blocks.{n}": (cfg.n_layer, *s) for n, s in cfg.block})
    return shapes


def init(cfg: Config, seed: int = 0, *, abstract: bool = False) -> Params:
    """Fresh fp32 parameters, each drawn as the model's own ``_init_weights`` draws it, from
    torch's generator seeded by ``(seed, path)`` (a stacked weight: by each layer's path), so
    each value depends on its path only. ``abstract=True``: :class:`colfunc.random.Abstract`
    leaves, described but not made (see :func:`colfunc.models.decoder.init`)."""
    top = {name: f"{name}" for name, _ in cfg.top}

    def value(path: str, shape: tuple[int, ...]) -> torch.Tensor:
        if path in top:
            return _drawn(cfg, seed, path)
        name = path.removeprefix("blocks.")
        return torch.stack(
            [_drawn(cfg, seed, f"{cfg.layers}.{i}.{name}") for i in range(cfg.n_layer)]
        )

    return make_params(param_shapes(cfg), value, abstract)


def _drawn(cfg: Config, seed: int, name: str) -> torch.Tensor:
    """The parameter ``name`` (the model's own name) as the model initializes it: its module
    made for real on the CPU and passed to ``_init_weights``."""
    parent, _, leaf = name.rpartition(".")
    owner = copy.deepcopy(cfg.template.get_submodule(parent) if parent else cfg.template)
    owner.to_empty(device="cpu", recurse=False)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(random.key(seed, name))
        cfg.template._init_weights(owner)
    return getattr(owner, leaf).detach().float().clone()


def from_state(cfg: Config, state: dict[str, torch.Tensor]) -> Params:
    """The parameter tree of a ``transformers`` state dict (layers stacked)."""
    flat: dict[str, torch.Tensor] = {}
    for name, _ in cfg.top:
        if name not in state:
            raise ValueError(f"{cfg.architecture}: the weights have no {name!r}")
        flat[name] = state[name]
    for name, _ in cfg.block:
        keys = [f"{cfg.layers}.{i}.{name}" for i in range(cfg.n_layer)]
        missing = [k for k in keys if k not in state]
        if missing:
            raise ValueError(f"{cfg.architecture}: the weights have no {missing[0]!r}")
        flat[f"blocks.{name}"] = torch.stack([state[k] for k in keys])
    return nn.nest(flat)


# --- tensor parallelism from the config's own plan ------------------------------------------------

_COLUMN = ("colwise", "colwise_gather_output", "colwise_rep", "local_colwise")
_ROW = ("rowwise", "rowwise_rep", "local_rowwise", "rowwise_split_input")
_REPLICATED = ("replicated_with_grad_allreduce", "replicate", "local")


def tp_plan(cfg: Config) -> dict[str, Any]:
    """The 1D tensor-parallel plan of the model from ``base_model_tp_plan`` (and the model
    class's own, for the head): ``colwise`` splits a linear map's outputs (its ``[out, in]``
    weight on dim 0, its bias with it), ``rowwise`` its inputs (dim 1, the bias replicated),
    an embedding ``rowwise`` its vocabulary. A ValueError naming the architecture where the
    config has no plan, or a style colfunc does not lay out."""
    import transformers

    from colfunc.core import P

    base = getattr(cfg.hf, "base_model_tp_plan", None) or {}
    model_cls = transformers.AutoModelForCausalLM._model_mapping[type(cfg.hf)]
    own = getattr(model_cls, "_tp_plan", None) or {}
    if not base:
        raise ValueError(
            f"{cfg.architecture}: its config has no base_model_tp_plan, so colfunc does not know "
            "how to split it; train it without tensor parallelism (tp=1)"
        )
    prefix = getattr(model_cls, "base_model_prefix", "") or ""
    layers_rel = (
        cfg.layers[len(prefix) + 1 :] if cfg.layers.startswith(prefix + ".") else cfg.layers
    )
    shapes = param_shapes(cfg)
    plan: dict[str, Any] = {}
    entries = [(f"{prefix}.{k}" if prefix else k, v) for k, v in base.items()] + list(own.items())
    for key, style in entries:
        stacked = (
            key.startswith(f"{prefix}.{layers_rel}.*.")
            if prefix
            else key.startswith(f"{layers_rel}.*.")
        )
        if stacked:
            key = "blocks." + key.split(".*.", 1)[1]
        lead = (None,) if stacked else ()
        weight, bias = f"{key}.weight", f"{key}.bias"
        if weight not in shapes:
            continue  # (a module this configuration leaves out)
        if style in _COLUMN:
            plan[weight] = P(*lead, "tp", None)
            if bias in shapes:
                plan[bias] = P(*lead, "tp")
        elif style in _ROW or style == "embedding_rowwise":
            if len(shapes[weight]) == len(lead) + 2 and style != "embedding_rowwise":
                plan[weight] = P(*lead, None, "tp")
            else:
                plan[weight] = P(*lead, "tp", None)
        elif style not in _REPLICATED:
            raise ValueError(
                f"{cfg.architecture}: its tensor-parallel plan lays out {key!r} as {style!r}, "
                f"which colfunc does not; known: {sorted({*_COLUMN, *_ROW, *_REPLICATED})}"
            )
    return plan


# --- the engine ----------------------------------------------------------------------------------


def paged_forward(
    params: Params,
    tokens_N: torch.Tensor,
    batch: nn.PagedBatch,
    cache: dict[str, torch.Tensor],
    cfg: Config,
    select_R: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits ``[R, V]`` at the packed rows ``select`` over a paged KV cache, and the new keys
    and values ``[L, N, K, E]``: the model's own forward on the packed tokens ``[1, N]`` at their
    positions, each layer's attention against its slice of the cache."""
    from torch.func import functional_call

    positions = batch.token_positions()[None]
    rt, h, kw = _record(params, cfg, input_ids=tokens_N[None], position_ids=positions)
    carry = {"h": h}

    def block(layer: Params, c: Any, paged: nn.Paged) -> tuple[Any, dict[str, torch.Tensor]]:
        i = paged.layer
        j = cfg.kw_of_layer[i]
        flat = dict(tree.flatten_with_paths(layer)[0])
        PAGED.paged = paged
        try:
            out = functional_call(rt.layers[i], flat, (c["h"],), {**cfg.statics[j], **kw[j]})
            new_kv = PAGED.new_kv
        finally:
            PAGED.paged, PAGED.new_kv = None, None
        h = out[0] if isinstance(out, tuple) else out
        assert new_kv is not None
        return {"h": h}, new_kv

    carry, ys = nn.paged_scan(block, carry, params["blocks"], cache, batch)
    logits = _head(params, carry["h"][:, select_R], cfg)
    return logits[0], ys


def _kv_cache(cfg: Config, params: Params) -> KVCacheSpec:
    first = next(iter(_top(params).values()))
    window = getattr(cfg.hf, "sliding_window", None)
    types = getattr(cfg.hf, "layer_types", None)
    if types is not None and any(t != "sliding_attention" for t in types):
        window = None  # (full layers keep every block)
    return KVCacheSpec.like(
        first,
        layers=cfg.n_layer,
        kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        window=window if isinstance(window, int) and window > 0 else None,
    )


family = Family(
    name="transformers", module=sys.modules[__name__], config=Config, kv_cache=_kv_cache
)


def weights(cfg: Config) -> tuple[list[HFWeight], list[HFWeight]]:
    """The Hugging Face weight table (see :class:`colfunc.models.HFWeight`): every parameter
    under its own name (a tied alias read as its weight), the layers' by ``{i}``, none
    transposed."""
    aliases: dict[str, list[str]] = {}
    for alias, name in cfg.tied:
        aliases.setdefault(name, []).append(alias)
    top = [HFWeight(n, (n,), aliases=tuple(aliases.get(n, ()))) for n, _ in cfg.top]
    top += [HFWeight(alias, (name,)) for alias, name in cfg.tied]
    layer = [HFWeight(f"{cfg.layers}.{{i}}.{n}", (f"blocks.{n}",)) for n, _ in cfg.block]
    return top, layer
