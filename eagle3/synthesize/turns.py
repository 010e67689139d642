"""One turn: the request, the result, and reasoning capture (``synthesize.reasoning``).

An assistant turn is a :class:`TurnRequest` answered by a :class:`TurnResult`; a self-written user
turn (``kind: self`` sources) is a :class:`UserTurnRequest` continued by the backend into a
:class:`UserTurn`. Reasoning comes from a server's ``reasoning_content`` (older vLLM) or ``reasoning`` (vLLM >= 0.10)
message field, else a ``think_tags`` span in the text (:func:`split_reasoning`); it is stored as the
message's ``reasoning``, apart from ``content``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["TurnRequest", "TurnResult", "UserTurnRequest", "UserTurn", "user_turn_finish", "split_reasoning",
           "parse_chat_completion", "text_result"]


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


@dataclass
class UserTurnRequest:
    """One rendered prefix for the backend to continue with a user turn (self-prompting).

    Attributes:
        index: request number (0, 1, ...; follow-ups share their first turn's index).
        kind: ``"first"`` or ``"followup"``.
        system: the system prompt rendered (None = the template's default).
        topic: the seed topic steering it (or None).
        history: the messages before the new user turn (follow-ups: system?, user, assistant).
        prefix_text: rendered prefix ending with the user-turn header.
        prefix_ids: ``prefix_text`` tokenized without extra special tokens (list[int]).
        stop_ids: end-of-turn ids (:attr:`eagle3.synthesize.self_prompt.template.UserTurnFormat.eot_ids`).
        end_text: what the template writes after a user message (a stop string for servers).
        seed: the sampling seed of this request (int < 2**31).
    """

    index: int
    kind: str
    system: str | None
    topic: str | None
    history: list[dict]
    prefix_text: str
    prefix_ids: list[int]
    stop_ids: tuple[int, ...]
    end_text: str
    seed: int


@dataclass
class UserTurn:
    """What a backend sampled for one :class:`UserTurnRequest` (a candidate user prompt).

    Attributes:
        text: the user message (decoded without special tokens, the end-of-turn token excluded).
        finish_reason: ``"stop"`` when an id of ``stop_ids`` ended it, ``"length"`` at
            ``max_new_tokens``, ``"eos"`` when another EOS id ended it.
        num_tokens: generated tokens including the end-of-turn token.
        token_ids: the generated ids (None where the backend does not return them: the server).
    """

    text: str
    finish_reason: str
    num_tokens: int = 0
    token_ids: list[int] | None = None


def user_turn_finish(finish_reason: str | None, last_id: int | None, stop_reason, stop_ids: Sequence[int],
                     eos_ids: Sequence[int]) -> str:
    """``"stop"`` / ``"length"`` / ``"eos"`` of a sampled user turn from vLLM's (or a vLLM server's)
    ``finish_reason`` and ``stop_reason`` (the stop token id or string, None for an EOS stop) or the
    last generated id; ``stop_ids`` end a user turn, ``eos_ids`` are the tokenizer's EOS ids."""
    if finish_reason == "length":
        return "length"
    if last_id is not None and last_id in stop_ids:
        return "stop"
    if isinstance(stop_reason, int):
        return "stop" if stop_reason in stop_ids else "eos"
    if stop_reason is None and finish_reason == "stop":  # EOS: a turn end when an eos id is the end of turn
        return "stop" if set(eos_ids) & set(stop_ids) else "eos"
    return "stop" if finish_reason == "stop" else "length"


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


def text_result(text: str, finish: str, ptoks: int | None, ctoks: int | None, mode: str,
                tags: tuple[str, str]) -> TurnResult:
    """A :class:`TurnResult` from generated text (in-process backends have no reasoning fields):
    ``mode`` ``auto``/``tags`` split think tags (:func:`split_reasoning`), else the text is kept."""
    r = None
    if mode in ("auto", "tags"):
        r, text = split_reasoning(text, tags)
    return TurnResult(text, r, finish, ptoks, ctoks)
