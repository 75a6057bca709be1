"""Structured outputs: the tokens a sequence may take next, by a grammar, as a mask on its logits.

A request's :class:`Structure` (a JSON schema, any JSON object, a regular expression or a choice
among strings) is compiled by ``xgrammar`` against the engine's tokenizer (once per structure:
compiled grammars are cached) into a matcher per sequence. Before each token the matcher's
bitmask sets the logits of every token the grammar does not allow at that point to -inf, so the
sampler (greedy or not, with any filtering) picks an allowed one; the token is then fed to the
matcher. When the grammar is complete the end-of-sequence token is allowed, and taking it (or a
grammar that allows nothing more) ends the completion with ``stop``.

JSON grammars are compiled without free whitespace between tokens (``any_whitespace=False``:
compact JSON, as a model trained on it writes), so a random model's completions stay short.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any

import torch

__all__ = ["KINDS", "TOOL_CLOSE", "TOOL_OPEN", "Guide", "Structure", "compile_structure"]

KINDS = ("json_schema", "json_object", "regex", "choice", "tool_calls")
# a tool call's tags (the Hermes/Qwen format; colfunc.inference.tools)
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclasses.dataclass(frozen=True)
class Structure:
    """What a completion must be: ``kind`` one of :data:`KINDS` and its ``spec`` as text (the
    schema's JSON, the regular expression, the choices as a JSON list, the functions
    ``[{"name", "parameters"}]`` of a tool call as a JSON list; none for a JSON object).
    Checked when it is made."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Structure: kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise TypeError(f"Structure: spec must be text, got {type(self.spec).__name__}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"Structure: the JSON schema is not JSON ({e})") from None
            if not isinstance(schema, dict):
                raise ValueError(f"Structure: a JSON schema is an object, got {schema!r}")
        elif self.kind == "regex":
            try:
                re.compile(self.spec)
            except re.error as e:
                raise ValueError(
                    f"Structure: the regex {self.spec!r} does not compile ({e})"
                ) from None
        elif self.kind == "tool_calls":
            fns = json.loads(self.spec) if self.spec else None
            if not isinstance(fns, list) or not fns or not all(
                isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(
                    f.get("parameters"), dict) for f in fns
            ):  # fmt: skip
                raise ValueError(
                    f"Structure: tool_calls takes a list of {{'name', 'parameters'}}, got "
                    f"{self.spec!r}"
                )
        elif self.kind == "choice":
            choices = json.loads(self.spec) if self.spec else None
            if (
                not isinstance(choices, list)
                or not choices
                or not all(isinstance(c, str) and c for c in choices)
            ):
                raise ValueError(
                    f"Structure: choices must be a non-empty list of non-empty strings, got "
                    f"{self.spec!r}"
                )

    @classmethod
    def choice(cls, options: list[str]) -> Structure:
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def json_schema(cls, schema: Any) -> Structure:
        """A JSON schema given as a dict or its JSON text."""
        if not isinstance(schema, dict | str):
            raise ValueError(f"Structure: a JSON schema is an object, got {schema!r}")
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError(
            "structured outputs need the xgrammar package: pip install xgrammar"
        ) from None
    return xgrammar


@functools.lru_cache(maxsize=8)
def _compiler(tokenizer: Any, vocab: int, stop: tuple[int, ...]) -> Any:
    """An xgrammar compiler for the engine's tokenizer (a ``transformers`` one, or the bytes)."""
    xgr = _xgrammar()
    hf = getattr(tokenizer, "tok", None)
    if hf is not None:
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=list(stop))
    else:  # colfunc's byte tokenizer: token t is the byte t
        info = xgr.TokenizerInfo([bytes([t]) for t in range(256)] + [b""] * (vocab - 256),
                                 vocab_size=vocab, stop_token_ids=list(stop) or None)  # fmt: skip
    return _Compiler(xgr.GrammarCompiler(info))


class _Compiler:
    """An xgrammar compiler and the grammars it has compiled, by structure."""

    def __init__(self, compiler: Any) -> None:
        self.compiler = compiler
        self.grammars: dict[Structure, Any] = {}

    def compiled(self, structure: Structure) -> Any:
        if structure not in self.grammars:
            c = self.compiler
            if structure.kind == "json_schema":
                grammar = c.compile_json_schema(structure.spec, any_whitespace=False)
            elif structure.kind == "json_object":
                grammar = c.compile_builtin_json_grammar()
            elif structure.kind == "regex":
                grammar = c.compile_regex(structure.spec)
            elif structure.kind == "tool_calls":
                grammar = c.compile_grammar(_tool_call_grammar(json.loads(structure.spec)))
            else:
                choices = json.loads(structure.spec)
                grammar = c.compile_regex("|".join(re.escape(x) for x in choices))
            if len(self.grammars) >= 256:
                self.grammars.clear()
            self.grammars[structure] = grammar
        return self.grammars[structure]


def _tool_call_grammar(fns: list[dict[str, Any]]) -> Any:
    """One call of any of ``fns``: the tags around ``{"name": <its name>, "arguments": <its
    parameters' schema>}``."""
    xgr = _xgrammar()
    calls = [
        xgr.Grammar.from_json_schema(
            json.dumps(
                {
                    "type": "object",
                    "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            ),
            any_whitespace=False,
        )
        for f in fns
    ]
    return xgr.Grammar.concat(
        xgr.Grammar.from_regex(re.escape(TOOL_OPEN + "\n")),
        xgr.Grammar.union(*calls),
        xgr.Grammar.from_regex(re.escape("\n" + TOOL_CLOSE)),
    )


def compile_structure(
    structure: Structure, tokenizer: Any, vocab: int, stop: tuple[int, ...]
) -> Any:
    """The compiled grammar of ``structure`` for ``tokenizer`` (cached). ``stop``: the tokens
    that end a completion once the grammar is complete."""
    if not stop and getattr(tokenizer, "tok", None) is not None:
        raise ValueError("structured outputs need an end-of-sequence token to end a completion")
    return _compiler(tokenizer, vocab, stop).compiled(structure)


class Guide:
    """One sequence's matcher: :meth:`mask` its next logits, :meth:`accept` its token."""

    def __init__(self, compiled: Any, vocab: int) -> None:
        xgr = _xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab)
        self.vocab = vocab

    def mask(self, logits_V: torch.Tensor) -> torch.Tensor:
        """``logits`` with every token the grammar does not allow next at -inf (a copy)."""
        xgr = _xgrammar()
        self.matcher.fill_next_token_bitmask(self.bitmask)
        out = logits_V.float().clone()[None]
        xgr.apply_token_bitmask_inplace(out, self.bitmask.to(out.device), vocab_size=self.vocab)
        return out[0].to(logits_V.dtype)

    def accept(self, token: int) -> bool:
        """Feed ``token``; whether the completion is now done (its end token taken, or nothing
        more allowed)."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")
        return bool(self.matcher.is_terminated())
