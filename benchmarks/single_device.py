"""Single-device training step: colfunc vs the same GPT-2 as an ``nn.Module`` with fused AdamW.

Both sides start from the same weights and see the same batches; steps are timed interleaved
(ours, theirs, ours, ...) in one process so that drift in the machine's load hits both alike.
Prints the median step-time ratio ours/theirs per config (goal: at most 1.05) and checks that the
two losses agree, so the comparison is between equal computations.

    python benchmarks/single_device.py [--steps 30] [--configs tiny,small]
    colfunc bench single_device
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import colfunc as cf
from colfunc import models, optim

gpt = models.gpt


class Block(nn.Module):
    def __init__(self, cfg: gpt.Config) -> None:
        super().__init__()
        D, F_ = cfg.d_model, cfg.d_ff or 4 * cfg.d_model
        self.n_head = cfg.n_head
        self.ln1, self.ln2 = nn.LayerNorm(D, eps=cfg.norm_eps), nn.LayerNorm(D, eps=cfg.norm_eps)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.fc, self.proj = nn.Linear(D, F_), nn.Linear(F_, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        h = self.ln1(x)
        q, k, v = (
            m(h).view(B, T, self.n_head, -1).transpose(1, 2) for m in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, D))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 written the usual PyTorch way, tied head included."""

    def __init__(self, cfg: gpt.Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        x = self.wte(ids) + self.wpe(torch.arange(T))
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.ln_f(x[:, :-1]), self.wte.weight)
        return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())

    @torch.no_grad()
    def load_colfunc(self, params: dict) -> None:
        blocks = params["blocks"]
        self.wte.weight.copy_(params["embed"]["tokens"])
        self.wpe.weight.copy_(params["embed"]["positions"])
        self.ln_f.weight.copy_(params["final_norm"]["weight"])
        self.ln_f.bias.copy_(params["final_norm"]["bias"])
        for i, b in enumerate(self.blocks):
            for ln, name in ((b.ln1, "ln1"), (b.ln2, "ln2")):
                ln.weight.copy_(blocks[name]["weight"][i])
                ln.bias.copy_(blocks[name]["bias"][i])
            attn, mlp = blocks["attn"], blocks["mlp"]
            for lin, w, bias in (
                (b.q, attn["wq"], attn["bq"]),
                (b.k, attn["wk"], attn["bk"]),
                (b.v, attn["wv"], attn["bv"]),
                (b.o, attn["wo"], attn["bo"]),
                (b.fc, mlp["w_in"], mlp["b_in"]),
                (b.proj, mlp["w_out"], mlp["b_out"]),
            ):
                lin.weight.copy_(w[i].t())
                lin.bias.copy_(bias[i])


def bench(name: str, cfg: gpt.Config, batch_size: int, steps: int, warmup: int = 3) -> float:
    params = gpt.init(cfg, seed=0)
    kw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    # donating, as `colfunc train` does (the peer's optimizer updates in place too)
    step = cf.train_step(gpt.loss(cfg), optim.adamw(**kw), donate=True)  # type: ignore[arg-type]
    state = step.init(params)
    ref = GPT(cfg)
    ref.load_colfunc(params)
    torch_opt = torch.optim.AdamW(ref.parameters(), fused=True, **kw)  # type: ignore[arg-type]

    g = torch.Generator().manual_seed(0)
    T = cfg.max_seq_len
    ours_t, theirs_t, loss_gap = [], [], 0.0
    for i in range(warmup + steps):
        ids = torch.randint(0, cfg.vocab_size, (batch_size, T), generator=g)
        batch = {"input_ids": ids, "labels": ids}

        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        t1 = time.perf_counter()
        torch_opt.zero_grad(set_to_none=True)
        loss = ref(ids, ids)
        loss.backward()
        torch_opt.step()
        t2 = time.perf_counter()

        loss_gap = max(loss_gap, abs(float(metrics["loss"]) - float(loss.detach())))
        if i >= warmup:
            ours_t.append(t1 - t0)
            theirs_t.append(t2 - t1)
    ratio = statistics.median(a / b for a, b in zip(ours_t, theirs_t))
    tokens = batch_size * T
    print(
        f"{name:6s} params={sum(p.numel() for p in ref.parameters()) / 1e6:5.2f}M "
        f"batch={batch_size}x{T}  ours {statistics.median(ours_t) * 1e3:7.1f} ms "
        f"({tokens / statistics.median(ours_t):8.0f} tok/s)  torch "
        f"{statistics.median(theirs_t) * 1e3:7.1f} ms  median ratio ours/torch {ratio:.3f}  "
        f"max loss gap {loss_gap:.1e}"
    )
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--configs", default="tiny,small")
    args = parser.parse_args()
    sizes = {"tiny": (gpt.Config.tiny(), 16), "small": (gpt.Config.small(), 8)}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.configs.split(","):
        cfg, batch_size = sizes[name]
        bench(name, cfg, batch_size, args.steps)


if __name__ == "__main__":
    main()
