"""Inference engines from files: a ``colfunc train`` run folder or a Hugging Face folder.

An edge of the house: it reads runs (:mod:`colfunc.train`), run configs and Hugging Face
folders (:mod:`colfunc.hf`), so that :class:`colfunc.inference.Engine` itself reads no file
and imports nothing above the transforms.

``load_run``/``load_hf`` return what ``Engine(**loaded)`` takes (read the files once, build an
engine per rank, as ``colfunc serve --tp`` does); ``from_run``/``from_hf`` build the engine.

Example:
    >>> engine = engines.from_run("runs/gpt_tiny-20260101-120000")
    >>> out = engine.generate(["def "], SamplingParams(temperature=0, max_tokens=32))
    >>> print(out[0].outputs[0].text)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from colfunc import config, hf, models, tasks, train
from colfunc.generate import check_params
from colfunc.inference import ByteTokenizer, Engine, load_hf_tokenizer

__all__ = ["add_loras", "from_hf", "from_run", "load_hf", "load_run", "parse_loras"]


def load_run(run: str | Path) -> dict[str, Any]:
    """What :func:`from_run` builds an engine from: the model module, config, parameters and
    tokenizer of a ``colfunc train`` run (its ``data.tokenizer`` folder's, else bytes). Parameters
    that do not fit the run's model config, or are not finite, are refused."""
    state, run_cfg = train.load_run(run)
    tasks.check_language_run(run_cfg, run, "serve")
    params = train.model_params(run_cfg, state.params)  # (a lora run's adapters, merged)
    check_params(run_cfg.model, params)
    out: dict[str, Any] = {
        "model": config.model_module(run_cfg.model),
        "cfg": run_cfg.model,
        "params": params,
        "tokenizer": ByteTokenizer(),
    }
    if run_cfg.data.tokenizer is not None:  # the tokenizer the run was trained with
        tok = load_hf_tokenizer(hf.folder_of(run_cfg.data.tokenizer, what="tokenizer"))
        if tok is None:
            raise ValueError(
                f"the run was trained with data.tokenizer={run_cfg.data.tokenizer!r}, which "
                "holds no tokenizer now"
            )
        out["tokenizer"] = tok
    return out


def load_hf(
    folder: str | Path, dtype: torch.dtype | None = None, model_impl: str = "auto"
) -> dict[str, Any]:
    """What :func:`from_hf` builds an engine from: the model module, config, parameters,
    tokenizer (None if the folder has none) and end-of-sequence id or ids (``generation_config.json``'s,
    else ``config.json``'s) of a Hugging Face folder. ``model_impl``: its native family or its
    own ``transformers`` module (:data:`colfunc.hf.MODEL_IMPLS`)."""
    import transformers

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"engines.from_hf: {str(folder)!r} has no config.json")
    cfg, params = hf.load(str(folder), dtype, model_impl)
    hf_cfg = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    eos = getattr(hf_cfg, "eos_token_id", None)
    if (folder / "generation_config.json").is_file():  # what transformers' generate stops at
        generation = transformers.GenerationConfig.from_pretrained(folder, local_files_only=True)
        eos = generation.eos_token_id if generation.eos_token_id is not None else eos
    return {
        "model": models.of_config(cfg).module,
        "cfg": cfg,
        "params": params,
        "tokenizer": load_hf_tokenizer(folder),
        "eos_token_id": eos,
    }


def from_run(run: str | Path, **kwargs: Any) -> Engine:
    """The engine of a ``colfunc train`` run folder (or its checkpoint folder); ``kwargs`` go to
    :class:`~colfunc.inference.Engine` (``max_num_seqs``, ``kv_memory``, ``mesh``, ...)."""
    return Engine(**{**load_run(run), **kwargs})


def from_hf(
    folder: str | Path,
    *,
    dtype: torch.dtype | None = None,
    model_impl: str = "auto",
    **kwargs: Any,
) -> Engine:
    """The engine of a Hugging Face model folder (``save_pretrained``: ``config.json`` and
    safetensors; a native family, else the model's own ``transformers`` module, or as
    ``model_impl`` says), with the folder's tokenizer when it has one. Local files only;
    ``kwargs`` go to :class:`~colfunc.inference.Engine`."""
    loaded = load_hf(folder, dtype, model_impl)
    given = {k: v for k, v in kwargs.items() if v is not None or k not in loaded}
    return Engine(**{**loaded, **given})


def speculative(ngram: int, model: str | Path | None, tokens: int | None, load: bool = True) -> Any:
    """What ``colfunc serve``'s speculative flags ask for: prompt lookup of ``ngram`` drafts a
    step (``--speculative-ngram``), a draft model's folder proposing ``tokens`` a step
    (``--speculative-model``, ``--num-speculative-tokens``), or None. With ``load=False`` the
    flags are checked and nothing is read (None)."""
    from colfunc.inference.draft_model import DraftModel
    from colfunc.inference.speculative import Ngram

    if ngram and model is not None:
        raise ValueError("give one of --speculative-ngram and --speculative-model, not both")
    if model is None:
        if tokens is not None:
            raise ValueError("--num-speculative-tokens goes with --speculative-model FOLDER")
        spec = Ngram(ngram) if ngram else None  # (a ValueError names a bad count)
        return spec if load else None
    if tokens is None:
        raise ValueError("--speculative-model needs --num-speculative-tokens K (drafts a step)")
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"--num-speculative-tokens must be >= 1, got {tokens}")
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"--speculative-model: {str(model)!r} has no config.json")
    if not load:
        return None
    cfg, params = hf.load(str(model))
    return DraftModel(models.of_config(cfg).module, cfg, params, tokens)


def parse_loras(items: list[str], tp: int = 1) -> dict[str, str]:
    """``colfunc serve --lora NAME=FOLDER`` arguments, as ``{name: folder}``."""
    loras: dict[str, str] = {}
    for item in items:
        name, eq, where = item.partition("=")
        if not eq or not name or not where or name in loras:
            raise ValueError(f"--lora must be NAME=FOLDER with a name of its own, got {item!r}")
        loras[name] = where
    if loras and tp != 1:
        raise ValueError("--lora with --tp is not supported; serve adapters with --tp 1")
    return loras


def add_loras(engine: Engine, loras: dict[str, str], base_name: str) -> None:
    """Load each peft adapter folder of ``loras`` into ``engine`` under its name."""
    for name, where in loras.items():
        if name == base_name:
            raise ValueError(f"--lora {name}=...: the base model is served as {name!r}")
        engine.add_lora(name, where)
