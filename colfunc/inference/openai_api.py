"""The OpenAI API's requests as the server reads them: the pydantic models of the completions
and chat requests, the fields refused by name, and the sampling parameters a request asks for
(see :mod:`colfunc.inference.server`)."""

from __future__ import annotations

import contextlib
import json
from typing import Any, Literal

import pydantic
from fastapi.responses import JSONResponse

from colfunc.inference.grammar import Structure
from colfunc.inference.sampling import SamplingParams

__all__ = [
    "BadRequest",
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "Sampling",
    "TokenizeRequest",
    "error",
    "params_of",
    "prompt_list",
    "refuse_unbuilt",
    "structure_of",
    "visible",
]


class Sampling(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    # fields of the OpenAI API this server does not compute yet: refused by name when they
    # would change the answer (see refuse_unbuilt), never silently ignored
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    # vLLM's extra sampling fields that would change the answer: refused too, by name
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    use_beam_search: bool = False
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None


def prompt_list(prompt: Any) -> list[Any]:
    """The prompts of a completions request: one string or token list, or a list of either."""
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        return [prompt]
    return list(prompt)


_VLLM_GUIDED = ("guided_grammar", "structured_outputs")  # (the other guided_* are built)


def refuse_unbuilt(req: Sampling) -> None:
    """A 400 naming the first field whose value this server would otherwise ignore: what a
    client asks for and does not get must not come back as a plausible answer."""
    unbuilt: list[tuple[str, bool]] = [
        ("suffix", getattr(req, "suffix", None) is not None),
        ("best_of", req.best_of is not None and req.best_of != req.n and req.stream),
        ("functions", bool(req.functions)),
        ("function_call", req.function_call not in (None, "none", "auto")),
        *((f, getattr(req, f) is not None) for f in _VLLM_GUIDED),
        ("min_tokens", req.min_tokens != 0),
        ("allowed_token_ids", req.allowed_token_ids is not None),
        ("bad_words", bool(req.bad_words)),
        ("use_beam_search", req.use_beam_search),
        ("include_stop_str_in_output", req.include_stop_str_in_output),
        ("truncate_prompt_tokens", req.truncate_prompt_tokens is not None),
    ]
    for field, asked in unbuilt:
        if asked:
            raise BadRequest(
                f"{field}={getattr(req, field)!r} is not supported by this server: it would be "
                f"ignored, so the request is refused; leave {field} out",
                field,
            )


class _Message(pydantic.BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # a string, or OpenAI's content parts (text parts only: an image is refused by name); an
    # assistant's message of tool calls may have none
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it, its text parts joined (and its tool calls,
        their arguments as objects, or the call a tool's message answers)."""
        extra: dict[str, Any] = {}
        if self.tool_calls:
            extra["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            extra["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            extra["name"] = self.name
        if self.content is None or isinstance(self.content, str):
            return {"role": self.role, "content": self.content or "", **extra}
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(
                    f"messages: a content part of type {part.get('type')!r} is not supported by "
                    "this server (text parts only)",
                    "messages",
                )
            texts.append(part["text"])
        return {"role": self.role, "content": "".join(texts), **extra}


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):  # (templates render the arguments' object)
        with contextlib.suppress(json.JSONDecodeError):
            fn["arguments"] = json.loads(fn["arguments"])
    return {**call, "function": fn}


class TokenizeRequest(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[_Message] | None = None


class DetokenizeRequest(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class ChatRequest(Sampling):
    messages: list[_Message]
    logprobs: bool = False
    top_logprobs: int | None = None


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def error(status: int, message: str, kind: str, param: str | None = None, code: Any = None):
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _token_id(key: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise BadRequest(
            f"logit_bias keys are token ids (as strings), got {key!r}", "logit_bias"
        ) from None


def structure_of(req: Sampling) -> Structure | None:
    """The structure a request confines its output to: OpenAI's ``response_format``
    (``json_object``, ``json_schema``), or vLLM's ``guided_json``, ``guided_regex`` or
    ``guided_choice``; at most one of them."""
    asked: list[tuple[str, Any]] = []
    rf = req.response_format or {}
    kind = rf.get("type", "text")
    if kind == "json_object":
        asked.append(("response_format", lambda: Structure("json_object")))
    elif kind == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema")
        asked.append(("response_format", lambda: Structure.json_schema(schema)))
    elif kind != "text":
        raise BadRequest(
            f"response_format type {kind!r} is not supported: text, json_object or json_schema",
            "response_format",
        )
    if req.guided_json is not None:
        asked.append(("guided_json", lambda: Structure.json_schema(req.guided_json)))
    if req.guided_regex is not None:
        asked.append(("guided_regex", lambda: Structure("regex", req.guided_regex)))
    if req.guided_choice is not None:
        asked.append(("guided_choice", lambda: Structure.choice(req.guided_choice)))
    if len(asked) > 1:
        names = ", ".join(n for n, _ in asked)
        raise BadRequest(f"give one structure, not several ({names})", asked[1][0])
    if not asked:
        return None
    field, make = asked[0]
    try:
        structure: Structure = make()
    except (TypeError, ValueError) as e:
        raise BadRequest(f"{field}: {str(e).removeprefix('Structure: ')}", field) from e
    return structure


def params_of(req: Sampling, logprobs: int | None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    try:
        return SamplingParams(
            n=req.n,
            max_tokens=16 if max_tokens is None else max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            seed=req.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            logit_bias=tuple((_token_id(t), b) for t, b in (req.logit_bias or {}).items()),
            structure=structure_of(req),
        )
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e).removeprefix("SamplingParams: ")) from e


def visible(text: str, finished: bool, params: SamplingParams) -> str:
    """What of a completion's text may be sent yet: a possible start of a stop string, or a
    character still being decoded, is held back until the completion ends."""
    if finished:
        return text
    hold = max((len(s) - 1 for s in params.stop), default=0)
    end = len(text) - hold
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    return text[: max(end, 0)]
