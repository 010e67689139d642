"""One assistant turn: the request, the result, and reasoning capture (``synthesize.reasoning``).
(A self-written user turn is an :class:`eagle3.synthesize.self_prompt.template.UserTurnRequest`.)

Reasoning comes from a server's ``reasoning_content`` (older vLLM) or ``reasoning`` (vLLM >= 0.10)
message field, else a ``think_tags`` span in the text (:func:`split_reasoning`); it is stored as the
message's ``reasoning``, apart from ``content``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TurnRequest", "TurnResult", "split_reasoning", "parse_chat_completion", "text_result"]


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


def text_result(text: str, finish: str, ptoks: int | None, ctoks: int | None, mode: str,
                tags: tuple[str, str]) -> TurnResult:
    """A :class:`TurnResult` from generated text (in-process backends have no reasoning fields):
    ``mode`` ``auto``/``tags`` split think tags (:func:`split_reasoning`), else the text is kept."""
    r = None
    if mode in ("auto", "tags"):
        r, text = split_reasoning(text, tags)
    return TurnResult(text, r, finish, ptoks, ctoks)
