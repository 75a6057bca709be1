"""lm-evaluation-harness against ``colfunc serve``: its ``local-completions`` backend on a
multiple-choice task (loglikelihoods: ``echo`` with ``logprobs`` and ``max_tokens`` 1, prompts as
token lists) and a ``generate_until`` task, against its ``hf`` backend on the same folder.

A tiny random GPT-2 with a BPE tokenizer and two task files (YAML over local JSON lines) are
written here; nothing is downloaded. The per-sample loglikelihoods agree within 1e-4, the
accuracies are identical, and so are the generations.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from test_server import NAME, Served
from test_server import folder as folder  # (the tiny GPT-2 folder fixture)

pytestmark = pytest.mark.timeout(600)

MC = """task: colfunc_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN = """task: colfunc_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def _tasks(root: Path) -> Path:
    words = ["import os", "def f(x):", "class A:", "return x", "for i in", "while True:"]
    docs = [
        {"question": f"{w} #", "choices": [" a", " b", " yes", " no"][: 2 + i % 3], "answer": i % 2}
        for i, w in enumerate(words)
    ]
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "gen.jsonl").write_text(
        "".join(json.dumps({"question": w, "answer": " x"}) + "\n" for w in words)
    )
    (root / "mc.yaml").write_text(MC.format(data=root / "mc.jsonl"))
    (root / "gen.yaml").write_text(GEN.format(data=root / "gen.jsonl"))
    return root


def _run(model: str, args: str, root: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=args,
        tasks=["colfunc_tiny_mc", "colfunc_tiny_gen"],
        task_manager=TaskManager(include_path=str(root)),
        log_samples=True,
        batch_size=1,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def test_lm_eval_through_the_server_equals_its_hf_backend(folder, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = _tasks(tmp_path)
    served = Served(folder)
    try:
        ours = _run(
            "local-completions",
            f"model={NAME},base_url={served.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={folder},num_concurrent=1,max_retries=1,max_length=128",
            root,
        )
    finally:
        served.stop()
    theirs = _run("hf", f"pretrained={folder},dtype=float32,device=cpu,max_length=128", root)
    for task in ("colfunc_tiny_mc", "colfunc_tiny_gen"):
        assert ours["results"][task] == theirs["results"][task], task
    mc = zip(ours["samples"]["colfunc_tiny_mc"], theirs["samples"]["colfunc_tiny_mc"])
    for a, b in mc:
        for (lp_a, greedy_a), (lp_b, greedy_b) in zip(
            [r[0] for r in a["resps"]], [r[0] for r in b["resps"]]
        ):
            assert abs(lp_a - lp_b) < 1e-4 and greedy_a == greedy_b
    gen = zip(ours["samples"]["colfunc_tiny_gen"], theirs["samples"]["colfunc_tiny_gen"])
    for a, b in gen:
        assert a["resps"] == b["resps"]


@pytest.mark.slow  # (the completions test runs the same harness through the same server)
def test_lm_eval_chat_generations_through_the_server_equal_its_hf_backend(
    folder, tmp_path, monkeypatch
) -> None:
    """``local-chat-completions`` (the folder's chat template applied by the server) on the
    ``generate_until`` task gives the generations of the ``hf`` backend applying the same
    template."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = _tasks(tmp_path)

    def run(model: str, args: str) -> dict:
        return lm_eval.simple_evaluate(
            model=model, model_args=args, tasks=["colfunc_tiny_gen"],
            task_manager=TaskManager(include_path=str(root)), log_samples=True, batch_size=1,
            apply_chat_template=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
            fewshot_random_seed=0,
        )  # fmt: skip

    served = Served(folder)
    try:
        ours = run(
            "local-chat-completions",
            f"model={NAME},base_url={served.url}/v1/chat/completions,num_concurrent=1,"
            "max_retries=1",
        )
    finally:
        served.stop()
    theirs = run("hf", f"pretrained={folder},dtype=float32,device=cpu,max_length=128")
    pairs = zip(ours["samples"]["colfunc_tiny_gen"], theirs["samples"]["colfunc_tiny_gen"])
    texts = []
    for a, b in pairs:
        assert a["resps"] == b["resps"]
        texts.append(a["resps"][0][0])
    assert sum(len(t) for t in texts) > 0, texts  # (something was generated)
    assert ours["results"]["colfunc_tiny_gen"] == theirs["results"]["colfunc_tiny_gen"]
