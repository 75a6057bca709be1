"""Tool calling through the server, with the openai client: ``tool_choice="required"`` and a
named function always give a call that parses, to a declared function, with arguments valid for
its schema (a random model's free choices confined by the grammar); streamed, each call's id
and name come first and its arguments piece by piece, as OpenAI streams them, and they
reassemble to the non-streamed call; ``"none"`` and ``"auto"`` answer in text (a call written in
it parsed out); a tool's result goes back as a message. The stream's cutting of a growing text
(:class:`tools.ToolStream`) reassembles to :func:`tools.parse` of the whole, wherever the
updates fall, calls cut short included."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from test_server import NAME, TEMPLATE, Served  # noqa: E402

import colfunc as cf  # noqa: E402
from colfunc.inference import tools  # noqa: E402

pytestmark = pytest.mark.timeout(600)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather",
     "parameters": {"type": "object", "properties": {
         "city": {"enum": ["Paris", "Oslo", "Lima"]},
         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
         "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A tiny GPT-2 whose context holds the tools' system message (its template renders no
    tools, so the server lists them in one)."""
    path = tmp_path_factory.mktemp("tools")
    cf.testing.save_tiny_gpt2(path, n_positions=1024, chat_template=TEMPLATE)
    return path


def _valid(call) -> None:  # type: ignore[no-untyped-def]
    assert call.type == "function" and call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_tool_choices_always_give_valid_calls(folder) -> None:
    served = Served(folder)
    try:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
        ask = [{"role": "user", "content": "weather in Oslo?"}]
        for seed in range(12):
            r = client.chat.completions.create(
                model=NAME, messages=ask, tools=TOOLS, tool_choice="required", temperature=1.0,
                seed=seed, max_tokens=200,
            )  # fmt: skip
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
            _valid(choice.message.tool_calls[0])
        named = {"type": "function", "function": {"name": "add"}}
        r = client.chat.completions.create(model=NAME, messages=ask, tools=TOOLS, tool_choice=named,
                                           temperature=1.0, seed=3, max_tokens=200)  # fmt: skip
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "add"
        _valid(call)
        # streamed: its id, type and name first, then its arguments piece by piece
        stream = client.chat.completions.create(model=NAME, messages=ask, tools=TOOLS,
                                                tool_choice=named, temperature=1.0, seed=3,
                                                max_tokens=200, stream=True)  # fmt: skip
        chunks = [ch for ch in stream if ch.choices]
        got = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        first, rest = got[0], got[1:]
        assert first.id and first.type == "function" and first.function.name == "add"
        assert len(rest) > 1 and all(d.index == 0 and d.id is None for d in rest)
        assert first.function.arguments + "".join(d.function.arguments for d in rest) == (
            call.function.arguments
        )
        # a tool's result goes back, and "none" answers in text
        history = [*ask, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "add",
             "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "42"}]  # fmt: skip
        r = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=5)  # fmt: skip
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError, match="tool_choice names 'nope'"):
            client.chat.completions.create(
                model=NAME, messages=ask, tools=TOOLS, max_tokens=5,
                tool_choice={"type": "function", "function": {"name": "nope"}},
            )  # fmt: skip
    finally:
        served.stop()


def test_calls_written_in_text_are_parsed_out() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = tools.parse(text)
    assert content == "Sure." and len(calls) == 1
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert tools.parse("<tool_call>not json</tool_call> hi") == (
        "<tool_call>not json</tool_call> hi",
        [],
    )
    with pytest.raises(ValueError, match="function names repeat"):
        tools.functions([TOOLS[0], TOOLS[0]])


_PIECES = st.sampled_from([
    "Sure.", " ", "\n", "ok <b>", "<tool", "<tool_ca", "</tool_call>", "<tool_call>not json</tool_call>",
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
    '<tool_call>{"name": "now"}</tool_call>', "<tool_call>\n{\"name\": ",
    '<tool_call>{"arguments": {"x": [1, {"y": "}"}]}, "name": "late"}</tool_call>',
    '<tool_call>\n{"name": "f\\u00e9", "arguments": ', '{"q": "a}b", ', '"n": [1, 2]', "}", " }",
    "\n</tool_", '"s": "</tool_call>"',
])  # fmt: skip


def _joined(deltas):  # type: ignore[no-untyped-def]
    """Streamed call deltas joined per call: ``[(name, arguments)]`` in order."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] == len(calls) and d["type"] == "function"
            calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]][1] += d["function"]["arguments"]
    return [tuple(c) for c in calls.values()]


@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(_PIECES, max_size=8), cuts=st.lists(st.integers(0, 200), max_size=6))
def test_streamed_content_and_calls_reassemble_to_the_parsed_answer(pieces, cuts) -> None:
    """Whatever the text and wherever the stream's updates fall, the content deltas joined
    and the calls' deltas joined per call are :func:`tools.parse` of the whole text (ids
    aside), a call left open at the end included."""
    text = "".join(pieces)
    stream, content, deltas = tools.ToolStream(), "", []
    for end in sorted({min(c, len(text)) for c in cuts}):
        got, new = stream.feed(text[:end], False)
        content += got
        deltas += new
    got, new = stream.feed(text, True)
    content, deltas = content + got, deltas + new
    want_content, want_calls = tools.parse(text)
    assert content == (want_content or "")
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
    assert _joined(deltas) == want
    assert stream.calls == len(want_calls)


def test_content_streams_before_a_call_and_each_call_once_it_closes() -> None:
    stream = tools.ToolStream()
    assert stream.feed("Sure. <tool", False) == ("Sure.", [])  # (a call may be opening)
    assert stream.feed('Sure. <tool_call>{"name": "now"', False) == ("", [])
    content, calls = stream.feed('Sure. <tool_call>{"name": "now"}</tool_call>\n', False)
    assert content == "" and [c["function"]["name"] for c in calls] == ["now"]
    assert stream.feed('Sure. <tool_call>{"name": "now"}</tool_call>\n', True) == ("", [])


def test_a_call_written_name_first_streams_its_arguments_as_they_come() -> None:
    stream, text = tools.ToolStream(), '<tool_call>\n{"name": "add", "arguments": '
    content, (head,) = stream.feed(text, False)
    assert content == "" and head["index"] == 0 and head["id"].startswith("call_")
    assert head["function"] == {"name": "add", "arguments": ""}
    text += '{"a": 1}'  # (its last brace may be the call's own: held)
    assert stream.feed(text, False) == ("", [{"index": 0, "function": {"arguments": '{"a": 1'}}])
    text += "}\n</tool_"
    assert stream.feed(text, False) == ("", [{"index": 0, "function": {"arguments": "}"}}])
    assert stream.feed(text + "call>", True) == ("", [])
    # cut short: what it wrote of its arguments, finishing with "length"
    assert tools.parse('<tool_call>{"name": "add", "arguments": {"a": 1')[1][0]["function"] == {
        "name": "add", "arguments": '{"a": 1'}  # fmt: skip
