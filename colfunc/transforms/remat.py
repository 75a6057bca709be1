"""``remat``: activation checkpointing of every scanned layer.

Each layer run by :func:`colfunc.scan_layers` is wrapped in PyTorch's non-reentrant checkpoint, so
its activations are dropped after the forward pass and recomputed in the backward pass. A policy
chooses what is kept anyway:

``"full"``
    keep nothing but the layer's input (least memory; one extra forward per layer).
``"save_matmuls"``
    keep the outputs of matrix multiplies and attention, recompute the cheap pointwise ops
    (selective checkpointing, Korthikanti et al. 2022: most of the memory, little of the compute).
``"none"``
    no checkpointing (the transform is then the identity).
a set of ATen op names, e.g. ``{"mm", "addmm"}``
    keep the outputs of those ops ("by name").
a callable ``policy(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy``
    PyTorch's selective-checkpoint policy function, used as is.

Recomputation repeats the same operations on the same inputs, so on the CPU the result is bitwise
that of the plain step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from colfunc import core
from colfunc.step import Step
from colfunc.transforms.composition import apply_transform

if TYPE_CHECKING:
    from colfunc.transforms.composition import Composition

__all__ = ["MATMUL_OPS", "RematConfig", "remat"]

PyTree = Any
Policy = str | Collection[str] | Callable[..., CheckpointPolicy]

# The ops whose outputs "save_matmuls" keeps: the FLOP-heavy ones.
MATMUL_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    }
)


def _save_by_name(names: frozenset[str]) -> Callable[..., CheckpointPolicy]:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = op.__name__.split(".")[0]  # "mm.default" -> "mm"
        if name in names:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _policy_fn(policy: Policy) -> Callable[..., CheckpointPolicy] | None:
    """The selective policy function, or None for plain full checkpointing."""
    if isinstance(policy, str):
        if policy == "full":
            return None
        if policy == "save_matmuls":
            return _save_by_name(MATMUL_OPS)
        raise ValueError(
            f"remat: unknown policy {policy!r}; use 'full', 'save_matmuls', 'none', a set of ATen "
            "op names to keep, or a selective-checkpoint policy function"
        )
    if callable(policy):
        return policy
    if not isinstance(policy, (set, frozenset, list, tuple)) or not all(
        isinstance(n, str) for n in policy
    ):
        raise TypeError(
            f"remat: policy must be 'full', 'save_matmuls', 'none', a set of ATen op names to "
            f"keep or a selective-checkpoint policy function, got {policy!r}"
        )
    names = frozenset(policy)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"remat: a by-name policy must be a non-empty set of op names, got {policy!r}"
        )
    return _save_by_name(names)


class _Remat:
    """Context frame: checkpoint each layer of every ``scan_layers`` inside it."""

    def __init__(self, policy_fn: Callable[..., CheckpointPolicy] | None) -> None:
        self.policy_fn = policy_fn

    def scan_layers(
        self, block: core.ScanBlock, carry: PyTree, blocks: PyTree, xs: PyTree, inner: Callable
    ) -> tuple[PyTree, PyTree]:
        def layer(layer_params: PyTree, c: PyTree, x: PyTree) -> tuple[PyTree, PyTree]:
            if not torch.is_grad_enabled():
                return block(layer_params, c, x)  # nothing to save: inference runs plainly
            kwargs: dict[str, Any] = {"use_reentrant": False}
            # a selective-checkpoint region allows one backward pass; a split backward (zero
            # bubble) takes two, so it gets full checkpointing: the same values, more recompute
            if self.policy_fn is not None and core.innermost(core.SplitBackward) is None:
                kwargs["context_fn"] = functools.partial(
                    create_selective_checkpoint_contexts, self.policy_fn
                )
            return checkpoint(block, layer_params, c, x, **kwargs)

        return inner(layer, carry, blocks, xs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RematConfig:
    """The argument of :func:`remat`, checked."""

    policy: Policy = "full"

    def __post_init__(self) -> None:
        if not (isinstance(self.policy, str) and self.policy == "none"):
            _policy_fn(self.policy)  # raises on a bad policy

    def build(self, step: Step, comp: Composition) -> Step:
        if isinstance(self.policy, str) and self.policy == "none":
            return step
        frame = _Remat(_policy_fn(self.policy))
        inner = step.forward_backward

        def forward_backward(
            params: PyTree, batch: PyTree, extra: dict[str, Any]
        ) -> tuple[torch.Tensor, PyTree]:
            with core.context(frame):
                return inner(params, batch, extra)

        # the forward pass alone saves nothing for a backward: it runs as it is
        return step.replace(forward_backward=forward_backward)


def remat(step: Step, policy: Policy = "full") -> Step:
    """Checkpoint the activations of each scanned layer of ``step``'s loss; see the module docs.

    Example:
        >>> step = cf.remat(cf.train_step(models.gpt.loss(cfg), optim.adamw(3e-4)), "save_matmuls")
    """
    if not isinstance(step, Step):
        raise TypeError(f"remat: expected a Step (from cf.train_step), got {type(step).__name__}")
    if isinstance(policy, set):
        policy = frozenset(policy)  # a config is a value: hashable, immutable
    return apply_transform(step, "remat", RematConfig(policy=policy))
