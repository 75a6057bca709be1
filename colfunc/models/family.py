"""Model families as registered adapters: what the edges and the engine need to know of a model.

A family is one module of pure functions (``Config``, ``init``, ``loss``, ``apply``,
``param_shapes``, ``tp_plans``; ``paged_forward`` for serving) and a :class:`Family` value
beside them that declares the rest:

- ``hf``: its Hugging Face side (:class:`HFMapping`): the architecture names and ``model_type``
  it reads, the weight table (:class:`HFWeight` entries, one table for both directions), and the
  config conversion both ways. :mod:`colfunc.hf` reads and writes any registered family through it.
- ``kv_cache``: the shape of its KV cache (:class:`KVCacheSpec`), which
  :class:`colfunc.inference.Engine` allocates without reading any parameter path.

Families are found by config type (:func:`of_config`), by name (:func:`get`) and by Hugging Face
architecture or ``model_type`` (:func:`of_hf`). ``colfunc.models`` registers the built-in ones;
a new family is one file that builds its ``Family`` and one :func:`register` call::

    family = Family(name="mistral", module=mistral, config=mistral.Config, hf=..., kv_cache=...)
    colfunc.models.register(family)

Nothing here imports ``transformers``: a family's ``hf.write_config`` returns the keyword
arguments of its ``transformers`` config (built by ``AutoConfig.for_model(model_type, ...)``)
and ``hf.read_config`` reads attributes of one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from colfunc import nn, random

__all__ = [
    "FAMILIES",
    "Family",
    "HFMapping",
    "HFWeight",
    "KVCacheSpec",
    "get",
    "make_params",
    "of_config",
    "of_hf",
    "positive_number",
    "register",
    "registered",
    "require",
    "unregister",
]

Params = dict[str, Any]


class HFWeight(NamedTuple):
    """One Hugging Face tensor and the colfunc parameters that make it.

    ``key``: the Hugging Face key (``"{i}"`` stands for the layer index in per-layer entries);
    ``paths``: the colfunc paths, concatenated along the last dim to make it (GPT-2's fused
    ``c_attn`` is ``wq``, ``wk``, ``wv``); ``transpose``: stored ``[out, in]`` on the Hugging
    Face side (``nn.Linear``), where colfunc keeps ``[in, out]``; ``groups``: concatenated in
    that many interleaved groups instead (see :meth:`split`); ``layers``: the layers a
    per-layer entry exists in (None: all of them; in the others the colfunc slice is zeros that
    nothing reads, as a mixture of experts' dense MLP in its sparse layers).
    """

    key: str
    paths: tuple[str, ...]
    transpose: bool = False
    groups: int = 1
    aliases: tuple[str, ...] = ()  # other names a saved file may give it (legacy checkpoints)
    layers: tuple[int, ...] | None = None

    def at(self, i: int) -> bool:
        """Whether this per-layer entry exists in layer ``i``."""
        return self.layers is None or i in self.layers

    def split(self, x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
        """The colfunc pieces (last dims ``sizes``) of the Hugging Face tensor ``x`` (already in
        colfunc's ``[in, out]`` layout): cut along the last dim, or with ``groups`` > 1 cut in
        that many interleaved groups (GPT-NeoX's fused qkv: each head's q, k, v in turn)."""
        if self.groups == 1:
            return x.split(sizes, dim=-1)
        g = self.groups
        parts = x.unflatten(-1, (g, -1)).split([s // g for s in sizes], dim=-1)
        return tuple(p.flatten(-2) for p in parts)

    def join(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """The Hugging Face tensor (in colfunc's layout) of the pieces ``xs``: the inverse of
        :meth:`split`."""
        if len(xs) == 1:
            return xs[0]
        if self.groups == 1:
            return torch.cat(xs, dim=-1)
        return torch.cat([x.unflatten(-1, (self.groups, -1)) for x in xs], dim=-1).flatten(-2)


def linear(key: str, *paths: str) -> HFWeight:
    """An ``nn.Linear`` weight: transposed between the two layouts."""
    return HFWeight(key, paths, transpose=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFMapping:
    """A family's Hugging Face side.

    ``architectures``: the ``transformers`` causal-LM class names it reads (``config.json``'s
    ``architectures``); ``model_type``: the config's ``model_type``, also what
    ``AutoConfig.for_model`` builds on the way out; ``weights(cfg) -> (top, per_layer)``: the
    weight table; ``read_config(hf_config) -> Config``, refusing options the family does not
    compute (see :func:`require`); ``write_config(cfg) -> dict``, the ``transformers`` config's
    keyword arguments.
    """

    architectures: tuple[str, ...]
    model_type: str
    weights: Callable[[Any], tuple[list[HFWeight], list[HFWeight]]]
    read_config: Callable[[Any], Any]
    write_config: Callable[[Any], dict[str, Any]]

    def __post_init__(self) -> None:
        if isinstance(self.architectures, str) or not self.architectures:
            raise ValueError(
                f"HFMapping: architectures must be a non-empty tuple of class names, got "
                f"{self.architectures!r}"
            )
        for name in ("weights", "read_config", "write_config"):
            if not callable(getattr(self, name)):
                raise TypeError(f"HFMapping: {name} must be callable, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """The KV cache a family's ``paged_forward`` reads: per layer and token slot, ``kv_heads``
    keys and values of ``head_dim``, in ``dtype`` on ``device``. ``window``: every layer attends
    to each token's last ``window`` tokens only (a sliding window), so a sequence's blocks that
    fall wholly before the window are given back as it advances (None: all are kept).
    ``regime``: a sequence longer than this many tokens is computed otherwise (LongRoPE's long
    factors), all of it: the cache of one that grows past it is computed again, once, and no
    block is shared between sequences (no prefix caching)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    window: int | None = None
    regime: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCacheSpec: {name} must be an int >= 1, got {value!r}")
        w = self.window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"KVCacheSpec: window must be None or an int >= 1, got {w!r}")
        r = self.regime
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise ValueError(f"KVCacheSpec: regime must be None or an int >= 1, got {r!r}")

    @classmethod
    def like(
        cls,
        table: torch.Tensor,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        window: int | None = None,
        regime: int | None = None,
    ) -> KVCacheSpec:
        """A cache in ``table``'s dtype and on its device (a model's embedding, say)."""
        return cls(
            layers=layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=table.dtype,
            device=table.device,
            window=window,
            regime=regime,
        )

    @classmethod
    def of_decoder(cls, cfg: Any, params: Params) -> KVCacheSpec:
        """The cache of a decoder whose config has ``n_layer``, ``n_head`` and ``d_model`` (and
        optionally ``n_kv_heads`` and ``head_dim``, else ``n_head`` and ``d_model / n_head``,
        and ``cache_window`` or ``sliding_window``: the window of every layer),
        stored as its token embedding ``params["embed"]["tokens"]`` is: one key and one value of
        every key/value head per layer and token."""
        kv_heads = getattr(cfg, "n_kv_heads", None) or cfg.n_head
        head_dim = getattr(cfg, "head_dim", None) or cfg.d_model // cfg.n_head
        return cls.like(
            params["embed"]["tokens"],
            layers=cfg.n_layer,
            kv_heads=kv_heads,
            head_dim=head_dim,
            window=getattr(cfg, "cache_window", getattr(cfg, "sliding_window", None)),
            regime=getattr(cfg, "cache_regime", None),
        )

    def slot_bytes(self) -> int:
        """Bytes of one token slot across every layer (keys and values), on one rank."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """A model family: its module of pure functions and what the edges and the engine need.

    ``name``: how configs and the CLI name it (``"llama"``); ``module``: the functions (a module
    or any object with them); ``config``: its ``Config`` class (:func:`of_config` looks families
    up by it); ``hf``: its Hugging Face side, or None; ``kv_cache(cfg, params)``: its cache, or
    None for a model that is not served token by token.
    """

    name: str
    module: Any
    config: type
    hf: HFMapping | None = None
    kv_cache: Callable[[Any, Params], KVCacheSpec] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"Family: name must be an identifier, got {self.name!r}")
        if not isinstance(self.config, type):
            raise TypeError(f"Family {self.name!r}: config must be a class, got {self.config!r}")
        for fn in ("init", "loss", "param_shapes"):
            if not callable(getattr(self.module, fn, None)):
                raise TypeError(
                    f"Family {self.name!r}: module {_name(self.module)} has no {fn}(); a "
                    "family's module defines init, loss and param_shapes"
                )
        if self.hf is not None and not isinstance(self.hf, HFMapping):
            raise TypeError(f"Family {self.name!r}: hf must be an HFMapping, got {self.hf!r}")
        if self.kv_cache is not None and not callable(getattr(self.module, "paged_forward", None)):
            raise TypeError(
                f"Family {self.name!r}: a kv_cache is given but module {_name(self.module)} has "
                "no paged_forward() to read it"
            )


def _name(module: Any) -> str:
    return getattr(module, "__name__", type(module).__name__)


# The registry, name -> family, in registration order: like the op layer's rule table, the one
# table every edge reads (``colfunc.models`` fills it with the built-in families).
FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` to the registry; refuses a name, config class, architecture or
    ``model_type`` another family already has. Returns the family."""
    if not isinstance(family, Family):
        raise TypeError(f"register takes a colfunc.models.Family, got {family!r}")
    for other in FAMILIES.values():
        clash = None
        if other.name == family.name:
            clash = f"the name {family.name!r}"
        elif other.config is family.config:
            clash = f"the config class {family.config.__qualname__}"
        elif family.hf is not None and other.hf is not None:
            shared = set(family.hf.architectures) & set(other.hf.architectures)
            if shared:
                clash = f"the architecture {sorted(shared)[0]!r}"
            elif family.hf.model_type == other.hf.model_type:
                clash = f"the model_type {family.hf.model_type!r}"
        if clash is not None:
            raise ValueError(
                f"register: family {other.name!r} already has {clash}; unregister it first or "
                "give the new family its own"
            )
    FAMILIES[family.name] = family
    return family


def unregister(name: str) -> Family:
    """Remove the family named ``name`` from the registry and return it."""
    if name not in FAMILIES:
        raise ValueError(f"unregister: no family named {name!r}; registered: {sorted(FAMILIES)}")
    return FAMILIES.pop(name)


@contextmanager
def registered(family: Family) -> Iterator[Family]:
    """``family`` registered for the ``with`` block only (tests, notebooks)."""
    register(family)
    try:
        yield family
    finally:
        unregister(family.name)


def get(name: str) -> Family:
    """The family registered as ``name``."""
    if name not in FAMILIES:
        raise ValueError(f"no model family named {name!r}; registered: {sorted(FAMILIES)}")
    return FAMILIES[name]


def of_config(cfg: Any) -> Family:
    """The family registered for the class of ``cfg`` (exactly that class: a family whose
    ``Config`` subclasses another's is its own family, and is not mistaken for the other's
    while it is not registered). A TypeError for anything else."""
    for family in FAMILIES.values():
        if type(cfg) is family.config:
            return family
    raise TypeError(
        f"expected the Config of a registered model family (e.g. "
        f"colfunc.models.gpt.Config.tiny()), got {type(cfg).__name__} from "
        f"{type(cfg).__module__}; registered: {sorted(FAMILIES)} (colfunc.models.register adds one)"
    )


def of_hf(architectures: list[str] | tuple[str, ...], model_type: str | None) -> Family:
    """The family that reads a Hugging Face config: by its ``architectures`` first, then by its
    ``model_type``."""
    with_hf = [f for f in FAMILIES.values() if f.hf is not None]
    for name in architectures:
        for f in with_hf:
            if f.hf is not None and name in f.hf.architectures:
                return f
    for f in with_hf:
        if f.hf is not None and f.hf.model_type == model_type:
            return f
    known = sorted(a for f in with_hf if f.hf is not None for a in f.hf.architectures)
    raise ValueError(
        f"no registered model family reads architectures={list(architectures)!r}, "
        f"model_type={model_type!r}; colfunc reads {known}"
    )


def positive_number(value: object) -> bool:
    """Whether ``value`` is a real number > 0, its type checked before the comparison (so a
    config's ``norm_eps="x"`` is its own ValueError, not a TypeError from ``>``)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and value > 0


def require(model: str, hf_cfg: Any, option: str, allowed: tuple[Any, ...]) -> None:
    """Refuse a Hugging Face config whose ``option`` is not in ``allowed`` (a ValueError naming
    both): what the family's functions do not compute must not load as a silently different
    model. An option the config lacks (an older ``transformers``) counts as ``allowed[0]``."""
    value = getattr(hf_cfg, option, allowed[0])
    if value not in allowed:
        raise ValueError(
            f"from_hf: {model} with {option}={value!r} is not supported; colfunc's model "
            f"computes {option} in {allowed!r}"
        )


def make_params(
    shapes: dict[str, tuple[int, ...]],
    value: Callable[[str, tuple[int, ...]], torch.Tensor],
    abstract: bool,
) -> Params:
    """The parameter tree of ``shapes`` (dotted paths), each leaf ``value(path, shape)``; with
    ``abstract`` a :class:`colfunc.random.Abstract` that makes it when asked."""
    if abstract:
        return nn.nest(
            {p: random.abstract(s, functools.partial(value, p, s)) for p, s in shapes.items()}
        )
    return nn.nest({p: value(p, s) for p, s in shapes.items()})
