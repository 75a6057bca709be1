"""``lora``: low-rank adapters (LoRA, Hu et al. 2021) as a transform of the training step.

``cf.lora(step, rank, alpha, targets)`` adds, beside every weight ``w[in, out]`` a target pattern
matches, an adapter ``a[in, r]`` and ``b[r, out]`` (``b`` zero at init, as peft), trains the
adapters only and computes ``x @ w + (x @ a) @ b * alpha / r`` wherever the model multiplies by
``w`` (:class:`colfunc.nn.LowRank`), inside the scanned block, one layer at a time: the base is
never merged, so ZeRO-3 and offload still gather or fetch it per layer, and it gets no gradient.

The adapters live in the parameter tree next to their weight, in a ``lora`` dict:
``blocks.attn.wq`` gets ``blocks.attn.lora.wq.a [L, in, r]`` and ``blocks.attn.lora.wq.b
[L, r, out]``. So every transform handles them as the parameters they are: sharded by a plan
derived from the base's (``shard``: a column-parallel weight's ``b`` split on its output dim, a
row-parallel weight's ``a`` on its input dim, no collective beyond the base's), cut by ZeRO,
staged by the pipeline, kept on the device by offload while the frozen base streams from host
memory, saved by checkpoints. A group in ``shared`` (weights with the same input, which a
Hugging Face model fuses into one module: GPT-2's ``c_attn``) shares one ``a``, kept at the
group's first weight; each member keeps its own ``b``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from colfunc import core, random, tree
from colfunc.adapters import quant
from colfunc.core import P, Plan
from colfunc.nn.lowrank import LowRank, column_norms
from colfunc.step import Step, Trainable, train_step

__all__ = [
    "INITS",
    "LoraConfig",
    "Target",
    "adapter_numel",
    "adapter_paths",
    "call",
    "config_of",
    "is_adapter",
    "lora",
    "magnitude_path",
]

PyTree = Any
INITS = ("kaiming", "gaussian")
KEY = "lora"  # the dict beside the adapted weights


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """The arguments of :func:`lora`, checked; ``scale`` is ``alpha / rank`` (``alpha /
    sqrt(rank)`` with ``rslora``, Kalajdzievski 2023)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("blocks.attn.w*", "blocks.mlp.w*")
    dropout: float = 0.0
    init: str = "kaiming"
    rslora: bool = False
    shared: tuple[tuple[str, ...], ...] = ()
    seed: int = 0
    base_dtype: str | None = None
    dora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora: rank must be an int >= 1, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)):
            raise TypeError(f"lora: alpha must be a number, got {self.alpha!r}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"lora: alpha must be finite and > 0, got {self.alpha!r}")
        targets = (self.targets,) if isinstance(self.targets, str) else self.targets
        if not isinstance(targets, (tuple, list)) or not targets:
            raise TypeError(
                f"lora: targets must be a path pattern or a non-empty list of them, got "
                f"{self.targets!r}"
            )
        for t in targets:
            if not isinstance(t, str) or not t:
                raise TypeError(f"lora: each target must be a path pattern (str), got {t!r}")
        object.__setattr__(self, "targets", tuple(targets))
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise TypeError(f"lora: dropout must be a number in [0, 1), got {self.dropout!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora: dropout must be in [0, 1), got {self.dropout!r}")
        if self.init not in INITS:
            raise ValueError(f"lora: init must be one of {INITS}, got {self.init!r}")
        for flag in ("rslora", "dora"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"lora: {flag} must be a bool, got {getattr(self, flag)!r}")
        groups = []
        for g in self.shared:
            if isinstance(g, str) or not isinstance(g, (tuple, list)) or len(g) < 2:
                raise TypeError(
                    f"lora: shared must be groups (tuples) of two or more weight paths, got {g!r}"
                )
            parents = {p.rpartition(".")[0] for p in g}
            if len(parents) != 1:
                raise ValueError(
                    f"lora: a shared group's weights must sit side by side (one parent), got {g!r}"
                )
            groups.append(tuple(g))
        seen = [p for g in groups for p in g]
        if len(seen) != len(set(seen)):
            raise ValueError(f"lora: a weight is in two shared groups: {groups!r}")
        object.__setattr__(self, "shared", tuple(groups))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"lora: seed must be an int, got {self.seed!r}")
        if self.base_dtype is not None and self.base_dtype not in quant.FORMATS:
            raise ValueError(
                f"lora: base_dtype must be None or one of {quant.FORMATS}, got {self.base_dtype!r}"
            )

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`lora` that make this config."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def leader(self, path: str) -> str:
        """The weight whose ``a`` ``path`` uses: the first of its shared group, else itself."""
        for g in self.shared:
            if path in g:
                return g[0]
        return path


@dataclasses.dataclass(frozen=True)
class Target:
    """A weight with an adapter: its path, and where its ``a`` and ``b`` are kept."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    leader: str  # the weight whose ``a`` it uses (itself unless shared)

    @property
    def stacked(self) -> bool:
        return self.path.startswith("blocks.")

    @property
    def a(self) -> str:
        return adapter_paths(self.leader)[0]

    @property
    def b(self) -> str:
        return adapter_paths(self.path)[1]


def magnitude_path(path: str) -> str:
    """The path of DoRA's magnitude of the weight at ``path``."""
    return adapter_paths(path)[1][:-1] + "m"


def adapter_paths(path: str) -> tuple[str, str]:
    """The paths of the adapter of the weight at ``path``: ``(a, b)``."""
    parent, _, name = path.rpartition(".")
    stem = f"{parent}.{KEY}.{name}" if parent else f"{KEY}.{name}"
    return f"{stem}.a", f"{stem}.b"


def is_adapter(path: str) -> bool:
    """Whether ``path`` is an adapter's ``a`` or ``b``."""
    parts = path.split(".")
    return len(parts) >= 3 and parts[-3] == KEY and parts[-1] in ("a", "b", "m")


def base_of(path: str) -> str:
    """The weight an adapter path belongs to (``blocks.attn.lora.wq.b -> blocks.attn.wq``)."""
    parts = path.split(".")
    return ".".join([*parts[:-3], parts[-2]])


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape)


class _Packed:
    """A quantized weight seen as the weight it stands for (its shape; the scales' dtype)."""

    def __init__(self, q: dict[str, Any]) -> None:
        self.shape = quant.unpacked_shape(q)
        self.dtype = q["absmax"].dtype


def _weights(params: PyTree) -> list[tuple[str, Any]]:
    """``(path, leaf)`` of every parameter but the adapters, a quantized weight as one."""
    out: list[tuple[str, Any]] = []

    def walk(node: Any, path: str) -> None:
        if quant.is_quantized(node):
            out.append((path, _Packed(node)))
        elif type(node) is dict:
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif not is_adapter(path):
            out.append((path, node))

    walk(params, "")
    return out


def resolve(config: LoraConfig, params: PyTree) -> list[Target]:
    """The weights ``config.targets`` select in ``params`` (adapters already there excluded);
    a pattern that matches nothing, or a match that is not a matrix, is an error naming it."""
    flat = _weights(params)
    out: dict[str, Target] = {}
    for pattern in config.targets:
        hits = [(p, x) for p, x in flat if tree.match(pattern, p)]
        if not hits:
            raise ValueError(
                f"lora: target {pattern!r} matches no parameter; parameter paths look like "
                f"{[p for p, _ in flat[:6]]}"
            )
        for p, x in hits:
            want = 3 if p.startswith("blocks.") else 2
            if len(_shape(x)) != want or not getattr(x, "dtype", torch.int8).is_floating_point:
                kind = "stacked [layers, in, out]" if want == 3 else "[in, out]"
                raise ValueError(
                    f"lora: target {pattern!r} matches {p} of shape {list(_shape(x))}, which is "
                    f"not a floating {kind} weight of a linear map; narrow the pattern"
                )
            out[p] = Target(p, _shape(x), x.dtype, config.leader(p))
    for g in config.shared:
        missing = [p for p in g if p not in out]
        if missing:
            raise ValueError(
                f"lora: shared group {g!r} names {missing[0]}, which no target selects"
            )
        ins = {out[p].shape[-2] for p in g}
        if len(ins) != 1:
            raise ValueError(f"lora: a shared group's weights need one input size, got {g!r}")
    return [out[p] for p in sorted(out)]


def _get(params: PyTree, path: str) -> Any:
    node = params
    for k in path.split("."):
        if not isinstance(node, dict) or k not in node:
            return None
        node = node[k]
    return node


def _set(params: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``params`` with ``path`` set, copying only the dicts along the way."""
    head, _, rest = path.partition(".")
    out = dict(params)
    out[head] = _set(out.get(head, {}), rest, value) if rest else value
    return out


def _init_a(config: LoraConfig, t: Target, path: str) -> torch.Tensor:
    shape = (*t.shape[:-1], config.rank)
    if config.init == "gaussian":  # peft's "gaussian": N(0, 1/r)
        return random.normal(config.seed, path, shape, 1.0 / config.rank, t.dtype)
    bound = 1.0 / math.sqrt(t.shape[-2])  # kaiming_uniform(a=sqrt(5)) on [r, in], as peft
    return random.uniform(config.seed, path, shape, -bound, bound, t.dtype)


def adapter_numel(config: LoraConfig, params: PyTree) -> int:
    """How many values the adapters of ``params`` under ``config`` hold (each shared ``a``
    once)."""
    total = 0
    for t in resolve(config, params):
        lead = math.prod(t.shape[:-2])
        total += lead * config.rank * t.shape[-1]
        if t.leader == t.path:
            total += lead * config.rank * t.shape[-2]
        if config.dora:
            total += lead * t.shape[-1]
    return total


def _column_norms(w: Any, t: Target) -> torch.Tensor:
    """DoRA's initial magnitude: the norm of each output column of ``w`` (``[..., out]``)."""
    if isinstance(w, random.Abstract):
        w = w.materialize()
    if quant.is_quantized(w):
        w = quant.dequantize(w, t.dtype)
    if w.device.type == "meta":
        return torch.empty((*w.shape[:-2], w.shape[-1]), dtype=w.dtype, device="meta")
    return column_norms(w.detach()).to(w.dtype)


def add_adapters(config: LoraConfig, params: PyTree) -> PyTree:
    """``params`` with an adapter for every target: the ones already there (a checkpoint, a
    peft folder read by :func:`colfunc.hf.load_adapter`) kept after checking their shapes, the
    others made (``a`` by ``config.init``, ``b`` zero)."""
    if not isinstance(params, dict):
        raise TypeError(f"lora: params must be a dict tree, got {type(params).__name__}")
    for p in tree.paths(params):
        parts = p.split(".")
        if KEY in parts[:-1] and not is_adapter(p):
            raise ValueError(
                f"lora: the parameter {p} sits under a {KEY!r} dict, the name adapters use; "
                "rename it"
            )
    out = params
    for t in resolve(config, params):
        w = _get(out, t.path)
        if config.base_dtype is not None and not quant.is_quantized(w):
            if isinstance(w, random.Abstract):  # quantized once made, where a layout makes it
                w = w.materialize()
            if getattr(w, "device", None) is not None and w.device.type == "meta":
                w = quant.meta_quantized(w, config.base_dtype, t.path)
            else:
                w = quant.quantize(w, config.base_dtype, t.path)
            out = _set(out, t.path, w)
        lead = t.shape[:-2]
        if config.dora and _get(out, magnitude_path(t.path)) is None:  # m = the column norms
            out = _set(out, magnitude_path(t.path), _column_norms(w, t))
        shapes = {t.a: (*lead, t.shape[-2], config.rank), t.b: (*lead, config.rank, t.shape[-1])}
        for path, shape in shapes.items():
            have = _get(out, path)
            if have is not None:
                if _shape(have) != shape:
                    raise ValueError(
                        f"lora: the adapter {path} has shape {list(_shape(have))}, expected "
                        f"{list(shape)} (rank {config.rank} for {t.path} {list(t.shape)})"
                    )
                continue
            device = getattr(_get(params, t.path), "device", None)
            if isinstance(device, torch.device) and device.type == "meta":  # a dry run's
                value: Any = torch.empty(shape, dtype=t.dtype, device="meta")
            elif path == t.b:
                value = torch.zeros(shape, dtype=t.dtype)
            else:
                value = _init_a(config, t, path)
            if isinstance(device, torch.device) and device.type not in ("cpu", "meta"):
                value = value.to(device)
            out = _set(out, path, value)
    return out


Make = Callable[[str, Any, dict[str, Any], dict[str, Any]], Any]


def attach(node: dict[str, Any], prefix: str, make: Make) -> dict[str, Any]:
    """``node`` (a dict of parameters at ``prefix``) with the ``lora`` dicts taken out and each
    adapted weight replaced by ``make(path, weight, its adapter, the lora dict)``, recursively
    (a quantized weight's dict is a weight, not a level)."""
    out = {}
    for k, v in node.items():
        if k != KEY:
            nested = type(v) is dict and not quant.is_quantized(v)
            out[k] = attach(v, f"{prefix}{k}.", make) if nested else v
    for name, ad in node.get(KEY, {}).items():
        out[name] = make(f"{prefix}{name}", out[name], ad, node[KEY])
    return out


def outside_blocks(params: PyTree, fn: Callable[[dict[str, Any]], PyTree]) -> PyTree:
    """``params`` with ``fn`` applied to everything but ``blocks`` (which the scanned block
    handles a layer at a time)."""
    if not isinstance(params, dict):
        return params
    out = fn({k: v for k, v in params.items() if k != "blocks"})
    if "blocks" in params:
        out["blocks"] = params["blocks"]
    return out


class Adapted:
    """What :func:`lora` puts on its loss function (``loss_fn.lora``): the config, and how the
    adapters are laid out under ``shard``."""

    def __init__(self, config: LoraConfig) -> None:
        self.config = config

    def _make(self, path: str, w: Any, ad: dict[str, Any], group: dict[str, Any]) -> LowRank:
        c = self.config
        a = group[c.leader(path).rpartition(".")[2]]["a"]
        if quant.is_quantized(w):  # the frozen base in 4 or 8 bits, dequantized at its matmul
            w = quant.Dequantized(w, a.dtype)
        return LowRank(w, a, ad["b"], c.scale, c.dropout, path, ad.get("m"))

    def attach_top(self, params: PyTree) -> PyTree:
        """The parameters outside ``blocks`` with their adapters attached (``blocks`` as is:
        the scanned block attaches each layer's)."""
        return outside_blocks(params, lambda rest: attach(rest, "", self._make))

    def attach_layer(self, layer: PyTree) -> PyTree:
        return attach(layer, "blocks.", self._make) if isinstance(layer, dict) else layer

    def plan(
        self, plan: dict[str, P], params: PyTree, mode: str, mesh_sizes: dict[str, int]
    ) -> dict[str, P]:
        """``plan`` with an entry for every adapter in ``params``, placed to match its weight:
        ``a`` split as the weight's input dim, ``b`` as its output dim (each replicated on
        the other). Only 1D tensor parallelism lays adapters out."""
        paths = [p for p in tree.paths(params) if is_adapter(p)]
        if not paths or not plan:  # (no plan: data parallel only, nothing is laid out)
            return plan
        axes = {a for spec in plan.values() for a in spec.axes()}
        if mode != "1d" and axes:
            raise ValueError(
                f"lora: adapters are laid out for 1D tensor parallelism; shard(tensor_mode="
                f"{mode!r}) is not supported with lora (use the 1D plan)"
            )
        entries: dict[str, P] = {}
        for path in paths:
            weight = base_of(path)
            spec = next((s for pat, s in plan.items() if tree.match(pat, weight)), P())
            nd = 3 if weight.startswith("blocks.") else 2
            full = list(spec) + [None] * (nd - len(spec))
            lead, s_in, s_out = full[:-2], full[-2], full[-1]
            if path.endswith(".m"):  # DoRA's magnitude: one per output
                entries[path] = P(*lead, s_out)
            else:
                entries[path] = (
                    P(*lead, s_in, None) if path.endswith(".a") else P(*lead, None, s_out)
                )
        packed = set()
        for weight, x in _weights(params):  # a quantized weight's codes and scales: as it
            if isinstance(x, _Packed):
                spec = next((s for pat, s in plan.items() if tree.match(pat, weight)), P())
                _check_blocks(weight, x.shape, spec, mesh_sizes)
                for leaf in tree.paths(_get(params, weight)):
                    entries[f"{weight}.{leaf}"] = spec
                packed |= {pat for pat in plan if tree.match(pat, weight)}
        # (a pattern that named a quantized weight now names its codes and scales, through
        # the entries above: it may match no tensor itself)
        optional: frozenset[str] = getattr(plan, "optional", frozenset()) | packed
        return Plan({**entries, **plan}, optional)


def _check_blocks(weight: str, shape: tuple[int, ...], spec: P, sizes: dict[str, int]) -> None:
    """Refuse a tensor-parallel split of a quantized weight's outputs that cuts its blocks."""
    full = list(spec) + [None] * (len(shape) - len(spec))
    out = full[-1]
    names = out if isinstance(out, tuple) else (out,) if out is not None else ()
    n = math.prod(sizes[a] for a in names)
    if n > 1 and (shape[-1] // n) % quant.BLOCK:
        raise ValueError(
            f"lora: the quantized {weight} has {shape[-1]} outputs, split over {n} ranks into "
            f"{shape[-1] // n}, not a multiple of the quantization block ({quant.BLOCK}); use "
            f"fewer tensor-parallel ranks or base_dtype=None"
        )


class AttachLayers:
    """Context frame: every :func:`colfunc.scan_layers` inside it runs each layer through
    ``attach_layer`` (its adapters attached) first: a model's own forward, not only its loss."""

    def __init__(self, attach_layer: Callable[[PyTree], PyTree]) -> None:
        self.attach_layer = attach_layer

    def scan_layers(
        self, block: Any, carry: PyTree, blocks: PyTree, xs: PyTree, inner: Callable[..., Any]
    ) -> tuple[PyTree, PyTree]:
        attach_layer = self.attach_layer
        return inner(lambda layer, c, x: block(attach_layer(layer), c, x), carry, blocks, xs)


def call(
    config: LoraConfig, fn: Callable[..., Any], params: PyTree, *args: Any, **kwargs: Any
) -> Any:
    """``fn(params, *args, **kwargs)`` (a model's ``apply``, say) reading ``params`` with their
    adapters: the weights outside ``blocks`` attached here, each layer's as it is scanned.

    Example:
        >>> logits = adapters.call(config, llama.apply, state.params, ids, cfg)
    """
    adapted = Adapted(config)
    with core.context(AttachLayers(adapted.attach_layer)):
        return fn(adapted.attach_top(params), *args, **kwargs)


def _wrap(loss_fn: Callable[..., Any], adapted: Adapted) -> Any:
    """``loss_fn`` reading adapted weights: each layer's attached inside the scanned block."""
    if isinstance(loss_fn, core.Layered):
        inner = loss_fn
        block_fn: Callable[..., Any] = inner.block
        post_fn: Callable[..., Any] = inner.post

        def block(layer: PyTree, *rest: Any) -> Any:  # (carry) or (carry, x)
            return block_fn(adapted.attach_layer(layer), *rest)

        def post(params: PyTree, *rest: Any) -> Any:  # (carry, batch) or (carry, batch, ys)
            return post_fn(adapted.attach_top(params), *rest)

        xs = inner.xs
        wrapped = core.Layered(
            lambda params, batch: inner.pre(adapted.attach_top(params), batch),
            block,
            post,
            name=inner.name,
            divisors=inner.divisors,
            sequence_dims=inner.sequence_dims,
            batch_sequence_dims=inner.batch_sequence_dims,
            expert_dims=inner.expert_dims,
            xs=None if xs is None else (lambda p, b: xs(adapted.attach_top(p), b)),
        )
        wrapped.lora = adapted  # type: ignore[attr-defined]
        return wrapped
    return _Plain(loss_fn, adapted)


class _Plain:
    """A loss that is not layered, reading adapted weights (top-level targets only)."""

    def __init__(self, fn: Callable[..., Any], adapted: Adapted) -> None:
        self.fn, self.lora = fn, adapted

    def __call__(self, params: PyTree, batch: PyTree) -> Any:
        if isinstance(params, dict) and any(
            is_adapter(p) for p in tree.paths(params.get("blocks", {}))
        ):
            raise ValueError(
                "lora: targets under 'blocks' need a layered loss (cf.layered), which runs each "
                "layer through the adapters; the models' loss(cfg) is one"
            )
        return self.fn(self.lora.attach_top(params), batch)


def config_of(step_or_loss: Any) -> LoraConfig | None:
    """The :class:`LoraConfig` a step (or its loss function) was built with, or None."""
    loss = step_or_loss
    if isinstance(step_or_loss, Step):
        loss = (step_or_loss.base or step_or_loss).loss_fn
    adapted = getattr(loss, "lora", None)
    return adapted.config if isinstance(adapted, Adapted) else None


def lora(
    step: Step,
    rank: int = 8,
    alpha: float = 16.0,
    targets: str | Sequence[str] = ("blocks.attn.w*", "blocks.mlp.w*"),
    dropout: float = 0.0,
    *,
    init: str = "kaiming",
    rslora: bool = False,
    shared: Sequence[Sequence[str]] = (),
    seed: int = 0,
    base_dtype: str | None = None,
    dora: bool = False,
) -> Step:
    """``step`` training low-rank adapters of the weights ``targets`` selects, all else frozen.

    ``step.init(params)`` adds the adapters (``a`` by ``init``: ``"kaiming"``, peft's default,
    or ``"gaussian"``; ``b`` zero; drawn from ``(seed, path)``) unless ``params`` already has
    them; the state then trains them only (plus what the step's own ``trainable`` names): the
    base gets no gradient, no optimizer state, no reduction and no update, and comes out of
    every step bit-identical. ``rslora`` scales by ``alpha / sqrt(rank)``; ``dropout`` drops the
    adapters' input in training; ``shared`` groups weights with one input (a fused Hugging Face
    module) under one ``a``. ``base_dtype="nf4"`` (QLoRA) or ``"int8"`` stores each targeted
    base weight quantized (:mod:`colfunc.adapters.quant`), dequantized one layer at a time just
    before its matmul. ``dora=True`` (DoRA, Liu et al. 2024) adds a trained magnitude per
    output column (``lora.<weight>.m``, the base's column norms at init) and rescales each
    column of ``w + a b scale`` to it, the norms held constant in the backward pass, as peft.

    It composes with every transform, applied before or after them.

    Example:
        >>> step = cf.lora(cf.train_step(llama.loss(cfg), optim.adamw(1e-3)), rank=8, alpha=16)
        >>> step = cf.zero(cf.shard(step, mesh, plan=llama.tp_plan(cfg)), stage=3)
    """
    if not isinstance(step, Step):
        raise TypeError(f"lora: expected a Step (from cf.train_step), got {type(step).__name__}")
    config = LoraConfig(
        rank=rank,
        alpha=alpha,
        targets=(targets,) if isinstance(targets, str) else tuple(targets),
        dropout=dropout,
        init=init,
        rslora=rslora,
        shared=tuple(tuple(g) for g in shared),
        seed=seed,
        base_dtype=base_dtype,
        dora=dora,
    )
    base = step.base if step.base is not None else step
    if config_of(base) is not None:
        raise ValueError("lora: the step already has lora applied; apply it once")
    adapted = Adapted(config)
    own = base.trainable

    def trains(path: str) -> bool:
        return is_adapter(path) or (own is not None and own(path))

    new = train_step(
        _wrap(base.loss_fn, adapted), base.optimizer, donate=base.donate, trainable=trains
    )
    assert isinstance(new.trainable, Trainable)
    new = new.replace(prepare=lambda params: add_adapters(config, params))
    return step.composition.build(new) if step.composition is not None else new
