"""Every private PyTorch API colfunc uses, in one place.

PyTorch's underscored names carry no compatibility promise, so each one colfunc needs is taken
here, by one entry of :data:`ENTRIES`, and used everywhere else through this module. On a torch
that moved or removed one, the first use raises :class:`TorchChanged` naming the entry, what it
is for and the torch versions it is known to work with, instead of an ``AttributeError`` deep in
a step. ``tests/test_torch_private.py`` checks every entry on the installed torch.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = ["ENTRIES", "TorchChanged", "check_all", "get"]

KNOWN_GOOD = "torch>=2.6,<2.14"

# name -> (dotted location, what colfunc uses it for)
ENTRIES: dict[str, tuple[str, str]] = {
    "fused_adamw_": ("torch._fused_adamw_", "the fused AdamW update over lists of tensors"),
    "foreach_add": ("torch._foreach_add", "optimizer arithmetic over lists of tensors"),
    "foreach_add_": ("torch._foreach_add_", "optimizer arithmetic over lists of tensors"),
    "foreach_mul": ("torch._foreach_mul", "optimizer arithmetic over lists of tensors"),
    "foreach_mul_": ("torch._foreach_mul_", "optimizer arithmetic over lists of tensors"),
    "foreach_div": ("torch._foreach_div", "optimizer arithmetic over lists of tensors"),
    "foreach_div_": ("torch._foreach_div_", "optimizer arithmetic over lists of tensors"),
    "foreach_lerp": ("torch._foreach_lerp", "Adam's first moment"),
    "foreach_addcmul_": ("torch._foreach_addcmul_", "Adam's second moment"),
    "foreach_addcdiv_": ("torch._foreach_addcdiv_", "Adam's update"),
    "foreach_sqrt": ("torch._foreach_sqrt", "Adam's denominator"),
    "foreach_copy_": (
        "torch._foreach_copy_",
        "writing a layer's gradients into data parallelism's flat buffer in one call",
    ),
    "foreach_maximum": ("torch._foreach_maximum", "AMSGrad's running maximum"),
    "foreach_norm": ("torch._foreach_norm", "gradient norms in one pass"),
    "top_saved_tensors_default_hooks": (
        "torch._C._autograd._top_saved_tensors_default_hooks",
        "whether saved-tensor hooks are in force (ZeRO-3 inside a checkpoint)",
    ),
    "current_autograd_node": (
        "torch._C._current_autograd_node",
        "whether a backward node is running (ZeRO-3 regathers)",
    ),
    "disable_current_modes": (
        "torch.utils._python_dispatch._disable_current_modes",
        "starting a ZeRO-3 prefetch out of sight of a checkpoint's dispatch modes",
    ),
    "TorchDispatchMode": (
        "torch.utils._python_dispatch.TorchDispatchMode",
        "cf.memory.track's view of every tensor made",
    ),
    "pytree": ("torch.utils._pytree", "flattening ATen arguments in ShardedTensor dispatch"),
    "make_wrapper_subclass": (
        "torch.Tensor._make_wrapper_subclass",
        "ShardedTensor, a tensor subclass that holds this rank's shard",
    ),
    "disabled_torch_function_impl": (
        "torch._C._disabled_torch_function_impl",
        "ShardedTensor seen by __torch_dispatch__ only",
    ),
    "are_functorch_transforms_active": (
        "torch._C._are_functorch_transforms_active",
        "collectives refusing to run under torch.func transforms",
    ),
    "is_functorch_wrapped_tensor": (
        "torch._C._functorch.is_functorch_wrapped_tensor",
        "kernels falling back to the reference under torch.func",
    ),
    "OpOverload": ("torch._ops.OpOverload", "the type of the ATen ops the sharding rules key on"),
    "flash_attention_cpu": (
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        "the CPU flash attention's log-sum-exp (ring attention's blocks; cf.memory's dry run)",
    ),
    "flash_attention_cpu_backward": (
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward",
        "the CPU flash attention's backward, one key/value block at a time (ring attention)",
    ),
    "grouped_mm": (
        "torch._grouped_mm",
        "the experts' grouped matmul on the CPU (one call for every expert's block of rows)",
    ),
    "cpu_avx512_bf16": (
        "torch.cpu._is_avx512_bf16_supported",
        "whether the CPU computes bf16 natively (amp's bf16 on CPUs without it is emulated)",
    ),
    "cpu_amx": (
        "torch.cpu._is_amx_tile_supported",
        "whether the CPU has AMX tiles (native bf16 matmuls)",
    ),
    "storage_use_count": (
        "torch._C._storage_Use_Count",
        "reusing a gradient buffer between steps only when no tensor refers to it any more",
    ),
}


class TorchChanged(RuntimeError):
    """A private PyTorch API colfunc uses is not where it was."""


def _resolve(location: str) -> Any:
    parts = location.split(".")
    # the longest importable module prefix, then attributes
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(location)


_CACHE: dict[str, Any] = {}


def get(name: str) -> Any:
    """The object of entry ``name`` (resolved once), or :class:`TorchChanged`."""
    if name in _CACHE:
        return _CACHE[name]
    if name not in ENTRIES:
        raise KeyError(f"torch_private: no entry {name!r}; the entries are {sorted(ENTRIES)}")
    location, purpose = ENTRIES[name]
    try:
        obj = _resolve(location)
    except (ImportError, AttributeError) as e:
        raise TorchChanged(
            f"colfunc needs {location} ({purpose}), which torch {torch.__version__} does not "
            f"have ({type(e).__name__}: {e}); install {KNOWN_GOOD}, the versions colfunc is "
            "tested with"
        ) from None
    _CACHE[name] = obj
    return obj


def check_all() -> dict[str, str]:
    """Every entry that does not resolve on this torch, with its message (empty: all do)."""
    bad = {}
    for name in ENTRIES:
        try:
            get(name)
        except TorchChanged as e:
            bad[name] = str(e)
    return bad


def saving_hooks_active() -> bool:
    """Whether saved-tensor hooks are already in force (inside a checkpoint, say): ZeRO-3's
    gathers and offload's fetches then leave the saved weights to them."""
    return get("top_saved_tensors_default_hooks")(False) is not None


def in_backward() -> bool:
    """Whether autograd is running a backward node (remat recomputing a layer, say)."""
    return get("current_autograd_node")() is not None


def storage_users(x: torch.Tensor) -> int:
    """How many tensors (views included) and storage objects refer to ``x``'s memory."""
    storage = x.untyped_storage()
    return int(get("storage_use_count")(storage._cdata)) - 1  # less ``storage`` itself


def __getattr__(name: str) -> Any:  # torch_private.foreach_add(...), torch_private.pytree, ...
    if name in ENTRIES:
        return get(name)
    raise AttributeError(f"module 'colfunc.torch_private' has no attribute {name!r}")


# resolved at import: every ShardedTensor op flattens its arguments with it
pytree_module: Any = get("pytree")
