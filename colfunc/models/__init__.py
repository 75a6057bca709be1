"""Causal language models as pure functions over parameter pytrees: GPT-2, LLaMA and OPT.

Each module exports ``Config`` (with ``tiny()`` and ``small()``), ``init(cfg, seed)``,
``apply(params, input_ids, cfg)``, ``loss(cfg)`` (a ``layered`` loss) and ``tp_plan``.
"""

from colfunc.models import gpt, llama, opt

__all__ = ["gpt", "llama", "opt"]
