"""The engine's threads per step (:class:`colfunc.inference.threads.StepThreads`, what
``colfunc serve`` runs with one rank): steps of more than ``at_tokens`` tokens compute with
``prefill`` threads, the others with ``decode`` threads, and the tokens are those of the engine
without it (and of ``transformers``' ``generate``). Bad values are refused by name, from Python
and from the command line (exit code 2, one line)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

import colfunc as cf
from colfunc import hf
from colfunc.cli import main
from colfunc.inference import Engine, SamplingParams
from colfunc.inference.threads import StepThreads, cpus

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@dataclasses.dataclass(frozen=True)
class _Recorded(StepThreads):
    seen: list = dataclasses.field(default_factory=list, compare=False)

    def __call__(self, tokens: int) -> None:
        super().__call__(tokens)
        self.seen.append((tokens, torch.get_num_threads()))


@pytest.fixture
def threads_kept():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _llama():
    torch.manual_seed(3)
    c = transformers.LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=64, vocab_size=97, max_position_embeddings=64,
    )  # fmt: skip
    m = transformers.LlamaForCausalLM(c).double().eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def test_each_step_runs_with_its_threads_and_the_tokens_are_unchanged(threads_kept) -> None:
    m = _llama()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (30, 3, 12, 25)]
    expected = cf.testing.hf_greedy(m, prompts, GREEDY.max_tokens)
    cfg, params = hf.from_hf(m)
    plain = Engine(cf.models.llama, cfg, params, max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)] == expected
    policy = _Recorded(decode=1, prefill=2, at_tokens=8)
    engine = Engine(cf.models.llama, cfg, params, max_num_batched_tokens=16, threads=policy)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)] == expected
    assert {t > 8 for t, _ in policy.seen} == {True, False}  # both kinds of step ran
    assert all(n == (2 if t > 8 else 1) for t, n in policy.seen), policy.seen


def test_serving_threads_leave_a_cpu_to_the_server() -> None:
    n = cpus()
    assert StepThreads.serving() == StepThreads(max(1, n - 1), n)
    assert StepThreads.serving(3, 5) == StepThreads(3, 5)


@pytest.mark.parametrize(
    "kwargs, name",
    [({"decode": 0, "prefill": 1}, "decode"), ({"decode": 1, "prefill": 2.0}, "prefill"),
     ({"decode": 1, "prefill": 1, "at_tokens": True}, "at_tokens")],
)  # fmt: skip
def test_bad_thread_counts_are_refused(kwargs, name) -> None:
    with pytest.raises(ValueError, match=f"StepThreads: {name} must be an int >= 1"):
        StepThreads(**kwargs)


def test_an_engine_takes_only_step_threads() -> None:
    cfg = cf.models.gpt.Config(n_layer=1, n_head=2, d_model=16, vocab_size=50, max_seq_len=32)
    with pytest.raises(TypeError, match="threads must be a StepThreads, got 2"):
        Engine(cf.models.gpt, cfg, cf.models.gpt.init(cfg), threads=2)


@pytest.mark.parametrize(
    "flags, said",
    [(["--engine-threads", "0"], "--engine-threads must be >= 1, got 0"),
     (["--prefill-threads", "-1"], "--prefill-threads must be >= 1, got -1"),
     (["--engine-threads", "1", "--tp", "2"], "--engine-threads applies to one rank")],
)  # fmt: skip
def test_bad_thread_flags_are_one_line(tmp_path, capsys, flags, said) -> None:
    assert main(["serve", "--hf", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
