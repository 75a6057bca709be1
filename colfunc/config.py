"""Run configuration: Python config files of frozen dataclasses, overridable from the command line.

A config file is a Python module that defines four frozen dataclass instances:

``model``
    the model's own ``Config`` (``colfunc.models.gpt.Config.tiny()``, ``llama.Config(...)``, ...);
``optim``, ``data``, ``train``
    an :class:`OptimConfig`, a :class:`DataConfig` and a :class:`TrainConfig`;

and may define ``parallel = dict(...)``, the parallel layout, which training commands read, and
``lora = dict(rank=..., alpha=..., targets=[...], base_dtype=...)``, the keyword arguments of
:func:`colfunc.lora`: the run then trains low-rank adapters of a frozen base.

``--set section.field=value`` replaces any field, the text coerced by the field's annotation
(``int``, ``float``, ``bool``, ``str``, tuples written ``0.9,0.95``, ``None`` for optional fields).
Every mistake is a ValueError naming the field and the value.

Example:
    >>> cfg = load("examples/configs/gpt_tiny.py", ["train.steps=100", "optim.lr=1e-3"])
    >>> cfg.train.steps, cfg.model.d_model
    (100, 128)
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import math
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from colfunc import models
from colfunc.coerce import coerce as _coerce

__all__ = [
    "DataConfig",
    "OptimConfig",
    "RunConfig",
    "TrainConfig",
    "default",
    "from_dict",
    "load",
    "lora_config",
    "model_module",
    "override",
    "to_dict",
]

SECTIONS = ("model", "optim", "data", "train")


def _check_positive(owner: str, name: str, value: Any, *, allow_zero: bool = False) -> None:
    need = "an int >= 0" if allow_zero else "a positive int"
    if isinstance(value, bool) or not isinstance(value, int):  # the type before any comparison
        raise ValueError(f"{owner}.{name} must be {need}, got {value!r}")
    if not (value >= 0 if allow_zero else value > 0):
        raise ValueError(f"{owner}.{name} must be {need}, got {value!r}")


def _check_finite(owner: str, name: str, value: Any, *, low: float = 0.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner}.{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= low):
        raise ValueError(f"{owner}.{name} must be finite and >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimizer: AdamW, its learning rate warmed up linearly, then decayed on a cosine.

    The learning rate rises linearly from 0 to ``lr`` over ``warmup_steps`` (cut to the run's
    length when the run is shorter), then follows a cosine down to ``final_lr`` at the last step.
    ``clip_norm`` clips the gradients' global norm first (0 turns clipping off).
    """

    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    warmup_steps: int = 50
    final_lr: float = 0.0

    def __post_init__(self) -> None:
        for name in ("lr", "eps", "weight_decay", "clip_norm", "final_lr"):
            _check_finite("optim", name, getattr(self, name))
        if not (isinstance(self.betas, tuple) and len(self.betas) == 2):
            raise ValueError(f"optim.betas must be a pair (beta1, beta2), got {self.betas!r}")
        for beta in self.betas:
            if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
                raise ValueError(f"optim.betas must lie in [0, 1), got {self.betas!r}")
        _check_positive("optim", "warmup_steps", self.warmup_steps, allow_zero=True)
        if self.final_lr > self.lr:
            raise ValueError(
                f"optim.final_lr={self.final_lr!r} is above optim.lr={self.lr!r}; the learning rate "
                f"decays from lr to final_lr"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The corpus and the batches drawn from it.

    ``corpus`` is ``"stdlib"`` (the running Python's standard library sources), a text file or a
    folder; ``val_fraction`` of it is held out for validation (see :mod:`colfunc.data`). Batches
    are ``batch_size`` windows of ``seq_len`` bytes, a pure function of ``(seed, step)``.
    ``tokenizer``: None (bytes), or ``"hf:FOLDER"``, the tokenizer saved in a Hugging Face folder:
    the corpus is then cut into its tokens.
    """

    corpus: str = "stdlib"
    tokenizer: str | None = None
    val_fraction: float = 0.05
    batch_size: int = 16
    seq_len: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.corpus, str) or not self.corpus:
            raise ValueError(
                f"data.corpus must be 'stdlib' or a path to a text file or folder, got "
                f"{self.corpus!r}"
            )
        if isinstance(self.val_fraction, bool) or not (
            isinstance(self.val_fraction, (int, float)) and 0 < self.val_fraction < 1
        ):
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction!r}")
        _check_positive("data", "batch_size", self.batch_size)
        _check_positive("data", "seq_len", self.seq_len)
        _check_positive("data", "seed", self.seed, allow_zero=True)
        if self.tokenizer is not None and (
            not isinstance(self.tokenizer, str) or not self.tokenizer
        ):
            raise ValueError(
                f"data.tokenizer must be None (bytes) or 'hf:FOLDER', got {self.tokenizer!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The training loop: how long, how often to log and evaluate, where to write.

    A record goes to ``metrics.jsonl`` every ``log_every`` steps; the validation loss (mean over
    ``eval_batches`` fixed batches) is measured at step 0, every ``eval_every`` steps and at the
    end. The run is written to ``out_dir/name`` (an empty name means ``<config>-<date>-<time>``).
    At the end, ``sample_tokens`` bytes are sampled after ``sample_prompt`` (0 skips it).
    ``seed`` seeds the parameters' initialisation.

    Checkpoints: every ``save_every`` steps (0: only at the end and when stopped by a signal),
    keeping the newest ``keep_last`` (0: all). ``async_save`` copies the state to host memory
    and writes it in a background thread, so the step waits only for the copy.

    ``tensorboard``: every record also goes to TensorBoard event files beside ``metrics.jsonl``
    (``tensorboard --logdir runs/``; needs the ``tensorboard`` package).
    """

    steps: int = 300
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 8
    seed: int = 0
    name: str = ""
    out_dir: str = "runs"
    sample_prompt: str = "def "
    sample_tokens: int = 200
    save_every: int = 0
    keep_last: int = 3
    async_save: bool = False
    tensorboard: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "log_every", "eval_every", "eval_batches"):
            _check_positive("train", name, getattr(self, name))
        for name in ("seed", "sample_tokens", "save_every", "keep_last"):
            _check_positive("train", name, getattr(self, name), allow_zero=True)
        for name in ("async_save", "tensorboard"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"train.{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.name, str) or "/" in self.name or self.name in (".", ".."):
            raise ValueError(f"train.name must be a plain folder name, got {self.name!r}")
        if not isinstance(self.out_dir, str) or not self.out_dir:
            raise ValueError(f"train.out_dir must be a folder path, got {self.out_dir!r}")
        if self.sample_tokens and not self.sample_prompt:
            raise ValueError("train.sample_prompt must not be empty when train.sample_tokens > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A whole run: the four sections, checked against each other, and the parallel layout.

    ``parallel`` is the mesh and transforms a run asks for (``{}``: one device). ``init`` is
    where the parameters start: None (the model's own init from ``train.seed``) or
    ``"hf:FOLDER"``, a Hugging Face folder's weights (a config file's ``model = "hf:FOLDER"``
    sets both the model and this).
    """

    model: Any
    optim: OptimConfig
    data: DataConfig
    train: TrainConfig
    parallel: dict[str, Any] = dataclasses.field(default_factory=dict)
    init: str | None = None
    lora: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_sections()
        self._check_together()

    @classmethod
    def _unchecked(cls, **fields: Any) -> RunConfig:
        """A run whose sections are checked but not yet against each other: a config file's,
        before its ``--set`` overrides (which may be what makes it whole) are applied."""
        cfg = object.__new__(cls)
        for f in dataclasses.fields(cls):
            if f.name in fields:
                value = fields[f.name]
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                value = f.default
            object.__setattr__(cfg, f.name, value)
        cfg._check_sections()
        return cfg

    def _check_sections(self) -> None:
        model_module(self.model)  # the Config of a registered model family
        for name, kind in (("optim", OptimConfig), ("data", DataConfig), ("train", TrainConfig)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise ValueError(
                    f"{name} must be a colfunc.config.{kind.__name__}, got {type(value).__name__}"
                )
        if not isinstance(self.parallel, dict):
            raise ValueError(f"parallel must be a dict, got {type(self.parallel).__name__}")
        lora_config(self.lora)

    def _check_together(self) -> None:
        if not hasattr(self.model, "max_seq_len"):
            return  # not a language model (the DiT): its task checks its own data
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} is longer than the model's context "
                f"model.max_seq_len={self.model.max_seq_len}"
            )
        if self.data.tokenizer is None and self.model.vocab_size < 256:
            raise ValueError(
                f"model.vocab_size={self.model.vocab_size} is too small for the byte-level "
                f"tokenizer, which needs 256"
            )


def lora_config(section: Any) -> Any:
    """The :class:`colfunc.adapters.LoraConfig` of a ``lora`` section (None when empty)."""
    from colfunc.adapters import LoraConfig

    if not isinstance(section, dict):
        raise ValueError(f"lora must be a dict of cf.lora's arguments, got {section!r}")
    if not section:
        return None
    fields = [f.name for f in dataclasses.fields(LoraConfig)]
    unknown = sorted(set(section) - set(fields))
    if unknown:
        raise ValueError(f"lora: unknown key {unknown[0]!r}; the keys are {', '.join(fields)}")
    try:  # (lists from a file or JSON: LoraConfig makes them tuples)
        return LoraConfig(**section)
    except TypeError as e:
        raise ValueError(str(e)) from None


def model_module(model_cfg: Any) -> Any:
    """The module of a model config's registered family (``colfunc.models.gpt`` for a
    ``gpt.Config``)."""
    try:
        return models.of_config(model_cfg).module
    except TypeError as e:
        raise ValueError(f"model: {e}") from None


def default() -> RunConfig:
    """The built-in run of ``colfunc train``: the tiny GPT on the standard library's sources.

    ``examples/configs/gpt_tiny.py`` spells out the same run.
    """
    from colfunc.models import gpt

    return RunConfig(
        model=gpt.Config.tiny(),
        optim=OptimConfig(),
        data=DataConfig(),
        train=TrainConfig(),
    )


def _load_module(path: Path) -> types.ModuleType:
    if path.is_dir():
        hint = (
            f"; to continue that run use --resume {path}"
            if (path / "metrics.jsonl").is_file()
            else ""
        )
        raise ValueError(f"config file {str(path)!r} is a folder, not a Python file{hint}")
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    name = "colfunc_config_" + "".join(c if c.isalnum() else "_" for c in path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"config file {str(path)!r} is not a Python module (it needs .py)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a config file is user code: report where it failed, in one line
        raise ValueError(f"config file {str(path)!r} failed: {type(e).__name__}: {e}") from e
    return module


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The run defined by the config file at ``path`` (None: :func:`default`), with overrides.

    Each override is ``"section.field=value"``; see :func:`override`.
    """
    if path is None:
        cfg = default()
    else:
        module = _load_module(Path(path))
        missing = [s for s in SECTIONS if not hasattr(module, s)]
        if missing:
            raise ValueError(
                f"config file {str(path)!r} must define {', '.join(SECTIONS)}; missing "
                f"{', '.join(missing)}"
            )
        sections = {s: getattr(module, s) for s in SECTIONS}
        parallel = getattr(module, "parallel", None)
        lora = getattr(module, "lora", None) or {}
        init = None
        try:
            if isinstance(sections["model"], str):  # "hf:FOLDER": its config, its weights
                if not sections["model"].startswith("hf:"):
                    raise ValueError(
                        f"model must be a colfunc.models Config or 'hf:FOLDER', got "
                        f"{sections['model']!r}"
                    )
                from colfunc import hf

                init = sections["model"]
                sections["model"] = hf.read_config(init, getattr(module, "model_impl", "auto"))
            fields = dict(
                sections, parallel={} if parallel is None else parallel, init=init, lora=lora
            )
            # with overrides, the sections are checked against each other once they are applied
            cfg = RunConfig._unchecked(**fields) if overrides else RunConfig(**fields)
        except ValueError as e:
            raise ValueError(f"config file {str(path)!r}: {e}") from e
        if overrides:
            try:
                return dataclasses.replace(override(cfg, overrides))  # the checks, on the whole
            except ValueError as e:
                if str(e).startswith("--set"):  # (an override's own error says which)
                    raise
                shown = " ".join(f"--set {o}" for o in overrides)
                raise ValueError(f"config file {str(path)!r} with {shown}: {e}") from e
    return override(cfg, overrides)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _derived_fields(obj: Any) -> dict[str, None]:
    """The fields of ``obj`` that hold the value derived from a ``None`` default.

    Model configs resolve ``d_ff=None`` to ``4 * d_model`` (and the like) when built, so a plain
    ``dataclasses.replace(cfg, d_model=256)`` would keep the old width's ``d_ff``. Passing
    ``None`` again for such fields lets them follow the fields they derive from.
    """
    nullable = [f.name for f in dataclasses.fields(obj) if f.init and f.default is None]
    if not nullable:
        return {}
    probe = dataclasses.replace(obj, **dict.fromkeys(nullable))
    return {n: None for n in nullable if getattr(probe, n) == getattr(obj, n)}


# a parallel section's short forms, as the dict they stand for: pipeline=2 is
# dict(stages=2, ...), tensor=2 dict(size=2), zero=1 dict(stage=1), amp="bf16" dict(dtype="bf16")
_SHORT_FORMS = {"pipeline": "stages", "tensor": "size", "zero": "stage", "amp": "dtype"}


def _set_layout(layout: dict[str, Any], key: str, value: Any) -> None:
    """``layout[key] = value`` for ``--set parallel.KEY=VALUE``; a dotted ``KEY`` such as
    ``pipeline.stages`` sets one entry of that section's dict, made (or widened from its short
    form) as needed, so a resume can add a layout as a fresh config would."""
    head, dot, rest = key.partition(".")
    if not dot:
        layout[key] = value
        return
    current = layout.get(head)
    if current is None:
        current = {}
    elif not isinstance(current, dict):
        if head not in _SHORT_FORMS:
            raise ValueError(
                f"--set parallel.{key}: parallel[{head!r}] is {current!r}, not a dict to set "
                f"{rest!r} in"
            )
        current = {_SHORT_FORMS[head]: current}
    current = dict(current)
    _set_layout(current, rest, value)
    layout[head] = current


def override(cfg: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """``cfg`` with each ``"section.field=value"`` applied (all of a section's fields at once, so
    that fields which must change together, like ``n_head`` and ``d_model``, can)."""
    changes: dict[str, dict[str, Any]] = {}
    layout, lora = dict(cfg.parallel), dict(cfg.lora)
    for item in overrides:
        key, sep, text = item.partition("=")
        section, dot, field = key.strip().partition(".")
        if not sep or not dot or not field:
            raise ValueError(
                f"--set {item!r} must look like section.field=value (e.g. train.steps=100)"
            )
        if section == "parallel":  # a plain dict: any key, a Python literal (checked at launch)
            _set_layout(layout, field, _literal(text.strip()))
            continue
        if section == "lora":  # cf.lora's arguments, Python literals
            lora = {**lora, field: _literal(text.strip())}
            continue
        if section not in SECTIONS:
            raise ValueError(
                f"--set {item!r}: unknown section {section!r}; sections are "
                f"{', '.join(SECTIONS)}, parallel and lora"
            )
        current = getattr(cfg, section)
        types_ = _field_types(type(current))
        if field not in types_:
            raise ValueError(
                f"--set {item!r}: unknown field {section}.{field}; {section} has "
                f"{', '.join(types_)}"
            )
        changes.setdefault(section, {})[field] = _coerce(text, types_[field], key.strip())
    replaced = {}
    for section, fields in changes.items():
        current = getattr(cfg, section)
        try:
            replaced[section] = dataclasses.replace(
                current, **{**_derived_fields(current), **fields}
            )
        except ValueError as e:
            shown = ", ".join(f"{section}.{k}={v!r}" for k, v in fields.items())
            raise ValueError(f"--set {shown}: {e}") from e
    if layout != cfg.parallel:
        from colfunc import parallel  # the check, here so that a bad value fails at once

        if layout:
            try:
                parallel.parse(layout, cfg.model)
            except ValueError as e:
                raise ValueError(f"--set parallel: {e}") from e
        replaced["parallel"] = layout
    if lora != cfg.lora:
        try:
            lora_config(lora)
        except ValueError as e:
            raise ValueError(f"--set {e}") from e
        replaced["lora"] = lora
    return dataclasses.replace(cfg, **replaced) if replaced else cfg


def _literal(text: str) -> Any:
    """A ``--set parallel.key=value`` value: a Python literal (``2``, ``{"stage": 3}``), else
    the text itself (``full``)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """``cfg`` as plain JSON values; ``model`` gains ``"family"`` (``"gpt"``, ``"llama"``, ...)."""
    out: dict[str, Any] = {}
    for section in SECTIONS:
        value = getattr(cfg, section)
        if section == "model" and callable(getattr(value, "to_json", None)):
            out[section] = value.to_json()  # (a model config that says what it is itself)
            continue
        out[section] = {n: _jsonable(getattr(value, n)) for n in _field_types(type(value))}
    out["model"]["family"] = models.of_config(cfg.model).name
    out["parallel"] = cfg.parallel
    out["init"] = cfg.init
    out["lora"] = _jsonable(dict(cfg.lora))
    return out


def from_dict(d: dict[str, Any]) -> RunConfig:
    """The inverse of :func:`to_dict` (values are coerced by each field's annotation)."""
    if not isinstance(d, dict) or any(not isinstance(d.get(s), dict) for s in SECTIONS):
        raise ValueError(f"a run config needs the sections {', '.join(SECTIONS)}")
    model = dict(d["model"])
    family = model.pop("family", None)
    if family not in models.FAMILIES:
        raise ValueError(
            f"model.family={family!r} is not a registered model family; registered: "
            f"{sorted(models.FAMILIES)}"
        )
    classes = {
        "model": models.get(family).config,
        "optim": OptimConfig,
        "data": DataConfig,
        "train": TrainConfig,
    }
    sections = {}
    for section, cls in classes.items():
        fields = model if section == "model" else d[section]
        from_json = getattr(cls, "from_json", None)
        if section == "model" and callable(from_json):
            sections[section] = from_json(fields)
            continue
        types_ = _field_types(cls)
        unknown = set(fields) - set(types_)
        if unknown:
            raise ValueError(f"unknown fields in {section}: {', '.join(sorted(unknown))}")
        kwargs = {k: _coerce(v, types_[k], f"{section}.{k}") for k, v in fields.items()}
        sections[section] = cls(**kwargs)
    return RunConfig(
        **sections, parallel=d.get("parallel") or {}, init=d.get("init"), lora=d.get("lora") or {}
    )
