"""The ``server`` backend of stage 1: any OpenAI-compatible ``/v1/chat/completions`` endpoint
(``vllm serve`` on GPUs), driven with httpx (async, at most ``server.concurrency`` conversations in
flight).

Timeouts, connection errors, HTTP 5xx/408/429, bodies that are not JSON and responses without
``choices`` are retried ``server.max_retries`` times with exponential backoff (``backoff_s * 2**attempt``,
capped at 60 s); a sample that still fails counts towards the circuit breaker, which stops the stage
after ``server.breaker_failures`` consecutive failed samples. Other 4xx answers are not retried. The
API key is read from the environment variable named by ``server.api_key_env`` (never stored).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.chat import ChatRenderer, template_kwargs
from eagle3.config import Params
from eagle3.errors import SynthesisError
from eagle3.prompts import Prompt
from eagle3.synthesize.conversation import Conversation, Session, prepare
from eagle3.synthesize.turns import TurnRequest, TurnResult, parse_chat_completion

__all__ = ["ServerBackend", "SampleFailed", "PromptTooLong", "Stopped", "run_server", "run_async", "server_renderer"]

log = logging.getLogger(__name__)

_CONTEXT_RE = re.compile(r"maximum context length|context length|max_model_len|too long|exceeds", re.I)


class SampleFailed(Exception):
    """A sample still failing after its retries (or a non-retryable 4xx)."""

    def __init__(self, kind: str, message: str, attempts: int) -> None:
        super().__init__(message)
        self.kind, self.message, self.attempts = kind, message, attempts


class PromptTooLong(Exception):
    """The server says the prompt does not fit its context."""


class Stopped(Exception):
    """The stage is stopping (circuit breaker)."""


class ServerBackend:
    """An OpenAI-compatible chat-completions server (``vllm serve``), driven with httpx.AsyncClient.

    Args:
        params: run params (``synthesize.server`` and the generation settings).

    Attributes:
        errors: failed attempts by kind (``timeout``, ``connection``, ``http_5xx``, ``http_429``,
            ``http_408``, ``http_4xx``, ``bad_json``, ``bad_response``), retried or not.
        retries: attempts repeated after a failure.
    """

    name = "server"

    def __init__(self, params: Params) -> None:
        self.syn = params.synthesize
        self.sp = params.synthesize.server
        self.template_kwargs = template_kwargs(params)
        self.model_name = self.sp.model
        self.errors: Counter = Counter()
        self.retries = 0
        self.stop = None  # asyncio.Event, made inside the loop
        key = os.environ.get(self.sp.api_key_env) if self.sp.api_key_env else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def client(self):
        import httpx

        limits = httpx.Limits(max_connections=self.sp.concurrency, max_keepalive_connections=self.sp.concurrency)
        return httpx.AsyncClient(base_url=self.sp.base_url.rstrip("/"), headers=self.headers,
                                 timeout=httpx.Timeout(self.sp.timeout_s), limits=limits)

    async def resolve_model(self, client) -> str:
        """``server.model``, else the first id of ``GET /models``.

        Raises:
            SynthesisError: the server cannot be reached or lists no model.
        """
        if self.model_name:
            return self.model_name
        last = ""
        for attempt in range(self.sp.max_retries + 1):
            try:
                r = await client.get("/models")
                if r.status_code == 200:
                    data = r.json().get("data") or []
                    if data:
                        self.model_name = data[0]["id"]
                        return self.model_name
                    last = "the server lists no model"
                else:
                    last = f"HTTP {r.status_code}: {r.text[:200]}"
            except Exception as exc:  # noqa: BLE001 - any failure to reach it is reported below
                last = f"{type(exc).__name__}: {exc}"
            if attempt < self.sp.max_retries:
                await asyncio.sleep(min(self.sp.backoff_s * 2**attempt, 60.0))
        raise SynthesisError(
            f"synthesize.server: cannot list models at {self.sp.base_url}/models ({last}). Start the server "
            f"(e.g. `vllm serve MODEL --port 8000`) or set synthesize.server.model."
        )

    async def chat(self, client, req: TurnRequest) -> TurnResult:
        """POST one chat completion with retries (see the module docstring).

        Raises:
            SampleFailed: still failing after ``max_retries`` (or a non-retryable 4xx).
            PromptTooLong: the server says the prompt does not fit its context.
            Stopped: the stage is stopping (circuit breaker).
        """
        import httpx

        payload: dict[str, Any] = {"model": self.model_name, "messages": req.messages,
                                   "max_tokens": req.max_new_tokens, "temperature": self.syn.temperature,
                                   "top_p": self.syn.top_p, "seed": self.syn.seed}
        if self.template_kwargs:
            payload["chat_template_kwargs"] = self.template_kwargs
        kind, msg = "unknown", ""
        for attempt in range(self.sp.max_retries + 1):
            if self.stop is not None and self.stop.is_set():
                raise Stopped()
            try:
                r = await client.post("/chat/completions", json=payload)
            except httpx.TimeoutException as exc:
                kind, msg = "timeout", f"no response within {self.sp.timeout_s:g} s ({type(exc).__name__})"
            except httpx.TransportError as exc:
                kind, msg = "connection", f"{type(exc).__name__}: {exc or 'connection closed'}"
            else:
                code = r.status_code
                if code >= 500 or code in (408, 429):
                    kind, msg = ("http_5xx" if code >= 500 else f"http_{code}"), f"HTTP {code}: {r.text[:200]}"
                elif code >= 400:
                    text = r.text[:500]
                    if code == 400 and _CONTEXT_RE.search(text):
                        raise PromptTooLong(text)
                    self.errors["http_4xx"] += 1
                    raise SampleFailed("http_4xx", f"HTTP {code}: {text[:300]}", attempt + 1)
                else:
                    try:
                        body = r.json()
                    except ValueError:
                        kind, msg = "bad_json", f"HTTP {code} body is not JSON: {r.text[:120]!r}"
                    else:
                        try:
                            return parse_chat_completion(body, self.syn.reasoning, self.syn.think_tags)
                        except ValueError as exc:
                            kind, msg = "bad_response", str(exc)
            self.errors[kind] += 1
            log.warning("sample %s: attempt %d failed (%s: %s)", req.key, attempt + 1, kind, msg)
            if attempt < self.sp.max_retries:
                self.retries += 1
                delay = min(self.sp.backoff_s * 2**attempt, 60.0)
                if self.stop is not None:
                    try:
                        await asyncio.wait_for(self.stop.wait(), timeout=delay)
                        raise Stopped()
                    except TimeoutError:
                        pass
                else:
                    await asyncio.sleep(delay)
        raise SampleFailed(kind, msg, self.sp.max_retries + 1)

    def close(self) -> None:
        pass



@dataclass
class _Workers:
    """What the ``concurrency`` workers of one server session share: the queue of conversations, the
    stop event (set by the circuit breaker) and the count of consecutive failed samples."""

    backend: ServerBackend
    sess: Session
    renderer: ChatRenderer | None
    context_len: int
    max_new: int
    breaker_failures: int
    queue: asyncio.Queue
    consecutive: int = 0
    tripped: bool = False

    async def conversation(self, client, conv: Conversation) -> None:
        """Run one conversation's turns in order (a prompt that does not fit ends it)."""
        while not conv.finished:
            req = prepare(conv, self.renderer, self.context_len, self.max_new)
            if req is None:
                return
            try:
                res = await self.backend.chat(client, req)
            except PromptTooLong:
                conv.too_long(req.prompt_tokens)
                return
            conv.add(res, req)

    def failed(self, conv: Conversation, exc: SampleFailed) -> None:
        """Record a failed sample; open the circuit breaker after ``breaker_failures`` in a row."""
        self.sess.failed.append({"id": conv.prompt.id, "origin": conv.prompt.origin, "kind": exc.kind,
                                 "message": exc.message, "attempts": exc.attempts, "turn": conv.turn})
        self.sess.progress.update(1, failed=len(self.sess.failed))
        self.consecutive += 1
        if self.consecutive >= self.breaker_failures and not self.backend.stop.is_set():
            self.tripped = True
            self.backend.stop.set()

    async def worker(self, client) -> None:
        """Take the next conversation until the queue is empty or the stage stops."""
        while not self.backend.stop.is_set():
            try:
                conv = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                await self.conversation(client, conv)
            except Stopped:
                self.sess.interrupted.append(conv.prompt.id)
                return
            except asyncio.CancelledError:
                self.sess.interrupted.append(conv.prompt.id)
                raise
            except SampleFailed as exc:
                self.failed(conv, exc)
                continue
            self.consecutive = 0
            self.sess.finish(conv)


def run_server(backend: ServerBackend, prompts: list[Prompt], sess: Session, renderer: ChatRenderer | None,
               context_len: int, max_new: int, breaker_failures: int) -> bool:
    """Server backend: ``concurrency`` workers, each taking the next conversation and running its
    turns in order. Returns True when the circuit breaker opened.

    Raises:
        SynthesisError: the server lists no model; any unexpected exception of a worker (a bug) is
            re-raised once every worker has stopped.
    """

    async def main() -> bool:
        backend.stop = asyncio.Event()
        queue: asyncio.Queue = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(Conversation(p))
        w = _Workers(backend, sess, renderer, context_len, max_new, breaker_failures, queue)
        async with backend.client() as client:
            await backend.resolve_model(client)
            sess.settings["model"] = backend.model_name
            tasks = [asyncio.create_task(w.worker(client)) for _ in range(min(backend.sp.concurrency, len(prompts)))]
            stopper = asyncio.create_task(backend.stop.wait())
            everything = asyncio.gather(*tasks)
            await asyncio.wait([stopper, everything], return_when=asyncio.FIRST_COMPLETED)
            if backend.stop.is_set():  # the breaker opened: cancel the turns in flight
                for t in tasks:
                    t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            stopper.cancel()
            try:
                await everything
            except BaseException:  # noqa: BLE001 - inspected just below
                pass
            bugs = [r for r in results if isinstance(r, Exception)]
            if bugs:  # anything but the handled failures and cancellations stops the stage loudly
                raise bugs[0]
        return w.tripped

    return run_async(main)


def run_async(fn: Callable):
    """``asyncio.run(fn())``, in a helper thread when this thread already runs a loop (Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(fn())
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as ex:
        return ex.submit(lambda: asyncio.run(fn())).result()


def server_renderer(params: Params) -> ChatRenderer | None:
    """The target's tokenizer for length checks in server mode (tokenizer files only for hub ids);
    None (with a warning) when it cannot be loaded: the server then reports over-long prompts."""
    try:
        spec = params.target.model
        looks_local = spec.startswith(("embedded:", ".", "/", "~")) or Path(spec).expanduser().exists()
        if looks_local:
            from eagle3.target import load_tokenizer, resolve_target

            tok = load_tokenizer(resolve_target(params.target), params.target.trust_remote_code)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(spec, trust_remote_code=params.target.trust_remote_code)
        return ChatRenderer(tok, template_kwargs(params))
    except Exception as exc:  # noqa: BLE001 - any failure means: no local tokenizer
        log.warning("synthesize: no local tokenizer for %s (%s); prompt lengths are checked by the server only",
                    params.target.model, exc)
        return None

