"""Text from a trained run, and a cache-free reference sampler.

:func:`complete` (``colfunc generate``, the sample after ``colfunc train``) runs on the inference
engine (:class:`colfunc.inference.Engine`: paged KV cache, one forward pass per new token).
:func:`sample` recomputes the model over the last ``max_seq_len`` tokens for every new token: no
cache, slow, and simple enough to serve as a reference.

Legend: T tokens so far, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from colfunc.config import RunConfig, model_module

__all__ = ["Generated", "check_params", "complete", "generate", "sample"]


def check_params(model_cfg: Any, params: Any) -> None:
    """Refuse parameters that do not fit ``model_cfg`` (the paths and shapes its init makes) or
    hold a value that is not finite, naming the first such parameter."""
    from colfunc import tree

    want = model_module(model_cfg).param_shapes(model_cfg)
    got = {p: tuple(x.shape) for p, x in tree.flatten_with_paths(params)[0]}
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise ValueError(
            f"the parameters do not match the model config: missing {missing[:3]}, "
            f"unexpected {extra[:3]}"
        )
    for path, shape in want.items():
        if got[path] != tuple(shape):
            raise ValueError(
                f"parameter {path!r} has shape {got[path]}, but the model config makes "
                f"{tuple(shape)}: the checkpoint and its config disagree"
            )
    for path, x in tree.flatten_with_paths(params)[0]:
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            raise ValueError(f"parameter {path!r} holds values that are not finite (NaN or inf)")


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


class Generated(NamedTuple):
    """What :func:`generate` made: the text (prompt included) and how many tokens it sampled
    (fewer than asked where the model's context ended it)."""

    text: str
    new_tokens: int


def generate(
    cfg: RunConfig,
    params: Any,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
) -> Generated:
    """``prompt`` and up to ``max_new_tokens`` tokens sampled after it by a run's model (bytes,
    or the run's ``data.tokenizer``), on the inference engine; the output stops at the model's
    context, and ``new_tokens`` says how many were sampled.

    Example:
        >>> state, cfg = checkpoint.load("runs/demo/checkpoint")
        >>> print(generate(cfg, state.params, "def ", 200).text)
    """
    from colfunc.inference import ByteTokenizer, Engine, SamplingParams

    if not prompt:
        raise ValueError("the prompt must not be empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    from colfunc.resume import model_params

    params = model_params(cfg, params)  # (a lora run's adapters, merged)
    check_params(cfg.model, params)
    max_new_tokens = min(max_new_tokens, cfg.model.max_seq_len)  # the context ends it anyway
    tokenizer: Any = ByteTokenizer()
    if cfg.data.tokenizer is not None:  # the run's own tokenizer (a Hugging Face folder's)
        from colfunc import hf
        from colfunc.inference.tokenizers import load_hf_tokenizer

        tokenizer = load_hf_tokenizer(hf.folder_of(cfg.data.tokenizer, what="tokenizer"))
    engine = Engine(model_module(cfg.model), cfg.model, params, tokenizer=tokenizer, max_num_seqs=1)
    p = SamplingParams(temperature=temperature, top_k=top_k, seed=seed, max_tokens=max_new_tokens)
    (out,) = engine.generate([prompt], p)
    new = out.outputs[0].token_ids
    return Generated(tokenizer.decode(out.prompt_token_ids + new), len(new))


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
    """:func:`generate`'s text alone: ``prompt`` and up to ``max_new_tokens`` tokens after it.

    Example:
        >>> state, cfg = checkpoint.load("runs/demo/checkpoint")
        >>> print(complete(cfg, state.params, "def ", 200))
    """
    return generate(
        cfg, params, prompt, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed
    ).text
