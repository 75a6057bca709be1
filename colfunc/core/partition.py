"""``P``, a partition spec: which mesh axes split each dim of a parameter (a plan's values), and
``Plan``, a plan whose optional patterns may match no parameter."""

from __future__ import annotations


class P(tuple):
    """A partition spec: for each tensor dim, the mesh axis (or tuple of axes) it is split over.

    ``P(None, "tp")`` keeps dim 0 whole and splits dim 1 over the ``tp`` axis;
    ``P(("dp", "tp"))`` splits dim 0 over both axes (``dp`` major). Trailing dims not named are
    whole. It lives on the ground floor so that models can state plans without importing the
    distributed core.
    """

    def __new__(cls, *entries: str | tuple[str, ...] | None) -> P:
        seen: set[str] = set()
        for dim, e in enumerate(entries):
            names = e if isinstance(e, tuple) else (e,)
            for name in names:
                if name is None and not isinstance(e, tuple):
                    continue
                if not isinstance(name, str) or not name:
                    raise TypeError(
                        f"P: entry for dim {dim} must be None, an axis name or a tuple of axis "
                        f"names; got {e!r}"
                    )
                if name in seen:
                    raise ValueError(f"P{entries!r}: mesh axis {name!r} is used for two dims")
                seen.add(name)
        return super().__new__(cls, entries)

    def axes(self) -> tuple[str, ...]:
        """Every mesh axis named, in dim order."""
        out: list[str] = []
        for e in self:
            if isinstance(e, tuple):
                out.extend(e)
            elif e is not None:
                out.append(e)
        return tuple(out)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"


class Plan(dict[str, P]):
    """A plan (path pattern -> :class:`P`) naming the patterns that may match no parameter:
    ``optional``, the parameters some of a model's configs lack (an untied head). Any other
    pattern that matches nothing is an error in ``shard`` (a mistyped path)."""

    def __init__(self, entries: dict[str, P], optional: frozenset[str] | set[str] = frozenset()):
        super().__init__(entries)
        self.optional = frozenset(optional)

    def __repr__(self) -> str:
        return f"Plan({dict.__repr__(self)}, optional={sorted(self.optional)})"
