"""``scan_layers`` (``jax.lax.scan`` over stacked layers, through the interceptors on the stack)
and ``layered``, the form a model's loss takes so that transforms see its layers."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch

from colfunc import tree
from colfunc.core.frames import LayerGrads, PyTree, ScanBlock, ScanInterceptor
from colfunc.core.stack import _STACK, _implements, innermost

Block = Callable[[PyTree, PyTree], PyTree]  # (layer params, carry) -> carry


class _Unstack(torch.autograd.Function):
    """``unbind(0)`` of tracked stacked leaves; the backward hands the rows of the layers in
    ``late`` (those without a :class:`_Tap`) to the frame, last layer first, and hands back
    zeros (see LayerGrads).

    (Written with ``forward(ctx, ...)``: ``apply`` then skips binding the signature of
    ``forward``, which costs more than the node itself; this node and :class:`_Tap` run only
    under data parallelism, never under ``torch.func`` transforms.)"""

    @staticmethod
    def forward(
        ctx: Any,
        frame: LayerGrads,
        paths: tuple[str, ...],
        late: tuple[int, ...],
        *xs: torch.Tensor,
    ) -> Any:
        ctx.frame, ctx.paths, ctx.late = frame, paths, late
        ctx.xs = [x.detach() for x in xs]
        ctx.set_materialize_grads(False)
        return tuple(r for x in xs for r in x.unbind(0))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        # the layers that had no node of their own (see LayerGrads.early), last layer first
        n = len(grads) // len(ctx.paths) if ctx.paths else 0
        for i in sorted(ctx.late, reverse=True):
            layer = dict(zip(ctx.paths, grads[i::n]))
            ctx.frame.on_layer(i, layer, _LayerSlices(ctx.paths, ctx.xs, i))
        zeros = []
        zero: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        for path, x in zip(ctx.paths, ctx.xs):
            # one zero seen through a stride-0 view costs no memory; a distributed tensor's
            # zeros must carry its placements
            if type(x) is torch.Tensor:
                key = (x.dtype, x.device)
                if key not in zero:
                    zero[key] = torch.zeros((), dtype=x.dtype, device=x.device)
                z = zero[key].expand(x.shape)
            else:
                z = torch.zeros_like(x)
            ctx.frame.handed[path] = z
            zeros.append(z)
        return (None, None, None, *zeros)


class _LayerSlices(Mapping[str, torch.Tensor]):
    """Layer ``i``'s slice of each stacked leaf, by path, cut when asked for (a receiver reads
    one only for a gradient that is not a plain tensor)."""

    def __init__(self, paths: tuple[str, ...], xs: list[torch.Tensor], i: int) -> None:
        self.paths, self.xs, self.i = paths, xs, i

    def __getitem__(self, path: str) -> torch.Tensor:
        return self.xs[self.paths.index(path)][self.i]

    def __iter__(self) -> Iterator[str]:
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)


class _Tap(torch.autograd.Function):
    """Identity on a layer's tracked slices whose backward hands their gradients to the frame."""

    @staticmethod
    def forward(
        ctx: Any, frame: LayerGrads, i: int, paths: tuple[str, ...], *xs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.frame, ctx.i, ctx.paths = frame, i, paths
        ctx.params = [x.detach() for x in xs]
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.frame.on_layer(ctx.i, dict(zip(ctx.paths, grads)), dict(zip(ctx.paths, ctx.params)))
        return (None, None, None, *(None for _ in grads))


def num_layers(blocks: PyTree) -> int:
    """The size of the leading (layer) axis shared by every leaf of ``blocks``."""
    sizes = {x.shape[0] if x.dim() else None for x in tree.tensors(blocks)}
    if len(sizes) != 1 or None in sizes:
        shapes = {p: tuple(x.shape) for p, x in tree.flatten_with_paths(blocks)[0]}
        raise ValueError(
            f"stacked blocks must share one leading layer axis; got leaf shapes {shapes}"
        )
    (n,) = sizes
    assert n is not None
    return n


def _plain_scan(
    block: ScanBlock, carry: PyTree, blocks: PyTree, xs: PyTree
) -> tuple[PyTree, PyTree]:
    n = num_layers(blocks)
    # unbind once per leaf (its backward is a single stack), not x[i] per layer (whose backward
    # would materialise a full-size zero gradient per layer).
    flat, treedef = tree.flatten_with_paths(blocks)
    leaves = [x for _, x in flat]
    taps = innermost(LayerGrads)
    tracked = (
        []
        if taps is None or not torch.is_grad_enabled()
        else [k for k, x in enumerate(leaves) if id(x) in taps.paths]
    )
    taken: dict[int, Any] = {}  # leaf index -> its rows, through the node that takes grads
    early: Collection[int] = ()
    if tracked:
        assert taps is not None
        paths = tuple(taps.paths[id(leaves[k])] for k in tracked)
        early = taps.early_layers(paths, n)
        late = tuple(i for i in range(n) if i not in early)
        rows = _Unstack.apply(taps, paths, late, *(leaves[k] for k in tracked))
        taken = {k: rows[m * n : (m + 1) * n] for m, k in enumerate(tracked)}
    per_leaf = [taken[k] if k in taken else x.unbind(0) for k, x in enumerate(leaves)]
    x_rows = _rows(xs, n)
    ys: list[PyTree] = []
    for i in range(n):
        layer = [r[i] for r in per_leaf]
        if i in early:
            tapped = _Tap.apply(taps, i, paths, *(layer[k] for k in tracked))
            for k, t in zip(tracked, tapped):
                layer[k] = t
        carry, y = block(tree.unflatten(treedef, layer), carry, x_rows[i])
        ys.append(y)
    return carry, _stack(ys)


def _rows(xs: PyTree, n: int) -> list[PyTree]:
    """``xs`` cut along its leading layer axis: one pytree per layer (``None`` without xs)."""
    if xs is None:
        return [None] * n
    flat, treedef = tree.flatten_with_paths(xs)
    for path, x in flat:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != n:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"scan_layers: xs.{path} must be a tensor stacked on a leading layer axis of "
                f"size {n} (the number of layers), got {shape}"
            )
    per_leaf = [x.unbind(0) for _, x in flat]
    return [tree.unflatten(treedef, [r[i] for r in per_leaf]) for i in range(n)]


def _stack(ys: list[PyTree]) -> PyTree:
    """The per-layer outputs stacked on a new leading layer axis (``None`` if every one is)."""
    if not ys or all(y is None for y in ys):
        return None
    structures = {tree.structure(y) for y in ys}
    if len(structures) != 1:
        raise ValueError(
            f"scan_layers: every layer's y must have one structure; got {sorted(map(str, structures))}"
        )
    per_layer = [tree.leaves(y) for y in ys]
    return tree.unflatten(
        tree.structure(ys[0]), [torch.stack(list(col)) for col in zip(*per_layer)]
    )


def _run_scan(block: ScanBlock, carry: PyTree, blocks: PyTree, xs: PyTree) -> tuple[PyTree, PyTree]:
    """Run the scan through every :class:`ScanInterceptor` on the stack, innermost first."""
    chain = [f for f in _STACK.frames if _implements(f, ScanInterceptor)]

    def run(i: int, block: ScanBlock, carry: PyTree, blocks: PyTree, xs: PyTree) -> Any:
        if i < 0:
            return _plain_scan(block, carry, blocks, xs)
        return chain[i].scan_layers(
            block, carry, blocks, xs, lambda b, c, bl, x: run(i - 1, b, c, bl, x)
        )

    return run(len(chain) - 1, block, carry, blocks, xs)


def scan_layers(block: Callable[..., Any], carry: PyTree, blocks: PyTree, xs: PyTree = None) -> Any:
    """``jax.lax.scan`` over the leading layer axis of ``blocks``.

    Without ``xs``: ``carry = block(layer_params, carry)`` for each layer, and the final carry is
    returned. With ``xs`` (a pytree of tensors stacked on the same leading layer axis, e.g. this
    layer's KV cache): ``carry, y = block(layer_params, carry, x)`` with ``x`` the layer's slice
    of ``xs``, and the scan returns ``(carry, ys)``, the ``y``\\ s stacked per layer (``None``
    where every ``y`` is None). ``carry`` is any pytree: hidden state, conditioning, positions.

    Semantically a loop; transforms on the context stack may change *how* it runs (checkpointed,
    gathered per layer, only a pipeline stage's layers) but never what it computes.

    Example:
        >>> h = cf.scan_layers(lambda layer, h: h @ layer["w"], h, {"w": torch.randn(4, 8, 8)})
        >>> (h, c), ys = cf.scan_layers(lambda l, hc, kv: (hc, kv + 1), (h, c), blocks, xs=kv)
    """
    if xs is None:
        carry, _ = _run_scan(lambda layer, c, x: (block(layer, c), None), carry, blocks, None)
        return carry
    return _run_scan(block, carry, blocks, xs)


class Layered:
    """A loss made of three pure parts; see :func:`layered`."""

    def __init__(
        self,
        pre: Callable[[PyTree, PyTree], PyTree],
        block: Block,
        post: Callable[[PyTree, PyTree, PyTree], torch.Tensor],
        *,
        name: str = "layered",
        divisors: Mapping[str, int | None] | None = None,
        sequence_dims: Mapping[str, int] | None = None,
        batch_sequence_dims: Mapping[str, int] | None = None,
        xs: Callable[[PyTree, PyTree], PyTree] | None = None,
        expert_dims: Mapping[str, int] | None = None,
    ) -> None:
        for label, fn in (("pre", pre), ("block", block), ("post", post)):
            if not callable(fn):
                raise TypeError(f"layered: {label} must be callable, got {fn!r}")
        if xs is not None and not callable(xs):
            raise TypeError(f"layered: xs must be callable (params, batch) -> pytree, got {xs!r}")
        self.xs = xs
        dims = {"": 1} if sequence_dims is None else dict(sequence_dims)
        for path, dim in dims.items():
            if not isinstance(path, str) or isinstance(dim, bool) or not isinstance(dim, int):
                raise TypeError(
                    f"layered: sequence_dims maps carry leaf paths (str) to dims (int), got "
                    f"{path!r}: {dim!r}"
                )
        self.pre, self.block, self.post, self.name = pre, block, post, name
        self.divisors = dict(divisors or {})
        self.sequence_dims = dims
        bdims = None if batch_sequence_dims is None else dict(batch_sequence_dims)
        for path, dim in (bdims or {}).items():
            if not isinstance(path, str) or isinstance(dim, bool) or not isinstance(dim, int):
                raise TypeError(
                    f"layered: batch_sequence_dims maps batch entry paths (str) to dims (int), "
                    f"got {path!r}: {dim!r}"
                )
        self.batch_sequence_dims = bdims
        edims = dict(expert_dims or {})
        for path, dim in edims.items():
            if not isinstance(path, str) or isinstance(dim, bool) or not isinstance(dim, int):
                raise TypeError(
                    f"layered: expert_dims maps parameter paths (str) to their expert dim (int), "
                    f"got {path!r}: {dim!r}"
                )
        self.expert_dims = edims

    def __call__(self, params: PyTree, batch: PyTree) -> torch.Tensor:
        if self.xs is None:
            return self.post(params, self.carry(params, batch), batch)
        carry, ys = self.run(params, batch)
        return self.post(params, carry, batch, ys)  # type: ignore[call-arg]

    def _check(self, params: PyTree) -> None:
        if not isinstance(params, dict) or "blocks" not in params:
            keys = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ValueError(
                f"{self.name}: params must be a dict with the stacked layers under 'blocks'; got {keys}"
            )

    def carry(self, params: PyTree, batch: PyTree) -> PyTree:
        """The carry after the last layer: ``pre``, then the scan of ``block``."""
        self._check(params)
        if self.xs is not None:
            return self.run(params, batch)[0]
        return scan_layers(self.block, self.pre(params, batch), params["blocks"])

    def run(self, params: PyTree, batch: PyTree) -> tuple[PyTree, PyTree]:
        """``(carry, ys)`` after the last layer of a loss with per-layer ``xs``."""
        self._check(params)
        if self.xs is None:
            raise ValueError(f"{self.name}: run() is for a layered loss with xs; use carry()")
        xs = self.xs(params, batch)
        return scan_layers(self.block, self.pre(params, batch), params["blocks"], xs=xs)

    def __repr__(self) -> str:
        return f"Layered({self.name})"


def layered(
    pre: Callable[[PyTree, PyTree], PyTree],
    block: Block,
    post: Callable[[PyTree, PyTree, PyTree], torch.Tensor],
    *,
    name: str = "layered",
    divisors: Mapping[str, int | None] | None = None,
    sequence_dims: Mapping[str, int] | None = None,
    batch_sequence_dims: Mapping[str, int] | None = None,
    xs: Callable[[PyTree, PyTree], PyTree] | None = None,
    expert_dims: Mapping[str, int] | None = None,
) -> Layered:
    """A loss function ``(params, batch) -> loss`` made of three pure parts.

    ``pre(params, batch) -> carry`` (any pytree of tensors: hidden state, conditioning,
    positions); ``block(layer_params, carry) -> carry`` scanned over ``params["blocks"]`` by
    :func:`scan_layers`; ``post(params, carry, batch) -> loss``. ``pipeline`` needs this form,
    since it tells where a model may be cut into stages (every tensor leaf of the carry crosses
    between stages).

    ``divisors`` names the sizes that a tensor-parallel axis must divide for the model's plan to
    split it cleanly, e.g. ``{"n_head": 12}``: ``shard`` checks them against its mesh.
    ``sequence_dims`` maps the paths of the carry leaves that have a sequence dim to that dim,
    which sequence parallelism splits (default ``{"": 1}``: the carry is one ``[B, T, ...]``
    tensor); leaves not named (conditioning, rotary tables) stay whole.
    ``batch_sequence_dims`` does the same for the batch, which the long-context modes
    (``shard(sequence_parallel="ulysses" | "ring" | "zigzag" | "usp")``) split before the model
    runs (default None: every batch tensor of two or more dims, on dim 1, as ``[B, T]`` token ids
    and labels are).

    With ``xs(params, batch)`` (a pytree stacked on a leading layer axis: per-layer noise,
    conditioning, a cache), the scan runs with those ``xs``: ``block(layer_params, carry, x) ->
    (carry, y)`` and ``post(params, carry, batch, ys)`` gets the ``y``\\ s stacked per layer
    (per-layer auxiliary losses, say). Under ``pipeline`` each stage takes its layers' rows of
    ``xs``, and the ``ys`` so far travel with the carry to the last stage.

    ``expert_dims`` maps the paths of a mixture of experts' stacked expert weights to their
    expert dim (``{"blocks.mlp.experts.w_gate": 1, ...}``): ``shard(expert_axis=...)`` splits
    them there.

    Example:
        >>> loss = cf.layered(pre, block, post, sequence_dims={"h": 1})  # carry {"h", "cond"}
    """
    return Layered(
        pre,
        block,
        post,
        name=name,
        divisors=divisors,
        sequence_dims=sequence_dims,
        batch_sequence_dims=batch_sequence_dims,
        xs=xs,
        expert_dims=expert_dims,
    )
