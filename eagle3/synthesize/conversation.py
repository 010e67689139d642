"""Conversations of stage 1 and the batched driver of the in-process backends.

Multi-turn: the source's assistant turns are dropped; each assistant turn is regenerated in order,
each request holding the regenerated earlier turns (their answer text; reasoning is not sent back).
Prompts longer than the context (``target.max_model_len``) are skipped and counted; a later turn that
no longer fits ends its conversation early (``dropped_turns``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from eagle3.chat import ChatRenderer
from eagle3.contracts.samples import SampleStore
from eagle3.errors import SynthesisError
from eagle3.io import naming_file
from eagle3.prompts import Prompt
from eagle3.stage import Progress
from eagle3.synthesize.turns import TurnRequest, TurnResult

__all__ = ["Conversation", "prepare", "Session", "run_batched"]


@dataclass
class Conversation:
    """One prompt being answered turn by turn; :meth:`sample` is its ``samples.jsonl`` record."""

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
        if p.category:  # stage 5 reports per category and warns when training has only one
            s["category"] = p.category
        return s


def prepare(conv: Conversation, renderer: ChatRenderer | None, context_len: int, max_new: int) -> TurnRequest | None:
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
class Session:
    """What one run of the stage has written, skipped and failed (feeds ``stats.json``)."""

    store: SampleStore
    progress: Progress
    settings: dict
    timeline: Any
    skipped: list[dict] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)
    interrupted: list[str] = field(default_factory=list)
    written: int = 0
    tokens: int = 0

    def finish(self, conv: Conversation) -> None:
        if conv.skipped is not None:
            self.skipped.append({"id": conv.prompt.id, "origin": conv.prompt.origin, "reason": conv.skipped})
            self.progress.update(1)
            return
        s = conv.sample(self.settings)
        with naming_file(self.store.path):  # a full disk: the error names the file
            self.store.append(s)
        with naming_file(self.timeline.name):
            self.timeline.write(json.dumps({"t": round(time.time(), 3), "id": s["id"],
                                            "completion_tokens": s["completion_tokens"]}) + "\n")
            self.timeline.flush()
        self.written += 1
        self.tokens += s["completion_tokens"]
        self.progress.update(1, tokens=s["completion_tokens"], written=self.written, skipped=len(self.skipped))


def run_batched(backend, prompts: list[Prompt], sess: Session, batch_size: int, max_new: int) -> None:
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
        convs = [Conversation(p) for p in order[i:i + batch_size]]
        while True:
            reqs, owners = [], []
            for c in convs:
                if c.finished:
                    continue
                r = prepare(c, renderer, backend.context_len, max_new)
                if r is not None:
                    reqs.append(r)
                    owners.append(c)
            if not reqs:
                break
            for c, res, req in zip(owners, backend.generate(reqs), reqs):
                c.add(res, req)
        for c in convs:
            sess.finish(c)

