"""Any Hugging Face causal LM through its own ``transformers`` module (``colfunc.models.hf_module``).

On tiny random models of architectures colfunc has no native family for (StableLM, Starcoder2,
Granite, Falcon; built here from ``transformers`` configs, nothing downloaded): logits equal the
module's own forward; one AdamW step equals ``transformers`` + ``torch.optim.AdamW`` (fp64,
1e-9); dp2 with ZeRO-3, a two-stage pipeline, offload and (where the config has a plan) tp=2
equal one device (fp64 AdamW, 1e-9); the engine's greedy tokens equal ``generate``'s, with
prefix caching on and preemption forced, and under tp=2. For Llama and Qwen2, which are native
too, the module and the native path agree. What cannot be cut is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import colfunc as cf
from colfunc import hf, models, optim, tree
from colfunc.inference import Engine, SamplingParams
from colfunc.models import hf_module

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(600)

SIZES = dict(
    vocab_size=53, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=40, num_hidden_layers=2, max_position_embeddings=64, bos_token_id=0,
    eos_token_id=0,
)  # fmt: skip

# name -> (the transformers config class, extra fields): none of these has a native family
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    # partial rotary embedding, LayerNorms with biases, no plan (tensor parallelism refused)
    "stablelm": ("StableLmConfig", {"partial_rotary_factor": 0.5}),
    # a sliding window shorter than the prompts, biases, a plain MLP
    "starcoder2": ("Starcoder2Config", {"sliding_window": 5}),
    # multipliers on the embeddings, residuals, attention and logits
    "granite": (
        "GraniteConfig",
        {"logits_scaling": 2.0, "embedding_multiplier": 3.0, "residual_multiplier": 0.5,
         "attention_multiplier": 0.3},
    ),
    # grouped-query attention with attention and MLP side by side, tied head
    "falcon": (
        "FalconConfig",
        {"new_decoder_architecture": True, "num_kv_heads": 2, "ffn_hidden_size": 40},
    ),
}  # fmt: skip


def _config(name: str) -> Any:
    cls, extra = ARCHS[name]
    sizes = dict(SIZES)
    if name == "falcon":
        sizes = {
            k: v for k, v in sizes.items() if k not in ("num_key_value_heads", "intermediate_size")
        }
    return getattr(transformers, cls)(**sizes, **extra)


def _model(name: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> Any:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(name)).to(dtype).eval()
    model.generation_config.eos_token_id = None  # (greedy references run their whole length)
    return model


def _batch(seed: int, rows: int = 2, length: int = 12) -> dict[str, torch.Tensor]:
    ids = torch.randint(
        0, SIZES["vocab_size"], (rows, length), generator=torch.Generator().manual_seed(seed)
    )
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_logits_and_loss_equal_the_module(name: str) -> None:
    model = _model(name)
    cfg, params = hf.from_hf(model)
    assert isinstance(cfg, hf_module.Config) and cfg.architecture == type(model).__name__
    batch = _batch(1)
    with torch.no_grad():
        want = model(input_ids=batch["input_ids"]).logits
        got = hf_module.apply(params, batch["input_ids"], cfg)
        loss = hf_module.loss(cfg)(params, batch)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    V = SIZES["vocab_size"]
    ce = torch.nn.functional.cross_entropy(
        want[:, :-1].reshape(-1, V), batch["labels"][:, 1:].reshape(-1)
    )
    torch.testing.assert_close(loss, ce, rtol=0, atol=1e-9)


MORE = [
    "CohereConfig", "Cohere2Config", "OlmoConfig", "Olmo3Config", "PhiConfig", "PersimmonConfig",
    "NemotronConfig", "Ernie4_5Config", "SeedOssConfig", "ApertusConfig", "ArceeConfig",
    "BitNetConfig", "Exaone4Config",
]  # fmt: skip


@pytest.mark.parametrize("config_class", MORE)
def test_more_architectures_give_their_modules_logits(config_class: str) -> None:
    if not hasattr(transformers, config_class):
        pytest.skip(f"this transformers has no {config_class}")
    torch.manual_seed(0)
    c = getattr(transformers, config_class)(**SIZES)
    model = transformers.AutoModelForCausalLM.from_config(c).double().eval()
    cfg, params = hf.from_hf(model)
    assert isinstance(cfg, hf_module.Config)
    ids = _batch(3)["input_ids"]
    with torch.no_grad():
        got, want = hf_module.apply(params, ids, cfg), model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_one_adamw_step_equals_transformers(name: str) -> None:
    model = _model(name).train()
    cfg, params = hf.from_hf(model)
    batch = _batch(2)
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), **hyper)
    logits = model(input_ids=batch["input_ids"]).logits
    V = SIZES["vocab_size"]  # (transformers' own loss casts the logits to fp32)
    torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, V), batch["labels"][:, 1:].reshape(-1)
    ).backward()
    opt.step()
    step = cf.train_step(hf_module.loss(cfg), optim.adamw(**hyper))
    state, _ = step(step.init(params), batch)
    want = dict(tree.flatten_with_paths(hf.from_hf(model)[1])[0])
    got = dict(tree.flatten_with_paths(state.params)[0])
    assert got.keys() == want.keys()
    for path, x in got.items():
        torch.testing.assert_close(x, want[path], rtol=1e-9, atol=1e-9, msg=path)


def _compose(how: str, step: cf.Step, mesh: cf.Mesh, cfg: Any) -> cf.Step:
    if how == "dp2_zero3":
        return cf.zero(cf.shard(step, mesh), stage=3)
    if how == "pp2":
        return cf.pipeline(step, 2, microbatches=2)
    if how == "offload":  # ZeRO-3's pieces homed on the host, each layer fetched as it runs
        return cf.remat(cf.offload(cf.zero(cf.shard(step, mesh), 3), "host", "1MiB"), "full")
    if how == "amp_remat":  # (amp in fp64 keeps the comparison exact)
        return cf.remat(cf.amp(cf.zero(cf.shard(step, mesh), 2), "fp64"), "full")
    return cf.shard(step, mesh, plan=hf_module.tp_plan(cfg))


MESHES = {
    "dp2_zero3": {"dp": 2},
    "pp2": {"pp": 2},
    "offload": {"dp": 2},
    "tp2": {"tp": 2},
    "amp_remat": {"dp": 2},
}


@pytest.mark.parametrize("how", sorted(MESHES))
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_transforms_equal_one_device(name: str, how: str) -> None:
    model = _model(name, seed=3)
    cfg, params = hf.from_hf(model)
    batches = [_batch(10 + k, rows=4, length=8) for k in range(2)]
    ref = cf.train_step(hf_module.loss(cfg), optim.adamw(1e-2, weight_decay=0.1))
    if how == "tp2" and getattr(cfg.hf, "base_model_tp_plan", None) is None:
        with pytest.raises(ValueError, match="no base_model_tp_plan"):
            hf_module.tp_plan(cfg)
        return

    def main(mesh: cf.Mesh):
        step = _compose(how, ref, mesh, cfg)
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-9)

    for losses in cf.launch(main, mesh=MESHES[how]):
        assert len(losses) == len(batches)


def test_frozen_parameters_under_zero3_stay_and_the_rest_equals_one_device() -> None:
    model = _model("granite", seed=6)
    cfg, params = hf.from_hf(model)
    batches = [_batch(30 + k, rows=4, length=8) for k in range(2)]
    ref = cf.train_step(
        hf_module.loss(cfg), optim.adamw(1e-2), trainable=["blocks.self_attn.*", "model.norm.*"]
    )

    def main(mesh: cf.Mesh):
        step = cf.zero(cf.shard(ref, mesh), stage=3)
        cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-9)
        state = step.init(params)
        for b in batches:
            state, _ = step(state, b)
        return cf.full_state(state)

    flat0 = dict(tree.flatten_with_paths(params)[0])
    for final in cf.launch(main, mesh={"dp": 2}):
        moved = set()
        for p, x in tree.flatten_with_paths(final.params)[0]:
            if not torch.equal(x, flat0[p]):
                moved.add(p)
        assert moved and all(p.startswith(("blocks.self_attn.", "model.norm.")) for p in moved)
        assert set(tree.paths(final.opt_state.exp_avg)) == {
            p for p in flat0 if p.startswith(("blocks.self_attn.", "model.norm."))
        }


@pytest.mark.parametrize("mode", ["ulysses", "ring", "zigzag", "megatron"])
@pytest.mark.parametrize("name", ["granite", "stablelm"])
def test_sequence_parallel_modes_equal_one_device(name: str, mode: str) -> None:
    """The module's linear maps run as colfunc's (which keep a sequence split's batch and
    sequence dims apart) and its attention through the sequence axis' frames; zigzag's
    reordered sequence holds only if they do."""
    model = _model(name, seed=3)
    cfg, params = hf.from_hf(model)
    batches = [_batch(20 + k, rows=2, length=16) for k in range(2)]
    ref = cf.train_step(hf_module.loss(cfg), optim.adamw(1e-2, weight_decay=0.1))
    if mode == "megatron" and getattr(cfg.hf, "base_model_tp_plan", None) is None:
        return  # (tensor parallelism needs the config's plan)

    def main(mesh: cf.Mesh):
        if mode == "megatron":
            step = cf.shard(ref, mesh, plan=hf_module.tp_plan(cfg), sequence_parallel=True)
        else:
            step = cf.shard(ref, mesh, sequence_parallel=mode)
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-9)

    cf.launch(main, mesh={"tp": 2} if mode == "megatron" else {"sp": 2})


@pytest.mark.parametrize("name", ["starcoder2", "granite", "falcon"])
def test_the_engine_gives_generates_greedy_tokens(name: str) -> None:
    model = _model(name, seed=7, dtype=torch.float32)
    cfg, params = hf.from_hf(model)
    # the second prompt is longer than Starcoder2's window, and the tokens run on past it
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [50, 9, 30, 31, 32, 7, 7, 8, 40, 41, 2, 3]]
    want = cf.testing.hf_greedy(model, prompts, 10)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = Engine(hf_module, cfg, params, block_size=4, num_blocks=32)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)] == want
    # the same prompts again, sharing their cached blocks, with a preemption forced
    assert cf.testing.greedy_with_preemption(engine, prompts, greedy) == want
    assert engine.stats()["preemptions"] >= 1
    assert engine.stats()["prefix_hits"] > 0 or not engine.allocator.prefix_caching
    if name != "granite":
        return

    def main(mesh: cf.Mesh):
        tp = Engine(hf_module, cfg, params, mesh=mesh, block_size=4, num_blocks=32)
        return [o.outputs[0].token_ids for o in tp.generate(prompts, greedy)]

    for tokens in cf.launch(main, mesh={"tp": 2}):
        assert tokens == want


@pytest.mark.parametrize("name", ["LlamaConfig", "Qwen2Config"])
def test_native_families_and_their_modules_agree(name: str, tmp_path: Path) -> None:
    """fp64: ``transformers``' norms compute in fp32 whatever the weights, so the module and the
    native path agree to ~1e-7, and give the same greedy tokens."""
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**SIZES))
    model.save_pretrained(tmp_path)
    native = hf.load(f"hf:{tmp_path}", torch.float64)
    adapted = hf.load(f"hf:{tmp_path}", torch.float64, model_impl="hf")
    assert not isinstance(native[0], hf_module.Config) and isinstance(adapted[0], hf_module.Config)
    assert "native" in hf.describe(native[0]) and "transformers module" in hf.describe(adapted[0])
    batch = _batch(4)
    for cfg, params in (native, adapted):
        step = cf.train_step(models.of_config(cfg).module.loss(cfg), optim.sgd(0.1))
        state = step.init(params)
        losses = []
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        if cfg is native[0]:
            first = losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(first), rtol=0, atol=1e-7)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5, 4]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = [
        [
            o.outputs[0].token_ids
            for o in Engine(models.of_config(c).module, c, p).generate(prompts, greedy)
        ]
        for c, p in (native, adapted)
    ]
    assert tokens[0] == tokens[1]


def test_what_cannot_be_cut_is_refused_by_name(tmp_path: Path) -> None:
    # layers of two kinds (a dense MLP between mixture-of-experts ones)
    moe = transformers.Qwen2MoeConfig(
        **SIZES, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"Qwen2MoeForCausalLM: decoder layer 1 .*heterogeneous"):
        hf_module.config_of(moe)
    # attention that does not go through transformers' interface (BLOOM's ALiBi)
    bloom = transformers.BloomConfig(vocab_size=53, hidden_size=32, n_head=4, n_layer=2)
    with pytest.raises(ValueError, match="BloomForCausalLM: its layers' attention does not go"):
        hf_module.config_of(bloom)
    # a forward that does not run on stand-ins (Falcon's ALiBi path)
    alibi = transformers.FalconConfig(
        vocab_size=53, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, alibi=True
    )
    with pytest.raises(ValueError, match="FalconForCausalLM: its forward does not run"):
        hf_module.config_of(alibi)
    # a folder: the same line, naming the folder; native-only refused for a module-only model
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(moe).save_pretrained(tmp_path / "moe")
    with pytest.raises(ValueError, match=r"moe'.*Qwen2MoeForCausalLM: decoder layer 1"):
        hf.load(f"hf:{tmp_path / 'moe'}", model_impl="hf")
    native, _ = hf.load(f"hf:{tmp_path / 'moe'}")  # (the native family lays both kinds out)
    assert native.dense_layers == (0,) and native.sparse_layers == (1,)
    _model("stablelm").save_pretrained(tmp_path / "stablelm")
    with pytest.raises(ValueError, match=r"no registered model family reads .*model_impl='hf'"):
        hf.read_config(f"hf:{tmp_path / 'stablelm'}", model_impl="native")
    with pytest.raises(ValueError, match="model_impl must be one of"):
        hf.read_config(f"hf:{tmp_path / 'stablelm'}", model_impl="torch")


def test_attention_dropout_and_masks_are_refused_not_ignored() -> None:
    cfg_hf = _config("stablelm")
    cfg_hf.attention_dropout = 0.1
    cfg = hf_module.config_of(cfg_hf)
    params = tree.map(lambda x: x.double(), hf_module.init(cfg, seed=0))
    batch = _batch(0)
    with pytest.raises(ValueError, match=r"attention dropout 0\.1 while training"):
        hf_module.loss(cfg)(params, batch)
    with torch.no_grad():  # (no dropout out of training)
        hf_module.loss(cfg)(params, batch)


def test_folders_load_abstractly_and_export_loads_back(tmp_path: Path) -> None:
    model = _model("granite", seed=4, dtype=torch.float32)
    model.save_pretrained(tmp_path / "in")
    cfg, params = hf.load(f"hf:{tmp_path / 'in'}")
    _, abstract = hf.load_abstract(f"hf:{tmp_path / 'in'}")
    made = cf.random.materialize(abstract)
    for (p, x), (q, y) in zip(tree.flatten_with_paths(params)[0], tree.flatten_with_paths(made)[0]):
        assert p == q and torch.equal(x, y), p
    hf.save(tmp_path / "out", cfg, params)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(back) is type(model)
    for key, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], tensor), key
    # the engine of the folder runs the module, and greedy tokens are generate's
    from colfunc import engines

    engine = engines.from_hf(tmp_path / "in", max_num_seqs=2)
    assert isinstance(engine.cfg, hf_module.Config)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in engine.generate([[5, 6, 7]], greedy)]
    assert got == cf.testing.hf_greedy(model.eval(), [[5, 6, 7]], 6)


REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {"stablelm_finetune_zero.py": "stablelm", "starcoder2_finetune_tp.py": "starcoder2"}


def _folder(root: Path, name: str) -> Path:
    import inspect
    import json

    fast = cf.testing.save_bpe_tokenizer(root, 300, "</s>")
    eos = fast.eos_token_id
    c = _config(name)
    c.vocab_size, c.bos_token_id, c.eos_token_id, c.pad_token_id = len(fast) + 7, eos, eos, eos
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(c).save_pretrained(root)
    (root / "corpus.txt").write_text(inspect.getsource(json) * 2)
    return root


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_example_fine_tunes_a_folder_and_resumes_exactly(
    example, tmp_path, monkeypatch, capsys
) -> None:
    """``colfunc train`` on a folder colfunc has no native family for, with the example's own
    parallel layout: the first validation loss is ``transformers``' on the same tokens, the run
    says it runs the module, and four steps at once equal two, a (sharded) checkpoint and two
    more."""
    import json

    from colfunc import config, train
    from colfunc.cli import main

    folder = _folder(tmp_path / "model", EXAMPLES[example])
    monkeypatch.setenv("COLFUNC_HF_MODEL", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sets = [
        f"data.corpus={folder / 'corpus.txt'}", "data.seq_len=32", "data.batch_size=4",
        "train.log_every=1", "train.eval_every=2", "train.eval_batches=1", "train.sample_tokens=0",
        "optim.warmup_steps=0", "optim.lr=3e-3", "optim.final_lr=3e-3", f"train.out_dir={tmp_path}",
    ]  # fmt: skip
    path = REPO / "examples" / "configs" / example
    cfg = config.load(path, sets)
    assert isinstance(cfg.model, hf_module.Config)
    # (one intra-op thread throughout: by default colfunc uses the idle cores, and a matmul's
    # rounding depends on how many threads split it)
    common = [a for s in sets for a in ("--set", s)] + ["--threads", "1"]
    assert main(["train", str(path), "--name", "whole", "--set", "train.steps=4", *common]) == 0
    assert "through its transformers module" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                str(path),
                "--name",
                "cut",
                "--set",
                "train.steps=2",
                *common,
                "--no-progress",
            ]
        )
        == 0
    )
    if example.startswith("stablelm"):  # ZeRO-3 over dp=2: a shard per rank
        assert len(list((tmp_path / "cut" / "checkpoints").rglob("rank-*.safetensors"))) == 2
    resume = [
        "train",
        "--resume",
        str(tmp_path / "cut"),
        "--set",
        "train.steps=4",
        "--threads",
        "1",
    ]
    assert main([*resume, "--no-progress"]) == 0
    whole, _ = train.load_run(tmp_path / "whole")
    cut, _ = train.load_run(tmp_path / "cut")
    assert whole.step == cut.step == 4
    for (p, x), (_, y) in zip(
        tree.flatten_with_paths(whole.params)[0], tree.flatten_with_paths(cut.params)[0]
    ):
        assert torch.equal(x, y), p
    records = [
        json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
    ]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    want = cf.testing.hf_validation_loss(folder, 4, 32)
    assert val[0] == pytest.approx(want, abs=1e-4)


def test_serve_runs_the_module_under_tp_and_says_so(tmp_path) -> None:
    """``colfunc serve --hf FOLDER --tp 2`` on a Granite folder: one line says the module runs,
    and the openai client's greedy completions are the single-device engine's."""
    import signal

    import openai
    from test_server import Process

    from colfunc import engines

    folder = _folder(tmp_path / "granite", "granite")
    server = Process("--hf", str(folder), "--model-name", "m", "--tp", "2")
    try:
        direct = engines.from_hf(folder)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        greedy = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for prompt in ["def f(x):", "import json\n"]:
            want = direct.generate([prompt], p)[0].outputs[0].text
            assert (
                client.completions.create(model="m", prompt=prompt, **greedy).choices[0].text
                == want
            )
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
        err = server.proc.stderr.read() if server.proc.stderr else ""
        assert "model: GraniteForCausalLM through its transformers module" in err
    finally:
        server.kill()
