"""Structured outputs: completions confined to a JSON schema, any JSON object, a regex or a
choice, by ``xgrammar``'s token masks applied before sampling.

On a tiny random model (whose free choices are noise): 200 requests with drawn JSON schemas
(objects, arrays, enums, nested objects, required and optional fields), sampled, all end by the
grammar and validate against their schema (``jsonschema``), so the masks never left a request
without a legal token; choices and regexes likewise; through the server, ``response_format``
and vLLM's ``guided_*`` fields, and their bad values refused by name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import engines
from colfunc.inference import SamplingParams
from colfunc.inference.grammar import Structure

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(600)

NAME = "tiny"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    cf.testing.save_tiny_gpt2(path, n_positions=512)
    return path


@pytest.fixture(scope="module")
def engine(folder):
    return engines.from_hf(folder, max_num_seqs=64)


WORD = st.text(alphabet="abcdefghij", min_size=1, max_size=4)
LEAF = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 200),
    ),
    st.builds(lambda ws: {"enum": sorted(set(ws))}, st.lists(WORD, min_size=1, max_size=4)),
    st.builds(
        lambda ws: {"type": "string", "enum": sorted(set(ws))},
        st.lists(WORD, min_size=1, max_size=3),
    ),
    st.just({"type": "null"}),
)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    def make(props: dict, required: list[str]) -> dict:
        return {"type": "object", "properties": props,
                "required": [k for k in required if k in props],
                "additionalProperties": False}  # fmt: skip

    props = st.dictionaries(WORD, children, min_size=1, max_size=3)
    return props.flatmap(lambda p: st.lists(st.sampled_from(sorted(p)), unique=True).map(
        lambda req: make(p, req)))  # fmt: skip


SCHEMA = st.recursive(
    LEAF,
    lambda inner: st.one_of(
        _object(inner),
        st.builds(
            lambda item, n: {"type": "array", "items": item, "maxItems": n},
            inner,
            st.integers(0, 3),
        ),
    ),
    max_leaves=6,
).filter(lambda s: s.get("type") in ("object", "array"))


@settings(max_examples=4, deadline=None)
@given(schemas=st.lists(SCHEMA, min_size=50, max_size=50), seed=st.integers(0, 2**16))
def test_drawn_schemas_give_valid_json(engine, schemas, seed) -> None:
    """50 drawn schemas at a time (four draws: 200 requests), sampled at temperature 1 in one
    batch: every completion ends by its grammar and validates against its schema."""
    params = [
        SamplingParams(
            temperature=1.0, max_tokens=400, seed=seed + i, structure=Structure.json_schema(s)
        )
        for i, s in enumerate(schemas)
    ]
    outs = engine.generate(["{"] * len(schemas), params)
    for schema, out in zip(schemas, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (schema, o.text)
        jsonschema.validate(json.loads(o.text), schema)


def test_choices_regexes_and_json_objects(engine) -> None:
    choices = ["red", "green", "blue sky"]
    p = SamplingParams(
        temperature=1.0, max_tokens=20, n=8, seed=1, structure=Structure.choice(choices)
    )
    (out,) = engine.generate(["colour:"], p)
    assert all(o.text in choices and o.finish_reason == "stop" for o in out.outputs)
    pattern = r"[0-9]{2,3}-[a-f]{2}"
    p = SamplingParams(
        temperature=1.0, max_tokens=20, n=8, seed=2, structure=Structure("regex", pattern)
    )
    (out,) = engine.generate(["id:"], p)
    assert all(re.fullmatch(pattern, o.text) for o in out.outputs)
    p = SamplingParams(temperature=0, max_tokens=300, structure=Structure("json_object"))
    (out,) = engine.generate(["{"], p)
    if out.outputs[0].finish_reason == "stop":  # (a random model's object may run long)
        assert isinstance(json.loads(out.outputs[0].text), dict)
    greedy = SamplingParams(temperature=0, max_tokens=20, structure=Structure.choice(choices))
    (again,) = engine.generate(["colour:"], greedy)
    assert again.outputs[0].text in choices
    with pytest.raises(ValueError, match="does not compile"):
        Structure("regex", "([a-z")
    with pytest.raises(ValueError, match="non-empty list of non-empty strings"):
        Structure.choice([])


def test_the_server_takes_response_format_and_guided_fields(folder) -> None:
    import openai
    from test_server import Served

    served = Served(folder)
    try:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                  "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["ok", "n"],
                  "additionalProperties": False}  # fmt: skip
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        r = client.completions.create(model="tiny-gpt", prompt="{", max_tokens=60, temperature=1,
                                      seed=4, extra_body={"response_format": fmt})  # fmt: skip
        jsonschema.validate(json.loads(r.choices[0].text), schema)
        chat = client.chat.completions.create(
            model="tiny-gpt", messages=[{"role": "user", "content": "pick"}], max_tokens=10,
            temperature=1, extra_body={"guided_choice": ["yes", "no"]},
        )  # fmt: skip
        assert chat.choices[0].message.content in ("yes", "no")
        bad = [
            ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format"),
            ({"guided_regex": "([a-"}, "guided_regex"),
            ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
            ({"response_format": {"type": "xml"}}, "response_format"),
        ]  # fmt: skip
        for extra, param in bad:
            body = {"model": "tiny-gpt", "prompt": "x", "max_tokens": 2, **extra}
            resp = httpx.post(served.url + "/v1/completions", json=body, timeout=30)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    finally:
        served.stop()
