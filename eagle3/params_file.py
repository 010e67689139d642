"""A params YAML file <-> :class:`~eagle3.config.Params`: loading, overrides, dump, fingerprint, diff.

:mod:`eagle3.config` holds the schema (one pydantic section per stage); this module reads and writes
``params/*.yaml`` and ``<run>/params.yaml`` against it. Loading validates: unknown keys are errors with a
did-you-mean, wrong types and out-of-range values name the file, the key and what is allowed
(:class:`ParamsError`). Overrides come from the command line (``--set section.key=value``, values parsed
as YAML) or from papermill parameters. The fingerprint and the diff cover the keys that change what a run
computes, so that a run directory refuses params it was not made with (:mod:`eagle3.rundir`).
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from eagle3.config import Params
from eagle3.errors import ParamsError
from eagle3.io import path_kind

__all__ = [
    "ParamsError",
    "load_params",
    "parse_overrides",
    "apply_overrides",
    "params_fingerprint",
    "dump_params",
    "diff_params",
    "differing_values",
    "changed_stage",
    "STAGE_OWN_SECTIONS",
    "semantic_sections",
]


def _model_at(loc: tuple, model: type[BaseModel] = Params) -> type[BaseModel] | None:
    """The pydantic model that owns the key at ``loc`` (for did-you-mean suggestions)."""
    cur: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(cur, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        args = getattr(ann, "__args__", ()) or ()
        cands = [ann, *args]
        for a in list(cands):
            cands.extend(getattr(a, "__args__", ()) or ())
        nxt = next((c for c in cands if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nxt is None:
            return None
        cur = nxt
    return cur


def _short(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters (a 300-character value named once, not in full)."""
    return text if len(text) <= limit else f"{text[:limit - 20]}... ({len(text)} characters)"


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(x for x in e["loc"])
        key = ".".join(str(x) for x in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            owner = _model_at(loc)
            known = list(getattr(owner, "model_fields", {}) or {})
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            lines.append(f"  {key}: unknown key.{hint} Allowed here: {', '.join(known)}.")
        else:
            got = e.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {_short(repr(got))})"
            lines.append(f"  {key}: {e['msg']}{got_s}.")
    return f"Invalid params in {source}:\n" + "\n".join(lines)


def parse_overrides(items: list[str] | None) -> dict:
    """Parse ``["section.key=value", ...]`` into a nested dict; values are parsed as YAML. A key part
    that is an integer stays a string here (``synthesize.sources.0.limit`` ->
    ``{"synthesize": {"sources": {"0": {"limit": ...}}}}``) and indexes a list in :func:`apply_overrides`.

    Raises ParamsError when an item has no ``=`` or no section.
    """
    out: dict = {}
    for item in items or []:
        if "=" not in item:
            raise ParamsError(f"Override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise ParamsError(f"Override {item!r} has an empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ParamsError(f"Override {item!r}: value is not valid YAML ({exc})") from None
        cur = out
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
            if not isinstance(cur, dict):
                raise ParamsError(f"Override {item!r} conflicts with another override")
        cur[parts[-1]] = value
    return out


def apply_overrides(data: dict, overrides: dict, defaults: dict | None = None, path: tuple = ()) -> dict:
    """Deep-merge ``overrides`` into a copy of ``data`` (dicts merge, everything else replaces).

    A key that is a non-negative integer (``"0"``, as :func:`parse_overrides` leaves it) indexes a
    list: ``{"synthesize": {"sources": {"0": {"self_prompt": {"count": 100}}}}}`` changes the first
    source's count and keeps the rest of the list. A list the file does not state is taken from
    ``defaults`` (the resolved defaults, :func:`load_params`), so that the embedded default's sources
    can be reached too. ``path``: the keys above ``data``, for messages.

    Raises:
        ParamsError: an index past the end of the list, a key into a list that is not an index, an
            index into a value that is not a list (each naming the override's key path).
    """
    merged = json.loads(json.dumps(data)) if data else {}
    for key, value in overrides.items():
        here = (*path, str(key))
        below = defaults.get(key) if isinstance(defaults, dict) else None
        # a key the data lacks stays absent but for what the override sets (the schema's defaults
        # fill the rest), except a list to index: the default's entries
        cur = merged[key] if key in merged else below if isinstance(below, list) else None
        if isinstance(value, dict) and isinstance(cur, list):
            # the defaults describe the default's own entries only: a list the data states has none
            merged[key] = _apply_to_list(cur, value, None if key in merged else below, here)
        elif isinstance(value, dict) and _is_index(next(iter(value), None)) and not isinstance(cur, dict):
            shown = _short(json.dumps(cur if key in merged else below))
            raise ParamsError(f"--set {'.'.join(here)}.{next(iter(value))}: {'.'.join(here)} is {shown}, "
                              f"not a list (an integer key part indexes a list)")
        elif isinstance(value, dict) and (isinstance(cur, dict) or key not in merged):
            merged[key] = apply_overrides(cur or {}, value, below, here)
        else:
            merged[key] = value
    return merged


def _is_index(part) -> bool:
    """Whether an override's key part indexes a list: a non-negative integer (``0``, ``12``)."""
    return isinstance(part, int) or (isinstance(part, str) and part.isdigit())


def _apply_to_list(items: list, overrides: dict, defaults, path: tuple) -> list:
    """``items`` with ``overrides`` (``{index: value}``) applied, each entry merged as
    :func:`apply_overrides` merges a dict (an entry that is no dict is replaced).

    Raises:
        ParamsError: a key that is no index, or an index past the end (the message gives the range).
    """
    out = json.loads(json.dumps(items))
    name = ".".join(path)
    for part, value in overrides.items():
        if not _is_index(part):
            raise ParamsError(f"--set {name}.{part}: {name} is a list of {len(out)}; index its entries with "
                              f"0..{len(out) - 1} (e.g. {name}.0.KEY=VALUE)")
        i = int(part)
        if i >= len(out):
            whole = f"--set '{name}=[...]'"
            raise ParamsError(f"--set {name}.{i}: index out of range: {name} has {len(out)} entr"
                              f"{'y' if len(out) == 1 else 'ies'} (0..{len(out) - 1}); to add one, set the whole "
                              f"list: {whole}" if out else
                              f"--set {name}.{i}: {name} is an empty list; set the whole list: {whole}")
        below = defaults[i] if isinstance(defaults, list) and i < len(defaults) else None
        if isinstance(value, dict) and isinstance(out[i], dict):
            out[i] = apply_overrides(out[i], value, below, (*path, str(i)))
        else:
            out[i] = value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first at line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _read_text(p: Path) -> str:
    """The text of params file ``p``.

    Raises:
        ParamsError: ``p`` does not exist, is a folder or no regular file (``/dev/null``, a pipe), cannot
            be read, or is not UTF-8 text; the message says which.
    """
    which = "Pass one of the files in params/ (e.g. params/smollm2-135m.yaml) or a path to your own YAML file."
    kind, words = path_kind(p)
    if kind == "missing":
        raise ParamsError(f"Params file not found: {p}. {which}")
    if kind == "folder":
        raise ParamsError(f"Params file {p} is a folder, not a YAML file. {which}")
    if kind == "other":
        raise ParamsError(f"Params file {p} is not a regular file (a device, pipe or socket). It is {words}. {which}")
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ParamsError(f"Params file {p} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}): "
                          f"a params file is YAML. {which}") from None
    except OSError as exc:
        raise ParamsError(f"Params file {p} cannot be read: {exc.strerror}.") from None


def load_params(
    path: str | Path | None,
    overrides: list[str] | dict | None = None,
) -> Params:
    """Load and validate a params YAML file, then apply overrides.

    Args:
        path: the YAML file; ``None`` gives the defaults (the embedded CPU target).
        overrides: ``["section.key=value", ...]`` or an already nested dict.

    Returns:
        Params: validated parameters.

    Raises:
        ParamsError: missing file, a folder, device or unreadable file, bytes that are not UTF-8,
            YAML syntax error (with the line), a top level that is not a
            mapping, unknown keys (with a did-you-mean), wrong types or out-of-range values (each
            naming the file and the key).
    """
    source = str(path) if path is not None else "(defaults)"
    data: dict = {}
    if path is not None:
        p = Path(path)
        try:
            # _UniqueKeyLoader is a yaml.SafeLoader (no arbitrary objects), refusing repeated keys
            loaded = yaml.load(_read_text(p), Loader=_UniqueKeyLoader)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ParamsError(f"YAML syntax error in {p}{where}: {problem}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ParamsError(f"{p}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    if overrides:
        ov = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
        # a list the file leaves at its default is indexed in the default (the embedded sources)
        data = apply_overrides(data, ov, _shown_dump(Params()))
        if not isinstance(overrides, dict):
            source += f" with overrides {[_short(o) for o in overrides]}"
    try:
        return Params.model_validate(data)
    except ValidationError as exc:
        raise ParamsError(_format_errors(exc, source)) from None


def dump_params(params: Params) -> str:
    """The resolved params as YAML text (every key explicit, but for the prompt sources' fields of
    another kind left at their defaults: :meth:`eagle3.config.PromptSource.shown`)."""
    return yaml.safe_dump(_shown_dump(params), sort_keys=False)


def _shown_dump(params: Params) -> dict:
    """``params.model_dump(mode="json")`` with each prompt source as :meth:`eagle3.config.PromptSource.shown` (a
    local file's source without ``name: human-eval``, the default of another kind)."""
    d = params.model_dump(mode="json")
    for section in ("synthesize", "evaluate"):
        d[section]["sources"] = [src.shown() for src in getattr(params, section).sources]
    return d


# Sections/keys that do not change what a run computes: a run directory may be resumed with
# different values of these.
_NON_SEMANTIC = {("tracking",), ("run", "output_dir"), ("run", "name"),
                 # the same loss and gradients either way (train.model.SupervisedRows): a compute choice
                 ("train", "supervised_rows")}


def _semantic(d: dict, prefix: tuple = ()) -> dict:
    out = {}
    for k, v in d.items():
        key = (*prefix, k)
        if any(key[: len(ns)] == ns for ns in _NON_SEMANTIC):
            continue
        out[k] = _semantic(v, key) if isinstance(v, dict) else v
    return out


def semantic_sections(params: Params, sections: tuple[str, ...]) -> dict:
    """The params ``sections`` as JSON values, without what does not change results (tracking, the run's
    name and folder, ``train.supervised_rows``: :func:`params_fingerprint`'s rule)."""
    dump = _semantic(params.model_dump(mode="json"))
    return {k: dump[k] for k in sections if k in dump}


def params_fingerprint(params: Params) -> str:
    """sha256 (16 hex chars) of the params that determine a run's results (tracking, names excluded)."""
    blob = json.dumps(_semantic(params.model_dump(mode="json")), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class _Absent:
    """The side of a difference where a list has no such item (shown ``(absent)``)."""

    def __repr__(self) -> str:
        return "(absent)"


ABSENT = _Absent()


def _differences(a: Params, b: Params) -> list[tuple[str, Any, Any]]:
    """``(dotted key, value in a, value in b)`` of every semantic key that differs. Lists of equal
    length are compared item by item (``evaluate.sources.0.fields.instruction``: the one changed
    field, not both whole lists of sources); where one list is the other plus items at its end, each
    added or removed item is named by its index with :data:`ABSENT` on the other side
    (``evaluate.sources.1: (absent) -> {...}``); other lists whole. Prompt sources are compared
    as shown (:meth:`eagle3.config.PromptSource.shown`), so a difference names only the fields of the source's kind
    and those set (the fingerprint, :func:`params_fingerprint`, covers every field)."""
    da, db = _semantic(_shown_dump(a)), _semantic(_shown_dump(b))
    out: list[tuple[str, Any, Any]] = []

    def walk(x: Any, y: Any, prefix: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                walk(x.get(k), y.get(k), f"{prefix}.{k}" if prefix else k)
        elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y) and x != y:
            for i, (xi, yi) in enumerate(zip(x, y)):
                walk(xi, yi, f"{prefix}.{i}")
        elif isinstance(x, list) and isinstance(y, list) and x != y and x[:len(y)] == y[:len(x)]:
            for i in range(min(len(x), len(y)), max(len(x), len(y))):  # items added (or removed) at the end
                out.append((f"{prefix}.{i}", x[i] if i < len(x) else ABSENT, y[i] if i < len(y) else ABSENT))
        elif x != y:
            out.append((prefix, x, y))

    walk(da, db, "")
    return out


def diff_params(a: Params, b: Params) -> list[str]:
    """Dotted keys whose values differ between two params (semantic keys only), with both values."""
    return [f"{k}: {x!r} -> {y!r}" for k, x, y in _differences(a, b)]


def differing_values(params: list[Params]) -> dict[str, list[Any]]:
    """``{dotted key: [value in each params]}`` of every semantic key on which the ``params`` do not all
    agree, keys as :func:`diff_params` names them (``train.lr``, ``synthesize.sources.0.limit``; a list
    item one params lacks: :data:`ABSENT`), in key order. Two params that differ from the first one in
    the same key differ from each other only there, so the keys are those of each one's difference
    with the first."""
    diffs = [{k: (x, y) for k, x, y in _differences(params[0], p)} for p in params[1:]]
    keys = sorted({k for d in diffs for k in d})
    out = {}
    for k in keys:
        first = next(d[k][0] for d in diffs if k in d)
        out[k] = [first, *(d[k][1] if k in d else first for d in diffs)]
    return out


# Params sections that one stage reads and no other: no other stage's module, notebook or input
# record reads them (tests/test_config.py greps the package and the notebooks for it). A change
# confined to such a section changes that stage's results only, so a run directory accepts it when
# that stage is redone (eagle3.rundir.prepare_run_dir; `eagle3 run PARAMS --stages 5 --redo 5`).
# Other sections feed several stages (stage 5 reads train.* norm flags and synthesize.sources, stage
# 3 reads vocab.max_seq_len, ...): a change there needs a new run.
STAGE_OWN_SECTIONS: dict[str, int] = {"evaluate": 5}


def changed_stage(a: Params, b: Params) -> int | None:
    """The one stage whose own params (:data:`STAGE_OWN_SECTIONS`) hold every difference between
    ``a`` and ``b``; None when they are equal or a difference is in params several stages read."""
    stages = {STAGE_OWN_SECTIONS.get(k.split(".", 1)[0]) for k, _, _ in _differences(a, b)}
    return stages.pop() if len(stages) == 1 and None not in stages else None
