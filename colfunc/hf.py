"""Hugging Face weights in and out, for every registered model family with a Hugging Face side
(GPT-2, LLaMA and OPT built in; see :mod:`colfunc.models.family`).

``from_hf(model) -> (cfg, params)`` reads a ``transformers`` model, ``load(folder)`` and
``read_config(folder)`` a ``save_pretrained`` folder (local files only), ``load_abstract(folder)``
its parameters described and read from the safetensors files one at a time as they are made; ``to_hf(cfg, params)`` writes
the state dict that ``load_state_dict`` takes; ``hf_config(cfg)`` builds the matching
``transformers`` config. The mapping between the two layouts is a table per model: each entry
names a Hugging Face key, the colfunc paths concatenated (along the output dim) to make it, and
whether the weight is transposed (``nn.Linear`` stores ``[out, in]``, colfunc and GPT-2's
``Conv1D`` store ``[in, out]``); each family declares its own (``family.hf.weights``). The same table serves both directions, so ``to_hf`` also maps any
tree shaped like the params, such as gradients.

Only the weights and the config cross over: nothing here downloads or needs ``transformers``
except :func:`hf_config`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from colfunc import models, nn, tree
from colfunc.models import HFMapping, HFWeight, hf_module
from colfunc.random import materialize

__all__ = [
    "MODEL_IMPLS",
    "byte_tokenizer",
    "describe",
    "folder_of",
    "from_hf",
    "hf_config",
    "impl_of",
    "load",
    "load_abstract",
    "load_adapter",
    "read_config",
    "save",
    "to_hf",
]

Config = Any  # the Config of a registered model family with a Hugging Face side
Params = dict[str, Any]
# how a Hugging Face model runs: its native family where colfunc has one, else its own
# transformers module (colfunc.models.hf_module); or either, forced
MODEL_IMPLS = ("auto", "native", "hf")


def _adapted(cfg: Any) -> bool:
    return isinstance(cfg, hf_module.Config)


def impl_of(cfg: Any) -> str:
    """The ``model_impl`` that reads a folder into ``cfg`` again: ``"hf"`` or ``"native"``."""
    return "hf" if _adapted(cfg) else "native"


def describe(cfg: Any) -> str:
    """One line saying how the model of ``cfg`` runs: its native family, or its own
    ``transformers`` module."""
    if _adapted(cfg):
        return f"model: {cfg.architecture} through its transformers module ({cfg.n_layer} layers)"
    family = models.of_config(cfg)
    return f"model: the native {family.name} family ({cfg.n_layer} layers)"


def _mapping(cfg: Any) -> tuple[Any, HFMapping]:
    """``(model module, Hugging Face side)`` of the registered family of ``cfg``."""
    family = models.of_config(cfg)
    if family.hf is None:
        with_hf = sorted(f.name for f in models.FAMILIES.values() if f.hf is not None)
        raise ValueError(
            f"the {family.name!r} model family has no Hugging Face counterpart; Hugging Face "
            f"weights and configs exist for {with_hf}"
        )
    return family.module, family.hf


def _table(cfg: Any) -> tuple[Any, list[HFWeight], list[HFWeight]]:
    """``(model module, top-level entries, per-layer entries)`` for a colfunc config."""
    if _adapted(cfg):
        return (hf_module, *hf_module.weights(cfg))
    module, mapping = _mapping(cfg)
    return (module, *mapping.weights(cfg))


def _copy(x: torch.Tensor) -> torch.Tensor:
    # always a fresh contiguous tensor: the result never aliases its source
    return x.clone(memory_format=torch.contiguous_format)


def _home(path: str, x: torch.Tensor) -> torch.Tensor:
    """A fresh copy of the weight at ``path``; the vocabulary head (``[D, V]``) column-major, as
    ``nn.Linear`` stores it, so that its weight gradient, ``(g^T x)^T``, is written along rows of
    ``V``: on a 20M LLaMA (vocabulary 32000) the training step takes 0.97x the time it takes with
    the head row-major (against ``transformers``: 1.023 rather than 1.054, median of 8 steps)."""
    if path == "head.weight" and x.dim() == 2:
        return x.t().clone(memory_format=torch.contiguous_format).t()
    return _copy(x)


def _read_hf_config(
    hf_cfg: Any, names: list[str], source: str | None = None, model_impl: str = "auto"
) -> Any:
    """The colfunc config of a ``transformers`` config: by the native family that reads it
    (found by the class ``names``, else the config's ``model_type``), or where none does (or
    ``model_impl="hf"``) the model's own module's (``source`` names the folder)."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
    where = f"{source!r}: " if source else ""
    if model_impl != "hf":
        try:
            family = models.of_hf(names, getattr(hf_cfg, "model_type", None))
        except ValueError as e:
            if model_impl == "native":
                raise ValueError(f"{where}{e} (model_impl='hf' runs its own module)") from None
        else:
            assert family.hf is not None  # of_hf finds only families with a Hugging Face side
            return family.hf.read_config(hf_cfg)
    try:
        return hf_module.config_of(hf_cfg)
    except ValueError as e:
        raise ValueError(f"{where}{e}") from None


def from_hf(hf_model: Any, model_impl: str = "auto") -> tuple[Config, Params]:
    """``(cfg, params)`` from a ``transformers`` causal LM: of a registered family
    (GPT2LMHeadModel, LlamaForCausalLM, ... built in), else run through its own module
    (:mod:`colfunc.models.hf_module`; ``model_impl`` forces either, see :data:`MODEL_IMPLS`).

    The params are fresh tensors in the model's dtype (never views of its weights). Options
    the colfunc model does not compute (OPT's ``project_in``, LLaMA's scaled rope, ...) raise
    ValueError.

    Example:
        >>> cfg, params = from_hf(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2)))
    """
    import transformers

    name = type(hf_model).__name__
    known = [a for f in models.FAMILIES.values() if f.hf is not None for a in f.hf.architectures]
    causal = type(hf_model) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING.values()
    if name not in known and (model_impl == "native" or not causal):
        raise ValueError(
            f"from_hf: no native family reads {name} (native: {sorted(known)}); load the "
            "causal-LM class (e.g. AutoModelForCausalLM), register a family for it "
            "(colfunc.models.register), or model_impl='hf' runs its own module"
        )
    cfg = _read_hf_config(hf_model.config, [name] if name in known else [], model_impl=model_impl)
    if _adapted(cfg):
        return cfg, _from_state_dict(cfg, hf_model.state_dict())
    return cfg, _from_state_dict(cfg, _saved_form(hf_model))


def _saved_form(hf_model: Any) -> dict[str, torch.Tensor]:
    """The model's state dict, and under the names ``save_pretrained`` writes where they differ
    (``transformers`` 5 keeps some weights fused in memory, a mixture's experts as one tensor,
    and writes them one per expert): the names the families' weight tables use."""
    state = hf_model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # (transformers 4: the names are the files')
        return dict(state)
    # both names where they differ: a table may use either (GPT-NeoX's head is the module's)
    return {**revert_weight_conversion(hf_model, dict(state)), **state}


def _from_state_dict(cfg: Any, state: dict[str, torch.Tensor]) -> Params:
    module, top, layer = _table(cfg)
    shapes: dict[str, tuple[int, ...]] = module.param_shapes(cfg)

    def pieces(key: str, entry: HFWeight) -> tuple[torch.Tensor, ...]:
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
        return entry.split(x, sizes)

    flat: dict[str, torch.Tensor] = {}
    for e in top:
        if all(p in flat for p in e.paths):  # a tied alias of a weight already read
            continue
        for p, x in zip(e.paths, pieces(e.key, e)):
            flat[p] = _home(p, x)

    def piece(e: HFWeight, k: int) -> Callable[[str], torch.Tensor]:  # (entry e's k-th path)
        return lambda key: pieces(key, e)[k]

    for e in layer:
        for k, p in enumerate(e.paths):
            flat[p] = _stacked(e, shapes[p], cfg.n_layer, piece(e, k))
    for p, shape in shapes.items():
        if tuple(flat[p].shape) != shape:
            raise ValueError(f"from_hf: {p} has shape {tuple(flat[p].shape)}, expected {shape}")
    return nn.nest({p: flat[p] for p in shapes})


def _stacked(
    e: HFWeight, shape: tuple[int, ...], n: int, piece: Callable[[str], torch.Tensor]
) -> torch.Tensor:
    """The stacked parameter ``[n, ...]`` (``shape``) that the per-layer entry ``e`` makes, its
    piece of the tensor under each key being ``piece(key)``; one tensor per expert stacked after
    the layer dim; zeros in the layers the entry does not exist in."""

    def one(i: int) -> torch.Tensor:
        if "{j}" in e.key:
            return torch.stack([piece(e.key.format(i=i, j=j)) for j in range(shape[1])])
        return piece(e.key.format(i=i))

    held = {i: one(i) for i in range(n) if e.at(i)}
    like = next(iter(held.values()))
    return torch.stack([held[i] if i in held else torch.zeros_like(like) for i in range(n)])


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

    def value(xs: list[torch.Tensor], e: HFWeight) -> torch.Tensor:
        x = e.join(xs)
        return _copy(x.detach().t() if e.transpose else x.detach())

    out = {e.key: value([flat[p] for p in e.paths], e) for e in top}
    for i in range(cfg.n_layer):
        for e in layer:
            if not e.at(i):  # (its slice is zeros nothing reads)
                continue
            if "{j}" in e.key:  # one tensor per expert
                for j in range(shapes[e.paths[0]][1]):
                    out[e.key.format(i=i, j=j)] = value([flat[p][i][j] for p in e.paths], e)
            else:
                out[e.key.format(i=i)] = value([flat[p][i] for p in e.paths], e)
    return out


def hf_config(cfg: Config, **overrides: Any) -> Any:
    """The ``transformers`` config of the model that :func:`to_hf`'s state dict loads into.

    ``overrides`` go to the config constructor (e.g. ``attn_implementation="eager"``).

    Example:
        >>> model = transformers.GPT2LMHeadModel(hf_config(cfg))
        >>> model.load_state_dict(to_hf(cfg, params))
    """
    import copy

    import transformers  # only here: the rest of this module needs no transformers

    if _adapted(cfg):
        out = copy.deepcopy(cfg.hf)
        for k, v in overrides.items():
            setattr(out, k, v)
        return out
    _, mapping = _mapping(cfg)
    kw = mapping.write_config(cfg)
    given = kw | overrides
    out = transformers.AutoConfig.for_model(mapping.model_type, **given)
    vocab = getattr(out, "vocab_size", None)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        # a class default past this vocabulary (a small model of a family whose tokenizer is
        # large) names no token: none, unless given
        value = getattr(out, name, None)
        if name not in given and isinstance(value, int) and vocab and value >= vocab:
            setattr(out, name, None)
    return out


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


def read_config(source: str, model_impl: str = "auto") -> Config:
    """The colfunc config of a Hugging Face folder's ``config.json``: its native family's, or
    where colfunc has none its own module's (``model_impl``: see :data:`MODEL_IMPLS`)."""
    import transformers

    hf_cfg = transformers.AutoConfig.from_pretrained(folder_of(source), local_files_only=True)
    names = list(getattr(hf_cfg, "architectures", None) or [])
    return _read_hf_config(hf_cfg, names, source, model_impl)


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


def load_abstract(source: str, model_impl: str = "auto") -> tuple[Config, Params]:
    """``(cfg, params)`` of a Hugging Face folder whose parameters are described, not made: each
    is a :class:`colfunc.random.Abstract` that reads its tensors from the safetensors files when
    it is made (one parameter at a time, as :meth:`colfunc.Step.init` makes them, so that a rank
    keeping only its shards never holds the whole model). Made, each equals :func:`load`'s."""
    return _described(source, read_config(source, model_impl))


def _described(source: str, cfg: Config) -> tuple[Config, Params]:
    """:func:`load_abstract` of the folder whose config ``cfg`` has already been read."""
    import safetensors

    from colfunc.random import abstract

    folder = folder_of(source)
    module, top, layer = _table(cfg)
    shapes: dict[str, tuple[int, ...]] = module.param_shapes(cfg)
    where = _safetensors_keys(folder)

    def read(key: str) -> torch.Tensor:
        if key not in where:
            raise ValueError(f"{source!r}: the weights have no {key!r}")
        with safetensors.safe_open(str(where[key]), framework="pt") as f:
            return f.get_tensor(key)

    def piece(entry: HFWeight, key: str, j: int) -> torch.Tensor:
        x = read(key)
        x = x.t() if entry.transpose else x
        sizes = [shapes[p][-1] for p in entry.paths]
        return entry.split(x, sizes)[j]

    made: dict[str, Any] = {}
    for e in top:
        for j, p in enumerate(e.paths):
            if p in made:  # a tied alias of a weight already described
                continue
            key = next((k for k in (e.key, *e.aliases) if k in where), None)
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
                return _home(path, piece(e, key, j))
            return _stacked(e, shapes[path], n, lambda k: piece(e, k, j))

        i = 0 if n is None else next(i for i in range(n) if e.at(i))
        first = key if n is None else key.format(i=i, j=0) if "{j}" in key else key.format(i=i)
        return abstract(shapes[path], make, dtype_of(first))

    return cfg, nn.nest({p: describe(p) for p in shapes})


def load(
    source: str, dtype: torch.dtype | None = None, model_impl: str = "auto"
) -> tuple[Config, Params]:
    """``(cfg, params)`` of a Hugging Face ``save_pretrained`` folder (local files only).

    The config is read and checked first (what the family does not compute is refused by
    name); safetensors weights are then read tensor by tensor (:func:`load_abstract`, made), in
    ``dtype`` (None: the config's ``dtype``, else as stored), without building the
    ``transformers`` model. A folder of ``pytorch_model.bin`` weights loads through
    ``transformers``."""
    import transformers

    folder = folder_of(source)
    cfg = read_config(source, model_impl)
    has_safetensors = (folder / "model.safetensors").is_file() or (
        folder / "model.safetensors.index.json"
    ).is_file()
    if not has_safetensors:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, dtype=dtype
        )
        return from_hf(hf_model, model_impl)
    if dtype is None:
        import json

        stated = json.loads((folder / "config.json").read_text())
        name = stated.get("dtype") or stated.get("torch_dtype")
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None
    _, described = _described(source, cfg)
    made = materialize(described)
    return cfg, made if dtype is None else tree.map(lambda x: x.to(dtype), made)


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

    ``tokenizer`` may also be ``"bytes"``: colfunc's byte-level tokenizer (:func:`byte_tokenizer`).
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
    fused = not set(state) <= set(model.state_dict(keep_vars=True))
    if fused:  # the files' names are not the module's (a mixture's experts): written as they are
        folder.mkdir(parents=True, exist_ok=True)
        _write_saved(folder, model, state, dtype)
    else:  # tied keys (the head shares the embedding) are skipped by save_pretrained
        model.load_state_dict(state, assign=True)
        model.tie_weights()
        if dtype is not None:
            model = model.to(dtype)
    tok = None
    if tokenizer == "bytes":
        tok = byte_tokenizer()
    elif tokenizer is not None:
        tok = transformers.AutoTokenizer.from_pretrained(
            folder_of(tokenizer, "tokenizer"), local_files_only=True
        )
    if not fused:
        model.save_pretrained(folder, safe_serialization=True)
    if tok is not None:
        tok.save_pretrained(folder)
    # the files readable as the umask says, as any other file (save_pretrained's are 0600)
    mode = 0o666 & ~_umask()
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(mode)
    return folder


def _write_saved(folder: Path, model: Any, state: dict[str, torch.Tensor], dtype: Any) -> None:
    """``config.json``, ``generation_config.json`` and ``model.safetensors`` of a state dict
    already under the names ``save_pretrained`` writes."""
    import safetensors.torch

    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    tensors = {k: (v if dtype is None else v.to(dtype)).contiguous() for k, v in state.items()}
    safetensors.torch.save_file(tensors, str(folder / "model.safetensors"), {"format": "pt"})


def load_adapter(source: str | Path, cfg: Config) -> tuple[Any, Params]:
    """``(lora_config, adapters)`` of a peft LoRA adapter folder for a model of config ``cfg``;
    see :func:`colfunc.adapters.load_adapter`."""
    from colfunc.adapters.peft import load_adapter as load_peft

    return load_peft(source, cfg)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def byte_tokenizer() -> Any:
    """colfunc's byte-level tokenizer (token id = UTF-8 byte value, no special tokens) as a
    ``transformers`` fast tokenizer, for a folder that ``AutoTokenizer`` and the server load:
    each byte is one token, under GPT-2's byte-to-character alphabet, and decodes back."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # 256 characters, one per byte
    byte_of = {c: b for b, c in _gpt2_bytes().items()}
    vocab = {c: byte_of[c] for c in alphabet}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def _gpt2_bytes() -> dict[int, str]:
    """GPT-2's map of bytes to printable characters (what ``ByteLevel`` pre-tokenizes into)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out
