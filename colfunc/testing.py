"""Checks that a parallel or transformed step computes what the reference step computes.

``assert_equivalent(step_a, step_b, params, batches)`` runs both steps from the same parameters on
the same batches and compares every loss and the final full parameters. Users prove their own
schemes equal to the single-device reference with it; colfunc's own tests are built on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from colfunc import tree
from colfunc.step import Step, full_state

__all__ = [
    "assert_equivalent",
    "assert_trees_close",
    "compose",
    "compositions",
    "greedy_with_preemption",
    "hf_greedy",
    "hf_validation_loss",
    "meshes",
    "placements",
    "save_bpe_tokenizer",
]

PyTree = Any


def _full(x: Any) -> Any:
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def assert_trees_close(
    actual: PyTree, expected: PyTree, *, rtol: float = 0.0, atol: float = 0.0, what: str = "tree"
) -> None:
    """Raise ``AssertionError`` naming the first path whose values differ beyond the tolerance.

    Structures must match exactly; tensor leaves are compared after gathering distributed ones,
    in the expected leaf's dtype, with ``|a - e| <= atol + rtol * |e|`` elementwise (both
    tolerances 0 means bitwise equality); other leaves must be equal.
    """
    flat_a, def_a = tree.flatten_with_paths(actual)
    flat_e, def_e = tree.flatten_with_paths(expected)
    if def_a != def_e:
        raise AssertionError(f"{what}: structures differ:\n  actual   {def_a}\n  expected {def_e}")
    for (path, a), (_, e) in zip(flat_a, flat_e):
        if isinstance(e, torch.Tensor):
            a = _full(a)
            e = _full(e)
            if not isinstance(a, torch.Tensor) or a.shape != e.shape:
                shape = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
                raise AssertionError(f"{what}.{path}: shape {shape} != expected {tuple(e.shape)}")
            a32, e32 = a.detach().to(e.dtype).cpu(), e.detach().cpu()
            if rtol == 0 and atol == 0:
                ok = torch.equal(a32, e32)
            else:
                ok = bool(torch.all((a32 - e32).abs() <= atol + rtol * e32.abs()))
            if not ok:
                diff = (a32.double() - e32.double()).abs()
                rel = diff / e32.double().abs().clamp_min(1e-30)
                raise AssertionError(
                    f"{what}.{path}: max abs diff {diff.max().item():.3g}, max rel diff "
                    f"{rel.max().item():.3g} (rtol={rtol}, atol={atol})"
                )
        elif a != e:
            raise AssertionError(f"{what}.{path}: {a!r} != expected {e!r}")


def assert_equivalent(
    step_a: Step,
    step_b: Step,
    params: PyTree,
    batches: Iterable[PyTree],
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> list[tuple[float, float]]:
    """Run both steps from ``params`` over ``batches``; assert equal losses, and equal final
    parameters and optimizer states.

    Before every step, :meth:`Step.evaluate` of each step is checked against the other's too.
    Returns the per-step ``(loss_a, loss_b)`` pairs. Distributed states are gathered with
    :func:`colfunc.full_state` (a collective: call this on every rank).

    Example:
        >>> ref = cf.train_step(loss_fn, optim.adamw(1e-3))
        >>> cf.testing.assert_equivalent(cf.remat(ref), ref, params, batches)
    """
    state_a, state_b = step_a.init(params), step_b.init(params)
    losses = []

    def close(la: float, lb: float, what: str) -> None:
        if not abs(la - lb) <= atol + rtol * abs(lb):
            raise AssertionError(f"{what}: {la!r} != {lb!r} (rtol={rtol}, atol={atol})")

    for i, batch in enumerate(batches):
        ea = float(_full(step_a.evaluate(state_a, batch)["loss"]))
        eb = float(_full(step_b.evaluate(state_b, batch)["loss"]))
        close(ea, eb, f"evaluate loss before step {i}")
        state_a, metrics_a = step_a(state_a, batch)
        state_b, metrics_b = step_b(state_b, batch)
        la, lb = float(_full(metrics_a["loss"])), float(_full(metrics_b["loss"]))
        close(la, lb, f"loss at step {i}")
        losses.append((la, lb))
    if not losses:
        raise ValueError("assert_equivalent: batches is empty; give at least one batch")
    full_a, full_b = full_state(state_a), full_state(state_b)
    assert_trees_close(full_a.params, full_b.params, rtol=rtol, atol=atol, what="params")
    assert_trees_close(full_a.opt_state, full_b.opt_state, rtol=rtol, atol=atol, what="opt_state")
    return losses


# --- hypothesis strategies (hypothesis is imported only when they are called) -----------------

TRANSFORMS = ("shard", "zero", "amp", "remat")


def meshes(
    axes: tuple[str, ...] = ("dp", "tp"), sizes: tuple[int, ...] = (1, 2, 4), max_ranks: int = 8
) -> Any:
    """A strategy of mesh shapes ``{axis: size}`` over ``axes``, at most ``max_ranks`` ranks."""
    from hypothesis import strategies as st

    def ok(shape: dict[str, int]) -> bool:
        n = 1
        for s in shape.values():
            n *= s
        return n <= max_ranks

    return st.fixed_dictionaries({a: st.sampled_from(sizes) for a in axes}).filter(ok)


def placements(ndim: int, n_axes: int, partial: bool = True) -> Any:
    """A strategy of placements for an ``ndim``-dim tensor on a mesh of ``n_axes`` axes: one of
    ``Shard(d)``, ``Replicate()`` or (with ``partial``) ``Partial("sum"|"avg"|"max")`` per axis.

    A ``max`` partial is never drawn beside a ``sum`` or ``avg`` one, since no single reduction
    recovers such a tensor.

    Example:
        >>> @given(pl=cf.testing.placements(ndim=2, n_axes=2))
        ... def test_round_trip(pl): ...
    """
    from hypothesis import strategies as st

    from colfunc.sharding.placement import Partial, Replicate, Shard

    if ndim < 0 or n_axes < 1:
        raise ValueError(f"placements: need ndim >= 0 and n_axes >= 1, got {ndim}, {n_axes}")
    kinds: list[Any] = [st.just(Replicate())]
    if ndim:
        kinds.append(st.builds(Shard, st.integers(0, ndim - 1)))
    if partial:
        kinds.append(st.sampled_from([Partial("sum"), Partial("avg"), Partial("max")]))
    one = st.one_of(*kinds)

    def ops(pl: tuple[Any, ...]) -> set[str]:
        return {p.op for p in pl if isinstance(p, Partial)}

    return st.tuples(*[one] * n_axes).filter(lambda pl: not ("max" in ops(pl) and len(ops(pl)) > 1))


def compositions(
    mesh_strategy: Any = None,
    stages: tuple[int | None, ...] = (None, 0, 1, 2, 3),
    remat_policies: tuple[str, ...] = ("none", "full", "save_matmuls"),
    schedules: tuple[str, ...] = (),
    amp_dtypes: tuple[str, ...] = ("fp64",),
) -> Any:
    """A strategy of transform compositions: ``{"mesh", "zero", "prefetch", "remat", "amp",
    "sequence_parallel", "order"}``.

    ``order`` is the order in which :func:`compose` applies ``shard``, ``zero``, ``amp`` and
    ``remat``, any of the 24 (every order builds the same step). ``zero`` is the stage, or None
    for no ``zero`` at all (``shard`` then reduces the gradients itself); ``prefetch`` is
    ZeRO-3's. ``amp`` is None or ``{"dtype", "loss_scale"}`` with a dtype of ``amp_dtypes``
    and a dynamic or no loss scale: the default ``"fp64"`` computes in the fp64 of the tests'
    parameters, so the whole of amp's machinery (scaling, widening, overflow checks) runs where
    the results stay equal to the reference at fp64 tolerances.

    With ``schedules`` (pipeline schedule names) a composition also has ``"pipeline"``: the
    ``schedule``, ``microbatches`` (one to three times the mesh's ``pp`` size) and
    ``virtual_stages`` (2 for ``"interleaved"``), which :func:`compose` applies first, innermost.
    """
    from hypothesis import strategies as st

    mesh_strategy = meshes() if mesh_strategy is None else mesh_strategy

    @st.composite
    def draw(d: Any) -> dict[str, Any]:
        mesh = d(mesh_strategy)
        order = list(d(st.permutations(TRANSFORMS)))
        out = {
            "mesh": mesh,
            "zero": d(st.sampled_from(stages)),
            "prefetch": d(st.integers(0, 2)),
            "remat": d(st.sampled_from(remat_policies)),
            "amp": d(
                st.sampled_from([None, *amp_dtypes]).flatmap(
                    lambda dt: (
                        st.just(None)
                        if dt is None
                        else st.builds(
                            dict, dtype=st.just(dt), loss_scale=st.sampled_from([None, "dynamic"])
                        )
                    )
                )
            ),
            "sequence_parallel": mesh.get("tp", 1) > 1 and d(st.booleans()),
            "order": tuple(order),
        }
        if schedules:
            name = d(st.sampled_from(schedules))
            out["pipeline"] = {
                "schedule": name,
                "microbatches": mesh.get("pp", 1) * d(st.integers(1, 3)),
                "virtual_stages": 2 if name == "interleaved" else 1,
            }
        return out

    return draw()


def compose(step: Step, mesh: Any, composition: dict[str, Any], plan: Any = None) -> Step:
    """Apply the transforms of a drawn ``composition`` to ``step`` on this rank's ``mesh``.

    A composition with ``"tensor_mode"`` (``"2d"``, ``"2.5d"``, ``"3d"``) shards by that mode,
    ``plan`` being the model's plan for it."""
    from colfunc.transforms import amp, pipeline, remat, shard, zero

    if composition.get("pipeline") is not None:  # innermost: it replaces the whole backward
        step = pipeline(step, mesh.shape.get("pp", 1), **composition["pipeline"])
    for name in composition["order"]:
        if name == "shard" and composition.get("tensor_mode", "1d") != "1d":
            step = shard(step, mesh, plan=plan, tensor_mode=composition["tensor_mode"])
        elif name == "shard":
            tp = mesh.shape.get("tp", 1) > 1
            sp = composition.get("sequence_parallel", False)
            sp = sp if isinstance(sp, str) else bool(sp)  # a mode name, or Megatron's on/off
            step = shard(step, mesh, plan=plan if tp else None, sequence_parallel=sp)
        elif name == "zero" and composition.get("zero") is not None:
            step = zero(step, composition["zero"], prefetch=composition.get("prefetch", 1))
        elif name == "remat":
            step = remat(step, composition["remat"])
        elif name == "amp" and composition.get("amp") is not None:
            step = amp(step, **composition["amp"])
    return step


def hf_greedy(model: Any, prompts: Iterable[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The tokens a ``transformers`` causal LM's ``generate`` picks greedily after each prompt
    (one at a time, so no padding, on the model's device): the reference the engine's greedy
    tokens are checked against."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        got = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
        out.append(got[0, len(prompt) :].tolist())
    return out


def greedy_with_preemption(
    engine: Any, prompts: list[list[int]], sampling: Any, at: int = 4
) -> list[list[int]]:
    """The tokens the engine generates for ``prompts`` when the newest running sequence is
    preempted at its ``at``-th step (it is computed again from what the prefix cache kept of
    it): what a test compares with :func:`hf_greedy`."""
    for r, prompt in enumerate(prompts):
        engine.add_request(prompt, sampling, request_id=f"p{r}")
    done: dict[str, list[int]] = {}
    for k in range(1000):
        if not engine.has_unfinished():
            break
        if k == at:
            engine.scheduler.preempt(engine.scheduler.running[-1])
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [done[f"p{r}"] for r in range(len(prompts))]


def hf_validation_loss(folder: Any, batch_size: int, seq_len: int, batches: int = 1) -> float:
    """``transformers``' own loss, averaged over the first ``batches`` validation batches of
    the folder's ``corpus.txt`` cut by the folder's tokenizer (as a run with that corpus and
    ``DataConfig(tokenizer="hf:FOLDER")`` cuts it): what a run's first validation loss must
    equal."""
    from pathlib import Path

    import transformers

    from colfunc import data
    from colfunc.inference.tokenizers import load_hf_tokenizer

    folder = Path(folder)
    tok = load_hf_tokenizer(folder)
    if tok is None:
        raise ValueError(f"{str(folder)!r} has no tokenizer")
    corpus = data.load_corpus(str(folder / "corpus.txt"), 0.05)
    ids = torch.tensor(tok.encode(bytes(corpus.val.numpy()).decode()), dtype=torch.int32)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    losses = []
    for i in range(batches):
        b = data.batch_at(ids, batch_size, seq_len, 0, i)
        with torch.no_grad():
            losses.append(model(input_ids=b["input_ids"], labels=b["labels"]).loss.item())
    return sum(losses) / len(losses)


def save_bpe_tokenizer(
    path: Any, vocab_size: int, eos_token: str, chat_template: str | None = None
) -> Any:
    """Train a byte-level BPE on two standard-library modules' sources (offline, in a second),
    save it to ``path`` as a ``transformers`` fast tokenizer and return it: the tokenizer of a
    tiny Hugging Face folder for tests (beside a random model's ``save_pretrained``)."""
    import email
    import inspect
    import json

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([inspect.getsource(json), inspect.getsource(email)], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return fast


def save_tiny_gpt2(path: Any, n_positions: int, chat_template: str | None = None) -> Any:
    """A tiny random GPT-2 folder at ``path`` (2 layers, 2 heads, width 32, seed 0) with the
    byte-level BPE of :func:`save_bpe_tokenizer` (320 tokens, ``<|endoftext|>`` its end and
    beginning of text): what a server test serves. Returns the tokenizer."""
    import torch
    import transformers

    fast = save_bpe_tokenizer(path, 320, "<|endoftext|>", chat_template=chat_template)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=len(fast),
        n_positions=n_positions,
        eos_token_id=fast.eos_token_id,
        bos_token_id=fast.eos_token_id,
    )
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    return fast
