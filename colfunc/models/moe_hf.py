"""What the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) share: their
weight tables (the router and one tensor per expert, as ``save_pretrained`` writes them), their
config fields both ways, and their tensor-parallel plan."""

from __future__ import annotations

import dataclasses
from typing import Any

from colfunc.core import P, Plan
from colfunc.models import decoder, decoder_hf
from colfunc.models.family import HFWeight, linear

__all__ = ["Names", "plan", "read", "weights", "write"]


@dataclasses.dataclass(frozen=True)
class Names:
    """A family's Hugging Face names under ``model.layers.{i}.``: the sparse block, and each
    expert's gate, up and down projections."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


def weights(cfg: Any, names: Names) -> tuple[list[HFWeight], list[HFWeight]]:
    """The decoder's weight table with the dense MLP's entries replaced by the router's, each
    expert's (``{j}``: one tensor per expert, stacked as ``[layers, experts, ...]``) and the
    shared expert's; where some layers are dense (``dense_layers``), the dense MLP's entries
    kept for those layers and the sparse ones' for the others."""
    top, layer = decoder_hf.family_weights(cfg)
    dense = {"blocks.mlp.w_gate", "blocks.mlp.w_up", "blocks.mlp.w_down"}
    only = tuple(cfg.dense_layers) or None
    kept = [e._replace(layers=only) for e in layer if set(e.paths) & dense] if only else []
    layer = [e for e in layer if not set(e.paths) & dense]
    b = f"model.layers.{{i}}.{names.block}."
    x = b + "experts.{j}."
    sparse = [
        linear(b + "gate.weight", "blocks.mlp.router"),
        linear(x + f"{names.gate}.weight", "blocks.mlp.experts.w_gate"),
        linear(x + f"{names.up}.weight", "blocks.mlp.experts.w_up"),
        linear(x + f"{names.down}.weight", "blocks.mlp.experts.w_down"),
    ]
    if cfg.d_shared_expert:
        s = b + "shared_expert."
        sparse += [
            linear(s + "gate_proj.weight", "blocks.mlp.shared.w_gate"),
            linear(s + "up_proj.weight", "blocks.mlp.shared.w_up"),
            linear(s + "down_proj.weight", "blocks.mlp.shared.w_down"),
            linear(b + "shared_expert_gate.weight", "blocks.mlp.shared_gate"),
        ]
    if only:
        sparse = [e._replace(layers=cfg.sparse_layers) for e in sparse]
    return top, layer + sparse + kept


def read(
    c: Any, label: str, *, experts: str = "num_experts", norm_topk: bool | None = None
) -> dict[str, Any]:
    """The MoE fields of a ``transformers`` config ``c``, refusing what colfunc does not
    compute (router jitter in training). Layers whose MLP is dense (``mlp_only_layers``, and
    those not on ``decoder_sparse_step``: layer ``i`` is sparse where ``(i + 1) % step == 0``)
    are ``dense_layers``. The load-balancing loss joins the loss as ``transformers`` adds it:
    only where the config asks for router logits (``output_router_logits``)."""
    jitter = getattr(c, "router_jitter_noise", None) or 0.0
    if jitter:
        raise ValueError(
            f"from_hf: {label} with router_jitter_noise={jitter!r} is not supported; colfunc's "
            "router adds no noise (set it to 0)"
        )
    only = list(getattr(c, "mlp_only_layers", None) or [])
    step = getattr(c, "decoder_sparse_step", None)
    step = 1 if step is None else step
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"from_hf: {label} decoder_sparse_step must be an int >= 1, got {step!r}")
    L = int(c.num_hidden_layers)
    dense = tuple(i for i in range(L) if i in only or (i + 1) % step)
    if len(dense) == L:
        raise ValueError(
            f"from_hf: {label} with no sparse layer (mlp_only_layers={only}, "
            f"decoder_sparse_step={step}, {L} layers) has no experts to run; load it as its "
            "dense family"
        )
    coef = float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0)
    shared = getattr(c, "shared_expert_intermediate_size", None) or None
    return dict(
        dense_layers=dense,
        n_experts=int(getattr(c, experts)),
        n_experts_per_tok=int(c.num_experts_per_tok),
        d_expert=int(getattr(c, "moe_intermediate_size", None) or c.intermediate_size),
        norm_topk_prob=bool(getattr(c, "norm_topk_prob", False))
        if norm_topk is None
        else norm_topk,
        d_shared_expert=shared,
        router_aux_loss_coef=coef if getattr(c, "output_router_logits", False) else 0.0,
    )


def write(cfg: Any, *, experts: str = "num_experts", moe_width: bool = True) -> dict[str, Any]:
    """The ``transformers`` config keyword arguments of the MoE fields (see :func:`read`)."""
    out: dict[str, Any] = {
        experts: cfg.n_experts,
        "num_experts_per_tok": cfg.n_experts_per_tok,
        "norm_topk_prob": cfg.norm_topk_prob,
        "router_aux_loss_coef": cfg.router_aux_loss_coef or 0.001,
        "output_router_logits": bool(cfg.router_aux_loss_coef),
    }
    if moe_width:
        out["moe_intermediate_size"] = cfg.d_expert
    else:
        out["intermediate_size"] = cfg.d_expert
    if cfg.d_shared_expert:
        out["shared_expert_intermediate_size"] = cfg.d_shared_expert
    if cfg.dense_layers:  # (the dense layers' MLPs are intermediate_size = d_ff wide)
        out.update(mlp_only_layers=list(cfg.dense_layers), decoder_sparse_step=1)
    return out


def plan(**kw: Any) -> Plan:
    """The 1D tensor-parallel plan: the decoder's for the attention, and Megatron's MLP inside
    each expert (``w_gate``/``w_up`` split on their width, ``w_down`` on its input; the router
    whole), and likewise the shared expert and the dense layers' MLP (``dense_layers``). The
    2D, 2.5D and 3D modes are not laid out."""
    given = decoder.plans(**kw)["1d"]
    base = dict(given.items())
    shared = {f"blocks.mlp.{s}{w}" for s in ("shared.", "") for w in ("w_gate", "w_up", "w_down")}
    entries = {
        **base,
        "blocks.mlp.experts.w_gate": P(None, None, None, "tp"),
        "blocks.mlp.experts.w_up": P(None, None, None, "tp"),
        "blocks.mlp.experts.w_down": P(None, None, "tp", None),
        "blocks.mlp.shared.w_gate": P(None, None, "tp"),
        "blocks.mlp.shared.w_up": P(None, None, "tp"),
        "blocks.mlp.shared.w_down": P(None, "tp", None),
    }
    return Plan(entries, optional=set(getattr(given, "optional", ())) | shared)
