"""The inference engine: continuous batching over a paged KV cache, with the training model code.

Each :meth:`Engine.step` runs one forward pass of the model's ``paged_forward`` over the tokens the
scheduler chose (decodes and prefill chunks of many sequences packed together), writes their keys
and values into the cache (``{"k", "v"}``, ``[L, C blocks, B slots, K, E]``, passed through
``cf.scan_layers`` as per-layer ``xs``), and samples a token for every sequence whose tokens are
all computed. :meth:`Engine.generate` loops over steps until every request is done.

Legend: L layers, C cache blocks, B block size (slots), K key/value heads, E head dim, N packed
tokens, S sequences in the step, V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Sequence as Seq
from typing import Any

import torch

from colfunc import core, models
from colfunc.inference.adapters import AdapterSlots, Rows, rows_of
from colfunc.inference.draft_model import Drafter, DraftModel
from colfunc.inference.grammar import Guide, compile_structure
from colfunc.inference.kv_cache import (
    BlockAllocator,
    KVMemoryError,
    copy_blocks,
    kv_bytes,
    paged_batch,
    store,
)
from colfunc.inference.sampling import SamplingParams, next_token
from colfunc.inference.scheduler import DROPPED, Scheduler, Sequence
from colfunc.inference.speculative import Ngram, draft, rows_of_drafts, settle, verify
from colfunc.inference.threads import StepThreads
from colfunc.inference.tokenizers import ByteTokenizer, Detokenized, Tokenizer, detokenize
from colfunc.sharding import Mesh, ShardedTensor, from_local
from colfunc.sharding.placement import Shard
from colfunc.transforms.local import local_piece
from colfunc.transforms.shard import place

__all__ = ["CompletionOutput", "Engine", "KVMemoryError", "RequestOutput", "encode_prompt"]

DEFAULT_KV_BYTES = 2 * 2**30  # the most the default cache size takes


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Engine: {name} must be an int >= 1, got {value!r}")
    return value


@dataclasses.dataclass
class CompletionOutput:
    """One completion: its tokens, text, why it ended (``stop``, ``length``, ``abort`` or None
    while running) and, when asked, per-token logprobs."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict[str, Any]] | None = None


@dataclasses.dataclass
class RequestOutput:
    """A request's state after a step: its prompt and its ``n`` completions so far."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then each one's
    # {"token", "logprob", "top"} as CompletionOutput.logprobs gives them
    prompt_logprobs: list[dict[str, Any] | None] | None = None


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    seqs: list[Sequence]
    forks: list[Sequence]  # waiting for the first completion's prompt to be computed
    prompt_logprobs: list[dict[str, Any] | None] | None = None


def _logprob(logits_V: torch.Tensor, token: int, k: int) -> dict[str, Any]:
    """``token``'s logprob under ``logits`` (their log-softmax, in fp64) and the ``k`` most
    likely tokens'."""
    lp_V = torch.log_softmax(logits_V.double(), dim=-1)
    top = torch.topk(lp_V, min(k, lp_V.numel()))
    top_k = dict(zip(top.indices.tolist(), top.values.tolist()))
    return {"token": token, "logprob": float(lp_V[token]), "top": top_k}


def _token_ids(name: str, value: int | Seq[int] | None) -> tuple[int, ...]:
    """``value`` (one id, several, or None) as a tuple of ids."""
    values = [] if value is None else [value] if isinstance(value, int) else value
    wrong = TypeError(f"Engine: {name} must be an id >= 0, a list of them or None, got {value!r}")
    if isinstance(value, bool | str) or not isinstance(values, Seq):
        raise wrong
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise wrong
    return tuple(values)


def encode_prompt(
    tokenizer: Tokenizer | None, vocab: int, max_seq_len: int, prompt: str | Seq[int]
) -> list[int]:
    """:meth:`Engine.encode_prompt` of an engine with these (also the server's, beside an engine
    in another process)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("Engine: this engine has no tokenizer; give prompts as token ids")
        ids = tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(
                    f"Engine: prompt token ids must be ints in [0, {vocab}), got {t!r}"
                )
    if not ids:
        raise ValueError("Engine: the prompt is empty")
    if len(ids) >= max_seq_len:
        raise ValueError(
            f"Engine: the prompt has {len(ids)} tokens; the model's context is "
            f"{max_seq_len}, which leaves no room for output: shorten it to at most "
            f"{max_seq_len - 1}"
        )
    return ids


class Engine:
    """Serve a colfunc model: ``Engine(models.gpt, cfg, params)`` (a run or a Hugging Face
    folder: :func:`colfunc.engines.from_run`, :func:`colfunc.engines.from_hf`).

    ``block_size`` token slots per KV block; the cache has ``num_blocks`` blocks, or as many as
    ``kv_memory`` (bytes, or a size like ``"1GiB"``) holds, or by default enough for
    ``max_num_seqs`` sequences at full context (at most 2 GiB). A step computes at most
    ``max_num_batched_tokens`` tokens of at most ``max_num_seqs`` sequences. With ``mesh`` (one
    ``tp`` axis, inside :func:`colfunc.launch`), every rank runs the same steps on its shards
    of the model's tensor-parallel plan and its heads of the cache, and samples the same tokens.

    ``max_loras``: how many LoRA adapters it may serve at once (:meth:`add_lora`; a request
    picks one with ``SamplingParams(lora=name)``, and a step mixes them with the base).

    ``threads``: a :class:`~colfunc.inference.threads.StepThreads`, the CPU threads of each step
    by its number of tokens (None: as the process has them).

    ``eos_token_id``: the end-of-sequence id, or several (Llama 3 ends a turn with any of
    ``[128001, 128008, 128009]``); None takes the tokenizer's. ``eos_token_ids`` holds them all.

    Example:
        >>> engine = Engine(models.gpt, cfg, params)
        >>> out = engine.generate(["def "], SamplingParams(temperature=0, max_tokens=32))
        >>> print(out[0].outputs[0].text)
    """

    def __init__(
        self,
        model: Any,
        cfg: Any,
        params: Any,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_memory: int | str | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        tokenizer: Tokenizer | None = None,
        eos_token_id: int | Seq[int] | None = None,
        mesh: Mesh | None = None,
        max_loras: int = 0,
        speculative: Ngram | DraftModel | None = None,
        threads: StepThreads | None = None,
    ) -> None:
        if isinstance(model, str):
            model = models.get(model).module
        if not callable(getattr(model, "paged_forward", None)):
            raise TypeError(
                f"Engine: {model!r} has no paged_forward; pass the module of a model family "
                "that is served token by token (a causal language model)"
            )
        family = models.of_config(cfg)
        if family.kv_cache is None:
            raise TypeError(f"Engine: the {family.name!r} model family declares no KV cache")
        spec = family.kv_cache(cfg, params)  # the layout is read before the params are placed
        self.model, self.cfg, self.mesh = model, cfg, mesh
        if mesh is not None:
            params = self._place(params, mesh, spec.kv_heads)
        self.tp = mesh.axis_size("tp") if mesh is not None else 1
        self.params = self.base_params = params
        self.adapters = AdapterSlots(max_loras)
        if max_loras and mesh is not None:
            raise ValueError(
                "Engine: max_loras (adapters) with a tensor-parallel mesh is not supported"
            )
        self.block_size = _positive("block_size", block_size)
        _positive("max_num_seqs", max_num_seqs)
        _positive("max_num_batched_tokens", max_num_batched_tokens)
        self.tokenizer = tokenizer
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
        self.eos_token_ids = _token_ids("eos_token_id", eos_token_id)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        # a byte tokenizer cannot write the ids a padded vocabulary adds
        self.vocab = cfg.vocab_size
        if isinstance(tokenizer, ByteTokenizer):
            self.vocab = min(self.vocab, tokenizer.vocab_size)
        K = spec.kv_heads // self.tp  # this rank's key/value heads
        per_block = self.block_size * spec.slot_bytes() // self.tp
        if num_blocks is not None and kv_memory is not None:
            raise ValueError("Engine: give num_blocks or kv_memory, not both")
        if num_blocks is None:
            full = max_num_seqs * -(-cfg.max_seq_len // self.block_size)
            budget = kv_bytes(kv_memory) if kv_memory is not None else DEFAULT_KV_BYTES
            num_blocks = full if kv_memory is None else budget // per_block
            num_blocks = min(num_blocks, budget // per_block)
            one_sequence = -(-cfg.max_seq_len // self.block_size) * per_block
            if kv_memory is not None and num_blocks * self.block_size < cfg.max_seq_len:
                raise KVMemoryError(kv_memory, budget, one_sequence, cfg.max_seq_len)
        _positive("num_blocks", num_blocks)
        if num_blocks * self.block_size < cfg.max_seq_len:
            raise ValueError(
                f"Engine: {num_blocks} blocks of {self.block_size} slots cannot hold one sequence "
                f"at the model's context of {cfg.max_seq_len} tokens; give at least "
                f"{-(-cfg.max_seq_len // self.block_size)} blocks ({per_block} bytes each)"
            )
        shape = (spec.layers, num_blocks, self.block_size, K, spec.head_dim)
        self.cache = {
            "k": torch.zeros(shape, dtype=spec.dtype, device=spec.device),
            "v": torch.zeros(shape, dtype=spec.dtype, device=spec.device),
        }
        # (a model with two regimes shares no block: a prefix's keys depend on the whole length)
        caching = enable_prefix_caching and spec.regime is None
        self.allocator = BlockAllocator(num_blocks, self.block_size, caching)
        self.scheduler = Scheduler(
            self.allocator,
            max_num_seqs,
            max_num_batched_tokens,
            window=spec.window,
            regime=spec.regime,
        )
        if speculative is not None and not isinstance(speculative, Ngram | DraftModel):
            raise TypeError(
                f"Engine: speculative must be an Ngram or a DraftModel, got {speculative!r}"
            )
        self.speculative = speculative  # drafts by prompt lookup or by a draft model
        self.drafter = None
        if isinstance(speculative, DraftModel):
            self.drafter = Drafter(
                speculative, spec, cfg.max_seq_len, num_blocks, self.block_size, self.vocab
            )
        self.drafted = self.accepted = 0  # draft tokens proposed and accepted
        if threads is not None and not isinstance(threads, StepThreads):
            raise TypeError(f"Engine: threads must be a StepThreads, got {threads!r}")
        self.threads = threads
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._default_seed = itertools.count()

    def _place(self, params: Any, mesh: Mesh, kv_heads: int) -> Any:
        """The parameters laid out by the model's tensor-parallel plan over the ``tp`` axis
        (heads, MLP width and vocabulary split, as in training)."""
        if tuple(mesh.axis_names) != ("tp",):
            raise ValueError(
                f"Engine: mesh must have the one axis 'tp' (tensor-parallel inference), got axes "
                f"{tuple(mesh.axis_names)}"
            )
        n = mesh.axis_size("tp")
        for field, value in (("n_head", self.cfg.n_head), ("key/value heads", kv_heads)):
            if value % n:
                raise ValueError(f"Engine: {field}={value} is not divisible by tp={n}")
        plan = self.model.tp_plan  # (a function of the config for a model run by its own module)
        return place(params, plan(self.cfg) if callable(plan) else plan, mesh)

    def _sharded_cache(self) -> dict[str, torch.Tensor]:
        """The cache as the model sees it: this rank's heads of a cache split on its head dim."""
        if self.mesh is None:
            return self.cache
        out: dict[str, torch.Tensor] = {}
        for key, c in self.cache.items():
            shape = (*c.shape[:3], c.shape[3] * self.tp, c.shape[4])
            out[key] = from_local(c, self.mesh, {"tp": Shard(3)}, shape)
        return out

    def add_lora(self, name: str, source: Any) -> None:
        """Serve the LoRA adapter ``source`` as ``name`` (requests pick it with
        ``SamplingParams(lora=name)``): a peft adapter folder, or ``(LoraConfig, adapters)``
        as :func:`colfunc.hf.load_adapter` returns them. At most ``max_loras`` are held."""
        if isinstance(source, tuple):
            config, adapters = source
        else:
            from colfunc.adapters.peft import load_adapter

            config, adapters = load_adapter(source, self.cfg)
        self.adapters.add(name, config, adapters, self.base_params)
        self.params = self.adapters.stacked(self.base_params)

    @property
    def loras(self) -> list[str]:
        """The names of the adapters served, in the order they were added."""
        return list(self.adapters.names)

    # --- requests ------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Seq[int]) -> list[int]:
        """``prompt``'s token ids, checked: text needs a tokenizer, ids must lie in the
        vocabulary, and the prompt must leave room for output in the model's context."""
        return encode_prompt(self.tokenizer, self.vocab, self.cfg.max_seq_len, prompt)

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; returns its id (``request_id`` if given)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"Engine: params must be SamplingParams, got {type(params).__name__}")
        self.adapters.slot(params.lora)  # (an adapter that is not loaded: refused by name)
        past = [t for t, _ in params.logit_bias if t >= self.vocab]
        if past:
            raise ValueError(
                f"Engine: logit_bias names token {past[0]}, past the vocabulary ({self.vocab})"
            )
        ids = self.encode_prompt(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"Engine: request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else next(self._default_seed)
        compiled = None
        if params.structure is not None:  # (compiled once per structure and tokenizer)
            if self.tokenizer is None:
                raise ValueError("Engine: structured outputs need a tokenizer")
            stop = self.eos_token_ids
            compiled = compile_structure(params.structure, self.tokenizer, self.vocab, stop)
        seqs = []
        for i in range(params.n):
            g = torch.Generator(device=self.cache["k"].device)
            g.manual_seed(seed * 1_000_003 + i)  # each completion its own stream
            seqs.append(Sequence(rid, i, list(ids), params, g))
            if compiled is not None:
                seqs[-1].guide = Guide(compiled, self.vocab)
        scored: list[dict[str, Any] | None] | None = None
        if params.prompt_logprobs is not None:
            scored = [None]  # (the first prompt token: nothing predicts it)
        self.requests[rid] = _Request(rid, ids, seqs, seqs[1:], scored)
        self.scheduler.add(seqs[0])
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks (unknown or finished ids are ignored)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
                if seq not in req.forks:
                    self.scheduler.finish(seq)
        req.forks.clear()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, int]:
        """Running and waiting sequences, KV blocks in use, prefix-cache hits, preemptions."""
        a = self.allocator
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "blocks_total": a.num_blocks,
            "blocks_used": a.used_count(),
            "prefix_hits": a.hits,
            "prefix_queries": a.queries,
            "preemptions": self.scheduler.preemptions,
            "draft_tokens": self.drafted,
            "accepted_tokens": self.accepted,
        }

    # --- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; the requests it advanced, as they stand (finished ones leave)."""
        # inference mode skips autograd's bookkeeping; ShardedTensors need version counters, so
        # a tensor-parallel engine runs under no_grad
        with torch.no_grad() if self.mesh is not None else torch.inference_mode():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        drafts = {}
        if self.speculative is not None:  # (not while the request's other completions wait)
            ready = [s for s in self.scheduler.running if not self.requests[s.request_id].forks]
            drafts = draft(ready, self.speculative, self.cfg.max_seq_len)
        work = self.scheduler.schedule()
        spec = settle(work.items, drafts) if drafts else {}
        if not work.items:
            if self.scheduler.waiting:
                raise RuntimeError("Engine: nothing could be scheduled although requests wait")
            return []
        if self.threads is not None:  # (few tokens: the CPUs less one; many: all of them)
            self.threads(sum(n for _, n in work.items))
        copy_blocks(self.cache, work.copies)  # copy on write, before anything writes
        qs = {}
        if self.drafter is not None:  # the draft model's drafts, over their placeholders
            copy_blocks(self.drafter.cache, work.copies)
            qs = self.drafter.propose(spec)
        tokens: list[int] = []
        rows: list[int] = []
        sampled: list[Sequence] = []
        scored_rows: list[int] = []  # rows whose logits score a prompt token
        scored: list[tuple[Sequence, int]] = []
        token_slots: list[int | None] = []  # each token's adapter (None: the base)
        for seq, n in work.items:
            lo = seq.computed
            tokens += seq.tokens[lo : lo + n]
            token_slots += [self.adapters.slot(seq.params.lora)] * n
            if seq in spec:  # its last token's and its drafts' logits, after the others'
                continue
            if lo + n == seq.num_tokens:
                rows.append(len(tokens) - 1)
                sampled.append(seq)
            if seq.params.prompt_logprobs is not None and seq.index == 0:
                first = len(tokens) - n  # this chunk's positions that predict a prompt token
                for p in range(lo, min(lo + n, len(seq.prompt) - 1)):
                    scored_rows.append(first + p - lo)
                    scored.append((seq, p + 1))
        spec_rows = rows_of_drafts(work.items, spec)
        device = self.cache["k"].device
        laid = [(seq.blocks, seq.computed, n, seq.num_tokens) for seq, n in work.items]
        batch, slot_N = paged_batch(laid, self.block_size, device)
        with contextlib.ExitStack() as stack:
            params = self.params
            if self.adapters.names:  # each request's tokens through its own adapter
                sampled_slots = [self.adapters.slot(seq.params.lora) for seq in sampled]
                frame = Rows(rows_of(token_slots, device), rows_of(sampled_slots, device))
                stack.enter_context(core.context(frame))
                params = frame.top(params)
            logits_SV, ys = self.model.paged_forward(
                params,
                torch.tensor(tokens, device=device),
                batch,
                self._sharded_cache(),
                self.cfg,
                torch.tensor(rows + scored_rows + spec_rows, dtype=torch.long, device=device),
            )
        if isinstance(logits_SV, ShardedTensor):  # split over the vocabulary: every rank samples
            logits_SV = logits_SV.full_tensor()  # the same tokens from the whole logits
        store(self.cache, slot_N, {key: local_piece(y) for key, y in ys.items()})
        touched: dict[str, _Request] = {}
        first = len(rows) + len(scored_rows)
        for seq, n in work.items:
            if seq in spec:  # its drafts verified: the keys and values of those it kept
                base, covered = spec[seq]
                self._verify(seq, (base, covered), logits_SV[first : first + covered + 1], qs)
                first += covered + 1
                touched[seq.request_id] = self.requests[seq.request_id]
                if seq.finish_reason is not None:
                    continue
            else:
                seq.computed += n
            self.scheduler.register_full(seq)
        for row, (seq, at) in enumerate(scored, start=len(rows)):
            req = self.requests[seq.request_id]
            if req.prompt_logprobs is not None and len(req.prompt_logprobs) == at:
                k = seq.params.prompt_logprobs or 0
                req.prompt_logprobs.append(
                    _logprob(logits_SV[row, : self.vocab], seq.prompt[at], k)
                )
        for row, seq in enumerate(sampled):
            req = self.requests[seq.request_id]
            touched[req.request_id] = req
            group = [seq]
            if seq.index == 0 and req.forks:  # the prompt is computed: the others share it
                for fork in req.forks:
                    fork.blocks = [
                        b if b == DROPPED else self.allocator.share(b) for b in seq.blocks
                    ]
                    fork.computed, fork.keys = seq.computed, list(seq.keys)
                    self.scheduler.running.append(fork)
                group += req.forks
                req.forks = []
            for one in group:
                self._append(one, logits_SV[row, : self.vocab])
        out = [self._output(req) for req in touched.values()]
        for o in out:
            if o.finished:
                del self.requests[o.request_id]
        return out

    def _verify(
        self, seq: Sequence, at: tuple[int, int], logits_JV: torch.Tensor, qs: dict[Sequence, Any]
    ) -> None:
        """Take a speculating sequence's tokens from its logits (``verify``; ``at``: its
        length without its drafts and how many the step covers), keeping the keys and values of
        its last token and the drafts it took."""
        base, covered = at
        cut = len(seq.output) - covered
        drafts = seq.output[cut:]
        del seq.output[cut:]
        got = verify(logits_JV[:, : self.vocab], drafts, seq.params, seq.prompt, seq.output,
                     seq.generator, qs.get(seq))  # fmt: skip
        self.drafted += covered
        self.accepted += len(got) - 1
        for j, token in enumerate(got):
            self._append(seq, logits_JV[j, : self.vocab], token)
            if seq.finish_reason is not None:
                return
        seq.computed = base + len(got) - 1
        seq.draft_computed = min(seq.draft_computed, seq.computed)

    def _append(self, seq: Sequence, logits_V: torch.Tensor, token: int | None = None) -> None:
        p = seq.params
        if p.max_tokens == 0:  # (the prompt scored: nothing to generate)
            seq.finish_reason = "length"
            self.scheduler.finish(seq)
            return
        if token is None:  # (else taken by speculative decoding)
            allowed_V = logits_V if seq.guide is None else seq.guide.mask(logits_V)
            token = next_token(allowed_V, p, seq.prompt, seq.output, seq.generator)
        complete = seq.guide is not None and seq.guide.accept(token)
        if p.logprobs is not None:
            seq.logprobs.append(_logprob(logits_V, token, p.logprobs))
        seq.output.append(token)
        if self.tokenizer is not None:  # (decoding only the new tokens, with some context)
            at = seq.detokenized if seq.detokenized is not None else Detokenized()
            seq.text, seq.detokenized = detokenize(self.tokenizer, seq.output, at)
        if (
            complete
            or token in p.stop_token_ids
            or (not p.ignore_eos and token in self.eos_token_ids)
        ):
            seq.finish_reason = "stop"
        elif p.stop and any(s in seq.text for s in p.stop):
            cut = min(seq.text.find(s) for s in p.stop if s in seq.text)
            seq.text, seq.finish_reason = seq.text[:cut], "stop"
        elif len(seq.output) >= p.max_tokens or seq.num_tokens >= self.cfg.max_seq_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)

    def _output(self, req: _Request) -> RequestOutput:
        outs = [
            CompletionOutput(
                seq.index,
                list(seq.output),
                seq.text,
                seq.finish_reason,
                list(seq.logprobs) if seq.params.logprobs is not None else None,
            )
            for seq in req.seqs
        ]
        finished = all(seq.finish_reason is not None for seq in req.seqs)
        scored = None if req.prompt_logprobs is None else list(req.prompt_logprobs)
        return RequestOutput(req.request_id, list(req.prompt), outs, finished, scored)

    def generate(
        self,
        prompts: str | Seq[int] | Seq[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` (text, or token ids) to completion, batched; outputs in prompt order."""
        plist: list[Any]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            plist = [prompts]
        else:
            plist = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params] * len(plist)
        else:
            params_list = list(params)
            if len(params_list) != len(plist):
                raise ValueError(
                    f"Engine.generate: {len(params_list)} SamplingParams for {len(plist)} prompts"
                )
        ids = [self.add_request(p, sp) for p, sp in zip(plist, params_list)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for o in self.step():
                if o.finished:
                    done[o.request_id] = o
        return [done[i] for i in ids]
