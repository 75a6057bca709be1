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

__all__ = ["CLOSE", "OPEN", "functions", "parse", "structure", "system_message"]
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


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A completion's text outside its tool calls (None if there is none) and the calls, as
    OpenAI returns them (``{"id", "type": "function", "function": {"name", "arguments"}}``,
    the arguments as JSON text). A block that is not a call's JSON stays in the text."""
    calls, kept, at = [], [], 0
    for m in _CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        kept.append(text[at : m.start()])
        at = m.end()
        arguments = call.get("arguments", {})
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments)},
        })  # fmt: skip
    kept.append(text[at:])
    rest = "".join(kept).strip()
    return (rest or None) if calls else text, calls
