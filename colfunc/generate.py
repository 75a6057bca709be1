"""Autoregressive sampling from any model's ``apply``: temperature, top-k, greedy at 0.

Each new token recomputes the model over the last ``max_seq_len`` tokens (no KV cache), which is
simple and exact; ``colfunc.inference`` is the fast path.

Legend: T tokens so far, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from colfunc import data
from colfunc.config import RunConfig, model_module

__all__ = ["complete", "sample"]


@torch.no_grad()
def sample(
    apply: Callable[[Any, torch.Tensor, Any], torch.Tensor],
    params: Any,
    cfg: Any,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
) -> torch.Tensor:
    """The prompt followed by ``max_new_tokens`` sampled tokens, as a 1-d LongTensor.

    ``apply(params, input_ids[1, T], cfg) -> logits[1, T, V]`` is a model's ``apply``.
    ``temperature=0`` picks the most likely token (greedy); otherwise the logits are divided by
    the temperature and, when ``top_k > 0``, only the ``top_k`` most likely tokens are kept. The
    draws come from a generator seeded with ``seed``: the same call gives the same text.

    Example:
        >>> ids = sample(gpt.apply, params, cfg, data.encode("def "), 100, seed=0)
        >>> print(data.decode(ids))
    """
    if prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
        raise ValueError(
            f"the prompt must be a non-empty 1-d tensor of token ids, got shape "
            f"{tuple(prompt_ids.shape)}"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 keeps every token), got {top_k}")
    generator = torch.Generator().manual_seed(seed)
    T0 = prompt_ids.numel()
    ids = torch.empty(T0 + max_new_tokens, dtype=torch.long)
    ids[:T0] = prompt_ids
    for t in range(T0, T0 + max_new_tokens):
        context_T = ids[max(0, t - cfg.max_seq_len) : t]
        logits_V = apply(params, context_T[None], cfg)[0, -1].float()
        if temperature == 0:
            ids[t] = logits_V.argmax()
            continue
        logits_V = logits_V / temperature
        if top_k:
            kth = torch.topk(logits_V, min(top_k, logits_V.numel())).values[-1]
            logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
        probs_V = torch.softmax(logits_V, dim=-1)
        ids[t] = torch.multinomial(probs_V, 1, generator=generator)[0]
    return ids


def complete(
    cfg: RunConfig,
    params: Any,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
) -> str:
    """``prompt`` and ``max_new_tokens`` bytes sampled after it by the byte-level model of a run.

    Example:
        >>> state, cfg = checkpoint.load("runs/demo/checkpoint")
        >>> print(complete(cfg, state.params, "def ", 200))
    """
    model = model_module(cfg.model)

    def byte_logits(params: Any, ids: torch.Tensor, model_cfg: Any) -> torch.Tensor:
        # a vocabulary padded past the 256 byte values never yields those extra ids
        return model.apply(params, ids, model_cfg)[..., : data.VOCAB_SIZE]

    ids = sample(
        byte_logits,
        params,
        cfg.model,
        data.encode(prompt),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
    )
    return data.decode(ids)
