"""What a training run feeds its model and makes at the end: one task per kind of model.

``colfunc train`` runs the same loop (the step, its transforms, checkpoints, logging) for every
model; a task supplies the rest:

- :class:`LanguageTask` (GPT, LLaMA, OPT): windows of a text corpus (bytes or a tokenizer's
  tokens), the loss in nats per token, a text sample after ``train.sample_prompt`` at the end;
- :class:`VideoTask` (the DiT): batches of the synthetic moving-shapes clips
  (:mod:`colfunc.data.video`) with their noise and times, the rectified-flow loss, and
  ``samples.gif`` at the end, one clip per condition.

:func:`for_run` picks it from the model's family.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from colfunc import data

if TYPE_CHECKING:
    from colfunc.config import RunConfig

__all__ = ["SAMPLES", "LanguageTask", "VideoTask", "for_run"]

SAMPLES = "samples.gif"
VIDEO_SETS = ("moving-shapes",)


class LanguageTask:
    """Next-token prediction on windows of ``data.corpus``."""

    unit = "tok"
    loss_unit = "nats/token"

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        dc = cfg.data
        corpus = data.load_corpus(dc.corpus, dc.val_fraction)
        if dc.tokenizer is not None:
            corpus = _tokenized(corpus, cfg)
        for side, tokens in (("training", corpus.train), ("validation", corpus.val)):
            if tokens.numel() < dc.seq_len:
                raise ValueError(
                    f"data.corpus={dc.corpus!r}: its {side} split has {tokens.numel()} bytes, "
                    f"fewer than data.seq_len={dc.seq_len}; use more text or a shorter seq_len"
                )
        self.corpus = corpus
        self.per_step = dc.batch_size * dc.seq_len
        if dc.tokenizer is None:
            self.loss_unit = "nats/byte"

    def describe(self) -> str:
        c = self.corpus
        return (
            f"on {self.cfg.data.corpus!r} ({c.train.numel() / 1e6:.1f} MB train, "
            f"{c.val.numel() / 1e6:.2f} MB validation)"
        )

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        dc = self.cfg.data
        return data.batch_at(self.corpus.train, dc.batch_size, dc.seq_len, dc.seed, step)

    def validation(self) -> list[dict[str, torch.Tensor]]:
        dc = self.cfg.data
        return [
            data.batch_at(self.corpus.val, dc.batch_size, dc.seq_len, dc.seed, i)
            for i in range(self.cfg.train.eval_batches)
        ]

    def finish(self, params: Any, run_dir: Path) -> str | None:
        """The text sample after ``train.sample_prompt`` (None when ``sample_tokens`` is 0)."""
        tc = self.cfg.train
        if not tc.sample_tokens:
            return None
        from colfunc.generate import complete

        text = complete(self.cfg, params, tc.sample_prompt, tc.sample_tokens)
        return f"--- sample (temperature 0.8, top-k 40) ---\n{text}\n---"


class VideoTask:
    """Rectified-flow training on the synthetic moving-shapes clips."""

    unit = "clip"
    loss_unit = "velocity MSE"

    def __init__(self, cfg: RunConfig) -> None:
        if cfg.data.corpus not in VIDEO_SETS:
            raise ValueError(
                f"data.corpus={cfg.data.corpus!r}: the DiT trains on the synthetic video set; "
                f"set data.corpus to one of {list(VIDEO_SETS)}"
            )
        if cfg.data.tokenizer is not None:
            raise ValueError("data.tokenizer is for language models; the DiT's captions are words")
        self.cfg = cfg
        self.per_step = cfg.data.batch_size

    def describe(self) -> str:
        m = self.cfg.model
        return (
            f"on the moving-shapes clips ({m.frames} frames of {m.size}x{m.size}, "
            f"{len(data.video.captions())} captions)"
        )

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        dc = self.cfg.data
        return data.video.training_batch(self.cfg.model, dc.batch_size, dc.seed, step)

    def validation(self) -> list[dict[str, torch.Tensor]]:
        dc, tc = self.cfg.data, self.cfg.train
        return data.video.validation_batches(
            self.cfg.model, dc.batch_size, dc.seed, tc.eval_batches
        )

    def finish(self, params: Any, run_dir: Path) -> str | None:
        """``samples.gif``: one sampled clip per caption (None when ``sample_tokens`` is 0)."""
        if not self.cfg.train.sample_tokens:
            return None
        from colfunc import video_sample

        prompts = data.video.captions()
        clips = video_sample.sample(self.cfg.model, params, prompts, seed=self.cfg.train.seed)
        path = run_dir / SAMPLES
        video_sample.write_gif(clips, path, labels=prompts)
        return f"colfunc: wrote {len(prompts)} sampled clips to {path}"


def _tokenized(corpus: data.Corpus, cfg: RunConfig) -> data.Corpus:
    """The corpus cut into the tokens of ``data.tokenizer`` (a Hugging Face folder's)."""
    from colfunc import hf
    from colfunc.inference.tokenizers import load_hf_tokenizer

    assert cfg.data.tokenizer is not None
    tok = load_hf_tokenizer(hf.folder_of(cfg.data.tokenizer, what="tokenizer"))
    if tok is None:
        raise ValueError(f"data.tokenizer={cfg.data.tokenizer!r}: the folder holds no tokenizer")
    if tok.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"data.tokenizer={cfg.data.tokenizer!r} has {tok.vocab_size} tokens, more than "
            f"model.vocab_size={cfg.model.vocab_size}"
        )

    def encode(text_bytes: torch.Tensor) -> torch.Tensor:
        text = bytes(text_bytes.numpy()).decode("utf-8", errors="replace")
        return torch.tensor(tok.encode(text), dtype=torch.int32)

    return corpus._replace(train=encode(corpus.train), val=encode(corpus.val))


def is_video_model(model_cfg: Any) -> bool:
    """Whether a model config is the video DiT's (trained and sampled as video)."""
    return type(model_cfg).__module__ == "colfunc.models.dit"


def check_language_run(cfg: RunConfig, run: Any, command: str) -> None:
    """Refuse a video DiT run where a language model is needed (``colfunc generate``,
    ``serve``, ``export``), pointing at ``colfunc sample``."""
    if is_video_model(cfg.model):
        raise ValueError(
            f"{str(run)!r} is a video DiT run, which colfunc {command} does not take (it works "
            f"on language models); sample its clips with: colfunc sample --run {run} "
            f"--prompt 'red square moving right'"
        )


def for_run(cfg: RunConfig) -> LanguageTask | VideoTask:
    """The task of ``cfg``'s model: video for the DiT, language for the rest."""
    if is_video_model(cfg.model):
        return VideoTask(cfg)
    return LanguageTask(cfg)
