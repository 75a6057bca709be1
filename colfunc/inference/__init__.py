"""Inference: a paged KV cache, continuous batching and sampling, over the training model code.

:class:`Engine` runs any ``colfunc.models`` module (a trained run, or a Hugging Face folder)
through its ``paged_forward``; :class:`SamplingParams` says how each request is sampled.
"""

from colfunc.inference.draft_model import DraftModel
from colfunc.inference.engine import CompletionOutput, Engine, RequestOutput
from colfunc.inference.kv_cache import BlockAllocator, block_hash
from colfunc.inference.sampling import SamplingParams, next_token
from colfunc.inference.scheduler import Scheduled, Scheduler, Sequence
from colfunc.inference.speculative import Ngram
from colfunc.inference.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_hf_tokenizer

__all__ = [
    "BlockAllocator",
    "ByteTokenizer",
    "CompletionOutput",
    "DraftModel",
    "Engine",
    "HFTokenizer",
    "Ngram",
    "RequestOutput",
    "SamplingParams",
    "Scheduled",
    "Scheduler",
    "Sequence",
    "Tokenizer",
    "block_hash",
    "load_hf_tokenizer",
    "next_token",
]
