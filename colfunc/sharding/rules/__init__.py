"""Sharding propagation rules, one small file per ATen op family.

Importing this package registers every rule; :mod:`.registry` explains what a rule is. To add
one, write a function in the family's file (or a new file imported below)::

    @rule(aten.my_op)
    def my_op(x: Spec, dim: int) -> OpSharding: ...
"""

from colfunc.sharding.rules import (  # noqa: F401  (importing registers the rules)
    attention,
    elementwise,
    embedding,
    factories,
    indexing,
    losses,
    matmul,
    moe,
    norms,
    reductions,
    softmax,
    views,
)
from colfunc.sharding.rules.registry import RULES, OpSharding, Option, Spec, lookup, pick, rule

__all__ = ["RULES", "OpSharding", "Option", "Spec", "lookup", "pick", "rule"]
