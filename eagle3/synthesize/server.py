"""The ``server`` backend of stage 1: any OpenAI-compatible ``/v1/chat/completions`` endpoint
(``vllm serve`` on GPUs), driven with httpx (async, at most ``server.concurrency`` conversations in
flight); for ``kind: self`` sources it also samples user turns on ``/v1/completions``.

Every request is retried by :class:`eagle3.synthesize.retry.RetryPolicy` (timeouts, connection
errors, HTTP 5xx/408/429, bodies that are not JSON or have no ``choices``; exponential backoff capped
at :data:`~eagle3.synthesize.retry.BACKOFF_CAP_S`); a sample that still fails counts towards the
circuit breaker, which stops the stage after ``server.breaker_failures`` consecutive failed samples.
Other 4xx answers are not retried. The API key is read from the environment variable named by
``server.api_key_env`` (never stored).
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

from eagle3.chat import ChatRenderer, eos_ids, template_kwargs
from eagle3.config import Params, SelfPromptParams
from eagle3.errors import SelfPromptError, SynthesisError
from eagle3.prompts import Prompt
from eagle3.synthesize.conversation import Conversation, Session, prepare
from eagle3.synthesize.retry import Rejected, RetryPolicy, SampleFailed, Stopped
from eagle3.synthesize.self_prompt.template import UserTurn, UserTurnRequest, user_turn_finish
from eagle3.synthesize.turns import TurnRequest, TurnResult, parse_chat_completion

__all__ = ["ServerBackend", "PromptTooLong", "run_server", "run_async", "server_renderer"]

log = logging.getLogger(__name__)

_CONTEXT_RE = re.compile(r"maximum context length|context length|max_model_len|too long|exceeds", re.I)


def _first_model(body: Any) -> str:
    data = body.get("data") if isinstance(body, dict) else None
    if not data:
        raise ValueError("the server lists no model")
    return data[0]["id"]


def _first_choice(body: Any) -> dict:
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or not body["choices"]:
        raise ValueError("response has no choices")
    return body["choices"][0]


class PromptTooLong(Exception):
    """The server says the prompt does not fit its context."""


class ServerBackend:
    """An OpenAI-compatible chat-completions server (``vllm serve``), driven with httpx.AsyncClient.

    Args:
        params: run params (``synthesize.server`` and the generation settings).
        tokenizer: the target's tokenizer, for self-prompting only (its EOS ids tell a user turn
            ended by EOS from one ended by the template's end of turn); None otherwise.

    Attributes:
        errors: failed attempts by kind (``timeout``, ``connection``, ``http_5xx``, ``http_429``,
            ``http_408``, ``http_4xx``, ``bad_json``, ``bad_response``), retried or not.
        retries: attempts repeated after a failure.
    """

    name = "server"

    def __init__(self, params: Params, tokenizer=None) -> None:
        self.syn = params.synthesize
        self.sp = params.synthesize.server
        self.policy = RetryPolicy.of(self.sp)
        self.tok = tokenizer
        self.user_turn_eos = sorted(set(eos_ids(tokenizer))) if tokenizer is not None else []
        self.template_kwargs = template_kwargs(params)
        self.model_name = self.sp.model
        self.errors: Counter = Counter()
        self.retries = 0
        self.stop = None  # asyncio.Event, made inside the loop
        key = os.environ.get(self.sp.api_key_env) if self.sp.api_key_env else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def client(self):
        """An ``httpx.AsyncClient`` on ``server.base_url`` with the API key header and at most
        ``server.concurrency`` connections (open it inside the event loop that uses it)."""
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
        try:
            self.model_name = await self.policy.request(lambda: client.get("/models"), _first_model, what="GET /models")
        except (SampleFailed, Rejected) as exc:
            raise SynthesisError(
                f"synthesize.server: cannot list models at {self.sp.base_url}/models ({exc}). Start the server "
                f"(e.g. `vllm serve MODEL --port 8000`) or set synthesize.server.model."
            ) from None
        return self.model_name

    def _count(self, kind: str, attempt: int) -> None:
        self.errors[kind] += 1
        if attempt < self.sp.max_retries:
            self.retries += 1

    async def chat(self, client, req: TurnRequest) -> TurnResult:
        """POST one chat completion with :class:`~eagle3.synthesize.retry.RetryPolicy`'s retries.

        Raises:
            SampleFailed: still failing after ``max_retries`` (or a non-retryable 4xx).
            PromptTooLong: the server says the prompt does not fit its context.
            Stopped: the stage is stopping (circuit breaker).
        """
        payload: dict[str, Any] = {"model": self.model_name, "messages": req.messages,
                                   "max_tokens": req.max_new_tokens, "temperature": self.syn.temperature,
                                   "top_p": self.syn.top_p, "seed": self.syn.seed}
        if self.template_kwargs:
            payload["chat_template_kwargs"] = self.template_kwargs
        try:
            return await self.policy.request(
                lambda: client.post("/chat/completions", json=payload),
                lambda body: parse_chat_completion(body, self.syn.reasoning, self.syn.think_tags),
                what=f"sample {req.key}", on_failure=self._count, stop=self.stop)
        except Rejected as exc:
            if exc.status == 400 and _CONTEXT_RE.search(exc.text):
                raise PromptTooLong(exc.text) from None
            self.errors["http_4xx"] += 1
            raise SampleFailed("http_4xx", f"HTTP {exc.status}: {exc.text[:300]}", exc.attempts) from None

    # ------------------------------------------------------------------ self-prompting (kind: self sources)

    def sample_user_turns(self, reqs: list[UserTurnRequest], settings: SelfPromptParams) -> list[UserTurn]:
        """One sampled user turn per request: ``POST /completions`` on the raw rendered prefix (no chat
        endpoint: it would add its own user-turn header), with vLLM's ``stop_token_ids`` /
        ``skip_special_tokens`` / ``top_k`` extensions and ``stop=[end_text]`` for servers without them.

        Raises:
            SelfPromptError: a request still fails after the retries, or the server refused it.
        """
        async def one(client, r: UserTurnRequest) -> UserTurn:
            body = {"model": self.model_name, "prompt": r.prefix_text, "max_tokens": settings.max_new_tokens,
                    "temperature": settings.temperature, "top_p": settings.top_p, "seed": r.seed,
                    "stop_token_ids": list(r.stop_ids), "skip_special_tokens": True}
            if settings.top_k:  # vLLM's extra sampling parameter (OpenAI's completions have none)
                body["top_k"] = settings.top_k
            if r.end_text.strip():
                body["stop"] = [r.end_text.strip()]
            return await self._post(client, "/completions", body, lambda resp: self._user_turn(r, resp))

        return self._map(one, reqs)

    def _user_turn(self, r: UserTurnRequest, resp: Any) -> UserTurn:
        ch = _first_choice(resp)
        stop_reason = ch.get("stop_reason")
        if isinstance(stop_reason, str):  # the end text itself stopped it
            stop_reason = r.stop_ids[0] if stop_reason == r.end_text.strip() else stop_reason
        fin = user_turn_finish(ch.get("finish_reason"), None, stop_reason, r.stop_ids, self.user_turn_eos)
        usage = resp.get("usage") or {}
        return UserTurn(ch.get("text") or "", fin, int(usage.get("completion_tokens", 0) or 0))

    def answer_user_turns(self, convs: list[list[dict]]) -> list[str]:
        """The target's greedy answers (``synthesize.max_new_tokens`` at most) to conversations ending
        with a user turn, through ``POST /chat/completions`` (the follow-up of a multi-turn self-prompt).

        Raises:
            SelfPromptError: see :meth:`sample_user_turns`.
        """
        async def one(client, msgs: list[dict]) -> str:
            body = {"model": self.model_name, "messages": msgs, "temperature": 0.0, "max_tokens": self.syn.max_new_tokens}
            return await self._post(client, "/chat/completions", body,
                                    lambda resp: (_first_choice(resp)["message"].get("content") or "").strip())

        return self._map(one, convs)

    async def _post(self, client, path: str, body: dict, parse: Callable[[Any], Any]) -> Any:
        try:
            return await self.policy.request(lambda: client.post(path, json=body), parse, what=f"POST {path}")
        except Rejected as exc:
            raise SelfPromptError(f"POST {path}: HTTP {exc.status}: {exc.text[:300]}") from None
        except SampleFailed as exc:
            raise SelfPromptError(f"POST {path} failed after {exc.attempts} attempts: {exc.message}") from None

    def _map(self, fn: Callable, items: list) -> list:
        """``fn(client, item)`` for every item, ``server.concurrency`` at a time, results in order."""
        async def main() -> list:
            gate = asyncio.Semaphore(self.sp.concurrency)
            async with self.client() as client:
                await self.resolve_model(client)

                async def one(x):
                    async with gate:
                        return await fn(client, x)

                return list(await asyncio.gather(*(one(x) for x in items)))

        return run_async(main)

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

