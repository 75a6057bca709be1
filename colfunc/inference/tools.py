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


def _call(m: re.Match[str]) -> dict[str, Any] | None:
    """The call a ``<tool_call>`` block holds, as OpenAI returns it; None if it is not one."""
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))},
    }


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A completion's text outside its tool calls (trailing whitespace dropped; None if nothing
    is left) and the calls, as OpenAI returns them (``{"id", "type": "function", "function":
    {"name", "arguments"}}``, the arguments as JSON text). A block that is not a call's JSON
    stays in the text; without calls, the text is returned as it is."""
    calls, kept, at = [], [], 0
    for m in _CALL.finditer(text):
        call = _call(m)
        if call is None:
            continue
        kept.append(text[at : m.start()])
        at = m.end()
        calls.append(call)
    kept.append(text[at:])
    rest = "".join(kept).rstrip()
    return (rest or None) if calls else text, calls


class ToolStream:
    """A chat completion's text, as it grows, cut into what OpenAI streams: content deltas, and
    each call whole as soon as its ``</tool_call>`` is written. What it hands out reassembles to
    :func:`parse` of the whole text: text that may open a call, and trailing whitespace (which
    :func:`parse` drops once there is a call), wait until they are known to be content."""

    def __init__(self) -> None:
        self.done = 0  # the text handed out (or held in `pending`) so far
        self.pending = ""  # trailing whitespace held back
        self.calls = 0

    def _content(self, piece: str) -> str:
        s = self.pending + piece
        body = s.rstrip()
        self.pending = s[len(body) :]
        return body

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content and the calls ``text`` (the whole text so far; ``final``: all of it)
        adds to what was handed out."""
        content, calls = "", []
        while (m := _CALL.search(text, self.done)) is not None:
            call = _call(m)
            if call is None:  # (not a call: text)
                content += self._content(text[self.done : m.end()])
            else:
                content += self._content(text[self.done : m.start()])
                calls.append(call)
            self.done = m.end()
        tail = text[self.done :]
        if final:
            content += self._content(tail)
            if not self.calls and not calls:  # no call: the text as it is
                content, self.pending = content + self.pending, ""
            self.done = len(text)
        else:  # up to a call begun, or to what may begin one
            at = tail.find(OPEN)
            if at < 0:
                at = len(tail) - max(
                    (k for k in range(1, len(OPEN)) if tail.endswith(OPEN[:k])), default=0
                )
            content += self._content(tail[:at])
            self.done += at
        self.calls += len(calls)
        return content, calls
