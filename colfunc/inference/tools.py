"""Tool calling in the Hermes/Qwen format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

The request's ``tools`` reach the model through the folder's chat template (its ``tools``
context, or, for a template that does not render tools, a system message listing them in the
same format). ``tool_choice``: ``"none"`` leaves them out, ``"auto"`` lets the model answer
freely and parses any calls it writes, ``"required"`` and a named function confine the answer to
calls (of any declared function, or of that one) by a grammar whose arguments follow each
function's JSON schema, so the answer always parses (:func:`structure`). :func:`parse` splits a
completion into its text and its calls, as OpenAI returns them.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from colfunc.inference.grammar import TOOL_CLOSE as CLOSE
from colfunc.inference.grammar import TOOL_OPEN as OPEN
from colfunc.inference.grammar import Structure

__all__ = ["CLOSE", "OPEN", "ToolStream", "functions", "parse", "structure", "system_message"]
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def functions(tools: list[Any]) -> list[dict[str, Any]]:
    """The declared functions (``{"name", "description", "parameters"}``) of OpenAI's
    ``tools``; a ValueError naming what is wrong."""
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ValueError(
                f"tools[{i}].function.name must be 1-64 of [A-Za-z0-9_.-], got {name!r}"
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append({"name": name, "description": fn.get("description", ""), "parameters": params})
    names = [f["name"] for f in out]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: function names repeat: {names}")
    return out


def structure(fns: list[dict[str, Any]], choice: Any) -> Structure | None:
    """The structure that ``tool_choice`` asks for: None for ``"none"`` and ``"auto"``; one or
    more calls of a declared function (``"required"``), or of the function named by
    ``{"type": "function", "function": {"name": ...}}``."""
    if choice in (None, "none", "auto"):
        return None
    if choice == "required":
        chosen = fns
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [f for f in fns if f["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names {name!r}, which tools do not declare")
    else:
        raise ValueError(
            f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}"
        )
    return Structure("tool_calls", json.dumps([{"name": f["name"], "parameters": f["parameters"]}
                                               for f in chosen]))  # fmt: skip


def system_message(fns: list[dict[str, Any]]) -> dict[str, str]:
    """The tools as a system message, for a chat template that does not render them."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in fns)
    return {
        "role": "system",
        "content": "You may call these functions:\n<tools>\n" + listed + "\n</tools>\nTo call "
        "one, answer " + OPEN + '\n{"name": <name>, "arguments": <arguments>}\n' + CLOSE,
    }


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:')


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _args(rest: str) -> str:
    """A call's arguments from its text after ``"arguments":``: without the whitespace around
    them and the call's own closing brace (the last one, as far as the text goes). A prefix of
    the text gives a prefix of the whole text's arguments, so they stream as they come."""
    body = rest.strip()
    return body[:-1].rstrip() if body.endswith("}") else body


def _head(body: str, at: int = 0) -> tuple[str, int] | None:
    """The name of a call written name first (``{"name": ..., "arguments": ...``) at ``at``,
    and where its arguments begin; None if it is not written so."""
    m = _HEAD.match(body, at)
    if m is None:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except json.JSONDecodeError:
        return None
    return name, m.end()


def _call(body: str) -> dict[str, Any] | None:
    """The call a ``<tool_call>`` block's text holds, as OpenAI returns it; None if it is not
    one. Written name first, its arguments are the model's own text (valid JSON or not, as
    OpenAI's are); otherwise the block must be a call's JSON, its arguments written again."""
    head = _head(body)
    if head is not None:
        name, at = head
        return {"id": _call_id(), "type": "function",
                "function": {"name": name, "arguments": _args(body[at:])}}  # fmt: skip
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return {
        "id": _call_id(),
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))},
    }


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A completion's text outside its tool calls (trailing whitespace dropped; None if nothing
    is left) and the calls, as OpenAI returns them (``{"id", "type": "function", "function":
    {"name", "arguments"}}``, the arguments as JSON text). A block that is not a call's JSON
    stays in the text; without calls, the text is returned as it is. A last block left open (the
    output cut short) is a call if it is written name first: its arguments as far as they go."""
    calls, kept, at, last = [], [], 0, 0  # (last: the end of the last block, a call or not)
    for m in _CALL.finditer(text):
        last = m.end()
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[at : m.start()])
        at = m.end()
        calls.append(call)
    opened = text.find(OPEN, last)
    head = _head(text, opened + len(OPEN)) if opened >= 0 else None
    if head is not None:
        name, begin = head
        kept.append(text[at:opened])
        at = len(text)
        calls.append({"id": _call_id(), "type": "function",
                      "function": {"name": name, "arguments": _args(text[begin:])}})  # fmt: skip
    kept.append(text[at:])
    rest = "".join(kept).rstrip()
    return (rest or None) if calls else text, calls


def _held(tail: str, tag: str) -> int:
    """How many characters at the end of ``tail`` may begin ``tag``."""
    return max((k for k in range(1, len(tag)) if tail.endswith(tag[:k])), default=0)


class ToolStream:
    """A chat completion's text, as it grows, cut into what OpenAI streams: content deltas, and
    the calls' deltas (``{"index", ...}``). A call written name first streams as it is written:
    its id, type and name once they are known (with ``arguments: ""``), then each new piece of
    its arguments; any other call comes whole once its ``</tool_call>`` is written. What it
    hands out reassembles to :func:`parse` of the whole text: text that may open a call, a
    closing brace that may be the call's own, and trailing whitespace (which :func:`parse`
    drops once there is a call) wait until they are known."""

    def __init__(self) -> None:
        self.done = 0  # the text handed out (or held in `pending`) so far
        self.pending = ""  # trailing whitespace held back
        self.calls = 0
        self.open: tuple[int, int, int] | None = None  # a call streaming: (tag at, args at, index)
        self.sent = ""  # the open call's arguments handed out

    def _content(self, piece: str) -> str:
        s = self.pending + piece
        body = s.rstrip()
        self.pending = s[len(body) :]
        return body

    def _more(self, args: str) -> list[dict[str, Any]]:
        assert self.open is not None and args.startswith(self.sent)  # (see _args)
        piece, self.sent = args[len(self.sent) :], args
        return [{"index": self.open[2], "function": {"arguments": piece}}] if piece else []

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content and the calls' deltas ``text`` (the whole text so far; ``final``: all of
        it) adds to what was handed out."""
        content, deltas = "", []
        while True:
            if self.open is not None:  # a call streaming: its new arguments, and its end
                tag, begin, _ = self.open
                m = _CALL.match(text, tag)
                if m is None and not final:
                    tail = text[begin:]
                    deltas += self._more(_args(tail[: len(tail) - _held(tail, CLOSE)]))
                    break
                end = m.end(1) if m is not None else len(text)
                deltas += self._more(_args(text[begin:end]))
                self.done, self.open, self.sent = m.end() if m else len(text), None, ""
                continue
            m = _CALL.search(text, self.done)
            if m is not None:  # a block closed (the first tag ahead: see _CALL)
                call = _call(m.group(1))
                if call is None:  # (not a call: text)
                    content += self._content(text[self.done : m.end()])
                else:
                    content += self._content(text[self.done : m.start()])
                    deltas.append({"index": self.calls, **call})
                    self.calls += 1
                self.done = m.end()
                continue
            tail = text[self.done :]
            at = tail.find(OPEN)
            if at >= 0:  # a block open: a call once its name is written first
                content += self._content(tail[:at])
                self.done += at
                head = _head(text, self.done + len(OPEN))
                if head is not None:
                    name, begin = head
                    self.open = (self.done, begin, self.calls)
                    deltas.append({"index": self.calls, "id": _call_id(), "type": "function",
                                   "function": {"name": name, "arguments": ""}})  # fmt: skip
                    self.calls += 1
                    continue
                if final:
                    content += self._content(text[self.done :])
                    self.done = len(text)
                break
            if final:
                content += self._content(tail)
                self.done = len(text)
            else:  # up to what may begin a call
                cut = len(tail) - _held(tail, OPEN)
                content += self._content(tail[:cut])
                self.done += cut
            break
        if final and not self.calls:  # no call: the text as it is
            content, self.pending = content + self.pending, ""
        return content, deltas
