"""What a prompt source loads into: :class:`Prompt` (one conversation to regenerate), the
:class:`LoadReport` of counts and bad records, and the hashes that make ids and the held-out split
stable across runs."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field

from eagle3.errors import PromptsError as PromptError

__all__ = ["PromptError", "BadRecord", "BAD_INPUT_KINDS", "bad_input_detail", "Prompt", "LoadReport", "prompt_hash",
           "split_for", "sample_id"]

BAD_INPUT_KINDS = (
    "malformed_json",
    "invalid_utf8",
    "not_an_object",
    "invalid_unicode",
    "unknown_format",
    "missing_field",
    "unknown_role",
    "empty_prompt",
    "no_user_turn",
    "assistant_only",
)
_MAX_EXAMPLES = 20


class BadRecord(Exception):
    """One record that cannot become a prompt; ``kind`` is one of :data:`BAD_INPUT_KINDS`. Counted
    in the :class:`LoadReport` (:meth:`LoadReport.reject`), never raised to the caller of a loader."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def bad_input_detail(bad: dict[str, int], examples: list[dict]) -> str:
    """The bad records' kinds (in :data:`BAD_INPUT_KINDS` order, zeros left out) and the first one's
    place and message, e.g. ``"malformed_json 2, unknown_format 1; first p.jsonl:5:3 malformed JSON: ..."``:
    the one wording of :meth:`LoadReport.summary`, stage 1's summary line (console and report index)
    and stage 5's evaluation sources. ``examples``: ``{"where", "message", ...}`` dicts, first first."""
    kinds = ", ".join(f"{k} {int(bad[k])}" for k in BAD_INPUT_KINDS if bad.get(k))
    return kinds + (f"; first {examples[0]['where']} {examples[0]['message']}" if examples else "")


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
        """Count one bad record of ``kind`` (:data:`BAD_INPUT_KINDS`); the first few are kept as examples."""
        self.bad[kind] += 1
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append({"kind": kind, "where": where, "message": message})

    def reject(self, on_bad_line: str, kind: str, where: str, message: str) -> None:
        """A bad record: counted (``on_bad_line="skip"``), or raised (``"fail"``).

        Raises:
            PromptError: ``on_bad_line`` is ``"fail"`` (the message names the place and the setting).
        """
        if on_bad_line == "fail":
            raise PromptError(f"{where}: {message} (synthesize.on_bad_line is 'fail'; set it to 'skip' to skip such lines)")
        self.add_bad(kind, where, message)

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
