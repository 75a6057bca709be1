"""Adapters trained beside a frozen model: LoRA (:func:`colfunc.lora`), merging them into the
weights, and peft's adapter folders in and out (:mod:`colfunc.adapters.peft`)."""

from colfunc.adapters.lora import (
    INITS,
    LoraConfig,
    Target,
    adapter_numel,
    adapter_paths,
    call,
    config_of,
    is_adapter,
    lora,
)
from colfunc.adapters.peft import adapter_config, fused_groups, load_adapter, save_adapter, to_peft
from colfunc.adapters.weights import combine, merge

__all__ = [
    "INITS",
    "LoraConfig",
    "Target",
    "adapter_config",
    "adapter_numel",
    "adapter_paths",
    "call",
    "combine",
    "config_of",
    "fused_groups",
    "is_adapter",
    "load_adapter",
    "lora",
    "merge",
    "save_adapter",
    "to_peft",
]
