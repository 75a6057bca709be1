"""peft's LoRA adapter folders in and out (``adapter_config.json`` and
``adapter_model.safetensors``), for every registered model family with a Hugging Face side.

A colfunc adapter of a weight maps to the LoRA layer of the ``transformers`` module that holds
it, through the family's weight table (as :mod:`colfunc.hf` reads weights): ``lora_A.weight [r, in]`` is ``a``
transposed and ``lora_B.weight [out, r]`` is ``b`` transposed. A module that fuses several colfunc
weights (GPT-2's ``c_attn`` holds ``wq``, ``wk`` and ``wv``) has one ``lora_A``, so those weights
must share one ``a`` (``cf.lora(..., shared=[...])``; :func:`fused_groups` names them), and its
``lora_B`` is their ``b`` concatenated as the weights are (DoRA's ``lora_magnitude_vector``
likewise).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from colfunc import models, nn, tree
from colfunc.adapters.lora import LoraConfig, adapter_paths, base_of, is_adapter, magnitude_path
from colfunc.models import HFWeight

__all__ = ["adapter_config", "fused_groups", "load_adapter", "save_adapter", "to_peft"]

PREFIX = "base_model.model."
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def _entries(cfg: Any) -> list[tuple[HFWeight, bool]]:
    """The family's weight table for ``cfg``: ``(entry, per_layer)``, linear maps only."""
    top, layer = _hf_side(cfg).weights(cfg)
    entries = [(e, False) for e in top] + [(e, True) for e in layer]
    return [(e, per_layer) for e, per_layer in entries if e.key.endswith(".weight")]


def _hf_side(cfg: Any) -> Any:
    """The Hugging Face side of the registered family of ``cfg``."""
    family = models.of_config(cfg)
    if family.hf is None:
        raise ValueError(f"peft: the {family.name!r} model family has no Hugging Face counterpart")
    return family.hf


def _module(entry: HFWeight) -> str:
    if not entry.key.endswith(".weight"):
        raise ValueError(f"peft: {entry.key} is not a module's weight")
    return entry.key[: -len(".weight")]


def fused_groups(cfg: Any) -> tuple[tuple[str, ...], ...]:
    """The groups of colfunc weights that one Hugging Face module holds (GPT-2's ``c_attn``:
    ``wq, wk, wv``): pass them as ``cf.lora(..., shared=...)`` to keep an adapter exportable."""
    return tuple(e.paths for e, _ in _entries(cfg) if len(e.paths) > 1)


def _owner(cfg: Any, weight: str) -> tuple[HFWeight, bool]:
    for e, per_layer in _entries(cfg):
        if weight in e.paths and (not per_layer or weight.startswith("blocks.")):
            return e, per_layer
    raise ValueError(f"peft: the {type(cfg).__module__} weight table has no entry for {weight}")


def _check_exportable(cfg: Any, config: LoraConfig, weights: list[str]) -> list[HFWeight]:
    """The table entries the adapted ``weights`` make up, each adapted whole with one ``a``."""
    entries: dict[str, HFWeight] = {}
    for w in weights:
        e, _ = _owner(cfg, w)
        if w == "embed.tokens":
            raise ValueError("peft: an adapter of the embedding table has no LoRA layer here")
        entries[e.key] = e
    for e in entries.values():
        missing = [p for p in e.paths if p not in weights]
        leaders = {config.leader(p) for p in e.paths}
        if missing or len(leaders) != 1:
            raise ValueError(
                f"peft: {_module(e)} holds {list(e.paths)} in one module with one lora_A; adapt "
                f"them together with one shared a: cf.lora(..., shared=[{tuple(e.paths)!r}])"
            )
    return list(entries.values())


def _suffix(entry: HFWeight, per_layer: bool) -> str:
    """The module name peft matches (its path below the layer, or the whole name)."""
    name = _module(entry)
    return name.split("{i}.", 1)[1] if per_layer else name


def to_peft(cfg: Any, params: Any, config: LoraConfig) -> dict[str, torch.Tensor]:
    """peft's adapter state dict (``base_model.model.<module>.lora_A.weight``, ...) of the
    adapters in ``params`` (full tensors: ``cf.full_state(state).params``)."""
    flat = dict(tree.flatten_with_paths(params)[0])
    weights = sorted({base_of(p) for p in flat if is_adapter(p)})
    if not weights:
        raise ValueError("peft: params hold no adapters (train with cf.lora)")
    out: dict[str, torch.Tensor] = {}
    for e in _check_exportable(cfg, config, weights):
        _, per_layer = _owner(cfg, e.paths[0])
        a = flat[adapter_paths(config.leader(e.paths[0]))[0]]
        bs = [flat[adapter_paths(p)[1]] for p in e.paths]
        layers = range(cfg.n_layer) if per_layer else [None]
        for i in layers:
            name = PREFIX + _module(e).format(i=i)
            ai = a if i is None else a[i]
            bi = e.join([b if i is None else b[i] for b in bs])
            out[name + ".lora_A.weight"] = ai.detach().t().contiguous().clone()
            out[name + ".lora_B.weight"] = bi.detach().t().contiguous().clone()
            if config.dora:  # DoRA's magnitudes, one per output, joined as the weights are
                ms = [flat[magnitude_path(p)] for p in e.paths]
                mi = e.join([(m if i is None else m[i]).unsqueeze(0) for m in ms])[0]
                out[name + ".lora_magnitude_vector"] = mi.detach().contiguous().clone()
    return out


def adapter_config(
    cfg: Any, params: Any, config: LoraConfig, base: str | None = None
) -> dict[str, Any]:
    """peft's ``adapter_config.json`` for the adapters in ``params``."""
    flat = tree.paths(params)
    weights = sorted({base_of(p) for p in flat if is_adapter(p)})
    targets = sorted(
        {_suffix(e, _owner(cfg, e.paths[0])[1]) for e in _check_exportable(cfg, config, weights)}
    )
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "use_rslora": config.rslora,
        "use_dora": config.dora,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": models.of_config(cfg).name == "gpt",
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


def save_adapter(
    folder: str | Path, cfg: Any, params: Any, config: LoraConfig, *, base: str | None = None
) -> Path:
    """Write a peft adapter folder that ``peft.PeftModel.from_pretrained(model, folder)`` loads.
    ``folder`` must not exist, or be empty."""
    import safetensors.torch

    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(
            f"{str(folder)!r} exists and is not an empty folder; refusing to overwrite it"
        )
    state = to_peft(cfg, params, config)
    meta = adapter_config(cfg, params, config, base)
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(state, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def _refuse(folder: Path, meta: dict[str, Any]) -> None:
    checks = [
        (
            meta.get("peft_type", "LORA") != "LORA",
            f"peft_type={meta.get('peft_type')!r} (LoRA only)",
        ),
        (meta.get("bias", "none") != "none", f"bias={meta.get('bias')!r} (only 'none')"),
        (bool(meta.get("rank_pattern")), "a rank_pattern (one rank for every module only)"),
        (bool(meta.get("alpha_pattern")), "an alpha_pattern (one alpha for every module only)"),
        (meta.get("layers_to_transform") is not None, "layers_to_transform (every layer only)"),
        (bool(meta.get("modules_to_save")), "modules_to_save (trained copies of whole modules)"),
    ]
    for bad, what in checks:
        if bad:
            raise ValueError(
                f"load_adapter: {str(folder)!r} has {what}, which colfunc does not read"
            )


def load_adapter(source: str | Path, cfg: Any) -> tuple[LoraConfig, dict[str, Any]]:
    """``(config, adapters)`` of a peft LoRA adapter folder for a model of config ``cfg``:
    ``adapters`` holds the adapter leaves only (``blocks.attn.lora.wq.a``, ...), to combine
    with the base's parameters (:func:`colfunc.adapters.combine`) and train further with
    ``cf.lora(step, **config.kwargs())`` or serve."""
    import safetensors

    folder = Path(str(source).removeprefix("hf:")).expanduser()
    if not (folder / CONFIG).is_file():
        raise ValueError(f"{str(source)!r} is not a peft adapter folder: it has no {CONFIG}")
    if not (folder / WEIGHTS).is_file():
        raise ValueError(
            f"{str(source)!r} has no {WEIGHTS} (colfunc reads safetensors adapters; save with "
            "safe_serialization=True)"
        )
    meta = json.loads((folder / CONFIG).read_text())
    _refuse(folder, meta)
    with safetensors.safe_open(str(folder / WEIGHTS), framework="pt") as f:
        names = f.keys()
        state = {k: f.get_tensor(k) for k in names}
    # peft keeps the adapter's name in memory only; a saved key has none (strip one if there)
    state = {
        k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
        for k, v in state.items()
    }
    rank = int(meta["r"])
    flat: dict[str, torch.Tensor] = {}
    shared: list[tuple[str, ...]] = []
    used: set[str] = set()
    shapes = models.of_config(cfg).module.param_shapes(cfg)
    for e, per_layer in _entries(cfg):
        name = PREFIX + _module(e)
        keys = [name.format(i=i) for i in range(cfg.n_layer)] if per_layer else [name]
        have = [k for k in keys if k + ".lora_A.weight" in state]
        if not have:
            continue
        if len(have) != len(keys):
            raise ValueError(
                f"load_adapter: {str(folder)!r} adapts {_module(e)} in some layers only; colfunc "
                "adapts every layer"
            )
        a_s, b_s, m_s = [], [], []
        for k in keys:
            a, b = state[k + ".lora_A.weight"], state[k + ".lora_B.weight"]
            used.update((k + ".lora_A.weight", k + ".lora_B.weight"))
            sizes = [shapes[p][-1] for p in e.paths]
            if a.shape[0] != rank or b.shape[1] != rank or b.shape[0] != sum(sizes):
                raise ValueError(
                    f"load_adapter: {k} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; "
                    f"expected rank {rank} and {sum(sizes)} outputs"
                )
            a_s.append(a.t())
            b_s.append(e.split(b.t(), [s for s in sizes]))
            if meta.get("use_dora"):
                mag = state.get(k + ".lora_magnitude_vector")
                if mag is None or tuple(mag.shape) != (sum(sizes),):
                    raise ValueError(f"load_adapter: {k} has no DoRA magnitude of {sum(sizes)}")
                used.add(k + ".lora_magnitude_vector")
                m_s.append([x[0] for x in e.split(mag.unsqueeze(0), sizes)])
        lead = e.paths[0]
        flat[adapter_paths(lead)[0]] = torch.stack(a_s) if per_layer else a_s[0]
        for j, p in enumerate(e.paths):
            col = [bs[j] for bs in b_s]
            flat[adapter_paths(p)[1]] = (torch.stack(col) if per_layer else col[0]).contiguous()
            if m_s:
                mc = [ms[j] for ms in m_s]
                flat[magnitude_path(p)] = (torch.stack(mc) if per_layer else mc[0]).contiguous()
        if len(e.paths) > 1:
            shared.append(tuple(e.paths))
    # peft saves the frozen base weight of an adapted head or embedding beside its adapter
    # (save_embedding_layers): a copy of the base's, not trained, read from the base instead
    unknown = sorted(k for k in set(state) - used if not k.endswith(".base_layer.weight"))
    if unknown:
        raise ValueError(
            f"load_adapter: {str(folder)!r} has {unknown[0]}, which no weight of the "
            f"{models.of_config(cfg).name} model maps to"
        )
    if not flat:
        raise ValueError(f"load_adapter: {str(folder)!r} holds no LoRA weights")
    weights = sorted({base_of(p) for p in flat})
    config = LoraConfig(
        rank=rank,
        alpha=float(meta.get("lora_alpha", 8)),
        targets=tuple(weights),
        dropout=float(meta.get("lora_dropout", 0.0)),
        rslora=bool(meta.get("use_rslora", False)),
        shared=tuple(shared),
        dora=bool(meta.get("use_dora", False)),
    )
    return config, nn.nest({p: x.contiguous() for p, x in flat.items()})
