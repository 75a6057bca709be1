"""Cutting a ``transformers`` causal LM into ``pre``, layers and ``post``: its config read
(:func:`config_of`), the model built on the meta device, the stand-ins that record what its
layers are called with, and the attention function registered with ``transformers``' attention
interface. See :mod:`colfunc.models.hf_module`, which makes the model a pure function of it."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from colfunc import nn, ops, tree

__all__ = ["ATTENTION", "PAGED", "Config", "Stop", "config_of", "runtime", "split_kwargs"]

Params = dict[str, Any]

ATTENTION = "colfunc"
# keyword arguments of the attention call that change nothing colfunc computes
_BENIGN = {
    "position_ids",
    "use_cache",
    "output_attentions",
    "output_router_logits",
    "cache_position",
}


@dataclasses.dataclass(frozen=True, eq=False)
class Config:
    """What colfunc knows of a ``transformers`` causal LM (made by :func:`config_of`).

    ``hf``: its ``transformers`` config; ``architecture``: the model class's name; ``layers``:
    the dotted path of its decoder layers; ``top``/``block``: the parameters outside the layers
    and of one layer, with their shapes; ``tied``: ``(alias, name)`` pairs of tied parameters
    (the alias is not a parameter here); ``kwargs``: per layer, the index of the set of keyword
    arguments it is called with (layers of one kind share the rotary tables, say) and each
    set's non-tensor ones; ``returns_tuple``: whether a layer returns ``(hidden, ...)``;
    ``template``: the model, its parameters on the meta device and its buffers made (each
    thread runs a copy of it).
    """

    hf: Any
    architecture: str
    layers: str
    top: tuple[tuple[str, tuple[int, ...]], ...]
    block: tuple[tuple[str, tuple[int, ...]], ...]
    tied: tuple[tuple[str, str], ...]
    kw_of_layer: tuple[int, ...]
    statics: tuple[dict[str, Any], ...]
    returns_tuple: bool
    template: Any = dataclasses.field(default=None, repr=False)  # the model: meta parameters

    @property
    def n_layer(self) -> int:
        return len(self.kw_of_layer)

    @property
    def vocab_size(self) -> int:
        return int(self.hf.vocab_size)

    @property
    def d_model(self) -> int:
        return int(self.hf.hidden_size)

    @property
    def max_seq_len(self) -> int:
        return int(getattr(self.hf, "max_position_embeddings", None) or 2**31 - 1)

    @property
    def n_head(self) -> int:
        return int(self.hf.num_attention_heads)

    @property
    def n_kv_heads(self) -> int:
        return int(getattr(self.hf, "num_key_value_heads", None) or self.n_head)

    @property
    def head_dim(self) -> int:
        return int(getattr(self.hf, "head_dim", None) or self.d_model // self.n_head)

    def __repr__(self) -> str:
        return f"hf_module.Config({self.architecture}, {self.n_layer} layers)"

    def to_json(self) -> dict[str, Any]:
        """The ``transformers`` config as JSON values (what a run's config file holds)."""
        import json

        return {"hf": json.loads(self.hf.to_json_string(use_diff=False))}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Config:
        """The inverse of :meth:`to_json`: the config read again by :func:`config_of`."""
        import transformers

        if not isinstance(d, dict) or not isinstance(d.get("hf"), dict):
            raise ValueError(f"a transformers model config needs its 'hf' dict, got {d!r}")
        fields = dict(d["hf"])
        model_type = fields.pop("model_type", None)
        if not isinstance(model_type, str):
            raise ValueError(f"model.hf has no model_type: {sorted(fields)}")
        return config_of(transformers.AutoConfig.for_model(model_type, **fields))


# --- the attention function transformers calls --------------------------------------------------


class _Paged(threading.local):
    """The engine's paged batch for the layer running on this thread (None: training), and
    the count of attention calls while :func:`config_of` probes a layer (None otherwise)."""

    paged: nn.Paged | None = None
    new_kv: dict[str, torch.Tensor] | None = None
    probed: int | None = None  # while config_of probes a layer: how often attention ran


PAGED = _Paged()


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers``' attention interface: ``q[B,H,T,D]``, ``k, v[B,K,S,D]`` (rotated) to
    ``[B,T,H,D]``, by :func:`colfunc.ops.attention` (or the paged cache in the engine)."""
    if PAGED.probed is not None:  # config_of's probe, on meta tensors: counted, not computed
        PAGED.probed += 1
        return query.transpose(1, 2).contiguous(), None
    name = type(module).__name__
    if attention_mask is not None:
        raise ValueError(
            f"{name}: colfunc's attention is causal over whole sequences and takes no attention "
            "mask; pack sequences without padding (labels -100 where a token is not learned)"
        )
    if dropout:
        raise ValueError(
            f"{name}: attention dropout {dropout} while training; colfunc's attention has none "
            "(set the config's attention dropout to 0)"
        )
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{name}: attention that is not causal is not computed by colfunc")
    odd = sorted(k for k, v in kwargs.items() if v is not None and k not in _BENIGN)
    if odd:
        raise ValueError(
            f"{name}: the model's attention takes {odd}, which colfunc's attention does not "
            "compute (attention sinks, say); this architecture is not supported"
        )
    paged = PAGED.paged
    if paged is not None:  # the engine: [1, H, N, D] packed rows against the paged cache
        q_NHE = query[0].transpose(0, 1)
        k_NKE, v_NKE = key[0].transpose(0, 1), value[0].transpose(0, 1)
        if scaling is not None:  # the paged op scales by 1/sqrt(E)
            q_NHE = q_NHE * (scaling * query.shape[-1] ** 0.5)
        y_NHE = ops.paged_attention(
            q_NHE, k_NKE, v_NKE, paged.k_cache, paged.v_cache, paged.batch,
            window=sliding_window, softcap=softcap,
        )  # fmt: skip
        PAGED.new_kv = {"k": k_NKE, "v": v_NKE}
        return y_NHE[None], None
    out = ops.attention(
        query, key, value, causal=True, scale=scaling, window=sliding_window, softcap=softcap
    )
    return out.transpose(1, 2).contiguous(), None


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        import transformers

        transformers.AttentionInterface.register(ATTENTION, _attention)
        _registered = True


# --- the module, built on the meta device --------------------------------------------------------


class Stop(Exception):
    """Raised by the last layer slot while ``pre`` records: the rest of the forward is post's."""


class _Slot(torch.nn.Module):
    """Stands where decoder layer ``i`` was. ``box["mode"]``: ``"record"`` (note the call, hand
    the hidden state on; the last slot stops the forward) or ``"inject"`` (hand back
    ``box["h"]``, the hidden state after the real layers)."""

    def __init__(self, i: int, box: dict[str, Any]) -> None:
        super().__init__()
        self.i, self.box = i, box

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        box = self.box
        if box["mode"] == "record":
            if args:
                raise ValueError(
                    f"{box['arch']}: its layers take positional arguments besides the hidden "
                    "state; the forward cannot be cut into layers"
                )
            box["calls"].append((self.i, hidden, kwargs))
            if self.i == box["last"]:
                raise Stop
            out = hidden
        else:
            out = box["h"]
        return (out,) if box["tuple"] else out


def _slotted(
    model: Any, path: str, n: int, returns_tuple: bool, arch: str
) -> tuple[Any, dict[str, Any]]:
    """``model`` with its ``n`` decoder layers (at ``path``) replaced by :class:`_Slot`
    stand-ins sharing one box: the real layers and the box."""
    box: dict[str, Any] = {
        "mode": "record", "calls": [], "last": n - 1, "tuple": returns_tuple, "arch": arch,
    }  # fmt: skip
    parent, _, leaf = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    real = getattr(owner, leaf)
    setattr(owner, leaf, torch.nn.ModuleList([_Slot(i, box) for i in range(n)]))
    return real, box


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(level)


_BUILDING = threading.Lock()


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules made in the block keep their parameters on the meta device (each one replaced
    as it is registered, before any initializer touches it) and their buffers as made: rotary
    frequencies and other constants a module computes when it is built. Process-wide while it
    lasts, so one build at a time (``_BUILDING``)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        p = module._parameters[name]
        if p is not None and not p.is_meta:  # (a tied weight, registered again, stays itself)
            module._parameters[name] = torch.nn.Parameter(
                p.to("meta"), requires_grad=p.requires_grad
            )

    setattr(torch.nn.Module, "register_parameter", on_meta)  # noqa: B010
    try:
        yield
    finally:
        setattr(torch.nn.Module, "register_parameter", register)  # noqa: B010


def _build(hf: Any) -> Any:
    """The ``transformers`` model of ``hf`` with its parameters on the meta device and its
    buffers made on the CPU, as the model makes them."""
    import transformers

    _register()
    try:
        with _BUILDING, _parameters_on_meta(), quiet():
            model = transformers.AutoModelForCausalLM.from_config(hf, attn_implementation=ATTENTION)
    except ValueError as e:
        model_type = getattr(hf, "model_type", "?")
        raise ValueError(
            f"model_type {model_type!r}: transformers builds no causal LM of it ({e})"
        ) from None
    return model


def _buffers_to(model: Any, device: torch.device | str) -> Any:
    for name, buf in list(model.named_buffers()):
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, buf.to(device))
    return model


def _find_layers(model: Any, n: int, arch: str) -> str:
    found = [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) == n and n > 0
    ]
    if len(found) != 1:
        what = "no list" if not found else f"{len(found)} lists ({found})"
        raise ValueError(
            f"{arch}: found {what} of {n} modules (num_hidden_layers) to take as its decoder "
            "layers; the model cannot be cut into layers"
        )
    return found[0]


def _shapes(module: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((n, tuple(p.shape)) for n, p in module.named_parameters())


def split_kwargs(kwargs: dict[str, Any], arch: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A layer call's keyword arguments: those holding tensors (which ride in the carry) and the
    rest (constants of the model)."""
    tensors, statics = {}, {}
    for k, v in kwargs.items():
        leaves = tree.leaves(v) if isinstance(v, tuple | list | dict) else [v]
        held = [isinstance(x, torch.Tensor) for x in leaves]
        if held and all(held):
            tensors[k] = v
        elif not any(held):
            statics[k] = v
        else:
            raise ValueError(f"{arch}: its layers' argument {k!r} mixes tensors and other values")
    return tensors, statics


@contextlib.contextmanager
def _probing(arch: str, what: str) -> Iterator[None]:
    """Run ``what`` on meta tensors: anything it raises but colfunc's own refusals becomes one
    (the model is not one colfunc can cut, or runs only on a device or dtype of its own)."""
    try:
        yield
    except (ValueError, Stop):
        raise
    except Exception as e:
        raise ValueError(
            f"{arch}: {what} does not run as colfunc runs it, on stand-in tensors "
            f"({type(e).__name__}: {e}); this architecture is not supported"
        ) from None


def config_of(hf: Any) -> Config:
    """Read a ``transformers`` config: build its causal LM on the meta device, find its decoder
    layers and check that it can be cut (see the module docstring). A ValueError naming the
    architecture and the reason otherwise."""
    hf = copy.deepcopy(hf)
    template = _build(hf)
    model = _buffers_to(copy.deepcopy(template), "meta")  # (the probe's: stand-ins throughout)
    arch = type(model).__name__
    n = getattr(hf, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise ValueError(
            f"{arch}: its config has no num_hidden_layers; colfunc cannot find its layers"
        )
    path = _find_layers(model, n, arch)
    layers = model.get_submodule(path)
    first = _shapes(layers[0])
    for i, layer in enumerate(layers):
        if type(layer) is not type(layers[0]) or _shapes(layer) != first:
            raise ValueError(
                f"{arch}: decoder layer {i} ({type(layer).__name__}) differs in its parameters "
                f"from layer 0 ({type(layers[0]).__name__}); heterogeneous layers cannot be "
                "stacked"
            )
    prefix = path + "."
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not name.startswith(prefix):
            names.setdefault(id(p), []).append(name)
    tied = tuple((alias, group[0]) for group in names.values() for alias in group[1:])
    aliases = {a for a, _ in tied}
    top = tuple(
        (nm, tuple(p.shape))
        for nm, p in model.named_parameters(remove_duplicate=False)
        if not nm.startswith(prefix) and nm not in aliases
    )
    # the probe: what each layer is called with, on meta tensors
    real, box = _slotted(model, path, n, False, arch)
    ids = torch.zeros((1, 4), dtype=torch.long, device="meta")
    with _probing(arch, "its forward"), contextlib.suppress(Stop):
        model(input_ids=ids, use_cache=False)
    calls = box["calls"]
    if [c[0] for c in calls] != list(range(n)):
        raise ValueError(
            f"{arch}: its forward called its layers in the order {[c[0] for c in calls]}, not "
            "0..n-1 once each; the forward cannot be cut into layers"
        )
    sets: list[tuple[dict[str, Any], dict[str, Any]]] = []
    kw_of_layer = []
    for _, _, kwargs in calls:
        tensors, statics = split_kwargs(kwargs, arch)
        ident = {k: [id(x) for x in tree.leaves(v)] for k, v in tensors.items()}
        for j, (other, other_statics) in enumerate(sets):
            if other == ident and other_statics == statics:
                kw_of_layer.append(j)
                break
        else:
            sets.append((ident, statics))
            kw_of_layer.append(len(sets) - 1)
    # one real layer on meta tensors: its output's form, and that attention goes through colfunc
    PAGED.probed = 0
    try:
        with _probing(arch, "its first layer"):
            out = real[0](calls[0][1], **calls[0][2])
        counted = PAGED.probed
    finally:
        PAGED.probed = None
    if counted != 1:
        raise ValueError(
            f"{arch}: its layers' attention does not go through transformers' attention "
            "interface (ALiBi or a hand-written attention); colfunc cannot run it"
        )
    return Config(
        hf=hf,
        architecture=arch,
        layers=path,
        top=top,
        block=first,
        tied=tied,
        kw_of_layer=tuple(kw_of_layer),
        statics=tuple(s for _, s in sets),
        returns_tuple=isinstance(out, tuple),
        template=template,
    )


class Runtime:
    """One thread's copy of the model on one device (``functional_call`` swaps the parameters
    of the module it is given, so threads, the ranks of the threads backend, each use their
    own): the model with layer slots, and the real layers."""

    def __init__(self, cfg: Config, device: torch.device) -> None:
        self.model = _buffers_to(copy.deepcopy(cfg.template), device)
        self.layers, self.box = _slotted(
            self.model, cfg.layers, cfg.n_layer, cfg.returns_tuple, cfg.architecture
        )
        self.training: bool | None = None

    def mode(self, training: bool) -> None:
        if training is not self.training:
            self.model.train(training)
            self.layers.train(training)
            self.training = training


_LOCAL = threading.local()


def runtime(cfg: Config, like: torch.Tensor) -> Runtime:
    cache = getattr(_LOCAL, "cache", None)
    if cache is None:
        cache = _LOCAL.cache = weakref.WeakKeyDictionary()
    device = getattr(like, "_local", like).device
    per = cache.setdefault(cfg, {})
    if device not in per:
        per[device] = Runtime(cfg, device)
    rt: Runtime = per[device]
    rt.mode(torch.is_grad_enabled())
    return rt
