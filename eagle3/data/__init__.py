"""Prompt sets that ship inside the package (package data, found with :mod:`importlib.resources`).

``general_chat.jsonl`` is the project's own general-chat evaluation set: 96 prompts
written for this project (not copied from MT-Bench, Vicuna-bench, AlpacaEval or any public
benchmark), 12 in each of :data:`GENERAL_CHAT_CATEGORIES`. One JSON object a line:

``{"id": "gc-<category>-NN", "category": ..., "prompt": ..., "followup": ...}`` where ``followup``
(optional) is a second user turn sent after the target's first answer (a two-turn conversation).

Stage 5 reads it as the prompt source ``{kind: embedded, name: general-chat}`` (see
:mod:`eagle3.prompts`), which turns each record into OpenAI-style messages.
"""

from __future__ import annotations

import json
from importlib import resources

__all__ = ["GENERAL_CHAT_CATEGORIES", "GENERAL_CHAT_FILE", "load_general_chat", "general_chat_messages"]

GENERAL_CHAT_FILE = "general_chat.jsonl"
GENERAL_CHAT_CATEGORIES = (
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
)


def load_general_chat() -> list[dict]:
    """The general-chat set, in file order.

    Returns:
        list[dict]: records with ``id``, ``category``, ``prompt`` and optionally ``followup`` (str).

    Raises:
        ValueError: a record lacks ``id``/``category``/``prompt`` or has an unknown category (the
            message names the line) — the shipped file is checked by tests/test_general_chat.py.
    """
    text = resources.files(__name__).joinpath(GENERAL_CHAT_FILE).read_text(encoding="utf-8")
    out = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        rec = json.loads(line)
        missing = [k for k in ("id", "category", "prompt") if not rec.get(k)]
        if missing or rec["category"] not in GENERAL_CHAT_CATEGORIES:
            raise ValueError(f"{GENERAL_CHAT_FILE}:{lineno}: missing {missing} or unknown category "
                             f"{rec.get('category')!r} (known: {list(GENERAL_CHAT_CATEGORIES)})")
        out.append(rec)
    return out


def general_chat_messages(rec: dict) -> list[dict]:
    """One record as OpenAI-style messages: the user prompt, then (with a ``followup``) an empty
    assistant placeholder and the second user turn. :func:`eagle3.prompts.record_to_turns` drops
    the placeholder and makes one turn group per user message (the target answers each)."""
    msgs = [{"role": "user", "content": rec["prompt"]}]
    if rec.get("followup"):
        msgs += [{"role": "assistant", "content": ""}, {"role": "user", "content": rec["followup"]}]
    return msgs
