"""Record schemas: one record of a prompt source (ShareGPT, OpenAI messages, Alpaca or a plain
prompt field) to the system/user turn groups stage 1 answers (see :mod:`eagle3.prompts` for the
formats and the ``fields`` mapping)."""

from __future__ import annotations

from typing import Any

from eagle3.config import PromptSource
from eagle3.prompts.prompt import BadRecord, PromptError

__all__ = ["ROLE_MAP", "PROMPT_FIELDS", "OPTIONAL_FIELDS", "get_path", "detect_format", "record_to_turns"]

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
    "developer": "system",
}
PROMPT_FIELDS = ("prompt", "question", "instruction", "query", "text", "input")
# fields a mapping may name that a record can lack (read as empty): record_to_turns reads them with required=False
OPTIONAL_FIELDS = ("input", "system")


def get_path(rec: Any, path: str) -> Any:
    """``record["a"]["b"][0]`` for path ``a.b.0`` (negative list indices too).

    Raises:
        KeyError: naming the missing part.
    """
    cur = rec
    for part in path.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.lstrip("-").isdigit() and -len(cur) <= int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise KeyError(part)
    return cur


def _field(rec: dict, path: str, required: bool = True) -> Any:
    try:
        return get_path(rec, path)
    except KeyError:
        if required:
            raise BadRecord("missing_field", f"field {path!r} missing (record keys: {sorted(rec)[:12]})") from None
        return None


def _text(value: Any, what: str) -> str:
    """A field's text: a string, None (empty) or OpenAI content parts joined.

    Raises:
        BadRecord: ``missing_field`` for another type (also a part's ``text``), ``invalid_unicode``
            for text that is not valid Unicode (a lone UTF-16 surrogate from a JSON escape such as
            ``"\\ud800"``: json.loads accepts it, no tokenizer or UTF-8 file can hold it).
    """
    if value is None:
        return ""
    if isinstance(value, list):  # OpenAI content parts
        parts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type", "text") == "text"]
        bad = next((p for p in parts if p is not None and not isinstance(p, str)), None)
        if bad is not None:
            raise BadRecord("missing_field", f"{what}: a content part's text is {type(bad).__name__}, not text")
        value = "".join(p or "" for p in parts)
    if not isinstance(value, str):
        raise BadRecord("missing_field", f"{what}: expected text, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRecord("invalid_unicode", f"{what}: character {exc.start} is a lone surrogate "
                                        f"{value[exc.start]!r}, not valid Unicode") from None
    return value


def detect_format(rec: dict, source: PromptSource) -> str:
    """The format of one record for ``format: auto`` (see :mod:`eagle3.prompts`); called per record.

    Raises:
        PromptError: no known layout (the message lists the record's keys and the options).
    """
    f = source.fields
    msgs_key = f.get("messages")
    for key in ([msgs_key] if msgs_key else ["conversations", "messages"]):
        try:
            msgs = get_path(rec, key)
        except KeyError:
            continue
        if isinstance(msgs, list):
            first = next((m for m in msgs if isinstance(m, dict)), {})
            if "from" in first or "value" in first:
                return "sharegpt"
            return "openai"
    if source.prompt_field or "prompt" in f:
        return "prompt"
    if "instruction" in f or rec.get("instruction") is not None:
        return "alpaca"
    if any(rec.get(k) is not None for k in PROMPT_FIELDS):
        return "prompt"
    raise PromptError(
        f"cannot detect the prompt format of a record with keys {sorted(rec)[:20]}; set format "
        f"(sharegpt, openai, alpaca, prompt) and fields / prompt_field in the source"
    )


def _chat_messages(rec: dict, fmt: str, f: dict[str, str]) -> list[dict]:
    """The messages of a ShareGPT / OpenAI record, roles mapped to system/user/assistant."""
    d_msgs, d_role, d_content = ("conversations", "from", "value") if fmt == "sharegpt" else ("messages", "role", "content")
    mkey, rkey, ckey = f.get("messages", d_msgs), f.get("role", d_role), f.get("content", d_content)
    raw = _field(rec, mkey)
    if not isinstance(raw, list):
        raise BadRecord("missing_field", f"field {mkey!r} is not a list of messages")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or rkey not in m:
            raise BadRecord("missing_field", f"{mkey}[{i}] has no {rkey!r} field")
        role = ROLE_MAP.get(str(m[rkey]).strip().lower())
        if role is None:
            raise BadRecord("unknown_role", f"{mkey}[{i}].{rkey} = {m[rkey]!r} is not a system/user/assistant role")
        messages.append({"role": role, "content": _text(m.get(ckey), f"{mkey}[{i}].{ckey}")})
    return messages


def _single_turn(rec: dict, fmt: str, source: PromptSource) -> list[dict]:
    """The system? and user message of an Alpaca or plain-prompt record."""
    f = source.fields
    if fmt == "alpaca":
        instr = _text(_field(rec, f.get("instruction", "instruction")), "instruction")
        inp = _text(_field(rec, f.get("input", "input"), required=False), "input")
        user = instr.strip() + ("\n\n" + inp.strip() if inp.strip() else "") if instr.strip() else ""
    else:
        key = source.prompt_field or f.get("prompt")
        if key is None:
            key = next((k for k in PROMPT_FIELDS if rec.get(k) is not None), PROMPT_FIELDS[0])
        user = _text(_field(rec, key), key)
    system = _text(_field(rec, f["system"], required=False), "system") if "system" in f else ""
    return ([{"role": "system", "content": system}] if system.strip() else []) + [{"role": "user", "content": user}]


def _checked(messages: list[dict], source: PromptSource) -> list[dict]:
    """The messages after the checks, with the source's system prompt and prompt template applied."""
    roles = [m["role"] for m in messages]
    if "user" not in roles:
        if roles and all(r == "assistant" for r in roles):
            raise BadRecord("assistant_only", "the conversation has only assistant turns")
        raise BadRecord("no_user_turn", f"the conversation has no user turn (roles: {roles})")
    for m in messages:
        if m["role"] == "user" and not m["content"].strip():
            raise BadRecord("empty_prompt", "a user turn is empty")
    if source.system_prompt and "system" not in roles:
        messages.insert(0, {"role": "system", "content": source.system_prompt})
    if source.prompt_template:
        first = next(m for m in messages if m["role"] == "user")
        first["content"] = source.prompt_template.replace("{prompt}", first["content"])
    return messages


def _groups(messages: list[dict]) -> list[list[dict]]:
    """Group: an assistant turn (dropped) or the end closes a group that holds a user message."""
    groups: list[list[dict]] = []
    cur: list[dict] = []
    for m in messages:
        if m["role"] == "assistant":
            if any(x["role"] == "user" for x in cur):
                groups.append(cur)
                cur = []
            # an assistant turn before any user turn (a greeting) is dropped with nothing to answer
            continue
        cur.append(m)
    if any(x["role"] == "user" for x in cur):
        groups.append(cur)  # trailing system messages after the last user turn are dropped
    return groups


def record_to_turns(rec: dict, fmt: str, source: PromptSource) -> list[list[dict]]:
    """Map one record to turn groups (system/user messages before each assistant turn).

    The source's assistant turns are dropped; each one (and a trailing user turn) marks where the
    target writes a turn. ``source.system_prompt`` is prepended when the record has no system turn;
    ``source.prompt_template`` wraps the first user message.

    Raises:
        BadRecord: with kind ``missing_field``, ``invalid_unicode``, ``unknown_role``, ``empty_prompt``,
            ``no_user_turn`` or ``assistant_only``.
    """
    if fmt in ("sharegpt", "openai"):
        messages = _chat_messages(rec, fmt, source.fields)
    elif fmt in ("alpaca", "prompt"):
        messages = _single_turn(rec, fmt, source)
    else:  # pragma: no cover
        raise PromptError(f"unknown format {fmt!r}")
    return _groups(_checked(messages, source))
