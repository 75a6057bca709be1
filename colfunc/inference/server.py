"""An OpenAI-compatible HTTP server over the engine: FastAPI and uvicorn, metrics for Prometheus.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` sends server-sent
events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``.
The engine runs on a thread of its own (:class:`EngineLoop`) or in a process of its own
(:class:`colfunc.inference.process_loop.ProcessLoop`, ``colfunc serve``'s default): requests go
in through a queue, outputs come back to each request's asyncio queue after every step. Bad
requests get status 400 with an OpenAI error body; a full waiting queue gets 503; a client that
goes away has its request aborted, which frees its blocks. ``colfunc serve`` binds 127.0.0.1 unless told otherwise; on
SIGTERM uvicorn stops accepting, lets the requests in flight finish, and the loop stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import fastapi
import prometheus_client
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from colfunc.inference import tools
from colfunc.inference.engine import RequestOutput
from colfunc.inference.logprobs import (
    chat_logprobs,
    completion_logprobs,
    logprob_block,
    vllm_prompt_logprobs,
)
from colfunc.inference.loop import EngineLoop, EngineStopped, QueueFull, apply, follow
from colfunc.inference.openai_api import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Sampling,
    TokenizeRequest,
    error,
    params_of,
    prompt_list,
    refuse_unbuilt,
    visible,
)

__all__ = ["EngineLoop", "QueueFull", "apply", "build_app", "follow"]


class _BodyLimit:
    """ASGI middleware: a request whose Content-Length is over ``limit`` gets 413 before its
    body is read (a plain ASGI wrapper, which leaves the app's view of a client's disconnect
    as it is)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            size = dict(scope["headers"]).get(b"content-length", b"")
            if size.isdigit() and int(size) > self.limit:
                refused = error(
                    413,
                    f"the request body has {int(size)} bytes, over this server's limit of "
                    f"{self.limit} (--max-request-bytes)",
                    "invalid_request_error",
                )
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


DISCONNECT_CHECK_S = 0.25  # how often a request's client is checked to be still there
MAX_REQUEST_BYTES = 4 * 2**20  # the default limit on a request's body


def build_app(
    loop: EngineLoop, model_name: str, max_request_bytes: int = MAX_REQUEST_BYTES
) -> fastapi.FastAPI:
    """The FastAPI app serving ``loop``'s engine as ``model_name``. A request whose body is
    over ``max_request_bytes`` gets 413 before its body is read."""

    @contextlib.asynccontextmanager
    async def lifespan(app: fastapi.FastAPI) -> AsyncIterator[None]:
        yield
        loop.stop()  # uvicorn has let the requests in flight finish

    app = fastapi.FastAPI(title="colfunc", lifespan=lifespan)
    engine = loop.engine

    app.add_middleware(_BodyLimit, limit=max_request_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: fastapi.Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return error(
            400, f"{where}: {first.get('msg', 'invalid request')}", "invalid_request_error", where
        )

    @app.exception_handler(BadRequest)
    async def bad(request: fastapi.Request, exc: BadRequest) -> JSONResponse:
        return error(400, str(exc), "invalid_request_error", exc.param, exc.code)

    @app.exception_handler(EngineStopped)
    async def stopped(request: fastapi.Request, exc: EngineStopped) -> JSONResponse:
        return error(500, str(exc), "server_error")

    @app.exception_handler(QueueFull)
    async def full(request: fastapi.Request, exc: QueueFull) -> JSONResponse:
        return error(503, f"the server is busy: {exc}; retry later", "server_error")

    async def start(
        req: Sampling, prompt: str | list[int], logprobs: int | None, structure: Any = None
    ) -> Any:
        served = [model_name, *engine.loras]
        if req.model not in served:
            raise BadRequest(
                f"the model {req.model!r} does not exist; this server serves "
                f"{', '.join(map(repr, served))}",
                "model",
                "model_not_found",
            )
        refuse_unbuilt(req)
        if loop.failure is not None:
            raise EngineStopped(f"the engine stopped: {loop.failure!r}")
        params = params_of(req, logprobs)
        if structure is not None:  # (a tool call the request requires)
            if params.structure is not None:
                raise BadRequest(
                    "tool_choice requires a call, which response_format forbids", "tool_choice"
                )
            params = dataclasses.replace(params, structure=structure)
        best_of = req.best_of if req.best_of is not None else req.n
        if best_of < req.n:
            raise BadRequest(f"best_of={best_of} must be at least n={req.n}", "best_of")
        if best_of > req.n:  # candidates, ranked by their tokens' summed logprobs
            wanted = logprobs if logprobs is not None else 0
            params = dataclasses.replace(params, n=best_of, logprobs=wanted)
        scored = [getattr(req, "prompt_logprobs", None)]  # (vLLM's field)
        if getattr(req, "echo", False) and logprobs is not None:  # the prompt's logprobs echoed
            scored.append(logprobs)
        if any(k is not None for k in scored):
            top = max(k for k in scored if k is not None)
            params = dataclasses.replace(params, prompt_logprobs=top)
        past = [t for t, _ in params.logit_bias if t >= engine.vocab]
        if past:
            raise BadRequest(
                f"logit_bias names token {past[0]}, past the vocabulary ({engine.vocab})",
                "logit_bias",
            )
        if req.model != model_name:  # an adapter's name: its requests run through it
            params = dataclasses.replace(params, lora=req.model)
        try:
            # (tokenized off the event loop: a long prompt does not hold up other requests)
            ids = await asyncio.to_thread(engine.encode_prompt, prompt)
        except ValueError as e:
            raise BadRequest(str(e).removeprefix("Engine: "), "prompt") from e
        rid, q = loop.submit(ids, params)
        return rid, q, ids, params

    async def outputs(
        request: fastapi.Request, rid: str, q: asyncio.Queue[Any]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        checked = time.monotonic()
        try:
            while True:
                try:
                    out = await asyncio.wait_for(q.get(), timeout=DISCONNECT_CHECK_S)
                except TimeoutError:
                    out = None
                # (checked on a clock: a request whose tokens keep coming is checked too)
                if time.monotonic() - checked >= DISCONNECT_CHECK_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if out is None:
                    continue
                if isinstance(out, BaseException):
                    raise EngineStopped(f"the engine stopped: {out!r}")
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                loop.abort(rid)  # the client went away, or the server is stopping

    def dec(ids: list[int]) -> str:
        return engine.tokenizer.decode(ids) if engine.tokenizer is not None else str(ids)

    def usage(prompt: list[int], out: RequestOutput) -> dict[str, int]:
        done = sum(len(o.token_ids) for o in out.outputs)
        return {
            "prompt_tokens": len(prompt),
            "completion_tokens": done,
            "total_tokens": len(prompt) + done,
        }

    async def respond(
        request: fastapi.Request,
        req: Sampling,
        prompt: Any,
        logprobs: int | None,
        chat: bool,
        fns: list[Any] | None = None,
        structure: Any = None,
    ) -> Any:
        rid, q, ids, params = await start(req, prompt, logprobs, structure)
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if not req.stream:
            last = None
            async for out in outputs(request, rid, q):
                last = out
            if last is None or not last.finished:
                return Response(status_code=499)
            choices = []
            for o in _best(last.outputs, req.n, keep_logprobs=logprobs is not None):
                if chat:
                    message, finish = _message(o.text, o.finish_reason, fns)
                    choice: dict[str, Any] = {
                        "index": o.index,
                        "message": message,
                        "logprobs": None if o.logprobs is None else chat_logprobs(o.logprobs, dec),
                        "finish_reason": finish,
                    }
                else:
                    echo = bool(getattr(req, "echo", False))
                    lead = dec(last.prompt_token_ids) if echo else ""
                    choice = {"index": o.index, "text": lead + o.text}
                    choice["logprobs"] = completion_logprobs(last, o, dec, lead, echo=echo)
                    choice["finish_reason"] = o.finish_reason
                    if getattr(req, "prompt_logprobs", None) is not None:
                        choice["prompt_logprobs"] = vllm_prompt_logprobs(last, dec)
                choices.append(choice)
            body = {"id": rid, "object": kind, "created": created, "model": model_name}
            return {**body, "choices": choices, "usage": usage(ids, last)}

        async def events() -> AsyncIterator[str]:
            sent = [""] * params.n
            head = {"id": rid, "object": kind + ("" if not chat else ".chunk"), "created": created}
            head["model"] = model_name
            if chat:
                for i in range(params.n):
                    delta = {"role": "assistant", "content": ""}
                    yield _sse(
                        {**head, "choices": [{"index": i, "delta": delta, "finish_reason": None}]}
                    )
            last = None
            echo = not chat and bool(getattr(req, "echo", False))
            tokens_sent = [0] * params.n  # the tokens whose logprobs have gone out
            counted = [0] * params.n  # the tokens a chunk has gone out for
            calls_of = [tools.ToolStream() for _ in range(params.n)]  # (with tools)
            async for out in outputs(request, rid, q):
                for o in out.outputs:
                    if echo and last is None:  # the prompt first, with its logprobs
                        lead = dec(out.prompt_token_ids)
                        block = None
                        if o.logprobs is not None and out.prompt_logprobs is not None:
                            block = logprob_block(out.prompt_logprobs, dec, out.prompt_token_ids)
                        c = {
                            "index": o.index,
                            "text": lead,
                            "logprobs": block,
                            "finish_reason": None,
                        }
                        yield _sse({**head, "choices": [c]})
                    if chat and fns:  # content and the calls' deltas as they come
                        ended = o.finish_reason is not None
                        ts = calls_of[o.index]
                        content, calls = ts.feed(visible(o.text, ended, params), ended)
                        step: dict[str, Any] = {"content": content} if content else {}
                        if calls:
                            step["tool_calls"] = calls
                        finish = _finish(o.finish_reason, ts.calls > 0) if ended else None
                        if step or ended:
                            one = {"index": o.index, "delta": step, "finish_reason": finish}
                            yield _sse({**head, "choices": [one]})
                        continue
                    text = visible(o.text, o.finish_reason is not None, params)
                    new, sent[o.index] = text[len(sent[o.index]) :], text
                    # a chunk for every step that made tokens, as vLLM sends them, even while
                    # their text waits (a character's bytes split over tokens)
                    fresh_tokens = len(o.token_ids) > counted[o.index]
                    counted[o.index] = len(o.token_ids)
                    if not new and not fresh_tokens and o.finish_reason is None:
                        continue
                    if chat:
                        c = {
                            "index": o.index,
                            "delta": {"content": new},
                            "finish_reason": o.finish_reason,
                        }
                        if o.logprobs is not None:
                            done = len(o.logprobs)
                            fresh = o.logprobs[tokens_sent[o.index] : done]
                            c["logprobs"] = chat_logprobs(fresh, dec)
                            tokens_sent[o.index] = done
                    else:
                        lp = None
                        if o.logprobs is not None:
                            done = len(o.logprobs)
                            lead = (dec(out.prompt_token_ids) if echo else "") + text[
                                : len(text) - len(new)
                            ]
                            new_lp = o.logprobs[tokens_sent[o.index] : done]
                            lp = logprob_block(new_lp, dec, offset=len(lead))
                            tokens_sent[o.index] = done
                        c = {"index": o.index, "text": new, "logprobs": lp}
                        c["finish_reason"] = o.finish_reason
                    yield _sse({**head, "choices": [c]})
                last = out
            if last is not None and (req.stream_options or {}).get("include_usage"):
                yield _sse({**head, "choices": [], "usage": usage(ids, last)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request, req: CompletionRequest) -> Any:
        prompts = prompt_list(req.prompt)
        if len(prompts) == 1:
            return await respond(request, req, prompts[0], req.logprobs, chat=False)
        if req.stream:
            raise BadRequest(
                "stream=true with several prompts is not supported; send one request per "
                "prompt, or stream=false",
                "stream",
            )
        encoded = []  # every prompt checked (and tokenized, once) before any runs
        for i, p in enumerate(prompts):
            try:
                encoded.append(engine.encode_prompt(p))
            except ValueError as e:
                raise BadRequest(f"prompt[{i}]: {str(e).removeprefix('Engine: ')}", "prompt") from e
        bodies = await asyncio.gather(
            *(respond(request, req, ids, req.logprobs, chat=False) for ids in encoded)
        )
        if any(isinstance(b, Response) for b in bodies):
            return Response(status_code=499)  # the client went away
        # one choice per prompt and sample, prompt-major, as OpenAI numbers them
        choices = [
            {**c, "index": k * req.n + c["index"]}
            for k, b in enumerate(bodies)
            for c in b["choices"]
        ]
        total = {key: sum(b["usage"][key] for b in bodies) for key in bodies[0]["usage"]}
        return {**bodies[0], "choices": choices, "usage": total}

    @app.post("/v1/chat/completions")
    async def chat(request: fastapi.Request, req: ChatRequest) -> Any:
        if engine.tokenizer is None:
            raise BadRequest("this model has no tokenizer, so it cannot take chat messages")
        if not req.messages:
            raise BadRequest("messages is empty; give at least one message", "messages")
        messages = [m.as_dict() for m in req.messages]
        fns, structure = None, None
        if req.tools and req.tool_choice != "none":
            try:
                fns = tools.functions(req.tools)
            except ValueError as e:
                raise BadRequest(str(e), "tools") from e
            try:
                structure = tools.structure(fns, req.tool_choice)
            except ValueError as e:
                raise BadRequest(str(e), "tool_choice") from e
        elif req.tool_choice not in (None, "none", "auto"):
            raise BadRequest(f"tool_choice={req.tool_choice!r} without tools", "tool_choice")
        renders = getattr(engine.tokenizer, "renders_tools", lambda: False)()
        if fns and not renders:  # (a template that does not render tools: a system message)
            messages = [tools.system_message(fns), *messages]
        declared = [{"type": "function", "function": f} for f in fns] if fns and renders else None
        text = engine.tokenizer.apply_chat_template(messages, tools=declared)
        top = (req.top_logprobs or 0) if req.logprobs else None
        return await respond(request, req, text, top, chat=True, fns=fns, structure=structure)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's ``/tokenize``: a prompt's (or chat messages') token ids and their count."""
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give one of prompt or messages", "prompt")
        prompt: str | list[int]
        if body.messages is not None:
            if engine.tokenizer is None:
                raise BadRequest("this model has no tokenizer, so no chat template", "messages")
            prompt = engine.tokenizer.apply_chat_template([m.as_dict() for m in body.messages])
        else:
            assert body.prompt is not None
            prompt = body.prompt
        try:
            ids = await asyncio.to_thread(engine.encode_prompt, prompt)
        except ValueError as e:
            raise BadRequest(str(e).removeprefix("Engine: "), "prompt") from e
        return {"count": len(ids), "max_model_len": engine.cfg.max_seq_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's ``/detokenize``: the text of token ids."""
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab]
        if bad:
            raise BadRequest(f"token {bad[0]} is not in the vocabulary ({engine.vocab})", "tokens")
        return {"prompt": await asyncio.to_thread(dec, list(body.tokens))}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "colfunc"}
        # each adapter as vLLM lists its LoRA modules: a model whose parent is the base
        cards = [{**card, "id": name, "root": name, "parent": model_name} for name in engine.loras]
        return {"object": "list", "data": [{**card, "root": model_name, "parent": None}, *cards]}

    @app.get("/health")
    async def health() -> Response:
        if not loop.alive():
            return JSONResponse({"status": "error"}, status_code=500)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        data = prometheus_client.generate_latest(loop.metrics.registry)
        return Response(data, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    return app


def _message(text: str, finish: str | None, fns: list[Any] | None) -> tuple[dict[str, Any], Any]:
    """A chat answer's message and finish reason: with tools, the calls it wrote parsed out of
    its text (``tool_calls``, finishing with ``tool_calls`` unless cut short)."""
    if not fns:
        return {"role": "assistant", "content": text}, finish
    content, calls = tools.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": content, "tool_calls": calls}, _finish(finish, True)


def _finish(reason: str | None, calls: bool) -> str | None:
    """A chat answer's finish reason: ``tool_calls`` where it wrote calls, unless it was cut
    short (``length``: its last call may be incomplete)."""
    return "tool_calls" if calls and reason != "length" else reason


def _best(outs: list[Any], n: int, keep_logprobs: bool) -> list[Any]:
    """The ``n`` completions of the highest summed logprob of their tokens (``best_of``), in
    that order and numbered 0..n-1; all of them, as they are, where there are no more than
    ``n``. Their logprobs are dropped where the request did not ask for them."""
    if len(outs) <= n:
        return outs
    ranked = sorted(outs, key=lambda o: -sum(e["logprob"] for e in o.logprobs or ()))[:n]
    return [
        dataclasses.replace(o, index=i, logprobs=o.logprobs if keep_logprobs else None)
        for i, o in enumerate(ranked)
    ]


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
