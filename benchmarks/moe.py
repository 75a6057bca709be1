"""Mixtures of experts on the CPU: colfunc's experts against ``transformers``' own, and the
grouped matmul against a loop over experts.

- ``step``: a training step of a random ``MixtralForCausalLM`` (4 layers, width 256, 8 experts
  of width 512, 2 per token, vocabulary 8000; batch 8 x 128 tokens, fp32), loaded into colfunc
  with ``hf.from_hf``: ``cf.train_step(mixtral.loss(cfg), optim.adamw)`` against the module's
  forward and backward and ``torch.optim.AdamW(fused=True)``, interleaved; the median over steps
  of theirs/ours (goal: at least 2). ``transformers`` runs its default experts implementation
  (``grouped_mm`` where it takes the inputs) and, on a second model, its loop over experts
  (``experts_implementation="eager"``). Both run under the host allocator setting that
  ``Step.init`` makes for the process (``COLFUNC_MALLOC``; see ``docs/cli.md``).
- ``block``: the sparse MLP alone, forward and backward, on the same weights and 1024 tokens:
  ``colfunc.nn.sparse_mlp`` against ``transformers``' ``MixtralSparseMoeBlock`` (its default
  experts and its loop), the median ratio theirs/ours (goal: at least 2 against the loop).
- ``grouped``: ``ops.grouped_matmul`` (rows sorted by expert, one matmul per expert's block)
  against the loop over experts that selects each expert's rows by a mask, on 2048 tokens x 2
  choices, 8 experts, 256 -> 512; the median time ratio loop/grouped (goal: above 1).
- ``ep``: expert parallelism on gloo, ``n`` = 2 and 4 ranks on one axis: the same Mixtral
  (2 layers) trained with the axis as the batch axis (every rank every expert: ep=1, data
  parallel) and as the expert axis (ep=n), steps interleaved in one launch; the median step time
  ratio ep1/ep_n, and the bytes rank 0 sends per step by op (ledger), the ``all_to_all_v`` bytes
  against the closed form from each rank's routed counts (:mod:`colfunc.sharding.rules.moe`).

- ``offload``: a training step under ``cf.offload(..., "host")`` (every chunk homed on the host,
  each layer streamed in), a layer's experts fetched when routed to (``experts="routed"``)
  against with the layer (``"layer"``), interleaved, at a few batch sizes: host-to-device bytes
  and device peak per step (the pool's ledger, ``offload/h2d_bytes`` and
  ``offload/device_peak_bytes``), the share of experts routed to, and the step time ratio.
- ``offload_ep``: the same under expert parallelism (``ep`` = 2 on the threads backend, each
  rank a batch of that size): each rank's host-to-device bytes a step, routed against with the
  layer (each rank fetches only its own experts that rows arrive for).

    python benchmarks/moe.py [--parts step,block,grouped,ep,offload,offload_ep] [--steps 5]
                             [--shapes mixtral,olmoe,qwen3moe]

``--shapes``: the experts' proportions for ``step`` and ``block``, each family's at this width
(the layers, width and vocabulary above): ``mixtral`` (8 experts of width 512, 2 per token),
``olmoe`` (64 of width 128, 8 per token, the top-k probabilities not renormalized) and
``qwen3moe`` (128 of width 96, 8 per token). A loop over experts costs per expert it visits,
so it falls behind as the experts grow many and small.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch
import transformers

import colfunc as cf
from colfunc import hf, models, ops, optim

SIZE = dict(
    vocab_size=8000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
)  # fmt: skip
_COMMON = {k: SIZE[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                "num_attention_heads", "num_key_value_heads",
                                "max_position_embeddings", "tie_word_embeddings")}  # fmt: skip
# the experts' proportions of each family at this width: (transformers config, its sizes,
# colfunc's module, whether the top-k probabilities are renormalized)
SHAPES: dict[str, tuple[Any, dict[str, Any], Any, bool]] = {
    # Mixtral 8x7B: 8 experts of 3.5x the width, 2 per token
    "mixtral": (transformers.MixtralConfig, SIZE, models.mixtral, True),
    # OLMoE 1B-7B: 64 experts of half the width, 8 per token, not renormalized
    "olmoe": (transformers.OlmoeConfig, {**_COMMON, "intermediate_size": 128, "num_experts": 64,
              "num_experts_per_tok": 8, "norm_topk_prob": False}, models.olmoe, False),
    # Qwen3 30B-A3B: 128 experts of 3/8 the width, 8 per token, renormalized
    "qwen3moe": (transformers.Qwen3MoeConfig, {**_COMMON, "intermediate_size": 512,
                 "moe_intermediate_size": 96, "num_experts": 128, "num_experts_per_tok": 8,
                 "norm_topk_prob": True, "head_dim": 64}, models.qwen3_moe, True),
}  # fmt: skip
HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model(impl: str | None, shape: str = "mixtral") -> Any:
    torch.manual_seed(0)
    kw = {} if impl is None else {"experts_implementation": impl}
    config, sizes, _, _ = SHAPES[shape]
    return transformers.AutoModelForCausalLM.from_config(config(**sizes), **kw)


def step_part(steps: int, shape: str = "mixtral") -> None:
    theirs = {"default": _model(None, shape), "eager": _model("eager", shape)}
    cfg, params = hf.from_hf(theirs["default"])
    ours = cf.train_step(SHAPES[shape][2].loss(cfg), optim.adamw(**HYPER), donate=True)
    state = ours.init(params)
    opts = {k: torch.optim.AdamW(m.parameters(), fused=True, **HYPER) for k, m in theirs.items()}
    for m in theirs.values():
        m.train()
    g = torch.Generator().manual_seed(1)
    ratios: dict[str, list[float]] = {k: [] for k in theirs}
    ms: dict[str, list[float]] = {"ours": [], **{k: [] for k in theirs}}
    gap = 0.0
    for i in range(steps + 1):
        ids = torch.randint(0, SIZE["vocab_size"], (8, 128), generator=g)
        batch = {"input_ids": ids, "labels": ids}
        t0 = time.perf_counter()
        state, metrics = ours(state, batch)
        t_ours = time.perf_counter() - t0
        for k, m in theirs.items():
            t0 = time.perf_counter()
            opts[k].zero_grad(set_to_none=True)
            loss = m(**batch).loss
            loss.backward()
            opts[k].step()
            t = time.perf_counter() - t0
            if i == 0 and k == "default":
                gap = abs(float(metrics["loss"]) - loss.item())
            elif i > 0:
                ratios[k].append(t / t_ours)
                ms[k].append(1e3 * t)
        if i > 0:
            ms["ours"].append(1e3 * t_ours)
    print(f"step ({shape}): first-step loss gap {gap:.1e}; theirs/ours (median of {steps}): " + ", ".join(
        f"{k} {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for k, v in ratios.items()
    ) + " (medians: " + ", ".join(f"{k} {statistics.median(v):.0f} ms" for k, v in ms.items()) + ")")  # fmt: skip


def block_part(reps: int = 7, shape: str = "mixtral") -> None:
    theirs = {"default": _model(None, shape), "eager": _model("eager", shape)}
    sizes, renorm = SHAPES[shape][1], SHAPES[shape][3]
    _, params = hf.from_hf(theirs["default"])
    layer = cf.tree.map(lambda x: x[0].detach().clone().requires_grad_(), params["blocks"]["mlp"])
    g = torch.Generator().manual_seed(2)
    h = torch.randn(8, 128, SIZE["hidden_size"], generator=g)
    blocks = {k: m.model.layers[0].mlp.train() for k, m in theirs.items()}
    times: dict[str, list[float]] = {"ours": [], **{k: [] for k in blocks}}
    gap = 0.0
    for i in range(reps + 1):
        x = h.clone().requires_grad_()
        t0 = time.perf_counter()
        y, _ = cf.nn.sparse_mlp(x, layer, sizes["num_experts_per_tok"], renorm)
        y.square().mean().backward()
        t_ours = time.perf_counter() - t0
        for k, block in blocks.items():
            xt = h.clone().requires_grad_()
            t0 = time.perf_counter()
            yt = block(xt)
            yt = yt[0] if isinstance(yt, tuple) else yt  # (some return the router logits too)
            yt.square().mean().backward()
            t = time.perf_counter() - t0
            if i:
                times[k].append(t)
            if k == "default":
                gap = max(gap, (y - yt).abs().max().item())
        if i:
            times["ours"].append(t_ours)
    ours = statistics.median(times["ours"])
    print(f"block ({shape}): 1024 tokens, outputs within {gap:.1e}; theirs/ours (median of {reps}): " + ", ".join(
        f"{k} {statistics.median(times[k]) / ours:.2f}" for k in blocks
    ) + f" (ours {1e3 * ours:.1f} ms)")  # fmt: skip
    with torch.no_grad():
        r = cf.nn.moe.route(h.reshape(-1, h.shape[-1]), layer["router"], sizes["num_experts_per_tok"], renorm)  # fmt: skip
    floor = _matmuls_alone(h.shape[-1], layer["experts"]["w_gate"].shape[-1], ops.moe.routed(r.topi, r.probs.numel())[2], reps)  # fmt: skip
    eager = statistics.median(times["eager"])
    print(f"block ({shape}): the experts' matmuls alone (forward and backward, one per expert "
          f"and product) {1e3 * floor:.1f} ms; their loop {1e3 * eager:.1f} ms, ours "
          f"{1e3 * ours:.1f} ms: beside the matmuls their loop spends {1e3 * (eager - floor):.1f} "
          f"ms, the most any block could save of it")  # fmt: skip


def _matmuls_alone(D: int, Fw: int, sizes: list[int], reps: int) -> float:
    """The median time of an MoE block's expert matmuls and nothing else: for each expert's
    rows, the gate, up and down products forward, and their input and weight gradients."""
    g = torch.Generator().manual_seed(4)
    per = [
        (torch.randn(n, D, generator=g), torch.randn(D, Fw, generator=g),
         torch.randn(n, Fw, generator=g), torch.randn(Fw, D, generator=g),
         torch.randn(n, D, generator=g))
        for n in sizes if n
    ]  # fmt: skip
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for x, w, hf_, wd, dy in per:
            x @ w, x @ w, hf_ @ wd  # (forward: gate, up, down)
            dh = dy @ wd.t()  # (backward: the down product's input and weight gradients,
            hf_.t() @ dy, dh @ w.t(), dh @ w.t(), x.t() @ dh, x.t() @ dh  # the gate's, the up's)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _masked(x: torch.Tensor, topi: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each expert's rows picked by a mask, one expert at a time (transformers' eager loop)."""
    out = x.new_zeros(x.shape[0], topi.shape[1], w.shape[2])
    for e in range(w.shape[0]):
        tok, slot = torch.where(topi == e)
        out[tok, slot] = x[tok] @ w[e]
    return out


def grouped_part(reps: int = 7) -> None:
    g = torch.Generator().manual_seed(3)
    N, K, E, D, F = 2048, 2, 8, 256, 512
    x = torch.randn(N, D, generator=g)
    w = torch.randn(E, D, F, generator=g)
    topi = torch.randint(0, E, (N, K), generator=g)
    times: dict[str, list[float]] = {"grouped": [], "masked": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        _, tokens, sizes, _ = ops.moe.routed(topi, E)
        ops.grouped_matmul(x.index_select(0, tokens), w, sizes)
        times["grouped"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _masked(x, topi, w)
        times["masked"].append(time.perf_counter() - t0)
    ratio = statistics.median(times["masked"]) / statistics.median(times["grouped"])
    print(f"grouped: {N} tokens x {K}, {E} experts, {D} -> {F}: loop/grouped {ratio:.2f} "
          f"(grouped {1e3 * statistics.median(times['grouped']):.1f} ms)")  # fmt: skip


EP_SIZE = {**SIZE, "num_hidden_layers": 2}


def _ep_rank(n: int, steps: int, mesh: cf.Mesh) -> dict[str, Any]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**EP_SIZE))
    cfg, params = hf.from_hf(model)
    loss, opt = models.mixtral.loss(cfg), optim.adamw(**HYPER)
    built = {  # one axis "x": the batch axis (every rank every expert), or the expert axis
        "ep1": cf.shard(cf.train_step(loss, opt), mesh, batch_axis="x"),
        f"ep{n}": cf.shard(cf.train_step(loss, opt), mesh, batch_axis=None, expert_axis="x"),
    }
    states = {k: s.init(params) for k, s in built.items()}
    g = torch.Generator().manual_seed(4)
    times: dict[str, list[float]] = {k: [] for k in built}
    sent: dict[str, dict[Any, int]] = {}
    counts = torch.zeros(0)
    for i in range(steps + 1):
        ids = torch.randint(0, EP_SIZE["vocab_size"], (8, 128), generator=g)
        batch = {"input_ids": ids, "labels": ids}
        if i == steps:  # each rank's routed counts for the last step, for the closed form
            sown = cf.core.Sown()
            with cf.core.context(sown):
                built[f"ep{n}"].evaluate(states[f"ep{n}"], batch)
            mine = torch.stack([v.to_local() for v in sown.values["expert_counts"]])
            counts = cf.sharding.comm.all_gather(mine[None], "x", 0)  # [ranks, layers, E]
        for k, step in built.items():
            cf.sharding.comm.all_reduce(torch.zeros(1), "x")  # (start together)
            with cf.sharding.recording(mesh) as led:
                led.reset()
                t0 = time.perf_counter()
                states[k], _ = step(states[k], batch)
                t = time.perf_counter() - t0
            if i:
                times[k].append(t)
            sent[k] = led.as_dict()
    me, per = mesh.axis_index("x"), EP_SIZE["num_local_experts"] // n
    mine_e = slice(me * per, (me + 1) * per)
    s = int(counts[me].sum()) - int(counts[me][:, mine_e].sum())  # rows out, all layers
    r = int(counts[:, :, mine_e].sum()) - int(counts[me][:, mine_e].sum())  # rows in
    formula = (s + r + 2 * s + r) * EP_SIZE["hidden_size"] * 4
    return {"times": times, "sent": sent, "formula": formula}


def ep_part(steps: int) -> None:
    for n in (2, 4):
        out = cf.launch(functools.partial(_ep_rank, n, steps), mesh={"x": n}, backend="gloo")
        t = out[0]["times"]
        ratio = [a / b for a, b in zip(t["ep1"], t[f"ep{n}"])]
        ok = all(o["sent"][f"ep{n}"].get(("all_to_all_v", "x"), -1) == o["formula"] for o in out)
        by_op = {
            k: ", ".join(f"{op} {b / 2**20:.2f} MiB" for (op, _), b in sorted(v.items()))
            for k, v in out[0]["sent"].items()
        }
        print(f"ep: {n} gloo ranks, ep1/ep{n} step time (median of {steps}) "
              f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}); rank 0 sends "
              f"{by_op}; all_to_all_v bytes = closed form on every rank: {ok}")  # fmt: skip


def offload_part(steps: int, shape: str) -> None:
    config, sizes, module, _ = SHAPES[shape]
    torch.manual_seed(0)
    cfg, params = hf.from_hf(transformers.AutoModelForCausalLM.from_config(config(**sizes)))
    ref = cf.train_step(module.loss(cfg), optim.adamw(**HYPER))
    g = torch.Generator().manual_seed(2)
    for rows, length in ((1, 4), (1, 32), (8, 128)):
        kinds = ("routed", "layer")
        runs = {k: cf.offload(ref, "host", "4GiB", experts=k) for k in kinds}
        states = {k: s.init(params) for k, s in runs.items()}
        got: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
        share = []
        for i in range(steps + 1):
            ids = torch.randint(0, SIZE["vocab_size"], (rows, length), generator=g)
            batch = {"input_ids": ids, "labels": ids}
            for k in kinds if i % 2 == 0 else kinds[::-1]:
                t0 = time.perf_counter()
                states[k], metrics = runs[k](states[k], batch)
                t = time.perf_counter() - t0
                if i > 0:  # (the first step of each is its warm-up)
                    got[k].append({"time": t, **{m: float(metrics[f"offload/{m}"])
                                   for m in ("h2d_bytes", "device_peak_bytes")}})  # fmt: skip
                if k == "routed":
                    counts = metrics["expert_counts"]
                    share.append(float((counts > 0).float().mean()))

        def med(k: str, m: str, got: dict[str, list[dict[str, float]]] = got) -> float:
            return statistics.median(r[m] for r in got[k])

        ratio = [a["time"] / b["time"] for a, b in zip(got["routed"], got["layer"])]
        print(
            f"offload ({shape}, {rows}x{length} tokens): experts routed to "
            f"{statistics.median(share):.0%}; routed/layer h2d "
            f"{med('routed', 'h2d_bytes') / 2**20:.1f}/{med('layer', 'h2d_bytes') / 2**20:.1f} MiB, "
            f"device peak {med('routed', 'device_peak_bytes') / 2**20:.1f}/"
            f"{med('layer', 'device_peak_bytes') / 2**20:.1f} MiB, step time "
            f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})"
        )


def _offload_ep_rank(shape: str, cfg: Any, params: Any, steps: int, mesh: cf.Mesh) -> Any:
    ref = cf.train_step(SHAPES[shape][2].loss(cfg), optim.adamw(**HYPER))
    n = mesh.axis_size("ep")
    g = torch.Generator().manual_seed(3)  # (the same batches on every rank: each takes its rows)
    out = {}
    for rows, length in ((1, 4), (1, 32), (8, 128)):
        kinds = ("routed", "layer")
        sharded = cf.shard(ref, mesh, expert_axis="ep")
        runs = {k: cf.offload(sharded, "host", "4GiB", experts=k) for k in kinds}
        states = {k: s.init(params) for k, s in runs.items()}
        got: dict[str, list[float]] = {k: [] for k in kinds}
        for i in range(steps + 1):
            ids = torch.randint(0, SIZE["vocab_size"], (rows * n, length), generator=g)
            for k in kinds:
                states[k], metrics = runs[k](states[k], {"input_ids": ids, "labels": ids})
                if i > 0:
                    got[k].append(float(metrics["offload/h2d_bytes"]))
        out[(rows, length)] = {k: statistics.median(v) for k, v in got.items()}
    return out


def offload_ep_part(steps: int, shape: str, n: int = 2) -> None:
    """The ``offload`` part under expert parallelism (``ep`` = n, threads): each rank's
    host-to-device bytes a step, its experts fetched when routed to against with the layer."""
    config, sizes, _, _ = SHAPES[shape]
    torch.manual_seed(0)
    cfg, params = hf.from_hf(transformers.AutoModelForCausalLM.from_config(config(**sizes)))
    main = functools.partial(_offload_ep_rank, shape, cfg, params, steps)
    per_rank = cf.launch(main, mesh={"ep": n})
    for key in per_rank[0]:
        routed = [r[key]["routed"] / 2**20 for r in per_rank]
        layer = [r[key]["layer"] / 2**20 for r in per_rank]
        print(
            f"offload ep={n} ({shape}, {key[0]}x{key[1]} tokens a rank): routed/layer h2d per "
            f"rank " + ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(routed, layer)) + " MiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="step,block,grouped")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--shapes", default="mixtral", help=f"of {', '.join(SHAPES)}")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    parts = set(args.parts.split(","))
    known = {"step", "block", "grouped", "ep", "offload", "offload_ep"}
    if parts - known:
        raise SystemExit(f"--parts: {args.parts!r}; expected some of {','.join(sorted(known))}")
    shapes = args.shapes.split(",")
    for shape in shapes:
        if shape not in SHAPES:
            raise SystemExit(f"--shapes: {shape!r} is not one of {', '.join(SHAPES)}")
    if "grouped" in parts:
        grouped_part()
    for shape in shapes:
        if "block" in parts:
            block_part(shape=shape)
        if "step" in parts:
            step_part(args.steps, shape)
        if "offload" in parts:
            offload_part(args.steps, shape)
        if "offload_ep" in parts:
            offload_ep_part(args.steps, shape)
    if "ep" in parts:
        ep_part(args.steps)


if __name__ == "__main__":
    main()
