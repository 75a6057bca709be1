"""``colfunc serve`` against the official ``openai`` client, on 127.0.0.1, with bounded loads.

The model is a tiny random GPT-2 saved with ``save_pretrained`` beside a byte-level BPE trained
here on a few standard-library sources (with a chat template), so nothing is downloaded. Every
server binds 127.0.0.1 on a free port and stops at the end of its test.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers
import uvicorn

import colfunc as cf
from colfunc import engines
from colfunc.inference import SamplingParams
from colfunc.inference.server import EngineLoop, build_app

pytestmark = pytest.mark.timeout(300)

NAME = "tiny-gpt"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    cf.testing.save_tiny_gpt2(path, n_positions=128, chat_template=TEMPLATE)
    return path


class Served:
    """A server on a thread: its base URL, its loop, and a way to stop it."""

    def __init__(self, folder: Path, max_waiting: int = 256, **engine_kw) -> None:
        self.loop = EngineLoop(engines.from_hf(folder, **engine_kw), max_waiting=max_waiting)
        config = uvicorn.Config(
            build_app(self.loop, NAME), host="127.0.0.1", port=0, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start within 30 s")
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def idle(self, within: float = 20.0) -> dict[str, int]:
        """The engine's stats once it has nothing left to do."""
        deadline = time.monotonic() + within
        while self.loop.engine.has_unfinished() or self.loop.pending:
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine is still busy: {self.loop.engine.stats()}")
            time.sleep(0.05)
        return self.loop.engine.stats()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(folder):
    s = Served(folder)
    yield s
    s.stop()


def _client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)


GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def test_completions_and_chat_through_the_openai_client(served, folder) -> None:
    client = _client(served)
    direct = engines.from_hf(folder)  # the same model, outside the server
    prompt = "def load(self, path):"
    done = client.completions.create(model=NAME, prompt=prompt, **GREEDY)
    (want,) = direct.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    assert done.choices[0].text == want.outputs[0].text
    assert done.usage.prompt_tokens == len(direct.encode_prompt(prompt))
    assert done.usage.completion_tokens == 12
    assert done.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=NAME, prompt=prompt, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, **GREEDY)
    templated = direct.tokenizer.apply_chat_template(messages)
    assert templated.endswith("assistant:")
    (want,) = direct.generate(
        [templated], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    assert chat.choices[0].message.content == want.outputs[0].text
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=NAME, messages=messages, stream=True, **GREEDY)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content

    two = client.completions.create(
        model=NAME, prompt=prompt, n=2, temperature=1.0, max_tokens=6, seed=3
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert [m.id for m in client.models.list().data] == [NAME]
    assert served.idle()["blocks_used"] == 0


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "nope", "prompt": "x"}, "model"),
        ({"model": NAME, "prompt": "x", "max_tokens": -1}, None),
        ({"model": NAME, "prompt": "x " * 400}, "prompt"),
        ({"model": NAME, "prompt": "x", "temperature": "hot"}, "temperature"),
        ({"model": NAME, "prompt": "x", "top_p": 3}, None),
        ({"model": NAME}, "prompt"),
    ],
)
def test_bad_requests_get_400_with_an_openai_error_body(served, body, param) -> None:
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    with pytest.raises(openai.BadRequestError):
        _client(served).completions.create(model="nope", prompt="x")


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("completions", {"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
        ("completions", {"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
        ("completions", {"prompt": "x", "guided_grammar": "root ::= 'a'"}, "guided_grammar"),
        ("completions", {"prompt": "x", "min_tokens": 3}, "min_tokens"),
        ("completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ("completions", {"prompt": "x", "logit_bias": {"five": 100}}, "logit_bias"),
        ("completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
        ("chat/completions", {"messages": []}, "messages"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
            "response_format",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi"}],
             "functions": [{"name": "f", "parameters": {}}]},
            "functions",
        ),
    ],
)  # fmt: skip
def test_what_the_server_would_ignore_is_refused_by_name(served, path, body, param) -> None:
    """Fields the server does not compute come back as a 400 naming them, never as an answer
    that silently left them out; their neutral values pass."""
    r = httpx.post(f"{served.url}/v1/{path}", json={"model": NAME, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]
    ok = {"model": NAME, "prompt": "x", "max_tokens": 2, "echo": False, "best_of": 1}
    ok |= {"logit_bias": {}, "response_format": {"type": "text"}}
    assert httpx.post(f"{served.url}/v1/completions", json=ok, timeout=30).status_code == 200


def test_a_prompt_array_gets_a_choice_per_prompt_and_sample(served) -> None:
    """``prompt`` as a list of strings or of token lists: one choice per prompt and sample,
    numbered prompt-major as OpenAI does, each the same as its prompt sent alone; usage summed;
    a bad prompt is named by its index before any runs; streaming several is refused."""
    client = _client(served)
    prompts = ["import os", "def f(x):", "class A:"]
    alone = [
        client.completions.create(model=NAME, prompt=p, **GREEDY).choices[0].text for p in prompts
    ]
    many = client.completions.create(model=NAME, prompt=prompts, **GREEDY)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == alone
    ids = [[5, 6, 7], [8, 9]]
    two = client.completions.create(model=NAME, prompt=ids, n=2, temperature=0, max_tokens=3)
    assert sorted(c.index for c in two.choices) == [0, 1, 2, 3]
    assert (two.usage.prompt_tokens, two.usage.completion_tokens) == (3 + 2, 2 * 2 * 3)
    bad = {"model": NAME, "prompt": ["fine", "x " * 400], "max_tokens": 2}
    r = httpx.post(served.url + "/v1/completions", json=bad, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt[1]:")
    streamed = {**bad, "prompt": ["a", "b"], "stream": True}
    r = httpx.post(served.url + "/v1/completions", json=streamed, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    assert served.idle()["blocks_used"] == 0


def test_health_and_metrics(served) -> None:
    _client(served).completions.create(model=NAME, prompt="import os", max_tokens=3)
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    text = httpx.get(served.url + "/metrics").text
    for name in (
        "colfunc_requests_running",
        "colfunc_requests_waiting",
        "colfunc_kv_cache_usage",
        "colfunc_generation_tokens_total",
        "colfunc_generation_tokens_per_second",
    ):
        assert name in text
    count = [
        ln for ln in text.splitlines() if ln.startswith("colfunc_time_to_first_token_seconds_count")
    ]
    assert count and float(count[0].split()[-1]) >= 1


def test_a_client_that_disconnects_has_its_request_aborted(served) -> None:
    body = {
        "model": NAME,
        "prompt": "class A:",
        "max_tokens": 100,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    stats = served.idle()
    assert stats["blocks_used"] == 0 and stats["running"] == 0


def test_bounded_load_ends_with_no_errors_and_every_block_free(served) -> None:
    async def one(client: httpx.AsyncClient, k: int) -> int:
        body = {"model": NAME, "prompt": f"def f{k}(x):", "max_tokens": 1 + k % 16, "seed": k}
        if k % 2:
            body["stream"] = True
            async with client.stream("POST", "/v1/completions", json=body) as r:
                lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
                assert lines[-1] == "data: [DONE]"
                for ln in lines[:-1]:
                    json.loads(ln.removeprefix("data: "))
                return r.status_code
        r = await client.post("/v1/completions", json=body)
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return r.status_code

    async def run() -> list[int]:
        limit = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:

            async def bounded(k: int) -> int:
                async with limit:
                    return await one(client, k)

            return await asyncio.wait_for(asyncio.gather(*(bounded(k) for k in range(200))), 240)

    statuses = asyncio.run(run())
    assert statuses == [200] * 200
    stats = served.idle()
    assert stats["blocks_used"] == 0
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}


def test_a_full_queue_answers_503(folder) -> None:
    s = Served(folder, max_waiting=1, max_num_seqs=1)
    try:

        async def run() -> list[int]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
                body = {"model": NAME, "prompt": "x", "max_tokens": 40, "ignore_eos": True}
                rs = await asyncio.gather(
                    *(client.post("/v1/completions", json=body) for _ in range(8))
                )
                for r in rs:
                    if r.status_code == 503:
                        assert r.json()["error"]["type"] == "server_error"
                return [r.status_code for r in rs]

        statuses = asyncio.run(run())
        assert 200 in statuses and 503 in statuses and set(statuses) <= {200, 503}
        assert s.idle()["blocks_used"] == 0
    finally:
        s.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Process:
    """``colfunc serve`` in a process of its own, on a free port, up and healthy."""

    def __init__(self, *args: str) -> None:
        port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "colfunc", "serve", *args, "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.kill()
                raise AssertionError(f"the server did not come up: {self.proc.communicate()}")
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_sigterm_finishes_the_requests_in_flight_then_exits(folder) -> None:
    server = Process("--hf", str(folder), "--model-name", NAME)
    try:
        body = {
            "model": NAME,
            "prompt": "def",
            "max_tokens": 60,
            "stream": True,
            "ignore_eos": True,
        }
        lines = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and not lines:
                    server.proc.send_signal(signal.SIGTERM)  # mid-stream
                if line.startswith("data: "):
                    lines.append(line)
        assert lines[-1] == "data: [DONE]"
        finals = [json.loads(ln[6:])["choices"][0]["finish_reason"] for ln in lines[:-1]]
        assert finals[-1] == "length"  # all 60 tokens came
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.kill()


def test_serve_tp2_gives_the_tokens_of_one_device(folder) -> None:
    server = Process("--hf", str(folder), "--model-name", NAME, "--tp", "2")
    try:
        direct = engines.from_hf(folder)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        prompts = ["def f(x):", "import json\n", "class Parser:"]
        p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        want = [o.outputs[0].text for o in direct.generate(prompts, p)]
        got = [
            client.completions.create(model=NAME, prompt=q, **GREEDY).choices[0].text
            for q in prompts
        ]
        assert got == want
        stream = client.completions.create(model=NAME, prompt=prompts[0], stream=True, **GREEDY)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want[0]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.kill()


def test_echo_scores_the_prompt_as_lm_eval_asks(served, folder) -> None:
    """lm-eval's loglikelihood requests: ``echo`` with ``logprobs`` and ``max_tokens`` 0 (and 1),
    the prompts as token lists: each choice's text is its prompt, its logprobs the prompt's
    tokens' (the first None), equal to ``transformers``' log-softmax at each position (1e-4),
    with the text offsets of the tokens; vLLM's ``prompt_logprobs`` gives the same numbers."""

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41, 42]]
    body = {"model": NAME, "prompt": prompts, "echo": True, "logprobs": 1, "temperature": 0}
    for max_tokens in (0, 1):
        r = httpx.post(served.url + "/v1/completions", json={**body, "max_tokens": max_tokens},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 2
        for ids, c in zip(prompts, choices):
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
            want = [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
            got = c["logprobs"]["token_logprobs"]
            assert got[0] is None and len(got) == len(ids) + max_tokens
            assert max(abs(a - b) for a, b in zip(got[1 : len(ids)], want)) < 1e-4
            tokens = c["logprobs"]["tokens"]
            assert c["text"].startswith("".join(tokens[: len(ids)]))
            offsets = c["logprobs"]["text_offset"]
            assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            assert all(len(top) == 1 for top in c["logprobs"]["top_logprobs"][1:])
    r = httpx.post(
        served.url + "/v1/completions",
        json={"model": NAME, "prompt": prompts[0], "prompt_logprobs": 2, "max_tokens": 1},
        timeout=60,
    )
    rows = r.json()["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(prompts[0])
    ids = prompts[0]
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    for i, row in enumerate(rows[1:]):
        assert abs(row[str(ids[i + 1])]["logprob"] - float(lp[i, ids[i + 1]])) < 1e-4
        assert sorted(e["rank"] for e in row.values() if e["rank"] is not None) == [1, 2]


def test_streamed_logprobs_and_echo_equal_the_whole_answer(served) -> None:
    """A streamed completion's chunks carry the logprobs of their tokens (and with ``echo`` the
    prompt's first): put together, the non-streamed answer's."""
    body = {"model": NAME, "prompt": "def f(x):", "logprobs": 2, "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "echo": True}  # fmt: skip
    whole = httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    text, lps = "", None
    with httpx.stream("POST", served.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:  # fmt: skip
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])["choices"][0]
            text += c["text"]
            if c["logprobs"] is not None:
                lps = c["logprobs"] if lps is None else {k: lps[k] + c["logprobs"][k] for k in lps}
    assert text == whole["text"]
    assert lps is not None
    assert lps["tokens"] == whole["logprobs"]["tokens"]
    assert lps["token_logprobs"] == whole["logprobs"]["token_logprobs"]
    assert lps["text_offset"] == whole["logprobs"]["text_offset"]


def test_logit_bias_chat_logprobs_and_tokenize(served) -> None:
    """``logit_bias`` moves the greedy choice (+100 forces a token, -100 bans the greedy one);
    chat returns its tokens' logprobs (and streams them, the same); ``/tokenize`` and
    ``/detokenize`` round-trip a prompt, and count the tokens of chat messages."""
    client = _client(served)
    plain = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=4, temperature=0,
                                      logprobs=0, extra_body={"ignore_eos": True})  # fmt: skip
    first = plain.choices[0].logprobs.tokens[0]
    ids = httpx.post(served.url + "/tokenize", json={"prompt": first}, timeout=30).json()["tokens"]
    forced = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=4, temperature=0,
                                       logit_bias={"7": 100}, extra_body={"ignore_eos": True})  # fmt: skip
    tok = httpx.post(served.url + "/tokenize", json={"prompt": forced.choices[0].text}, timeout=30)
    assert tok.json()["tokens"] == [7, 7, 7, 7]
    banned = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=1, temperature=0,
                                       logit_bias={str(ids[0]): -100})  # fmt: skip
    assert banned.choices[0].text != first
    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    assert all(c.logprob <= 0 and c.top_logprobs[0].logprob >= c.logprob - 1e-9 for c in content)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5,
                                            temperature=0, logprobs=True, top_logprobs=2,
                                            stream=True)  # fmt: skip
    streamed = [x for ch in stream if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.content]  # fmt: skip
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    r = httpx.post(served.url + "/tokenize", json={"prompt": "def load(self):"}, timeout=30).json()
    back = httpx.post(served.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=30)
    assert back.json()["prompt"] == "def load(self):" and r["count"] == len(r["tokens"])
    counted = httpx.post(served.url + "/tokenize", json={"messages": messages}, timeout=30).json()
    assert counted["count"] == chat.usage.prompt_tokens
    bad = httpx.post(served.url + "/detokenize", json={"tokens": [10**6]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_a_huge_body_gets_413_at_once_and_health_answers_meanwhile(served) -> None:
    """A 10 MB body is refused by its Content-Length, before it is read (413 within 1 s), and
    ``/health`` answers within 100 ms while it is sent."""
    import concurrent.futures

    body = b'{"model": "' + NAME.encode() + b'", "prompt": "' + b"x" * (10 * 2**20) + b'"}'

    def send() -> tuple[int, float]:
        t0 = time.monotonic()
        try:
            r = httpx.post(served.url + "/v1/completions", content=body, timeout=30,
                           headers={"content-type": "application/json"})  # fmt: skip
            return r.status_code, time.monotonic() - t0
        except httpx.TransportError:  # (the server may close before the upload ends)
            return 413, time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(send)
        t0 = time.monotonic()
        health = httpx.get(served.url + "/health", timeout=5)
        assert health.status_code == 200 and time.monotonic() - t0 < 0.1
        status, took = sent.result()
    assert status == 413 and took < 1.0
    small = httpx.post(served.url + "/v1/completions", json={"model": NAME, "prompt": "x",
                                                             "max_tokens": 1}, timeout=30)  # fmt: skip
    assert small.status_code == 200


def test_a_non_streaming_client_that_leaves_frees_its_blocks(served, monkeypatch) -> None:
    """A non-streaming request whose client gives up after 0.3 s is aborted (its blocks free
    within 1 s), having generated only part of what it asked for (each engine step slowed to
    10 ms, as a larger model's would take, so that it is still running when the client goes)."""
    step = served.loop.engine.step

    def slow() -> Any:
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(served.loop.engine, "step", slow)

    def generated() -> float:
        text = httpx.get(served.url + "/metrics", timeout=30).text
        line = next(
            ln for ln in text.splitlines() if ln.startswith("colfunc_generation_tokens_total")
        )
        return float(line.split()[-1])

    before = generated()
    body = {"model": NAME, "prompt": "class A:", "max_tokens": 120, "n": 4, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(served.url + "/v1/completions", json=body, timeout=0.3)
    left = time.monotonic()
    stats = served.idle(within=5.0)
    assert time.monotonic() - left < 1.0
    assert stats["blocks_used"] == 0 and stats["running"] == 0
    assert generated() - before < 4 * 120


def test_chat_content_parts_are_joined_and_images_refused(served) -> None:
    client = _client(served)
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]
    whole = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hello there"}], **GREEDY
    )
    split = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": parts}], **GREEDY
    )
    assert split.choices[0].message.content == whole.choices[0].message.content
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    r = httpx.post(served.url + "/v1/chat/completions", timeout=30,
                   json={"model": NAME, "messages": [{"role": "user", "content": image}]})  # fmt: skip
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]


def test_best_of_returns_the_candidates_of_highest_summed_logprob(served, folder) -> None:
    """``best_of=4, n=2``: four candidates drawn as the engine draws them for ``n=4`` with the
    same seed, the two whose tokens' logprobs sum highest returned (in that order), without
    logprobs unless asked."""
    body = {"model": NAME, "prompt": "def f(x):", "max_tokens": 6, "temperature": 1.0,
            "seed": 3, "best_of": 4, "n": 2, "ignore_eos": True}  # fmt: skip
    got = httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()["choices"]
    direct = engines.from_hf(folder)
    p = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3, logprobs=0, ignore_eos=True)
    (out,) = direct.generate(["def f(x):"], p)
    ranked = sorted(out.outputs, key=lambda o: -sum(e["logprob"] for e in o.logprobs))
    assert [c["text"] for c in got] == [o.text for o in ranked[:2]]
    assert [c["index"] for c in got] == [0, 1] and all(c["logprobs"] is None for c in got)
