"""Loading prompt sources into :class:`~eagle3.prompts.prompt.Prompt` lists: per source, records
converted, bad ones counted, exact duplicates removed, shuffled and cut to the limits; then all
sources together (stage 1's :func:`load_prompts`; stage 5 loads its user sets with :func:`load_source`)."""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.config import PromptSource, SynthesizeParams
from eagle3.prompts.files import HUMAN_EVAL_TEMPLATE, iter_records
from eagle3.prompts.prompt import BadRecord, LoadReport, Prompt, PromptError, prompt_hash, sample_id, split_for
from eagle3.prompts.schemas import OPTIONAL_FIELDS, detect_format, get_path, record_to_turns

__all__ = ["load_source", "load_prompts"]


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


@dataclass
class _SourceReader:
    """Reads one source's prompts in record order: bad records counted in ``report``, duplicates of
    ``seen`` and of each other dropped (when ``dedup``). With ``format: auto`` each record's format is
    detected on its own (an undetectable record is an ``unknown_format`` bad record)."""

    src: PromptSource
    label: str
    report: LoadReport
    on_bad_line: str
    seen: set[str]
    dedup: bool
    heldout_fraction: float
    field: str
    records: int = 0
    dups: int = 0
    formats: Counter = field(default_factory=Counter)
    local: set[str] = field(default_factory=set)
    out: list[Prompt] = field(default_factory=list)
    unresolved: dict[str, str] = field(default_factory=dict)
    first_keys: list[str] = field(default_factory=list)

    def turns(self, rec: dict, where: str) -> list[list[dict]] | None:
        """The record's turn groups, or None after counting it as bad."""
        fmt = self.src.format
        if fmt == "auto":
            try:
                fmt = detect_format(rec, self.src)
            except PromptError as exc:
                self.report.reject(self.on_bad_line, "unknown_format", where, str(exc))
                return None
        self.formats[fmt] += 1
        try:
            return record_to_turns(rec, fmt, self.src)
        except BadRecord as exc:
            self.report.reject(self.on_bad_line, exc.kind, where, str(exc))
            return None

    def add(self, rec: dict, where: str, turns: list[list[dict]]) -> None:
        ph = prompt_hash(turns)
        if self.dedup:
            if ph in self.seen or ph in self.local:
                self.dups += 1
                return
            self.local.add(ph)
        cat = rec.get("category") if isinstance(rec, dict) else None
        self.out.append(Prompt(id=sample_id(self.label, ph), source=self.label, prompt_hash=ph,
                               split=split_for(ph, self.heldout_fraction), turns=turns, origin=where,
                               category=cat if isinstance(cat, str) and cat else None))

    def read(self) -> _SourceReader:
        # a mapped optional field (input, system) missing from a record is read as empty: one that no
        # record has is a wrong path (instances[0].input for instances.0.input) that would silently drop
        # text from every prompt
        self.unresolved = {k: self.src.fields[k] for k in OPTIONAL_FIELDS if k in self.src.fields}
        for rec, where in iter_records(self.src, self.report, self.on_bad_line, self.field):
            self.records += 1
            if self.records == 1 and isinstance(rec, dict):
                self.first_keys = sorted(rec)[:12]
            for k, path in list(self.unresolved.items()):
                try:
                    get_path(rec, path)
                    del self.unresolved[k]
                except KeyError:
                    pass
            turns = self.turns(rec, where)
            if turns is not None:
                self.add(rec, where, turns)
        self.check_paths()
        return self

    def check_paths(self) -> None:
        """Raise when a mapped optional field is in none of the records (a wrong path)."""
        if not (self.records and self.unresolved):
            return
        k, path = next(iter(self.unresolved.items()))
        dotted = re.sub(r"\[(-?\d+)\]", r".\1", path)
        hint = f" (did you mean {dotted!r}? list items are dotted too)" if dotted != path else ""
        raise PromptError(
            f"{self.field}[{self.label}]: fields.{k} = {path!r} is in none of its {self.records} records{hint}; "
            f"the first record's keys: {self.first_keys}. A path names keys and list indices with dots, e.g. "
            f"instances.0.input"
        )


def _unusable(report: LoadReport, n_examples: int, records: int, bad: dict, fmt: str, where: str) -> PromptError:
    """The error of a source without a usable prompt: counts by kind and its first bad record."""
    first = report.examples[n_examples] if len(report.examples) > n_examples else None
    first_s = f"; first: {first['where']}: {first['message']}" if first else ""
    return PromptError(f"{where}: no usable prompt in {records} records (bad input: {bad or 'none'}; "
                       f"format {fmt}{first_s}). Check format, fields and prompt_field.")


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
    r = _SourceReader(src, label, report, on_bad_line, seen, dedup, heldout_fraction, field).read()
    out, dups, formats = r.out, r.dups, r.formats
    # one name when the source has one layout, else e.g. "openai+prompt" (counts in "formats")
    fmt = "+".join(sorted(formats)) or None
    bad = {k: v - before.get(k, 0) for k, v in report.bad.items() if v - before.get(k, 0)}
    # Bad lines are counted where they are read (before the format is known), so add the
    # malformed/invalid ones (they have no record) to the records count.
    records = r.records + sum(bad.get(k, 0) for k in ("malformed_json", "invalid_utf8", "not_an_object"))
    report.records += records
    report.duplicates += dups
    if not out and not dups:
        raise _unusable(report, n_examples, records, bad, fmt or source.format, f"{field}[{label}]")
    if shuffle:
        random.Random(seed).shuffle(out)
    usable = len(out)
    if source.limit is not None:
        out = out[: source.limit]
    seen.update(p.prompt_hash for p in out)  # later sources dedup against what was selected here
    report.sources.append({"label": label, "kind": source.kind, "format": fmt, "formats": dict(sorted(formats.items())),
                           "records": records, "usable": usable, "duplicates": dups, "selected": len(out), "bad": bad})
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
