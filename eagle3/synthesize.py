"""Stage 1 — synthesize: regenerate the assistant turns of a prompt set with the target itself.

Reads the prompt sources of ``params.synthesize`` (:mod:`eagle3.prompts`), writes
``01_synthesize/samples.jsonl`` (one conversation per line, schema below), ``stats.json``,
``progress.json``, ``throughput.jsonl`` (a ``{"t", "session_start"}`` line when a session starts
generating, then one ``{"t", "id", "completion_tokens"}`` line per sample written: the
throughput-over-time plot), ``errors.json`` (only when samples failed) and the figures.

Backends (``synthesize.backend``):

* ``transformers`` (CPU default): ``model.generate`` on batches of ``batch_size`` prompts, left
  padded (prompts sorted by length to waste little padding).
* ``vllm``: in-process ``vllm.LLM.chat`` (one call per ``batch_size`` conversations and turn).
* ``server``: any OpenAI-compatible ``/v1/chat/completions`` endpoint (``vllm serve`` on GPUs),
  through httpx (async, at most ``server.concurrency`` conversations in flight). Timeouts, connection
  errors, HTTP 5xx/408/429, bodies that are not JSON and responses without ``choices`` are retried
  ``server.max_retries`` times with exponential backoff (``backoff_s * 2**attempt``, capped at 60 s);
  a sample that still fails counts towards the circuit breaker, which stops the stage after
  ``server.breaker_failures`` consecutive failed samples. Other 4xx answers are not retried. The API
  key is read from the environment variable named by ``server.api_key_env`` (never stored).

Multi-turn: the source's assistant turns are dropped; each assistant turn is regenerated in order,
each request holding the regenerated earlier turns (their answer text; reasoning is not sent back).

Reasoning capture (``synthesize.reasoning``): a server's ``reasoning_content`` (older vLLM) or
``reasoning`` (vLLM >= 0.10) message field, else a ``think_tags`` span in the text
(:func:`split_reasoning`); stored as the message's ``reasoning``, apart from ``content``.

``samples.jsonl`` line::

    {"id", "source", "split": "train"|"heldout", "prompt_hash", "origin",
     "messages": [{"role": "system"|"user"|"assistant", "content", "reasoning"?}],
     "finish_reasons": ["stop"|"length"|..., one per assistant turn],
     "prompt_tokens": int (sum over turns of each request's prompt tokens),
     "completion_tokens": int (sum over turns; a final EOS token counts, as in vLLM's usage),
     "turn_usage": [{"prompt_tokens", "completion_tokens"} per assistant turn],
     "dropped_turns": int (only when later turns no longer fit the context),
     "settings": {"backend", "model", "temperature", "top_p", "max_new_tokens", "seed",
                  "enable_thinking", "reasoning"}}

Resume: the file is append-only while the stage runs, one ``write`` + ``flush`` per line. On
start a torn last line (no final newline: the process died mid-write) is cut off, the ids already
present are skipped, and at the end the file is rewritten atomically in prompt order so that an
interrupted-and-resumed run and an uninterrupted one give the same file (given deterministic
generation). Prompts longer than the context (``target.max_model_len``) are skipped and counted
(``bad_input.prompt_too_long``); a later turn that no longer fits ends its conversation early.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from eagle3.config import Params
from eagle3.io import Progress, atomic_path, atomic_write_json, read_json, stage_dir, write_stats
from eagle3.prompts import LoadReport, Prompt, load_prompts
from eagle3.errors import SynthesisError

__all__ = [
    "SAMPLES_FILE",
    "SynthesisError",
    "TurnResult",
    "TurnRequest",
    "split_reasoning",
    "parse_chat_completion",
    "ChatRenderer",
    "TransformersBackend",
    "VllmBackend",
    "ServerBackend",
    "SampleStore",
    "load_samples",
    "summarize_samples",
    "make_figures",
    "summary_table",
    "preview_rows",
    "throughput_series",
    "overall_rate",
    "run",
]

log = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
THROUGHPUT_FILE = "throughput.jsonl"
ERRORS_FILE = "errors.json"
_CONTEXT_RE = re.compile(r"maximum context length|context length|max_model_len|too long|exceeds", re.I)
_MAX_LISTED = 50


# ----------------------------------------------------------------------------- results and reasoning


@dataclass
class TurnRequest:
    """One assistant turn to generate.

    Attributes:
        key: the sample id (for error reports).
        messages: the chat so far, ``[{"role", "content"}]`` (ends with a user message).
        max_new_tokens: generation cap after fitting the context.
        prompt_tokens: rendered prompt length in tokens (None when no local tokenizer).
    """

    key: str
    messages: list[dict]
    max_new_tokens: int
    prompt_tokens: int | None = None


@dataclass
class TurnResult:
    """One generated assistant turn.

    Attributes:
        content: the answer text (reasoning removed).
        reasoning: the reasoning text, or None.
        finish_reason: ``"stop"`` (EOS / stop token), ``"length"`` (hit ``max_new_tokens`` or the
            context), or what the server said.
        prompt_tokens, completion_tokens: token counts (None when the server gave no usage).
    """

    content: str
    reasoning: str | None
    finish_reason: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def split_reasoning(text: str, tags: tuple[str, str] = ("<think>", "</think>")) -> tuple[str | None, str]:
    """Split ``<think>reasoning</think>answer`` into ``(reasoning, answer)``.

    Cases (tags configurable): open and close tag -> the span between them; only a close tag ->
    everything before it (the chat template opened the block, as DeepSeek-R1 and Qwen3 thinking
    templates do, and as vLLM's ``deepseek_r1`` reasoning parser assumes); only an open tag -> the
    rest of the text (generation stopped inside the reasoning); no tag -> ``(None, text)``.
    The reasoning is stripped, the answer left-stripped; an empty reasoning gives None.
    """
    open_t, close_t = tags
    if close_t in text:
        head, _, tail = text.partition(close_t)
        pre, found, inner = head.partition(open_t)
        reasoning = inner if found else head
        answer = (pre.strip() + "\n\n" if found and pre.strip() else "") + tail.lstrip()
        return (reasoning.strip() or None), answer
    if open_t in text:
        pre, _, inner = text.partition(open_t)
        return (inner.strip() or None), pre.strip()
    return None, text


def parse_chat_completion(body: Any, reasoning: str = "auto", tags: tuple[str, str] = ("<think>", "</think>")) -> TurnResult:
    """A chat-completions response body (parsed JSON) -> :class:`TurnResult`.

    Args:
        body: the response JSON: ``{"choices": [{"message": {"content", "reasoning_content" |
            "reasoning"}, "finish_reason"}], "usage": {"prompt_tokens", "completion_tokens"}}``.
        reasoning: ``"auto"`` (fields, then tags), ``"fields"``, ``"tags"`` or ``"off"``.
        tags: the (open, close) think tags.

    Raises:
        ValueError: the body is not a chat completion (no ``choices`` / ``message``); the message
            quotes a server ``error`` when there is one.
    """
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or not body["choices"]:
        err = body.get("error") if isinstance(body, dict) else None
        raise ValueError(f"response has no choices{f' (error: {str(err)[:200]})' if err else ''}")
    ch = body["choices"][0]
    msg = ch.get("message") if isinstance(ch, dict) else None
    if not isinstance(msg, dict):
        raise ValueError("response choice has no message")
    content = msg.get("content") or ""
    r: str | None = None
    if reasoning in ("auto", "fields"):
        r = msg.get("reasoning_content") or msg.get("reasoning") or None
    if r is None and reasoning in ("auto", "tags"):
        r, content = split_reasoning(content, tags)
    usage = body.get("usage") or {}
    return TurnResult(content=content, reasoning=(r.strip() if isinstance(r, str) and r.strip() else None),
                      finish_reason=str(ch.get("finish_reason") or "unknown"),
                      prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"))


def _text_result(text: str, finish: str, ptoks: int | None, ctoks: int | None, mode: str, tags: tuple[str, str]) -> TurnResult:
    """In-process backends have no reasoning fields: ``auto``/``tags`` split think tags, else keep."""
    r = None
    if mode in ("auto", "tags"):
        r, text = split_reasoning(text, tags)
    return TurnResult(text, r, finish, ptoks, ctoks)


# ----------------------------------------------------------------------------- chat rendering


class ChatRenderer:
    """Renders and counts chat prompts with the target's own chat template.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        template_kwargs: extra template variables (``{"enable_thinking": bool}`` or ``{}``).
    """

    def __init__(self, tokenizer, template_kwargs: dict | None = None) -> None:
        self.tok = tokenizer
        self.kwargs = dict(template_kwargs or {})

    def render(self, messages: list[dict]) -> str:
        """The prompt text vLLM and transformers both feed to the model (generation prompt added)."""
        return self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **self.kwargs)

    def count(self, messages: list[dict]) -> int:
        """Prompt length in tokens (the rendered text, tokenized without extra special tokens)."""
        return len(self.tok(self.render(messages), add_special_tokens=False)["input_ids"])


# ----------------------------------------------------------------------------- backends


def _template_kwargs(params: Params) -> dict:
    et = params.synthesize.enable_thinking
    return {} if et is None else {"enable_thinking": et}


class TransformersBackend:
    """transformers ``generate``, batched with left padding (the CPU default).

    Args:
        params: run params (``target`` for the model, ``synthesize`` for the settings).
        model, tokenizer: an already loaded target (else loaded with :func:`eagle3.target.load_target`).
    """

    name = "transformers"

    def __init__(self, params: Params, model=None, tokenizer=None) -> None:
        import torch

        from eagle3.target import load_target

        if model is None or tokenizer is None:
            model, tokenizer, resolved = load_target(params.target)
            self.model_name = resolved.name
        else:
            self.model_name = str(getattr(model, "name_or_path", "model"))
        self.model, self.tok = model, tokenizer
        self.syn = params.synthesize
        self.renderer = ChatRenderer(tokenizer, _template_kwargs(params))
        cfg_max = getattr(model.config, "max_position_embeddings", None) or params.target.max_model_len
        self.context_len = min(params.target.max_model_len, int(cfg_max))
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = sorted(eos_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.device = next(model.parameters()).device
        self._torch = torch

    def generate(self, reqs: list[TurnRequest]) -> list[TurnResult]:
        """Generate one turn for each request in one left-padded batch.

        Each request's tokens are cut at its own ``max_new_tokens`` (the batch runs to the largest);
        ``finish_reason`` is ``"stop"`` when an EOS id ends the turn within it, else ``"length"``.
        Sampling (temperature > 0) is seeded per batch with ``seed`` and the first request's id.
        """
        torch = self._torch
        texts = [self.renderer.render(r.messages) for r in reqs]
        old_side = self.tok.padding_side
        self.tok.padding_side = "left"
        try:
            enc = self.tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
        finally:
            self.tok.padding_side = old_side
        enc = {k: v.to(self.device) for k, v in enc.items()}
        sample = self.syn.temperature > 0
        kw: dict[str, Any] = dict(max_new_tokens=max(r.max_new_tokens for r in reqs), do_sample=sample,
                                  pad_token_id=self.pad_id, eos_token_id=self.eos_ids)
        if sample:
            kw.update(temperature=self.syn.temperature, top_p=self.syn.top_p, top_k=0)
            digest = hashlib.sha256(reqs[0].key.encode()).digest()
            torch.manual_seed((self.syn.seed + int.from_bytes(digest[:4], "little")) % (2**31))
        with torch.inference_mode():
            out = self.model.generate(**enc, **kw)
        new = out[:, enc["input_ids"].shape[1]:].tolist()
        plens = enc["attention_mask"].sum(dim=1).tolist()
        results = []
        for r, toks, plen in zip(reqs, new, plens):
            toks = toks[: r.max_new_tokens]
            stop = next((i for i, t in enumerate(toks) if t in self.eos_ids), None)
            if stop is not None:
                toks, finish, body = toks[: stop + 1], "stop", toks[:stop]
            else:
                finish, body = "length", toks
            text = self.tok.decode(body, skip_special_tokens=True)
            results.append(_text_result(text, finish, int(plen), len(toks), self.syn.reasoning, self.syn.think_tags))
        return results

    def close(self) -> None:
        pass


class VllmBackend:
    """In-process vLLM (``vllm.LLM.chat``); engine settings from :func:`eagle3.vllm_utils.engine_kwargs`
    plus ``synthesize.vllm_kwargs``. Each request is seeded with ``synthesize.seed`` (vLLM's
    per-request generator), so sampled outputs do not depend on batch composition."""

    name = "vllm"

    def __init__(self, params: Params) -> None:
        from vllm import LLM

        from eagle3.target import load_tokenizer, resolve_target
        from eagle3.vllm_utils import engine_kwargs

        resolved = resolve_target(params.target)
        self.model_name = resolved.name
        self.syn = params.synthesize
        self.context_len = params.target.max_model_len
        self.tok = load_tokenizer(resolved, params.target.trust_remote_code)
        self.renderer = ChatRenderer(self.tok, _template_kwargs(params))
        self.template_kwargs = _template_kwargs(params) or None
        kw = engine_kwargs(resolved.path, dtype=params.target.dtype, max_model_len=params.target.max_model_len,
                           seed=self.syn.seed, tensor_parallel_size=params.target.tensor_parallel_size,
                           trust_remote_code=params.target.trust_remote_code, **self.syn.vllm_kwargs)
        self.llm = LLM(**kw)

    def generate(self, reqs: list[TurnRequest]) -> list[TurnResult]:
        """One ``LLM.chat`` call for all requests (vLLM batches them itself)."""
        from vllm import SamplingParams

        sps = [SamplingParams(temperature=self.syn.temperature, top_p=self.syn.top_p, max_tokens=r.max_new_tokens,
                              seed=self.syn.seed, skip_special_tokens=True) for r in reqs]
        outs = self.llm.chat([r.messages for r in reqs], sampling_params=sps, use_tqdm=False,
                             chat_template_kwargs=self.template_kwargs)
        results = []
        for o in outs:
            c = o.outputs[0]
            results.append(_text_result(c.text, str(c.finish_reason or "unknown"), len(o.prompt_token_ids or []),
                                        len(c.token_ids), self.syn.reasoning, self.syn.think_tags))
        return results

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        self.llm = None
        del llm
        import gc

        gc.collect()


class _SampleFailed(Exception):
    def __init__(self, kind: str, message: str, attempts: int) -> None:
        super().__init__(message)
        self.kind, self.message, self.attempts = kind, message, attempts


class _PromptTooLong(Exception):
    pass


class _Stopped(Exception):
    pass


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
        self.template_kwargs = _template_kwargs(params)
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
            _SampleFailed: still failing after ``max_retries`` (or a non-retryable 4xx).
            _PromptTooLong: the server says the prompt does not fit its context.
            _Stopped: the stage is stopping (circuit breaker).
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
                raise _Stopped()
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
                        raise _PromptTooLong(text)
                    self.errors["http_4xx"] += 1
                    raise _SampleFailed("http_4xx", f"HTTP {code}: {text[:300]}", attempt + 1)
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
                        raise _Stopped()
                    except asyncio.TimeoutError:
                        pass
                else:
                    await asyncio.sleep(delay)
        raise _SampleFailed(kind, msg, self.sp.max_retries + 1)

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------- samples file


class SampleStore:
    """Append-only ``samples.jsonl`` with crash recovery.

    On open: an exclusive lock on ``.samples.jsonl.lock`` (``fcntl.flock``; released by the OS when
    the process dies, even by SIGKILL) keeps a second process from appending to the same file; a
    last line without its newline (a write torn by a crash) is cut off (``torn_lines``); every
    complete line must be JSON with an ``id`` (else :class:`SynthesisError` naming the line).

    Attributes:
        done: ids present, mapped to their ``completion_tokens``.
        torn_lines: 1 when a torn last line was dropped on open, else 0.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.done: dict[str, int] = {}
        self.torn_lines = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.path.parent / f".{self.path.name}.lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise SynthesisError(
                f"{self.path} is being written by another process (stage 1 already running on this run "
                f"directory?); wait for it or stop it first."
            ) from None
        if self.path.exists() and self.path.stat().st_size:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
            if torn:
                data = self.path.read_bytes()
                cut = data.rfind(b"\n") + 1
                with open(self.path, "r+b") as f:
                    f.truncate(cut)
                    f.flush()
                    os.fsync(f.fileno())
                self.torn_lines = 1
                log.warning("%s: dropped a torn last line (%d bytes) left by an interrupted run", self.path, len(data) - cut)
            with open(self.path, "rb") as f:
                for lineno, line in enumerate(f, start=1):
                    try:
                        obj = json.loads(line)
                        sid = obj["id"]
                    except (ValueError, KeyError, TypeError):
                        raise SynthesisError(
                            f"{self.path}:{lineno}: not a sample line (corrupt file?). Move the file away to "
                            f"start the stage afresh, or delete that line to keep the rest."
                        ) from None
                    self.done.setdefault(sid, int(obj.get("completion_tokens") or 0))
        self._f = open(self.path, "a", encoding="utf-8")

    def append(self, sample: dict) -> None:
        """Write one sample line and flush it to the OS (survives SIGKILL of this process)."""
        self._f.write(json.dumps(sample, ensure_ascii=False) + "\n")
        self._f.flush()
        self.done[sample["id"]] = int(sample.get("completion_tokens") or 0)

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        if not self._lock.closed:
            self._lock.close()  # releases the flock

    def finalize(self, order: list[str]) -> int:
        """Rewrite the file atomically with lines in ``order`` (ids not in ``order`` follow in file
        order), then close and unlock. Returns the number of such extra lines. No rewrite when the
        file is already in order."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        lines: dict[str, bytes] = {}
        file_order: list[str] = []
        with open(self.path, "rb") as f:
            for line in f:
                sid = json.loads(line)["id"]
                if sid not in lines:
                    lines[sid] = line
                    file_order.append(sid)
        wanted = [i for i in order if i in lines]
        extra = [i for i in file_order if i not in set(order)]
        final = wanted + extra
        if final != file_order:
            with atomic_path(self.path) as tmp:
                with open(tmp, "wb") as out:
                    for sid in final:
                        out.write(lines[sid])
                    out.flush()
                    os.fsync(out.fileno())
        self.close()
        return len(extra)


def load_samples(run_dir: str | Path, split: str | None = None) -> list[dict]:
    """The samples of stage 1 (``01_synthesize/samples.jsonl``), in file order.

    Args:
        run_dir: the run directory.
        split: ``"train"``, ``"heldout"`` or None (all).

    Returns:
        list[dict]: one dict per conversation (schema in the module docstring).

    Raises:
        FileNotFoundError: stage 1 has not written samples yet.
        ValueError: ``split`` is not train/heldout/None, or a complete line is not JSON (file:line).
    """
    if split not in (None, "train", "heldout"):
        raise ValueError(f"split must be 'train', 'heldout' or None, got {split!r}")
    path = Path(run_dir) / "01_synthesize" / SAMPLES_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run stage 1 (synthesize) first")
    out = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                break  # a torn last line of a running/crashed stage: not a sample yet
            try:
                s = json.loads(line)
            except ValueError:
                raise ValueError(f"{path}:{lineno}: not a JSON line") from None
            if split is None or s.get("split") == split:
                out.append(s)
    return out


# ----------------------------------------------------------------------------- conversations


@dataclass
class _Conv:
    prompt: Prompt
    messages: list[dict] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    usage: list[dict] = field(default_factory=list)
    turn: int = 0
    dropped_turns: int = 0
    skipped: str | None = None  # reason when the first turn does not fit

    @property
    def finished(self) -> bool:
        return self.skipped is not None or self.turn >= len(self.prompt.turns)

    def request_messages(self) -> list[dict]:
        sent = [{"role": m["role"], "content": m["content"]} for m in self.messages]
        return sent + [dict(m) for m in self.prompt.turns[self.turn]]

    def add(self, res: TurnResult, req: TurnRequest) -> None:
        self.messages += [dict(m) for m in self.prompt.turns[self.turn]]
        msg = {"role": "assistant", "content": res.content}
        if res.reasoning:
            msg["reasoning"] = res.reasoning
        self.messages.append(msg)
        self.finish_reasons.append(res.finish_reason)
        pt = res.prompt_tokens if res.prompt_tokens is not None else req.prompt_tokens
        self.usage.append({"prompt_tokens": int(pt or 0), "completion_tokens": int(res.completion_tokens or 0)})
        self.turn += 1

    def too_long(self, ptoks: int | None) -> None:
        """The current turn does not fit the context: skip the sample or end the conversation here."""
        if self.turn == 0:
            self.skipped = f"prompt_too_long ({ptoks} tokens)" if ptoks is not None else "prompt_too_long (server)"
        else:
            self.dropped_turns = len(self.prompt.turns) - self.turn
            self.turn = len(self.prompt.turns)

    def sample(self, settings: dict) -> dict:
        p = self.prompt
        s = {"id": p.id, "source": p.source, "split": p.split, "prompt_hash": p.prompt_hash, "origin": p.origin,
             "messages": self.messages, "finish_reasons": self.finish_reasons,
             "prompt_tokens": sum(u["prompt_tokens"] for u in self.usage),
             "completion_tokens": sum(u["completion_tokens"] for u in self.usage),
             "turn_usage": self.usage, "settings": settings}
        if self.dropped_turns:
            s["dropped_turns"] = self.dropped_turns
        return s


def _prepare(conv: _Conv, renderer: ChatRenderer | None, context_len: int, max_new: int) -> TurnRequest | None:
    """The next turn's request, or None after marking the conversation when the prompt does not fit."""
    msgs = conv.request_messages()
    if renderer is None:
        return TurnRequest(conv.prompt.id, msgs, max_new, None)
    try:
        n = renderer.count(msgs)
    except Exception as exc:  # noqa: BLE001 - jinja raises template-defined errors
        raise SynthesisError(
            f"sample {conv.prompt.id} ({conv.prompt.origin}), turn {conv.turn + 1}: the target's chat template "
            f"cannot render this conversation: {type(exc).__name__}: {exc}"
        ) from None
    room = context_len - n
    if room < 1:
        conv.too_long(n)
        return None
    return TurnRequest(conv.prompt.id, msgs, min(max_new, room), n)


# ----------------------------------------------------------------------------- drivers


@dataclass
class _Session:
    store: SampleStore
    progress: Progress
    settings: dict
    timeline: Any
    skipped: list[dict] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)
    interrupted: list[str] = field(default_factory=list)
    written: int = 0
    tokens: int = 0

    def finish(self, conv: _Conv) -> None:
        if conv.skipped is not None:
            self.skipped.append({"id": conv.prompt.id, "origin": conv.prompt.origin, "reason": conv.skipped})
            self.progress.update(1)
            return
        s = conv.sample(self.settings)
        self.store.append(s)
        self.timeline.write(json.dumps({"t": round(time.time(), 3), "id": s["id"],
                                        "completion_tokens": s["completion_tokens"]}) + "\n")
        self.timeline.flush()
        self.written += 1
        self.tokens += s["completion_tokens"]
        self.progress.update(1, tokens=s["completion_tokens"], written=self.written, skipped=len(self.skipped))


def _run_batched(backend, prompts: list[Prompt], sess: _Session, batch_size: int, max_new: int) -> None:
    """Transformers / in-process vLLM: chunks of ``batch_size`` conversations, turn by turn."""
    renderer = backend.renderer

    def length(p: Prompt) -> int:
        try:
            return renderer.count(p.first_messages())
        except Exception:  # noqa: BLE001 - _prepare reports template errors with the sample id
            return 0

    lens = {p.id: length(p) for p in prompts}
    order = sorted(prompts, key=lambda p: (lens[p.id], p.id))  # similar lengths share a batch
    for i in range(0, len(order), batch_size):
        convs = [_Conv(p) for p in order[i:i + batch_size]]
        while True:
            reqs, owners = [], []
            for c in convs:
                if c.finished:
                    continue
                r = _prepare(c, renderer, backend.context_len, max_new)
                if r is not None:
                    reqs.append(r)
                    owners.append(c)
            if not reqs:
                break
            for c, res, req in zip(owners, backend.generate(reqs), reqs):
                c.add(res, req)
        for c in convs:
            sess.finish(c)


def _run_server(backend: ServerBackend, prompts: list[Prompt], sess: _Session, renderer: ChatRenderer | None,
                context_len: int, max_new: int, breaker_failures: int) -> bool:
    """Server backend: ``concurrency`` workers, each taking the next conversation and running its
    turns in order. Returns True when the circuit breaker opened."""

    async def main() -> bool:
        backend.stop = asyncio.Event()
        queue: asyncio.Queue = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(_Conv(p))
        consecutive = [0]
        tripped = [False]

        async def worker(client) -> None:
            while not backend.stop.is_set():
                try:
                    conv = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    while not conv.finished:
                        req = _prepare(conv, renderer, context_len, max_new)
                        if req is None:
                            break
                        try:
                            res = await backend.chat(client, req)
                        except _PromptTooLong:
                            conv.too_long(req.prompt_tokens)
                            break
                        conv.add(res, req)
                except _Stopped:
                    sess.interrupted.append(conv.prompt.id)
                    return
                except asyncio.CancelledError:
                    sess.interrupted.append(conv.prompt.id)
                    raise
                except _SampleFailed as exc:
                    sess.failed.append({"id": conv.prompt.id, "origin": conv.prompt.origin, "kind": exc.kind,
                                        "message": exc.message, "attempts": exc.attempts, "turn": conv.turn})
                    sess.progress.update(1, failed=len(sess.failed))
                    consecutive[0] += 1
                    if consecutive[0] >= breaker_failures and not backend.stop.is_set():
                        tripped[0] = True
                        backend.stop.set()
                    continue
                consecutive[0] = 0
                sess.finish(conv)

        async with backend.client() as client:
            await backend.resolve_model(client)
            sess.settings["model"] = backend.model_name
            tasks = [asyncio.create_task(worker(client)) for _ in range(min(backend.sp.concurrency, len(prompts)))]
            stopper = asyncio.create_task(backend.stop.wait())
            everything = asyncio.gather(*tasks)
            await asyncio.wait([stopper, everything], return_when=asyncio.FIRST_COMPLETED)
            if backend.stop.is_set():
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
        return tripped[0]

    return _run_async(main)


def _run_async(fn: Callable):
    """``asyncio.run(fn())``, in a helper thread when this thread already runs a loop (Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(fn())
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as ex:
        return ex.submit(lambda: asyncio.run(fn())).result()


def _server_renderer(params: Params) -> ChatRenderer | None:
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
        return ChatRenderer(tok, _template_kwargs(params))
    except Exception as exc:  # noqa: BLE001 - any failure means: no local tokenizer
        log.warning("synthesize: no local tokenizer for %s (%s); prompt lengths are checked by the server only",
                    params.target.model, exc)
        return None


# ----------------------------------------------------------------------------- stats and figures


def _percentile(xs: list[int], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (k - lo))


def summarize_samples(samples: list[dict]) -> dict:
    """Summary numbers of a list of samples: counts, tokens, finish reasons, reasoning capture.

    ``reasoning_capture_rate`` = assistant turns with a non-empty ``reasoning`` / assistant turns;
    ``reasoning_char_share`` = reasoning characters / (reasoning + answer characters).
    Completion-token quantiles are per assistant turn.
    """
    turns = [m for s in samples for m in s["messages"] if m["role"] == "assistant"]
    per_turn = [u["completion_tokens"] for s in samples for u in s.get("turn_usage", [])]
    fr = Counter(r for s in samples for r in s["finish_reasons"])
    r_chars = sum(len(m.get("reasoning") or "") for m in turns)
    c_chars = sum(len(m["content"]) for m in turns)
    n_turns = len(turns)
    return {
        "samples": len(samples),
        "samples_train": sum(s["split"] == "train" for s in samples),
        "samples_heldout": sum(s["split"] == "heldout" for s in samples),
        "turns": n_turns,
        "multi_turn_samples": sum(len(s["finish_reasons"]) > 1 for s in samples),
        "dropped_turns": sum(s.get("dropped_turns", 0) for s in samples),
        "prompt_tokens": sum(s["prompt_tokens"] for s in samples),
        "completion_tokens": sum(s["completion_tokens"] for s in samples),
        "completion_tokens_mean": round(sum(per_turn) / len(per_turn), 2) if per_turn else 0.0,
        "completion_tokens_p50": _percentile(per_turn, 0.5),
        "completion_tokens_p90": _percentile(per_turn, 0.9),
        "completion_tokens_max": max(per_turn) if per_turn else 0,
        "finish_reasons": dict(sorted(fr.items())),
        "length_fraction": round(fr.get("length", 0) / n_turns, 4) if n_turns else 0.0,
        "reasoning_turns": sum(bool(m.get("reasoning")) for m in turns),
        "reasoning_capture_rate": round(sum(bool(m.get("reasoning")) for m in turns) / n_turns, 4) if n_turns else 0.0,
        "reasoning_char_share": round(r_chars / (r_chars + c_chars), 4) if (r_chars + c_chars) else 0.0,
    }


def _read_timeline(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").split("\n"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # torn last line
    return out


def throughput_series(events: list[dict]) -> list[tuple[tuple[float, float], float]]:
    """Completion tokens/s over wall-clock intervals from ``throughput.jsonl`` events.

    Events are ``{"t", "session_start": true}`` (written when a session starts generating) and
    ``{"t", "id", "completion_tokens"}`` (one per sample written). Within each session, writes are
    grouped until a group spans at least 1/30 of the session (batched backends write a whole batch
    at once); a group's rate is its tokens over the time since the previous group ended (the session
    start for the first). Returns ``[((t_from, t_to), tokens_per_s), ...]`` in unix seconds.
    """
    out: list[tuple[tuple[float, float], float]] = []
    sessions: list[list[dict]] = []
    for e in sorted(events, key=lambda r: (r["t"], "session_start" not in r)):
        if e.get("session_start") or not sessions:
            sessions.append([e])
        else:
            sessions[-1].append(e)
    for sess in sessions:
        start = sess[0]["t"]
        writes = [e for e in sess if "completion_tokens" in e]
        if not writes:
            continue
        min_span = (writes[-1]["t"] - start) / 30
        prev, tokens = start, 0
        for i, e in enumerate(writes):
            tokens += e["completion_tokens"]
            last = i == len(writes) - 1
            if (e["t"] - prev >= min_span and (last or writes[i + 1]["t"] > e["t"])) or last:
                if e["t"] > prev:
                    out.append(((prev, e["t"]), tokens / (e["t"] - prev)))
                prev, tokens = e["t"], 0
    return out


def overall_rate(events: list[dict]) -> float | None:
    """Completion tokens per second of generation over all sessions of ``throughput.jsonl``: the
    tokens written divided by the summed (last write - session start) of each session; None when
    nothing was generated."""
    tokens, seconds = 0, 0.0
    for (t_from, t_to), rate in throughput_series(events):
        tokens += rate * (t_to - t_from)
        seconds += t_to - t_from
    return round(tokens / seconds, 2) if seconds > 0 else None


def make_figures(run_dir: str | Path) -> dict:
    """Matplotlib figures of a stage-1 output (no pyplot state): ``completion_lengths`` (histogram of
    completion tokens per assistant turn, ``max_new_tokens`` marked), ``finish_reasons`` (bar),
    ``throughput`` (cumulative completion tokens and tokens/s over wall-clock time, from
    ``throughput.jsonl`` via :func:`throughput_series`) and, when any turn has reasoning, ``reasoning_share`` (histogram of the
    reasoning share of characters per turn)."""
    from matplotlib.figure import Figure

    sd = Path(run_dir) / "01_synthesize"
    samples = load_samples(run_dir)
    figs: dict = {}
    per_turn = [u["completion_tokens"] for s in samples for u in s.get("turn_usage", [])]
    max_new = samples[0]["settings"].get("max_new_tokens") if samples else None

    fig = Figure(figsize=(6, 3.2))
    ax = fig.subplots()
    hi = max([max_new or 0, *per_turn]) + 1
    ax.hist(per_turn, bins=min(40, hi), range=(0, hi), color="#4c72b0")
    if max_new:
        ax.axvline(max_new, color="#c44e52", ls="--", label=f"max_new_tokens={max_new}")
        ax.legend()
    ax.set_xlabel("completion tokens per assistant turn")
    ax.set_ylabel("turns")
    ax.set_title(f"Completion length ({len(per_turn)} turns)")
    figs["completion_lengths"] = fig

    fr = Counter(r for s in samples for r in s["finish_reasons"])
    fig = Figure(figsize=(4.5, 3.2))
    ax = fig.subplots()
    names = sorted(fr)
    ax.bar(names, [fr[n] for n in names], color=["#55a868" if n == "stop" else "#c44e52" for n in names])
    ax.set_ylabel("assistant turns")
    ax.set_title("Finish reasons")
    figs["finish_reasons"] = fig

    tl = _read_timeline(sd / THROUGHPUT_FILE)
    fig = Figure(figsize=(7, 3.2))
    ax1, ax2 = fig.subplots(1, 2)
    writes = sorted((r for r in tl if "completion_tokens" in r), key=lambda r: r["t"])
    if writes:
        t0 = min(r["t"] for r in tl)
        cum, acc = [], 0
        for r in writes:
            acc += r["completion_tokens"]
            cum.append(acc)
        ax1.plot([(r["t"] - t0) / 60 for r in writes], cum, color="#4c72b0", drawstyle="steps-post")
        for t_end, rate in throughput_series(tl):
            ax2.plot([(t_end[0] - t0) / 60, (t_end[1] - t0) / 60], [rate, rate], color="#dd8452", lw=2)
    ax1.set_xlabel("minutes")
    ax1.set_ylabel("completion tokens (cumulative)")
    ax2.set_xlabel("minutes")
    ax2.set_ylabel("tokens/s")
    fig.suptitle("Throughput over time")
    figs["throughput"] = fig

    shares = []
    for s in samples:
        for m in s["messages"]:
            if m["role"] == "assistant":
                r, c = len(m.get("reasoning") or ""), len(m["content"])
                shares.append(r / (r + c) if r + c else 0.0)
    if any(shares):
        fig = Figure(figsize=(6, 3.2))
        ax = fig.subplots()
        ax.hist(shares, bins=20, range=(0, 1), color="#8172b2")
        ax.set_xlabel("reasoning share of the turn (characters)")
        ax.set_ylabel("assistant turns")
        ax.set_title(f"Reasoning share ({sum(x > 0 for x in shares)}/{len(shares)} turns with reasoning)")
        figs["reasoning_share"] = fig
    return figs


def summary_table(stats: dict) -> dict:
    """The headline numbers of ``stats.json`` as a flat ``{metric: value}`` dict (for notebooks)."""
    keys = ["samples", "samples_train", "samples_heldout", "turns", "prompt_tokens", "completion_tokens",
            "completion_tokens_mean", "completion_tokens_p90", "length_fraction", "reasoning_capture_rate",
            "tokens_per_s", "elapsed_s", "generated_this_session", "backend"]
    out = {k: stats.get(k) for k in keys}
    out["finish_reasons"] = json.dumps(stats.get("finish_reasons", {}))
    out["bad_input"] = json.dumps({k: v for k, v in stats.get("bad_input", {}).items() if v})
    out["errors"] = json.dumps(stats.get("errors", {}))
    return out


def preview_rows(samples: list[dict], n: int = 8, width: int = 120) -> list[dict]:
    """The first ``n`` samples as flat rows (id, split, turns, finish reasons, tokens, the last
    prompt and answer cut to ``width`` characters) for a notebook table."""
    rows = []
    for s in samples[:n]:
        last_user = next((m["content"] for m in reversed(s["messages"]) if m["role"] == "user"), "")
        answer = s["messages"][-1]
        rows.append({"id": s["id"], "split": s["split"], "turns": len(s["finish_reasons"]),
                     "finish": ",".join(s["finish_reasons"]), "completion_tokens": s["completion_tokens"],
                     "prompt": last_user[:width], "answer": answer["content"][:width],
                     "reasoning": (answer.get("reasoning") or "")[:width]})
    return rows


# ----------------------------------------------------------------------------- the stage


def _settings(params: Params, model_name: str | None) -> dict:
    syn = params.synthesize
    return {"backend": syn.backend, "model": model_name, "temperature": syn.temperature, "top_p": syn.top_p,
            "max_new_tokens": syn.max_new_tokens, "seed": syn.seed, "enable_thinking": syn.enable_thinking,
            "reasoning": syn.reasoning}


def run(params: Params, run_dir: str | Path) -> dict:
    """Run stage 1: synthesize ``01_synthesize/samples.jsonl`` (resumable), then stats and figures.

    Args:
        params: validated run params.
        run_dir: the run directory (see :func:`eagle3.paths.resolve_run_dir`).

    Returns:
        dict: the stats written to ``stats.json``: :func:`summarize_samples` numbers plus
        ``prompts`` (load report), ``bad_input`` (counts by kind, ``prompt_too_long`` included),
        ``skipped`` (ids and reasons), ``errors`` (failed attempts by kind), ``retries``,
        ``failed_samples``, ``torn_lines_dropped``, ``resumed_from`` (samples found on start),
        ``generated_this_session``, ``completion_tokens_this_session``, ``generation_s``,
        ``tokens_per_s_this_session``, ``tokens_per_s`` (completion tokens per second of generation
        over all sessions, :func:`overall_rate`),
        ``load_s``, ``elapsed_s``, ``backend``, ``settings``.

    Raises:
        PromptError: unreadable prompt sources (see :mod:`eagle3.prompts`).
        SynthesisError: the circuit breaker opened, more than ``max_failed_samples`` samples failed
            (``stats.json`` then says ``complete: false`` and lists them; ``errors.json`` too), or
            ``samples.jsonl`` is corrupt. Samples written before stay; re-running resumes.
        TargetError: the target cannot be loaded.
    """
    from eagle3.tracking import Tracker

    t_start = time.time()
    syn = params.synthesize
    sd = stage_dir(run_dir, 1)
    prompts, report = load_prompts(syn)
    store = SampleStore(sd / SAMPLES_FILE)
    ids = [p.id for p in prompts]
    resumed_from = sum(1 for i in ids if i in store.done)
    pending = [p for p in prompts if p.id not in store.done]
    progress = Progress(sd, total=len(prompts), unit="samples", done=resumed_from,
                        tokens=sum(store.done.get(i, 0) for i in ids), desc="01_synthesize")
    settings = _settings(params, None)
    sess = _Session(store=store, progress=progress, settings=settings,
                    timeline=open(sd / THROUGHPUT_FILE, "a", encoding="utf-8"))
    backend = None
    tripped = False
    load_s = gen_s = 0.0
    try:
        if pending:
            t0 = time.time()
            if syn.backend == "transformers":
                backend = TransformersBackend(params)
            elif syn.backend == "vllm":
                backend = VllmBackend(params)
            else:
                backend = ServerBackend(params)
            settings["model"] = backend.model_name
            renderer = _server_renderer(params) if isinstance(backend, ServerBackend) else None
            load_s = time.time() - t0
            t1 = time.time()
            sess.timeline.write(json.dumps({"t": round(t1, 3), "session_start": True}) + "\n")
            if isinstance(backend, ServerBackend):
                tripped = _run_server(backend, pending, sess, renderer, params.target.max_model_len,
                                      syn.max_new_tokens, syn.server.breaker_failures)
            else:
                _run_batched(backend, pending, sess, syn.batch_size, syn.max_new_tokens)
            gen_s = time.time() - t1
    except BaseException:
        store.close()
        sess.timeline.close()
        progress.close("failed")
        raise
    finally:
        if backend is not None:
            backend.close()
    sess.timeline.close()

    failed = sess.failed
    ok = not tripped and len(failed) <= syn.max_failed_samples
    extra = store.finalize(ids) if ok else (store.close() or 0)
    samples = load_samples(run_dir)
    bad = report.to_dict()["bad_input"]
    bad["prompt_too_long"] = len(sess.skipped)
    errors = dict(sorted(getattr(backend, "errors", Counter()).items()))
    stats = summarize_samples(samples)
    stats.update({
        "backend": syn.backend,
        "settings": {k: v for k, v in settings.items()},
        "prompts": report.to_dict(),
        "bad_input": bad,
        "skipped": sess.skipped[:_MAX_LISTED],
        "errors": errors,
        "retries": getattr(backend, "retries", 0),
        "failed_samples": failed[:_MAX_LISTED],
        "failed": len(failed),
        "interrupted_samples": len(sess.interrupted),
        "circuit_breaker_open": tripped,
        "extra_samples_not_in_prompts": extra,
        "torn_lines_dropped": store.torn_lines,
        "resumed_from": resumed_from,
        "generated_this_session": sess.written,
        "completion_tokens_this_session": sess.tokens,
        "load_s": round(load_s, 2),
        "generation_s": round(gen_s, 2),
        "tokens_per_s_this_session": round(sess.tokens / gen_s, 2) if gen_s > 0 else None,
        "tokens_per_s": overall_rate(_read_timeline(sd / THROUGHPUT_FILE)),
        "elapsed_s": round(time.time() - t_start, 2),
    })
    if not ok:
        atomic_write_json(sd / ERRORS_FILE, {"failed_samples": failed, "interrupted": sess.interrupted,
                                             "errors": errors, "circuit_breaker_open": tripped})
        write_stats(sd, stats, complete=False)
        progress.close("failed")
        ids_s = ", ".join(f["id"] for f in failed[:20]) + (" ..." if len(failed) > 20 else "")
        kinds = Counter(f["kind"] for f in failed)
        why = (f"circuit breaker opened after {syn.server.breaker_failures} consecutive failed samples"
               if tripped else f"{len(failed)} samples failed (synthesize.max_failed_samples = {syn.max_failed_samples})")
        last = failed[-1]["message"] if failed else ""
        raise SynthesisError(
            f"Stage 1 stopped: {why}. Failed sample ids: {ids_s} (kinds: {dict(kinds)}; last error: {last}). "
            f"{len(samples)} samples written so far are kept in {store.path}; details in {sd / ERRORS_FILE}. "
            f"Fix the server and re-run to resume."
        )
    (sd / ERRORS_FILE).unlink(missing_ok=True)

    try:
        tracker = Tracker(params, run_dir, "01_synthesize")
        try:
            tracker.log({k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
            tracker.summary(stats)
            for name, fig in make_figures(run_dir).items():
                tracker.figure(name, fig)
        finally:
            tracker.finish()
    except BaseException:
        progress.close("failed")
        raise
    progress.close("done")
    return write_stats(sd, stats)
