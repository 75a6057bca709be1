"""Optimizers in the optax shape, with PyTorch's argument names and defaults.

Each optimizer is a :class:`GradientTransformation`: ``init(params) -> state`` and a pure
``update(grads, state, params) -> (updates, state)``; ``apply_updates(params, updates)`` gives the
new parameters. States are pytrees: tensors mirroring the parameters in fp32 (fp64 for fp64 parameters),
and Python int counters.

Example:
    >>> opt = chain(clip_by_global_norm(1.0), adamw(warmup_cosine(3e-4, 100, 10_000)))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
    >>> params = apply_updates(params, updates)
"""

from colfunc.optim import learning_rates
from colfunc.optim.accumulate import AccumulateState, accumulate
from colfunc.optim.adam import AdamState, AdamWHyper, adam, adamw
from colfunc.optim.base import (
    GradientTransformation,
    LearningRate,
    apply_updates,
    chain,
    learning_rate,
)
from colfunc.optim.clip import clip_by_global_norm, global_norm
from colfunc.optim.learning_rates import constant, linear_warmup, warmup_cosine
from colfunc.optim.partition import masked, multi_transform, set_to_zero
from colfunc.optim.sgd import SgdState, sgd

__all__ = [
    "AccumulateState",
    "AdamState",
    "AdamWHyper",
    "GradientTransformation",
    "LearningRate",
    "SgdState",
    "accumulate",
    "adam",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "global_norm",
    "learning_rate",
    "learning_rates",
    "linear_warmup",
    "masked",
    "multi_transform",
    "set_to_zero",
    "sgd",
    "warmup_cosine",
]
