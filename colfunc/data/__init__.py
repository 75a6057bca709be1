"""Data: the byte-level tokenizer, corpora split into train and validation, seeded batches, and
the synthetic moving-shapes video set (:mod:`colfunc.data.video`)."""

from colfunc.data import video
from colfunc.data.batches import batch_at, batches
from colfunc.data.corpus import Corpus, is_validation, load_corpus
from colfunc.data.tokenizer import VOCAB_SIZE, decode, encode

__all__ = [
    "VOCAB_SIZE",
    "Corpus",
    "batch_at",
    "batches",
    "decode",
    "encode",
    "is_validation",
    "load_corpus",
    "video",
]
