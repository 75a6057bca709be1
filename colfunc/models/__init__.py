"""Models as pure functions over parameter pytrees: the causal language models GPT-2, OPT and
the LLaMA-shaped families of one shared decoder (:mod:`colfunc.models.decoder`: LLaMA, Mistral,
Qwen 2, Qwen 3, Phi-3, OLMo 2, Gemma 2, Gemma 3, SmolLM 3, GPT-NeoX), and the spatial-temporal diffusion transformer DiT (Open-Sora's STDiT) for
video; any other ``transformers`` causal LM runs through its own module
(:mod:`colfunc.models.hf_module`, the ``transformers`` family).

Each module exports ``Config`` (with ``tiny()``), ``init(cfg, seed)``, ``apply(params, ...)``,
``loss(cfg)`` (a ``layered`` loss), ``tp_plan`` and ``family``: its :class:`Family`, which
declares the rest the edges need (Hugging Face names, weights and config; the KV cache). The
families are registered here; a new one is one module and one :func:`register` line (see
:mod:`colfunc.models.family`).
"""

from colfunc.models import (
    decoder,
    decoder_hf,
    dit,
    gemma2,
    gemma3,
    gpt,
    gpt_neox,
    hf_module,
    llama,
    mistral,
    mixtral,
    olmo2,
    olmoe,
    opt,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
    smollm3,
)
from colfunc.models.family import (
    FAMILIES,
    Family,
    HFMapping,
    HFWeight,
    KVCacheSpec,
    get,
    of_config,
    of_hf,
    register,
    registered,
    unregister,
)

for _module in (
    gpt,
    llama,
    mistral,
    qwen2,
    qwen3,
    phi3,
    olmo2,
    gemma2,
    gemma3,
    smollm3,
    gpt_neox,
    mixtral,
    qwen2_moe,
    qwen3_moe,
    olmoe,
    opt,
    dit,
    hf_module,
):
    register(_module.family)

__all__ = [
    "FAMILIES",
    "Family",
    "HFMapping",
    "HFWeight",
    "KVCacheSpec",
    "decoder",
    "decoder_hf",
    "dit",
    "gemma2",
    "gemma3",
    "get",
    "gpt",
    "gpt_neox",
    "llama",
    "mistral",
    "of_config",
    "of_hf",
    "olmo2",
    "opt",
    "phi3",
    "qwen2",
    "qwen3",
    "register",
    "registered",
    "smollm3",
    "unregister",
]
