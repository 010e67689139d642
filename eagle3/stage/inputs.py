"""What a stage consumed (``inputs.json``) and whether its outputs are stale.

When a stage starts, :class:`eagle3.stage.StageRun` takes the sha256 of every earlier stage's file it
consumes (:func:`consumed_files`) and writes them to ``inputs.json`` (``complete: false``: the partial
outputs of an interrupted run were made from them); :meth:`eagle3.stage.StageRun.finish` marks the
record complete before it writes ``stats.json``. :func:`stale_inputs` compares a finished stage's
record with the files now: ``eagle3 run`` refuses to skip a finished stage whose inputs changed (or
redoes it with ``--redo``), and a stage called directly on such a folder refuses too (:func:`check_fresh`).
"""

from __future__ import annotations

from pathlib import Path

from eagle3.io import atomic_write_json, file_sha256, read_json
from eagle3.params_file import semantic_sections
from eagle3.rundir import EVALUATE, EXTRACT, INPUTS_FILE, STAGES, SYNTHESIZE, TRAIN, VOCAB, RunDir

__all__ = ["QUICK_HASH_BYTES", "PARAMS_READ", "params_read", "consumed_files", "input_digests",
           "stale_inputs", "stale_message", "check_fresh",
           "record_shared", "shared_from"]


def consumed_files(run_dir: str | Path, stage: int, params=None) -> list[Path]:
    """The earlier stages' files that stage ``stage`` reads (docs/DESIGN.md "Stage contracts").

    1: the local prompt files (``kind: file`` sources of ``synthesize.sources``; embedded sets and
    Hugging Face datasets are versioned by the package / the hub). 2: ``samples.jsonl``.
    3: ``train.parquet``. 4: both tokenized splits, the vocab mapping (``vocab_mapping.safetensors``,
    ``mapping.json``) and, offline, Stage 3's ``meta.json`` and ``manifest.jsonl`` (whose sha256 lines
    stand for the hidden-state files). 5: ``samples.jsonl``, both tokenized splits (training prompts
    are excluded by their ids; the diagnosis reads held-out rows), the vocab mapping, Stage 3's
    ``meta.json``, the drafter (``config.json``, ``model.safetensors``; ``evaluate.drafter_dir`` when
    set) and the local files of ``evaluate.sources``.
    A file that does not exist is recorded as absent (a full-size vocab has no mapping file).
    """
    rd = RunDir(run_dir)

    def local_files(section) -> list[Path]:
        from eagle3.prompts import source_file

        return [f for src in getattr(section, "sources", None) or [] if (f := source_file(src)) is not None]

    if stage == SYNTHESIZE:
        return local_files(getattr(params, "synthesize", None))
    if stage == VOCAB:
        return [rd.samples]
    if stage == EXTRACT:
        return [rd.tokenized("train")]
    mapping = [rd.vocab_mapping, rd.mapping_json]
    if stage == TRAIN:
        online = bool(getattr(getattr(params, "train", None), "online", False))
        return [rd.tokenized("train"), rd.tokenized("heldout"), *mapping,
                *([] if online else [rd.extract_meta, rd.manifest])]
    if stage == EVALUATE:
        drafter = rd.evaluated_drafter(params)
        return [rd.samples, rd.tokenized("train"), rd.tokenized("heldout"), *mapping, rd.extract_meta,
                drafter / "config.json", drafter / "model.safetensors", *local_files(getattr(params, "evaluate", None))]
    raise ValueError(f"no stage {stage}")


# The params sections each stage reads (beyond the earlier stages' files, which consumed_files covers):
# recorded in inputs.json, so that a run's params.yaml edited after a stage ran makes that stage stale.
PARAMS_READ: dict[int, tuple[str, ...]] = {SYNTHESIZE: ("run", "target", "synthesize"), VOCAB: ("run", "target", "vocab"),
                                         EXTRACT: ("run", "target", "extract"), TRAIN: ("run", "target", "train"),
                                         EVALUATE: ("run", "target", "evaluate")}


def params_read(stage: int, params) -> dict | None:
    """The params stage ``stage`` reads (:data:`PARAMS_READ`, as JSON values without names and tracking),
    None without params (a stage called on a bare folder by a test)."""
    return semantic_sections(params, PARAMS_READ[stage]) if params is not None and hasattr(params, "model_dump") else None


def _leaves(d, prefix: str = "") -> dict[str, object]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, object] = {}
    for k, v in d.items():
        out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _params_changes(then: dict | None, params, stage: int) -> list[str]:
    """One line per params key the stage reads whose value differs from its record.

    A key the record lacks is a change only when its value now differs from its default: a param added
    to the package after the stage ran takes the default that keeps the earlier behaviour (a finished
    run does not go stale on an upgrade). A key recorded but no longer a param is not read: no change."""
    now = params_read(stage, params)
    if then is None or now is None:
        return []
    a, b = _leaves(then), _leaves(now)
    added = set(b) - set(a)
    defaults = _leaves(params_read(stage, type(params).model_validate({}))) if added else {}
    return [f"params.yaml: {k} {a.get(k, '(absent)')!r} when stage {stage} ran, {b[k]!r} now"
            for k in sorted(b) if (a[k] != b[k] if k in a else k not in defaults or defaults[k] != b[k])]


# eagle3 status hashes an input of at most this size (sha256 ~450 MiB/s per core on the CI machine)
QUICK_HASH_BYTES = 32 * 2**20


def _key(run_dir: Path, f: Path) -> str:
    try:
        return f.relative_to(run_dir).as_posix()
    except ValueError:
        return str(f)  # outside the run (evaluate.drafter_dir): the absolute path


def input_digests(run_dir: str | Path, stage: int, params=None) -> dict[str, dict | None]:
    """``{path relative to the run: {"sha256", "bytes"} or None when absent}`` of :func:`consumed_files`.

    Cost: one sha256 pass over each file (~450 MiB/s on one core of the CI machine); the hidden-state
    files are covered through the manifest's digests, not hashed here."""
    run_dir = Path(run_dir)
    out: dict[str, dict | None] = {}
    for f in consumed_files(run_dir, stage, params):
        out[_key(run_dir, f)] = {"sha256": file_sha256(f), "bytes": f.stat().st_size} if f.is_file() else None
    return out


def stale_inputs(run_dir: str | Path, stage: int, params=None, quick: bool = False) -> list[str]:
    """Why a stage's outputs (finished or partial) no longer match its inputs: one line per params key
    it reads whose value changed (:data:`PARAMS_READ`: the run's ``params.yaml`` edited by hand after the
    stage ran) and per changed, new or removed input file (empty: unchanged, or no ``inputs.json``: a
    stage that never started, or one that ran before stages recorded their inputs, which is not checked;
    a record without ``params`` is checked for its files only).

    ``quick`` (``eagle3 status``) compares the sizes and hashes only files of at most
    :data:`QUICK_HASH_BYTES` (prompt files, splits, mappings, the drafter: well under a second in
    all); a change that keeps the size of a larger file is then missed, which the full check (the
    runner, ``eagle3 verify``) catches."""
    rec = read_json(RunDir(run_dir).inputs(stage), None)
    if not rec or "files" not in rec:
        return []
    return _params_changes(rec.get("params"), params, stage) + _file_changes(run_dir, stage, rec["files"], params, quick)


def _file_changes(run_dir: str | Path, stage: int, then: dict, params, quick: bool) -> list[str]:
    """:func:`stale_inputs` for the consumed files: one line per changed, new or removed file."""
    if quick:
        run_dir = Path(run_dir)
        now = {_key(run_dir, f): ({"sha256": None, "bytes": f.stat().st_size} if f.is_file() else None)
               for f in consumed_files(run_dir, stage, params)}
        same = {k for k in set(then) | set(now)
                if (then.get(k) is None) == (now.get(k) is None) and (then.get(k) or {}).get("bytes") == (now.get(k) or {}).get("bytes")}
        for k in same:
            a = then.get(k)
            f = run_dir / k  # an absolute key (a file outside the run) stays itself
            now[k] = a if a is None or a["bytes"] > QUICK_HASH_BYTES else {"sha256": file_sha256(f), "bytes": a["bytes"]}
    else:
        now = input_digests(run_dir, stage, params)
    out = []
    # A file the record does not name at all was not an input when the stage ran (an older version
    # of consumed_files): nothing to compare it with, as for a folder without inputs.json. Absent
    # files are recorded as null, so a file that appeared since is still caught.
    for k in sorted(then):
        a, b = then.get(k), now.get(k)
        if (a or {}).get("sha256") == (b or {}).get("sha256"):
            continue
        if a is None:
            out.append(f"{k}: absent when stage {stage} ran, present now")
        elif b is None:
            out.append(f"{k}: removed since stage {stage} ran")
        elif b["sha256"] is None:  # quick: sizes only
            out.append(f"{k}: {a['bytes']} bytes when stage {stage} ran, {b['bytes']} now")
        else:
            out.append(f"{k}: sha256 {a['sha256'][:16]} ({a['bytes']} bytes) when stage {stage} ran, "
                       f"{b['sha256'][:16]} ({b['bytes']} bytes) now")
    return out


def stale_message(stage: int, reasons: list[str], params_file: str | Path | None = None) -> str:
    """The refusal of a finished stage whose inputs changed, with the command that redoes it."""
    pf = str(params_file) if params_file else "PARAMS"
    return (f"stage {stage} ({STAGES[stage]}) is complete, but its inputs changed since it ran:\n  "
            + "\n  ".join(reasons)
            + f"\nIts outputs were made from the old inputs; nothing was changed. Redo it with "
            f"`eagle3 run {pf} --stages {stage}-5 --redo {stage}` (the stage starts over; a later stage "
            f"whose inputs change with it is redone too).")


def check_fresh(run_dir: str | Path, stage: int, params, error: type[Exception]) -> None:
    """Raise ``error`` (:func:`stale_message`) when finished stage ``stage``'s inputs changed.

    Called by a stage before it returns its finished results without running (extract, train), so
    that a notebook opened on a stale run refuses as the runner does."""
    reasons = stale_inputs(run_dir, stage, params)
    if reasons:
        raise error(stale_message(stage, reasons))



def record_shared(run_dir: str | Path, stage: int, source: str | Path) -> None:
    """Put on record that stage ``stage`` of ``run_dir`` is the finished stage folder ``source`` of
    another run, shared by hard links (``eagle3 sweep``): ``inputs.json`` is ``source``'s record (the
    same inputs, the same stale check) plus ``"shared_from"``, ``source``'s absolute path."""
    rec = read_json(Path(source) / INPUTS_FILE, None) or {"stage": stage, "complete": True, "files": {}}
    atomic_write_json(RunDir(run_dir).inputs(stage), {**rec, "shared_from": str(Path(source).resolve())})


def shared_from(run_dir: str | Path, stage: int) -> Path | None:
    """The stage folder of another run that stage ``stage`` of ``run_dir`` shares (:func:`record_shared`),
    or None for a stage of its own (or one not started)."""
    rec = read_json(RunDir(run_dir).inputs(stage), None)
    return Path(rec["shared_from"]) if isinstance(rec, dict) and rec.get("shared_from") else None
