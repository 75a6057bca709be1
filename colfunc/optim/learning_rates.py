"""Learning rates that change with the update count: :data:`~colfunc.optim.LearningRate`, a
``Callable[[int], float]`` of the update count (from 0).

("Schedule" in colfunc means a pipeline schedule; these are learning rates.) An optimizer
evaluates its learning rate at the number of updates it has done, so update ``t`` (from 0)
uses ``lr(t)``: the convention of optax and of ``torch.optim.lr_scheduler.LambdaLR`` stepped
after each optimizer step. They are frozen values: comparable, printable and picklable.
"""

from __future__ import annotations

import dataclasses
import math

from colfunc.optim.base import check_number

__all__ = ["constant", "linear_warmup", "warmup_cosine"]


def _check_steps(owner: str, name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{owner}: {name} must be >= {low}, got {value}")


def _check_count(owner: str, count: int) -> None:
    if count < 0:
        raise ValueError(f"{owner}: the update count must be >= 0, got {count}")


@dataclasses.dataclass(frozen=True)
class _Constant:
    value: float

    def __post_init__(self) -> None:
        check_number("constant", "value", self.value, low=0.0)

    def __call__(self, count: int) -> float:
        _check_count("constant", count)
        return float(self.value)


@dataclasses.dataclass(frozen=True)
class _LinearWarmup:
    peak_lr: float
    warmup_steps: int
    init_lr: float

    def __post_init__(self) -> None:
        check_number("linear_warmup", "peak_lr", self.peak_lr, low=0.0)
        check_number("linear_warmup", "init_lr", self.init_lr, low=0.0)
        _check_steps("linear_warmup", "warmup_steps", self.warmup_steps, low=0)

    def __call__(self, count: int) -> float:
        _check_count("linear_warmup", count)
        if count >= self.warmup_steps:
            return float(self.peak_lr)
        return self.init_lr + (self.peak_lr - self.init_lr) * count / self.warmup_steps


@dataclasses.dataclass(frozen=True)
class _WarmupCosine:
    peak_lr: float
    warmup_steps: int
    total_steps: int
    final_lr: float

    def __post_init__(self) -> None:
        check_number("warmup_cosine", "peak_lr", self.peak_lr, low=0.0)
        check_number("warmup_cosine", "final_lr", self.final_lr, low=0.0)
        _check_steps("warmup_cosine", "warmup_steps", self.warmup_steps, low=0)
        _check_steps("warmup_cosine", "total_steps", self.total_steps, low=1)
        if self.warmup_steps > self.total_steps:
            raise ValueError(
                f"warmup_cosine: warmup_steps ({self.warmup_steps}) must be <= total_steps "
                f"({self.total_steps})"
            )

    def __call__(self, count: int) -> float:
        _check_count("warmup_cosine", count)
        if count < self.warmup_steps:
            return self.peak_lr * count / self.warmup_steps
        if count >= self.total_steps:
            return float(self.final_lr)
        progress = (count - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        # a weighted mean rather than final + (peak - final) * c: exactly peak_lr where c = 1
        return self.peak_lr * cosine + self.final_lr * (1.0 - cosine)


def constant(value: float) -> _Constant:
    """``value`` at every update."""
    return _Constant(value)


def linear_warmup(peak_lr: float, warmup_steps: int, init_lr: float = 0.0) -> _LinearWarmup:
    """Linear from ``init_lr`` (update 0) to ``peak_lr`` (update ``warmup_steps``), then flat."""
    return _LinearWarmup(peak_lr, warmup_steps, init_lr)


def warmup_cosine(
    peak_lr: float, warmup_steps: int, total_steps: int, final_lr: float = 0.0
) -> _WarmupCosine:
    """Linear warmup from 0 to ``peak_lr``, cosine decay to ``final_lr`` at ``total_steps``.

    ``lr(t) = peak_lr * t / warmup_steps`` for ``t < warmup_steps``; then, with
    ``c = (1 + cos(pi * (t - warmup_steps) / (total_steps - warmup_steps))) / 2``,
    ``lr(t) = c * peak_lr + (1 - c) * final_lr`` up to ``total_steps``; ``final_lr`` from there on.
    With ``final_lr=0`` this is Hugging Face's ``get_cosine_schedule_with_warmup`` up to
    ``total_steps``.

    Example:
        >>> opt = adamw(warmup_cosine(3e-4, warmup_steps=100, total_steps=10_000))
    """
    return _WarmupCosine(peak_lr, warmup_steps, total_steps, final_lr)
