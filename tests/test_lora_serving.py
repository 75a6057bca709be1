"""Many LoRA adapters served at once: a batch mixing three adapters and the base gives each request
the tokens it gets alone (on the adapter's merged model, greedy); prefix caching never shares a
prefix across adapters; the openai client picks an adapter by ``model``; ``colfunc serve --lora``
loads peft folders and lists them in ``/v1/models``.

The model is a tiny random LLaMA saved with ``save_pretrained``; the adapters are peft's, with
random weights (``init_lora_weights=False``), different ranks, alphas and targets, saved by peft.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import peft
import pytest
import torch
import transformers
import uvicorn

import colfunc as cf
from colfunc import adapters, engines, hf
from colfunc.inference import Engine, SamplingParams
from colfunc.inference.server import EngineLoop, build_app

pytestmark = pytest.mark.timeout(300)

NAME = "tiny-llama"
ADAPTERS = {  # name -> (rank, alpha, target modules)
    "sql": (4, 8, ["q_proj", "v_proj"]),
    "poem": (8, 4, ["q_proj", "k_proj", "o_proj", "down_proj"]),
    "code": (2, 16, ["gate_proj", "up_proj", "lm_head"]),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("base")
    fast = cf.testing.save_bpe_tokenizer(path, 320, "</s>")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    for k, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + k)
        base = transformers.AutoModelForCausalLM.from_pretrained(path)
        pc = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                             init_lora_weights=False)  # fmt: skip
        model = peft.get_peft_model(base, pc)
        with torch.no_grad():  # (peft's random b is small: make each adapter matter)
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(20)
        model.save_pretrained(path / "adapters" / name)
    return path


def _prompts(engine: Engine) -> list[list[int]]:
    texts = ["def f(x):", "import os\n", "class A:", "for i in", "return x", "while True:"]
    return [engine.encode_prompt(t) for t in texts]


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_a_mixed_batch_gives_each_request_its_adapters_tokens(folder) -> None:
    engine = engines.from_hf(folder, max_loras=3, max_num_seqs=16)
    for name in ADAPTERS:
        engine.add_lora(name, folder / "adapters" / name)
    assert engine.loras == list(ADAPTERS)
    prompts = _prompts(engine)
    choice = [None, "sql", "poem", "code"]
    jobs = [(p, choice[(i + k) % 4]) for i, p in enumerate(prompts) for k in range(2)]
    got = engine.generate(
        [p for p, _ in jobs], [SamplingParams(**{**vars(GREEDY), "lora": a}) for _, a in jobs]
    )
    loaded = engines.load_hf(folder)
    alone: dict[str | None, list[list[int]]] = {}
    for name in choice:  # each adapter alone: its merged model on a plain engine
        params = loaded["params"]
        if name is not None:
            config, ad = hf.load_adapter(folder / "adapters" / name, loaded["cfg"])
            params = adapters.merge(adapters.combine(params, ad), config)
        ref = Engine(**{**loaded, "params": params}, max_num_seqs=16)
        outs = ref.generate(prompts, GREEDY)
        alone[name] = [o.outputs[0].token_ids for o in outs]
    for (prompt, name), out in zip(jobs, got):
        assert out.outputs[0].token_ids == alone[name][prompts.index(prompt)], name
    # the adapters change the tokens (so the check above is not the base's tokens four times)
    assert len({tuple(alone[n][0]) for n in choice}) == 4
    # and peft's own model with the adapter gives the same greedy tokens
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    pm = peft.PeftModel.from_pretrained(base, folder / "adapters" / "poem")
    assert cf.testing.hf_greedy(pm, prompts[:2], 10) == alone["poem"][:2]


def test_prefix_caching_keeps_adapters_apart_and_bad_names_are_refused(folder) -> None:
    engine = engines.from_hf(folder, max_loras=2, max_num_seqs=8)
    engine.add_lora("sql", folder / "adapters" / "sql")
    engine.add_lora("poem", folder / "adapters" / "poem")
    prompt = engine.encode_prompt("def load(self, path):\n    with open(path) as f:\n")
    order = [None, "sql", "poem", "sql", None]
    outs = [engine.generate([prompt], SamplingParams(**{**vars(GREEDY), "lora": a}))[0]
            for a in order]  # fmt: skip
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens[0] == tokens[4] and tokens[1] == tokens[3]  # the same adapter: the same
    assert len({tuple(t) for t in tokens[:3]}) == 3  # another adapter: its own keys, not shared
    assert engine.stats()["prefix_hits"] > 0  # (reuse did happen, within an adapter)
    with pytest.raises(ValueError, match=r"no adapter named 'nope' is loaded; loaded: \['sql'"):
        engine.add_request(prompt, SamplingParams(lora="nope"))
    with pytest.raises(ValueError, match="at most max_loras=2"):
        engine.add_lora("code", folder / "adapters" / "code")
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora("sql", folder / "adapters" / "sql")


def test_the_openai_client_picks_an_adapter_by_model(folder) -> None:
    engine = engines.from_hf(folder, max_loras=2, max_num_seqs=8)
    engines.add_loras(engine, {n: str(folder / "adapters" / n) for n in ("sql", "poem")}, NAME)
    loop = EngineLoop(engine)
    server = uvicorn.Server(
        uvicorn.Config(build_app(loop, NAME), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        ids = {m.id for m in client.models.list().data}
        assert ids == {NAME, "sql", "poem"}
        texts = {}
        for model in (NAME, "sql", "poem"):
            r = client.completions.create(
                model=model, prompt="def f(x):", temperature=0, max_tokens=8,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            texts[model] = r.choices[0].text
        ref = engines.from_hf(folder, max_loras=2)
        ref.add_lora("sql", folder / "adapters" / "sql")
        want = ref.generate(["def f(x):"], SamplingParams(**{**vars(GREEDY), "max_tokens": 8,
                                                             "lora": "sql"}))  # fmt: skip
        assert texts["sql"] == want[0].outputs[0].text
        assert len(set(texts.values())) == 3
        bad = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "model_not_found"
        assert "'sql'" in bad.json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
