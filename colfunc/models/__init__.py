"""Models as pure functions over parameter pytrees: the causal language models GPT-2, LLaMA and
OPT, and the spatial-temporal diffusion transformer DiT (Open-Sora's STDiT) for video.

Each module exports ``Config`` (with ``tiny()``), ``init(cfg, seed)``, ``apply(params, ...)``,
``loss(cfg)`` (a ``layered`` loss) and ``tp_plan``.
"""

from colfunc.models import dit, gpt, llama, opt

__all__ = ["dit", "gpt", "llama", "opt"]
