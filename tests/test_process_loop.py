"""The engine in a process of its own (``colfunc serve``'s default with one rank,
:class:`~colfunc.inference.process_loop.ProcessLoop`), against the engine itself.

- The same tokens and text as the engine directly: greedy and seeded sampled completions, ``n``,
  logprobs, streamed and not, chat; the metrics count what the child generated.
- A client that leaves mid-stream has its request aborted in the child (its blocks given back).
- ``max_waiting`` reached: 503. The child killed: every request after gets a 500 naming the
  engine, ``/health`` 500. A build that fails on bad input (a KV cache too small) is a
  ``ValueError`` naming the flag; ``colfunc serve`` says it in one line with exit code 2.
"""

from __future__ import annotations

import functools
import json
import time

import pytest
from fastapi.testclient import TestClient

import colfunc as cf
from colfunc import engines, serve
from colfunc.cli import main
from colfunc.inference import SamplingParams
from colfunc.inference.process_loop import ProcessLoop
from colfunc.inference.server import build_app

pytestmark = pytest.mark.timeout(300)

NAME = "tiny"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    cf.testing.save_tiny_gpt2(path, n_positions=128, chat_template="{% for m in messages %}"
                              "{{ m['content'] }}\n{% endfor %}")  # fmt: skip
    return path


def _served(folder, **kw) -> serve.Served:
    base = dict(run=None, hf=str(folder), model_impl="auto", max_num_seqs=16, kv_memory=None,
                speculative=(0, None, None), loras={}, name=NAME)  # fmt: skip
    return serve.Served(**{**base, **kw})


@pytest.fixture(scope="module")
def loop(folder):
    loop = ProcessLoop(functools.partial(serve.build_engine, _served(folder)), max_waiting=64)
    with TestClient(build_app(loop, NAME)) as client:  # (its shutdown stops the loop)
        loop.client = client
        yield loop
    assert not loop.process.is_alive() and loop.done.is_set()


def _metric(client: TestClient, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_the_same_tokens_as_the_engine_itself(loop, folder) -> None:
    direct = engines.from_hf(folder)
    prompts = ["def f(x):", "import os\n", "class A:"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=5, n=2)
    want = [o.outputs[0].text for o in direct.generate(prompts, greedy)]
    want_sampled = [c.text for c in direct.generate(prompts[:1], sampled)[0].outputs]
    assert loop.engine.vocab == direct.vocab and loop.engine.loras == []
    assert loop.engine.encode_prompt("def") == direct.encode_prompt("def")
    client = loop.client
    before = _metric(client, "colfunc_generation_tokens_total")
    body = {"model": NAME, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    got = [client.post("/v1/completions", json={**body, "prompt": p}).json() for p in prompts]
    assert [g["choices"][0]["text"] for g in got] == want
    r = client.post("/v1/completions", json={**body, "prompt": prompts[0], "logprobs": 2})
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lps) == 12 and all(lp <= 0 for lp in lps)
    seeded = {**body, "prompt": prompts[0], "temperature": 0.8, "seed": 5, "n": 2}
    r = client.post("/v1/completions", json=seeded).json()
    assert [c["text"] for c in r["choices"]] == want_sampled
    with client.stream("POST", "/v1/completions",
                       json={**body, "prompt": prompts[1], "stream": True}) as s:  # fmt: skip
        chunks = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks[:-1])
    assert text == want[1]
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "temperature": 0}  # fmt: skip
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    after = _metric(client, "colfunc_generation_tokens_total")
    assert 12 * 7 < after - before <= 12 * 7 + 5  # (the chat's reply may stop early)
    assert client.get("/health").status_code == 200


def test_a_client_that_leaves_is_aborted_in_the_child(loop) -> None:
    client = loop.client
    body = {"model": NAME, "prompt": "x", "max_tokens": 100, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with client.stream("POST", "/v1/completions", json=body) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                break  # gone after the first chunk
    deadline = time.monotonic() + 5
    while _metric(client, "colfunc_kv_cache_usage") > 0 or loop.streams:
        assert time.monotonic() < deadline, "the request was not aborted in the child"
        time.sleep(0.05)
    assert _metric(client, "colfunc_requests_running") == 0


def test_a_full_queue_is_503_and_a_dead_child_fails_every_request(folder) -> None:
    loop = ProcessLoop(functools.partial(serve.build_engine, _served(folder)), max_waiting=0)
    try:
        with TestClient(build_app(loop, NAME)) as client:
            body = {"model": NAME, "prompt": "x", "max_tokens": 4}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 503 and "busy" in r.json()["error"]["message"]
            loop.process.kill()
            loop.process.join(timeout=10)
            deadline = time.monotonic() + 5
            while loop.failure is None:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert "exit code" in str(loop.failure)
            assert client.get("/health").status_code == 500
            loop.max_waiting = 8
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 500 and "engine" in r.json()["error"]["message"]
    finally:
        loop.stop()


def test_a_build_that_fails_on_bad_input_says_so(folder, capsys) -> None:
    with pytest.raises(ValueError, match="--kv-memory='1KiB'"):
        ProcessLoop(functools.partial(serve.build_engine, _served(folder, kv_memory="1KiB")))
    assert main(["serve", "--hf", str(folder), "--kv-memory", "1KiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "cannot hold one sequence" in err[-1] and "Traceback" not in "\n".join(err)
