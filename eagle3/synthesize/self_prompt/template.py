"""The prompt that asks the target for a user turn: its chat template cut at a new user message.

The chat template is rendered up to and including the user-turn header (derived from the target's
own template: a conversation whose last user message is a sentinel is rendered and cut before the
sentinel), and the target continues it with a user message until the template's end-of-turn token.

Every stage 1 backend continues a :class:`UserTurnRequest` into a :class:`UserTurn`
(``sample_user_turns`` of :mod:`eagle3.synthesize.local` and :mod:`eagle3.synthesize.server`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from eagle3.chat import eos_ids
from eagle3.config import SelfPromptParams
from eagle3.errors import SelfPromptError

__all__ = ["SENTINEL", "UserTurnFormat", "user_turn_format", "UserTurnRequest", "UserTurn", "user_turn_finish",
           "SelfPrompt", "request_seed", "plan_requests", "followup_request"]

# A user message no template rewrites (no leading/trailing whitespace, no markup); it must appear
# exactly once in the render, which is checked.
SENTINEL = "SELFPROMPTSENTINEL7f3a"


@dataclass(frozen=True)
class UserTurnFormat:
    """What the chat template puts around one user message.

    Attributes:
        prefix_text: the render of the conversation up to and including the user-turn header
            (e.g. SmolLM2: ``"<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n"``).
        end_text: what the template writes right after the user message (``"<|im_end|>\\n"``).
        eot_ids: token ids that end a user turn: the first token of ``end_text`` when it is a
            special token, else the tokenizer's EOS ids (a template without a special end marker).
    """

    prefix_text: str
    end_text: str
    eot_ids: tuple[int, ...]


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, t in added.items() if getattr(t, "special", False))
    return ids


def user_turn_format(tokenizer, system: str | None = None, history: Sequence[dict] = (),
                     template_kwargs: dict | None = None) -> UserTurnFormat:
    """Cut the target's chat template at the start of a new user message.

    Renders ``[system?] + history + [{"role": "user", "content": SENTINEL}]`` with
    ``add_generation_prompt=False`` and splits at the sentinel.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        system: a system prompt (None: the template's own default, if it has one).
        history: earlier ``{"role", "content"}`` messages (for a follow-up user turn).
        template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``).

    Returns:
        UserTurnFormat

    Raises:
        SelfPromptError: the sentinel is missing from the render or appears more than once
            (a template that rewrites or drops user content cannot be self-prompted this way).
    """
    msgs = ([{"role": "system", "content": system}] if system else []) + [dict(m) for m in history]
    msgs.append({"role": "user", "content": SENTINEL})
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, **(template_kwargs or {}))
    if text.count(SENTINEL) != 1:
        raise SelfPromptError(
            f"the chat template rendered the sentinel user message {text.count(SENTINEL)} times "
            f"(expected once); cannot derive the user-turn header from it"
        )
    prefix, end = text.split(SENTINEL)
    end_ids = tokenizer(end, add_special_tokens=False)["input_ids"] if end else []
    if end_ids and end_ids[0] in _special_ids(tokenizer):
        eot = (int(end_ids[0]),)
    else:
        eot = tuple(sorted(set(eos_ids(tokenizer))))
    if not eot:
        raise SelfPromptError("the chat template ends a user turn without a special token and the tokenizer has no EOS")
    return UserTurnFormat(prefix, end, eot)


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
        stop_ids: end-of-turn ids (:attr:`UserTurnFormat.eot_ids`).
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


@dataclass
class SelfPrompt:
    """One kept self-written conversation start.

    Attributes:
        index: the request number it came from.
        system, topic: as in :class:`UserTurnRequest`.
        user: the self-written first user message.
        followup: the self-written second user message (multi-turn), or None.
        answer: the target's first answer used to write ``followup`` (not a training target:
            stage 1 regenerates the assistant turns).
    """

    index: int
    system: str | None
    topic: str | None
    user: str
    followup: str | None = None
    answer: str | None = None

    def turns(self) -> list[list[dict]]:
        """Turn groups as :class:`eagle3.prompts.Prompt` holds them (one group per assistant turn)."""
        first = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": self.user}]
        return [first] + ([[{"role": "user", "content": self.followup}]] if self.followup else [])


def request_seed(seed: int, kind: str, index: int) -> int:
    """The sampling seed of request ``index`` of ``kind`` (``"first"``/``"followup"``): the first 4
    bytes of sha256(seed, kind, index), little-endian, mod 2**31."""
    h = hashlib.sha256(f"{seed}\0{kind}\0{index}".encode()).digest()
    return int.from_bytes(h[:4], "little") % (2**31)


def plan_requests(tokenizer, settings: SelfPromptParams, indices: Iterable[int],
                  template_kwargs: dict | None = None) -> list[UserTurnRequest]:
    """First-turn requests for the given request numbers (a pure function of settings and index).

    Request ``i`` takes ``system_prompts[i % len]`` and ``seed_topics[(i // len(system_prompts)) % len]``
    (so every pair occurs when both lists are given), the topic appended to the system prompt with
    ``topic_template`` (or used alone when there is no system prompt).

    Raises:
        SelfPromptError: see :func:`user_turn_format`.
    """
    systems = list(settings.system_prompts) or [None]
    topics = list(settings.seed_topics) or [None]
    fmts: dict = {}
    out = []
    for i in indices:
        system = systems[i % len(systems)]
        topic = topics[(i // len(systems)) % len(topics)]
        if topic is not None:
            steer = settings.topic_template.replace("{topic}", topic)
            system = f"{system} {steer}" if system else steer
        if system not in fmts:
            fmt = user_turn_format(tokenizer, system, (), template_kwargs)
            fmts[system] = (fmt, tokenizer(fmt.prefix_text, add_special_tokens=False)["input_ids"])
        fmt, ids = fmts[system]
        out.append(UserTurnRequest(i, "first", system, topic, [], fmt.prefix_text, list(ids), fmt.eot_ids,
                                   fmt.end_text, request_seed(settings.seed, "first", i)))
    return out


def followup_request(tokenizer, settings: SelfPromptParams, prompt: SelfPrompt, answer: str,
                     template_kwargs: dict | None = None) -> UserTurnRequest:
    """The request for the follow-up user turn after the target's ``answer`` to ``prompt.user``."""
    history = [{"role": "user", "content": prompt.user}, {"role": "assistant", "content": answer}]
    fmt = user_turn_format(tokenizer, prompt.system, history, template_kwargs)
    ids = tokenizer(fmt.prefix_text, add_special_tokens=False)["input_ids"]
    return UserTurnRequest(prompt.index, "followup", prompt.system, prompt.topic, history, fmt.prefix_text,
                           list(ids), fmt.eot_ids, fmt.end_text, request_seed(settings.seed, "followup", prompt.index))
