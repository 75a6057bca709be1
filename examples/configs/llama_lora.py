"""LoRA fine-tuning of a LLaMA-family model from a local Hugging Face folder: rank-16 adapters on
every attention and MLP weight, the base frozen (and, with ``base_dtype="nf4"``, stored in 4 bits:
QLoRA), streamed from host memory by cf.offload.

    COLFUNC_HF_MODEL=path/to/llama colfunc train examples/configs/llama_lora.py
    colfunc export --run runs/<name> --peft adapter/        # peft.PeftModel.from_pretrained reads it
    colfunc export --run runs/<name> --hf merged/ --merge   # the base with the adapters merged in

The folder is what ``save_pretrained`` writes (``config.json`` and safetensors, and its
tokenizer); nothing is downloaded. Any family colfunc reads (Mistral, Qwen, Gemma, Phi-3, ...)
works the same way.
"""

import os

from colfunc.config import DataConfig, OptimConfig, TrainConfig

FOLDER = os.environ.get("COLFUNC_HF_MODEL", "llama")

model = f"hf:{FOLDER}"  # its config and its weights
optim = OptimConfig(lr=2e-4, weight_decay=0.0, warmup_steps=10, final_lr=2e-5)
data = DataConfig(corpus="stdlib", tokenizer=f"hf:{FOLDER}", batch_size=4, seq_len=256, seed=0)
train = TrainConfig(steps=200, log_every=10, eval_every=50, eval_batches=4, sample_prompt="def ")

lora = dict(rank=16, alpha=32, targets=["blocks.attn.w*", "blocks.mlp.w*"], base_dtype=None)
parallel = dict(offload=dict(policy="auto", device_budget="2GiB"), remat="full")
