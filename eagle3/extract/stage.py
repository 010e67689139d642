"""Stage 3 orchestration: preflight, resume, the extraction loop, data parallel, manifest, verify.

``run(params, run_dir)`` reads ``02_vocab/train.parquet`` and writes ``03_extract/``:

* ``preflight.json``: projected bytes and free disk (before the model is loaded), projected time
  (after a short calibration once it is);
* ``meta.json``: aux layer ids, N, hidden size, dtype, target, stored layers, dataset fingerprint;
* ``rows_000000-002000/<row:06d>.safetensors``: ``token_ids`` int64 ``[seq]``, ``loss_mask`` int8
  ``[seq]``, ``hidden_states`` ``[seq, n_aux + 1, hidden]`` (last slot = layer N before the norm);
* ``manifest.jsonl``: one line per row (``row``, ``id``, ``num_tokens``, ``file``, ``bytes``,
  ``sha256``), written when every row has its file; ``manifest.part-RRR.jsonl`` journals (one per
  data-parallel rank) record finished files while the stage runs;
* ``progress.json``, ``timeline.jsonl`` (throughput over time), ``stats.json``, figures (PNG).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from eagle3.config import Params, dump_params
from eagle3.extract.core import (
    DTYPE_BYTES,
    ROW_FILE_RE,
    SHARD_DIR_RE,
    ExtractError,
    HiddenStateCapture,
    NonFiniteError,
    SampleWriter,
    TokenizedRows,
    check_sample_file,
    extract_batches,
    finite_flags,
    first_non_finite,
    iter_journal,
    pad_batch,
    plan_batches,
    resolve_layer_ids,
    sample_relpath,
    sha256_file,
    storage_dtype,
    text_config,
)
from eagle3.io import (
    Progress,
    atomic_write_json,
    atomic_write_text,
    free_bytes,
    read_json,
    stage_dir,
    write_stats,
)

__all__ = [
    "STAGE",
    "HEADER_BYTES_ESTIMATE",
    "run",
    "preflight",
    "verify",
    "load_rows",
    "HiddenStatesDataset",
    "online_samples",
    "OnlineExtractor",
    "extract_batches",
    "bytes_per_token",
]

STAGE = 3
STAGE_NAME = "03_extract"
# safetensors header of one sample file (JSON with 3 tensors + metadata, padded to 8 bytes), measured
# at ~330 bytes; the projection counts it per file.
HEADER_BYTES_ESTIMATE = 384
# meta.json keys that must agree for a folder to be resumed.
_META_KEYS = ("aux_layer_ids", "num_hidden_layers", "hidden_size", "dtype", "stored_layers",
              "dataset_fingerprint", "shard_size")
_ROOT_FILES = {"meta.json", "manifest.jsonl", "progress.json", "preflight.json", "stats.json",
               "timeline.jsonl", "torchrun_params.yaml"}


def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def bytes_per_token(num_slots: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Hidden-state bytes per token: ``num_slots x hidden_size x bytes per element`` (DESIGN "Scale")."""
    return num_slots * hidden_size * DTYPE_BYTES[dtype]


# ----------------------------------------------------------------------------------------------
# Data parallel (torchrun) helpers
# ----------------------------------------------------------------------------------------------


@dataclass
class _Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "_Dist":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch.distributed as dist

        if not dist.is_initialized():
            # gloo: CPU tensors only, works beside CUDA; long timeout because ranks finish their
            # shares at different times and wait at the final barrier.
            dist.init_process_group("gloo", timeout=datetime.timedelta(hours=72))
        return cls(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj: Any) -> list:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _launch_data_parallel(params: Params, run_dir: Path, nproc: int) -> dict:
    """Run this stage under ``torchrun --standalone --nproc-per-node nproc`` and return its stats."""
    sd = stage_dir(run_dir, STAGE)
    pfile = sd / "torchrun_params.yaml"
    atomic_write_text(pfile, dump_params(params))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "eagle3.extract", str(pfile), "--run-dir", str(run_dir)]
    print("eagle3 extract: data parallel:", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, check=False).returncode
    stats = read_json(sd / "stats.json", {}) or {}
    if rc != 0 or not stats.get("complete"):
        raise ExtractError(
            f"data-parallel extraction failed (exit code {rc}); see the output above and "
            f"{sd / 'progress.json'}. Re-running resumes. Command: {' '.join(cmd)}"
        )
    return stats


# ----------------------------------------------------------------------------------------------
# Setup: rows, target shape, meta, output folder checks
# ----------------------------------------------------------------------------------------------


def load_rows(run_dir: str | Path, split: str = "train") -> TokenizedRows:
    """Stage 2's tokenized samples (``02_vocab/<split>.parquet``) as :class:`TokenizedRows`."""
    return TokenizedRows(Path(run_dir) / "02_vocab" / f"{split}.parquet")


@dataclass
class _Setup:
    rows: TokenizedRows
    meta: dict
    aux: list[int]
    stored: list[int]
    num_layers: int
    hidden: int
    sdtype: torch.dtype
    cdtype: torch.dtype
    target_path: Path
    plan: list[list[int]]


def _setup(params: Params, run_dir: Path) -> _Setup:
    from transformers import AutoConfig

    from eagle3.target import resolve_target, torch_dtype

    ep = params.extract
    rows = load_rows(run_dir)
    rows.check_max_len(params.vocab.max_seq_len)
    resolved = resolve_target(params.target)
    cfg = text_config(AutoConfig.from_pretrained(resolved.path, trust_remote_code=params.target.trust_remote_code))
    n_layers, hidden = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    aux = resolve_layer_ids(ep.aux_layer_ids, n_layers)
    cdtype = torch_dtype(params.target.dtype, resolved.path)
    sdtype = storage_dtype(ep.dtype, cdtype)
    meta = {
        "aux_layer_ids": aux,
        "num_hidden_layers": n_layers,
        "hidden_size": hidden,
        "dtype": _dtype_name(sdtype),
        "target": str(resolved.path),
        "verifier": resolved.name,
        "stored_layers": [*aux, n_layers],
        "layout": {"token_ids": "int64 [seq]", "loss_mask": "int8 [seq]",
                   "hidden_states": f"{_dtype_name(sdtype)} [seq, {len(aux) + 1}, {hidden}]"},
        "convention": "slot i = layer id stored_layers[i]; id k < N = transformers hidden_states[k]; "
                      "id N = last decoder layer output before the final norm",
        "num_samples": len(rows),
        "num_tokens": rows.total_tokens,
        "dataset": str(rows.path),
        "dataset_fingerprint": rows.fingerprint(),
        "shard_size": ep.shard_size,
        "compute_dtype": _dtype_name(cdtype),
    }
    return _Setup(rows, meta, aux, meta["stored_layers"], n_layers, hidden, sdtype, cdtype, resolved.path,
                  plan_batches(rows.lengths, ep.token_budget))


def _check_meta(sd: Path, meta: dict) -> None:
    """Refuse to resume a folder written for another model, layer set, dtype or dataset."""
    old = read_json(sd / "meta.json", None)
    if not old:
        return
    diffs = [f"{k}: {old.get(k)!r} in {sd / 'meta.json'}, {meta[k]!r} now" for k in _META_KEYS if old.get(k) != meta[k]]
    if diffs:
        hint = ""
        if any(d.startswith(("hidden_size", "num_hidden_layers")) for d in diffs):
            hint = " The target model's hidden size / layer count disagrees with the stored files."
        raise ExtractError(
            f"{sd} holds hidden states of a different configuration:\n  " + "\n  ".join(diffs) +
            f"\n{hint} Delete {sd} to extract again, or start a new run (run.name)."
        )


def _scan_output_dir(sd: Path, n_rows: int, shard_size: int) -> tuple[list[Path], list[Path]]:
    """``(foreign, stale_temps)`` in the ``rows_*`` folders: files this stage did not write, and
    temp files of a killed writer (``.<name>.*.tmp``)."""
    from eagle3.extract.core import shard_name

    foreign: list[Path] = []
    temps: list[Path] = []
    for d in sorted(sd.iterdir()) if sd.exists() else []:
        if d.name.startswith(".") and d.name.endswith(".tmp") and d.is_file():
            temps.append(d)
            continue
        if not d.name.startswith("rows_"):
            continue
        m = SHARD_DIR_RE.match(d.name)
        if not d.is_dir() or not m or int(m.group(2)) - int(m.group(1)) != shard_size:
            foreign.append(d)
            continue
        for f in sorted(d.iterdir()):
            if f.name.startswith(".") and f.name.endswith(".tmp") and f.is_file():
                temps.append(f)
                continue
            fm = ROW_FILE_RE.match(f.name)
            row = int(fm.group(1)) if fm else -1
            if not fm or not f.is_file() or row >= n_rows or shard_name(row, shard_size) != d.name:
                foreign.append(f)
    return foreign, temps


def _known_entries(sd: Path) -> dict[int, dict]:
    """Finished-file records from the manifest and every rank's journal (later ones win)."""
    known: dict[int, dict] = {}
    for p in [sd / "manifest.jsonl", *sorted(sd.glob("manifest.part-*.jsonl"))]:
        for e in iter_journal(p):
            known[int(e["row"])] = e
    return known


def _scan_rows(sd: Path, setup: _Setup, rows_to_check: Iterable[int], known: dict[int, dict]) -> tuple[dict[int, dict], list[dict]]:
    """Check the files of ``rows_to_check``: ``(valid entries by row, redone [{row, id, reason}])``.

    A file is valid when its header parses, its shapes / dtypes / token ids / loss mask are right
    and, when a journal knows it, its size matches; an unjournaled good file is hashed. Invalid
    files are deleted (they are redone).
    """
    shard = setup.meta["shard_size"]
    slots, hidden = len(setup.stored), setup.hidden
    valid: dict[int, dict] = {}
    redone: list[dict] = []
    existing = {p.name: p for d in sd.glob("rows_*") if d.is_dir() for p in d.iterdir()}
    for r in rows_to_check:
        rel = sample_relpath(r, shard)
        path = sd / rel
        if path.name not in existing or existing[path.name] != path:
            continue
        reason = check_sample_file(path, setup.rows.tokens(r), slots, hidden, setup.sdtype, setup.rows.loss_mask(r))
        size = path.stat().st_size
        e = known.get(r)
        if reason is None and e is not None and e.get("file") == rel and int(e["bytes"]) != size:
            reason = f"size {size} != {e['bytes']} recorded when it was written (truncated?)"
        if reason is not None:
            path.unlink(missing_ok=True)
            redone.append({"row": r, "id": setup.rows.ids[r], "reason": reason})
            continue
        if e is None or e.get("file") != rel:
            e = {"row": r, "id": setup.rows.ids[r], "num_tokens": int(setup.rows.lengths[r]), "file": rel,
                 "bytes": size, "sha256": sha256_file(path)}
        valid[r] = {"row": r, "id": setup.rows.ids[r], "num_tokens": int(setup.rows.lengths[r]), "file": rel,
                    "bytes": int(e["bytes"]), "sha256": e["sha256"]}
    return valid, redone


# ----------------------------------------------------------------------------------------------
# Preflight
# ----------------------------------------------------------------------------------------------


def _fmt_gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def _projection(setup: _Setup, rows: Iterable[int] | None = None) -> dict:
    lengths = setup.rows.lengths if rows is None else setup.rows.lengths[list(rows)]
    tokens = int(np.sum(lengths)) if len(lengths) else 0
    bpt = bytes_per_token(len(setup.stored), setup.hidden, setup.sdtype)
    hidden_bytes = tokens * bpt
    return {"samples": int(len(lengths)), "tokens": tokens, "hidden_bytes": hidden_bytes,
            "bytes": hidden_bytes + tokens * 9 + int(len(lengths)) * HEADER_BYTES_ESTIMATE}


def _preflight_dict(params: Params, setup: _Setup, sd: Path, done_rows: int, done_tokens: int, done_bytes: int,
                    world: int) -> dict:
    ep = params.extract
    total = _projection(setup)
    todo_samples = total["samples"] - done_rows
    todo_tokens = total["tokens"] - done_tokens
    bpt = bytes_per_token(len(setup.stored), setup.hidden, setup.sdtype)
    todo_bytes = todo_tokens * (bpt + 9) + todo_samples * HEADER_BYTES_ESTIMATE
    free = free_bytes(sd)
    required = int(todo_bytes * ep.disk_margin)
    padded = sum(len(b) * int(setup.rows.lengths[b[0]]) for b in setup.plan)
    return {
        "samples": total["samples"],
        "tokens": total["tokens"],
        "max_seq_len": int(setup.rows.lengths.max()) if len(setup.rows) else 0,
        "mean_seq_len": round(float(setup.rows.lengths.mean()), 1) if len(setup.rows) else 0.0,
        "aux_layer_ids": setup.aux,
        "stored_layers": setup.stored,
        "num_hidden_layers": setup.num_layers,
        "hidden_size": setup.hidden,
        "dtype": _dtype_name(setup.sdtype),
        "bytes_per_element": DTYPE_BYTES[setup.sdtype],
        "bytes_per_token": bpt,
        "formula": f"tokens x (n_aux+1) x hidden x bytes = {total['tokens']} x {len(setup.stored)} x "
                   f"{setup.hidden} x {DTYPE_BYTES[setup.sdtype]}",
        "projected_hidden_bytes": total["hidden_bytes"],
        "projected_bytes": total["bytes"],
        "done_samples": done_rows,
        "done_tokens": done_tokens,
        "done_bytes": done_bytes,
        "todo_samples": todo_samples,
        "todo_tokens": todo_tokens,
        "todo_bytes": todo_bytes,
        "disk_margin": ep.disk_margin,
        "required_free_bytes": required,
        "free_bytes": free,
        "fits": required <= free,
        "output_dir": str(sd),
        "token_budget": ep.token_budget,
        "num_batches": len(setup.plan),
        "padding_efficiency": round(total["tokens"] / padded, 4) if padded else 1.0,
        "world_size": world,
        "backend": ep.backend,
        "projected_seconds": None,
        "calibration": None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _refusal(pf: dict) -> str:
    return (
        f"Stage 3 preflight: not enough free disk in {pf['output_dir']}.\n"
        f"  samples {pf['samples']} ({pf['todo_samples']} to do), tokens {pf['tokens']} ({pf['todo_tokens']} to do)\n"
        f"  per token: {len(pf['stored_layers'])} layers x {pf['hidden_size']} hidden x {pf['bytes_per_element']} bytes "
        f"= {pf['bytes_per_token']} bytes (+9 for token ids and loss mask)\n"
        f"  to write: {_fmt_gib(pf['todo_bytes'])}; x margin {pf['disk_margin']} = {_fmt_gib(pf['required_free_bytes'])} "
        f"needed; free: {_fmt_gib(pf['free_bytes'])}\n"
        "Options: fewer samples (synthesize.limit or a smaller prompt set); a shorter vocab.max_seq_len; "
        "a smaller storage dtype (extract.dtype: bfloat16 instead of float32; FP8 storage through the vLLM "
        "backend's hs_connectors FP8HiddenStatesConnector where supported); fewer aux layers "
        "(extract.aux_layer_ids); online mode (train.online: true: the target runs beside training and "
        "nothing is stored); or a disk with more space (run.output_dir)."
    )


def preflight(params: Params, run_dir: str | Path, write: bool = True) -> dict:
    """Project Stage 3's disk footprint without loading the model (``preflight.json``).

    Projected bytes = Σ tokens × (n_aux + 1) × hidden × bytes per element (DESIGN "Scale"), plus
    9 bytes per token (token ids, loss mask) and ~384 bytes of header per file. Files that a journal or
    the manifest records and that exist count as done (:func:`run` checks them fully before it starts).

    Returns:
        dict: the preflight numbers (``fits`` says whether ``todo_bytes x disk_margin <= free_bytes``).

    Raises:
        ExtractError: bad inputs (see :func:`run`); not a refusal (check ``fits``).
    """
    run_dir = Path(run_dir)
    setup = _setup(params, run_dir)
    sd = stage_dir(run_dir, STAGE)
    _check_meta(sd, setup.meta)
    known = _known_entries(sd)
    done = {r: e for r, e in known.items() if r < len(setup.rows) and (sd / e["file"]).is_file()}
    pf = _preflight_dict(params, setup, sd, len(done), sum(int(setup.rows.lengths[r]) for r in done),
                         sum(int(e["bytes"]) for e in done.values()), 1)
    if write:
        atomic_write_json(sd / "preflight.json", pf)
    return pf


# ----------------------------------------------------------------------------------------------
# Progress with token-based ETA, bytes written and other ranks folded in
# ----------------------------------------------------------------------------------------------


class _ExtractProgress(Progress):
    """:class:`eagle3.io.Progress` with a token-based ETA, bytes written, other ranks folded in and a
    ``timeline.jsonl`` point per write (the notebook's throughput-over-time plot)."""

    def __init__(self, sd: Path, own_dir: Path, *, total: int, total_tokens: int, done: int, tokens: int,
                 projected_bytes: int, done_bytes: int, writer_ref: Callable[[], int], other_dirs: Sequence[Path],
                 timeline: Path | None) -> None:
        self.total_tokens = total_tokens
        self.last_point: dict = {}
        self.done_bytes = done_bytes
        self.writer_ref = writer_ref
        self.other_dirs = list(other_dirs)
        self.timeline = timeline
        own_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(own_dir, total=total, unit="samples", done=done, tokens=tokens, desc=STAGE_NAME,
                         bytes_dir=own_dir / "_none_", projected_bytes=projected_bytes)

    def snapshot(self, status: str) -> dict:
        snap = super().snapshot(status)
        done, tokens, written = snap["done"], snap["tokens"], self.writer_ref()
        rate = snap["tokens_per_s"]
        for d in self.other_dirs:
            o = read_json(d / "progress.json", None) or {}
            done += o.get("done", 0) - o.get("extra", {}).get("start_done", 0)
            tokens += o.get("tokens", 0) - o.get("extra", {}).get("start_tokens", 0)
            written += o.get("extra", {}).get("bytes_written", 0)
            rate += o.get("tokens_per_s", 0.0) or 0.0
        snap.update(done=done, tokens=tokens, tokens_per_s=round(rate, 2))
        remaining = max(self.total_tokens - tokens, 0)
        snap["eta_s"] = 0.0 if remaining == 0 else (round(remaining / rate, 1) if rate > 0 else None)
        snap["total_tokens"] = self.total_tokens
        snap["bytes_written"] = written
        snap["bytes_on_disk"] = self.done_bytes + written
        snap["extra"] = dict(snap["extra"], bytes_written=self.writer_ref(), start_done=self._start_done,
                             start_tokens=self._start_tokens)
        # called by Progress._write (under its lock, also from its heartbeat thread): one timeline point
        self.last_point = {"t": round(time.time(), 3), "elapsed_s": snap["elapsed_s"], "done": done,
                           "tokens": tokens, "tokens_per_s": snap["tokens_per_s"], "bytes_written": written,
                           "status": status}
        if self.timeline is not None:
            with open(self.timeline, "a", encoding="utf-8") as f:
                f.write(json.dumps(self.last_point) + "\n")
        return snap


# ----------------------------------------------------------------------------------------------
# run()
# ----------------------------------------------------------------------------------------------


def run(params: Params, run_dir: str | Path, *, write_fn: Callable[[Path, bytes], None] | None = None) -> dict:
    """Stage 3: extract the target's aux hidden states (plus layer N before the norm) for every row.

    Reads ``02_vocab/train.parquet``; writes ``03_extract/`` (see the module docstring). Re-running
    resumes: complete files are kept (header, shapes, token ids checked), truncated or corrupt ones
    are redone, and the final manifest and tensors equal those of an uninterrupted run. With
    ``extract.data_parallel = P > 1`` it launches ``torchrun --nproc-per-node P`` itself; under
    torchrun each rank takes every P-th batch of the global plan, so the files are the same as
    with one process.

    Args:
        params: the run's params (``target``, ``vocab.max_seq_len``, ``extract``).
        run_dir: the run directory.
        write_fn: ``write_fn(tmp_path, data)`` writes one file's bytes (default: a plain write);
            tests pass one that fails like a full disk.

    Returns:
        dict: the stats (also in ``stats.json``).

    Raises:
        ExtractError: missing or malformed Stage 2 output; a row longer than ``vocab.max_seq_len``;
            bad aux layer ids; a folder written for another model / layers / dtype / dataset; a
            foreign file in a ``rows_*`` folder; a preflight refusal (not enough disk, with the
            numbers and the options); a full disk during the run (resumable).
        NonFiniteError: a sample with NaN/Inf hidden states (names the sample id).
    """
    run_dir = Path(run_dir)
    ep = params.extract
    if ep.data_parallel > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return _launch_data_parallel(params, run_dir, ep.data_parallel)
    sd = stage_dir(run_dir, STAGE)
    st = read_json(sd / "stats.json", {}) or {}
    if st.get("complete"):
        return st
    if ep.backend == "vllm":
        from eagle3.extract.vllm_backend import run_vllm

        return run_vllm(params, run_dir)
    return _run_transformers(params, run_dir, sd, write_fn)


@dataclass
class _Prepared:
    setup: _Setup
    valid: dict[int, dict]
    redone: list[dict]
    pf: dict
    journal: Path
    my_batches: list[list[int]]
    my_rows: list[int]
    done_rows: int
    done_tokens: int
    done_bytes: int


def _prepare(params: Params, run_dir: Path, sd: Path, dist: _Dist) -> _Prepared:
    """Inputs, folder checks, resume scan and preflight (refusal) — everything before the model loads."""
    ep = params.extract
    setup = _setup(params, run_dir)
    rows = setup.rows
    _check_meta(sd, setup.meta)
    foreign, temps = _scan_output_dir(sd, len(rows), ep.shard_size)
    if foreign:
        shown = "\n  ".join(str(p) for p in foreign[:5]) + ("\n  ..." if len(foreign) > 5 else "")
        raise ExtractError(
            f"{len(foreign)} file(s) in {sd} were not written by Stage 3 (the rows_* folders hold only "
            f"<row:06d>.safetensors files of this dataset):\n  {shown}\nMove them elsewhere and re-run; "
            f"nothing was changed."
        )
    known = _known_entries(sd)
    dist.barrier()  # every rank has read the journals
    if dist.rank == 0:
        for p in temps:  # a killed writer's temp files (ours: .<name>.*.tmp)
            p.unlink(missing_ok=True)
        for p in sd.glob("manifest.part-*.jsonl"):
            m = p.name[len("manifest.part-"):-len(".jsonl")]
            if not m.isdigit() or int(m) >= dist.world:
                p.unlink(missing_ok=True)
    my_batches = [b for i, b in enumerate(setup.plan) if i % dist.world == dist.rank]
    my_rows = [r for b in my_batches for r in b]
    valid, redone = _scan_rows(sd, setup, my_rows, known)
    journal = sd / f"manifest.part-{dist.rank:03d}.jsonl"
    atomic_write_text(journal, "".join(json.dumps(e) + "\n" for e in valid.values()))
    for r in redone:
        print(f"eagle3 extract: redoing row {r['row']} (id {r['id']}): {r['reason']}", flush=True)
    mine = {"done_rows": len(valid), "done_tokens": sum(e["num_tokens"] for e in valid.values()),
            "done_bytes": sum(e["bytes"] for e in valid.values()), "redone": redone}
    allr = dist.gather(mine)
    done_rows = sum(m["done_rows"] for m in allr)
    done_tokens = sum(m["done_tokens"] for m in allr)
    done_bytes = sum(m["done_bytes"] for m in allr)
    pf = None
    if dist.rank == 0:
        pf = _preflight_dict(params, setup, sd, done_rows, done_tokens, done_bytes, dist.world)
        atomic_write_json(sd / "preflight.json", pf)
        if not read_json(sd / "meta.json", None):
            atomic_write_json(sd / "meta.json", setup.meta)
    pf = dist.broadcast(pf)
    if not pf["fits"]:
        raise ExtractError(_refusal(pf))
    return _Prepared(setup, valid, [x for m in allr for x in m["redone"]], pf, journal, my_batches, my_rows,
                     done_rows, done_tokens, done_bytes)


def _make_progress(sd: Path, dist: _Dist, prep: _Prepared, writer_ref: Callable[[], int]) -> _ExtractProgress:
    """Rank 0 reports the whole stage in ``progress.json`` (other ranks' shares folded in from their
    ``.rankRRR/progress.json``); other ranks report their own share there."""
    rows = prep.setup.rows
    if dist.rank == 0:
        return _ExtractProgress(
            sd, sd, total=len(rows), total_tokens=rows.total_tokens, done=prep.done_rows, tokens=prep.done_tokens,
            projected_bytes=prep.pf["projected_bytes"], done_bytes=prep.done_bytes, writer_ref=writer_ref,
            other_dirs=[sd / f".rank{r:03d}" for r in range(1, dist.world)], timeline=sd / "timeline.jsonl")
    own = prep.valid.values()
    return _ExtractProgress(
        sd, sd / f".rank{dist.rank:03d}", total=len(prep.my_rows),
        total_tokens=int(sum(rows.lengths[r] for r in prep.my_rows)), done=len(prep.valid),
        tokens=sum(e["num_tokens"] for e in own), projected_bytes=prep.pf["projected_bytes"],
        done_bytes=sum(e["bytes"] for e in own), writer_ref=writer_ref, other_dirs=[], timeline=None)


def _run_transformers(params: Params, run_dir: Path, sd: Path, write_fn) -> dict:
    ep = params.extract
    dist = _Dist.from_env()
    prep = _prepare(params, run_dir, sd, dist)
    setup, valid, pf, rows = prep.setup, prep.valid, prep.pf, prep.setup.rows
    todo_batches = [b for b in prep.my_batches if any(r not in valid for r in b)]
    tracker = None
    if dist.rank == 0:
        from eagle3.tracking import Tracker

        tracker = Tracker(params, run_dir, STAGE_NAME)
    loop: dict = {"samples": 0, "tokens": 0, "computed_tokens": 0, "seconds": 0.0}
    writer = None
    calib: dict = {}
    progress = _make_progress(sd, dist, prep, lambda: writer.bytes_written if writer is not None else 0)
    try:
        if todo_batches:
            from eagle3.target import load_target, pick_device

            device = pick_device(params.target.device)
            if device == "cuda" and dist.world > 1:
                device = f"cuda:{dist.local_rank}"
            model, tok, _ = load_target(params.target, device=device)
            capture = HiddenStateCapture(model, setup.aux, setup.sdtype)
            if capture.hidden_size != setup.hidden:
                raise ExtractError(f"model hidden size {capture.hidden_size} != config {setup.hidden}")
            writer = SampleWriter(sd, prep.journal, setup.stored, threads=ep.writer_threads,
                                  max_pending_bytes=ep.max_pending_mb << 20, write_fn=write_fn)
            pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
            state = {"batches": 0, "computed": 0, "t0": time.perf_counter()}
            remaining_computed = sum(len(b) * int(rows.lengths[b[0]]) for b in todo_batches)

            def on_batch(n_new: int, t_new: int, computed: int) -> None:
                state["batches"] += 1
                state["computed"] += computed
                progress.update(n_new, tokens=t_new)
                if tracker is not None and time.perf_counter() - state.get("logged", 0.0) > 5.0:
                    state["logged"] = time.perf_counter()
                    tracker.log({k: v for k, v in progress.last_point.items() if k not in ("t", "status")})
                if state["batches"] == ep.calibration_batches and not calib:
                    dt = time.perf_counter() - state["t0"]
                    rate = state["computed"] / dt if dt > 0 else 0.0
                    left = max(remaining_computed - state["computed"], 0)
                    calib.update(batches=state["batches"], tokens=state["computed"], seconds=round(dt, 3),
                                 tokens_per_s=round(rate, 2),
                                 projected_seconds=round(left / rate, 1) if rate > 0 else None)
                    if dist.rank == 0:
                        pf.update(calibration=dict(calib), projected_seconds=calib["projected_seconds"])
                        atomic_write_json(sd / "preflight.json", pf)
                        print(f"eagle3 extract: calibration {rate:.0f} tokens/s -> about "
                              f"{calib['projected_seconds']:.0f} s left for this process's share", flush=True)

            loop = extract_batches(capture, rows, todo_batches, writer, shard_size=ep.shard_size,
                                   skip=set(valid), pad_id=pad_id, on_batch=on_batch)
            capture.close()
            del model
    except BaseException:
        if writer is not None:
            try:
                writer.close(wait=True)
            except BaseException:  # noqa: BLE001 - the first error is the one raised
                pass
        progress.close("failed")
        if tracker is not None:
            tracker.finish()
        raise
    bytes_written = writer.bytes_written if writer is not None else 0
    busy = writer.busy_s if writer is not None else 0.0
    progress.close("done")
    mine_loop = {"samples": loop["samples"], "tokens": loop["tokens"], "computed_tokens": loop["computed_tokens"],
                 "seconds": loop["seconds"], "bytes_written": bytes_written, "writer_busy_s": busy,
                 "calibration": calib or None}
    loops = dist.gather(mine_loop)
    dist.barrier()
    if dist.rank != 0:
        return {"rank": dist.rank, **mine_loop}
    return _finalize(params, run_dir, sd, setup, pf, loops, prep.redone, dist.world, tracker)


# ----------------------------------------------------------------------------------------------
# Finalize: manifest, stats, figures
# ----------------------------------------------------------------------------------------------


def _finalize(params: Params, run_dir: Path, sd: Path, setup: _Setup, pf: dict, loops: list[dict],
              redone: list[dict], world: int, tracker) -> dict:
    import shutil

    rows = setup.rows
    entries = _known_entries(sd)
    missing = [r for r in range(len(rows)) if r not in entries or not (sd / entries[r]["file"]).is_file()]
    if missing:
        r = missing[0]
        raise ExtractError(f"{len(missing)} row(s) have no file after the run (first: row {r}, id {rows.ids[r]}); "
                           f"re-run to resume.")
    keys = ("row", "id", "num_tokens", "file", "bytes", "sha256")
    lines = [json.dumps({k: entries[r][k] for k in keys}) for r in range(len(rows))]
    atomic_write_text(sd / "manifest.jsonl", "\n".join(lines) + "\n")
    total_bytes = sum(int(entries[r]["bytes"]) for r in range(len(rows)))
    verify_report = None
    if params.extract.verify:
        verify_report = verify(run_dir, raise_on_problem=True)
    secs = max((lp["seconds"] for lp in loops), default=0.0)
    new_tokens = sum(lp["tokens"] for lp in loops)
    computed = sum(lp["computed_tokens"] for lp in loops)
    written = sum(lp["bytes_written"] for lp in loops)
    calib = loops[0].get("calibration") or {}
    stats = {
        "backend": params.extract.backend,
        "num_samples": len(rows),
        "num_tokens": rows.total_tokens,
        "aux_layer_ids": setup.aux,
        "stored_layers": setup.stored,
        "num_hidden_layers": setup.num_layers,
        "hidden_size": setup.hidden,
        "dtype": _dtype_name(setup.sdtype),
        "bytes": total_bytes,
        "bytes_per_token": round(total_bytes / max(rows.total_tokens, 1), 2),
        "hidden_bytes_per_token": bytes_per_token(len(setup.stored), setup.hidden, setup.sdtype),
        "projected_bytes": pf["projected_bytes"],
        "projection_error": round(total_bytes / pf["projected_bytes"] - 1, 5) if pf["projected_bytes"] else 0.0,
        "samples_extracted": sum(lp["samples"] for lp in loops),
        "tokens_extracted": new_tokens,
        "computed_tokens": computed,
        "samples_skipped": len(rows) - sum(lp["samples"] for lp in loops),
        "files_redone": len(redone),
        "elapsed_s": round(secs, 3),
        "tokens_per_s": round(new_tokens / secs, 2) if secs > 0 else None,
        "write_bytes_per_s": round(written / secs, 1) if secs > 0 else None,
        "writer_busy_s": round(sum(lp["writer_busy_s"] for lp in loops), 3),
        "calibration_tokens_per_s": calib.get("tokens_per_s"),
        "preflight_projected_seconds": calib.get("projected_seconds"),
        "world_size": world,
        "verified": verify_report is not None,
    }
    for p in sd.glob("manifest.part-*.jsonl"):
        p.unlink(missing_ok=True)
    for d in sd.glob(".rank*"):
        shutil.rmtree(d, ignore_errors=True)
    if tracker is not None:
        from eagle3.extract import plots

        for name, fn in (("throughput", plots.fig_throughput), ("bytes_per_token", plots.fig_bytes_per_token),
                         ("layer_norms", plots.fig_layer_norms)):
            try:
                fig = fn(run_dir)
            except Exception as exc:  # noqa: BLE001 - a plot must not fail the stage
                print(f"eagle3 extract: figure {name} skipped: {exc}", flush=True)
                continue
            tracker.figure(name, fig)
            import matplotlib.pyplot as plt

            plt.close(fig)
        tracker.summary(stats)
        tracker.finish()
    return write_stats(sd, stats)


# ----------------------------------------------------------------------------------------------
# Verify, dataset, online
# ----------------------------------------------------------------------------------------------


def verify(run_dir: str | Path, *, check_hashes: bool = True, check_values: bool = True,
           raise_on_problem: bool = False) -> dict:
    """Full re-check of an existing ``03_extract`` folder against its manifest and Stage 2's rows.

    For every manifest line: the file exists with the recorded size and sha256, its header, shapes,
    dtypes, token ids and loss mask are right, and its hidden states are finite.

    Returns:
        dict: ``files``, ``bytes``, ``problems`` (list of ``{"row", "id", "file", "problem"}``).

    Raises:
        ExtractError: no manifest (the stage has not finished); with ``raise_on_problem``, any problem.
    """
    from safetensors.torch import load_file

    sd = Path(run_dir) / STAGE_NAME
    meta = read_json(sd / "meta.json", None)
    manifest = list(iter_journal(sd / "manifest.jsonl"))
    if not meta or not manifest:
        raise ExtractError(f"{sd}: no meta.json/manifest.jsonl; run Stage 3 to completion first")
    rows = load_rows(run_dir)
    dtype = getattr(torch, meta["dtype"])
    slots, hidden = len(meta["stored_layers"]), meta["hidden_size"]
    problems = []
    seen = set()
    for e in manifest:
        r, path = int(e["row"]), sd / e["file"]
        seen.add(r)

        def bad(msg: str) -> None:
            problems.append({"row": r, "id": e.get("id"), "file": str(path), "problem": msg})

        if r >= len(rows) or rows.ids[r] != e.get("id"):
            bad("row/id not in the dataset")
            continue
        if not path.is_file():
            bad("missing")
            continue
        if path.stat().st_size != int(e["bytes"]):
            bad(f"size {path.stat().st_size} != manifest {e['bytes']}")
            continue
        reason = check_sample_file(path, rows.tokens(r), slots, hidden, dtype, rows.loss_mask(r))
        if reason:
            bad(reason)
            continue
        if check_hashes and sha256_file(path) != e["sha256"]:
            bad("sha256 differs from the manifest")
            continue
        if check_values:
            hs = load_file(str(path))["hidden_states"]
            if not bool(torch.isfinite(hs).all()):
                bad("non-finite hidden states: " + first_non_finite(hs, meta["stored_layers"]))
    for r in range(len(rows)):
        if r not in seen:
            problems.append({"row": r, "id": rows.ids[r], "file": None, "problem": "no manifest line"})
    report = {"files": len(manifest), "bytes": sum(int(e["bytes"]) for e in manifest), "problems": problems}
    if problems and raise_on_problem:
        p = problems[0]
        raise ExtractError(f"verify {sd}: {len(problems)} problem(s); first: row {p['row']} (id {p['id']}) "
                           f"{p['file']}: {p['problem']}")
    return report


class HiddenStatesDataset(torch.utils.data.Dataset):
    """The stored samples of a finished Stage 3, by row (index ``i`` = row ``i`` of train.parquet).

    ``ds[i]`` -> ``{"token_ids": int64 [seq], "loss_mask": int8 [seq], "hidden_states": [seq, n_aux + 1,
    hidden] (meta dtype)}``; ``hidden_states[:, -1]`` is layer N before the final norm.

    Attributes:
        meta: ``meta.json`` (aux_layer_ids, stored_layers, hidden_size, dtype, ...).
        entries: the manifest lines. lengths: token counts (list[int]). ids: sample ids.

    Raises:
        ExtractError: the folder has no meta.json / manifest.jsonl (Stage 3 has not finished).
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir) / STAGE_NAME
        self.meta = read_json(self.dir / "meta.json", None)
        entries = sorted(iter_journal(self.dir / "manifest.jsonl"), key=lambda e: int(e["row"]))
        if not self.meta or not entries:
            raise ExtractError(f"{self.dir}: no meta.json/manifest.jsonl; run Stage 3 (extract) to completion first")
        self.entries = entries
        self.lengths = [int(e["num_tokens"]) for e in entries]
        self.ids = [str(e["id"]) for e in entries]

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.dir / self.entries[i]["file"]))


_ONLINE: dict = {}


class OnlineExtractor:
    """The hooked target held in memory for :func:`online_samples` (loaded once per configuration).

    Args:
        params: the run's params (``target``, ``extract.aux_layer_ids``, ``extract.dtype``).
        device: where the forward runs (default ``target.device``).
    """

    def __init__(self, params: Params, device: str | None = None) -> None:
        from eagle3.target import load_target, pick_device

        self.device = pick_device(device or params.target.device)
        model, tok, resolved = load_target(params.target, device=self.device)
        cdtype = next(model.parameters()).dtype
        self.model = model
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.capture = HiddenStateCapture(model, params.extract.aux_layer_ids, storage_dtype(params.extract.dtype, cdtype))

    @classmethod
    def get(cls, params: Params, device: str | None = None) -> "OnlineExtractor":
        key = (params.target.model_dump_json(), tuple(params.extract.aux_layer_ids or ()), params.extract.dtype, device)
        if key not in _ONLINE:
            _ONLINE.clear()  # one target in memory at a time
            _ONLINE[key] = cls(params, device)
        return _ONLINE[key]


def online_samples(params: Params, run_dir: str | Path, rows: Iterable[int] | None = None, *,
                   device: str | None = None, out_device: str = "cpu",
                   extractor: OnlineExtractor | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the same per-sample dicts as :class:`HiddenStatesDataset`, straight from the target.

    Rows are taken in the given order, grouped into consecutive batches of at most
    ``extract.token_budget`` padded tokens; nothing is written to disk.

    Args:
        params: the run's params.
        run_dir: the run directory (reads ``02_vocab/train.parquet``).
        rows: row indices (default: all, in order).
        device: forward device (default ``target.device``).
        out_device: where yielded tensors live (``"cpu"``, or the forward device to skip the copy).
        extractor: a loaded :class:`OnlineExtractor` (default: cached per target/layers/dtype).

    Yields:
        dict: ``token_ids`` int64 ``[seq]``, ``loss_mask`` int8 ``[seq]``, ``hidden_states``
        ``[seq, n_aux + 1, hidden]`` in the storage dtype.

    Raises:
        ExtractError: bad inputs as in :func:`run`; NonFiniteError naming the sample id.
    """
    data = load_rows(run_dir)
    data.check_max_len(params.vocab.max_seq_len)
    ex = extractor or OnlineExtractor.get(params, device)
    order = list(range(len(data))) if rows is None else [int(r) for r in rows]
    budget = params.extract.token_budget
    i = 0
    while i < len(order):
        batch, m = [order[i]], int(data.lengths[order[i]])
        i += 1
        while i < len(order) and max(m, int(data.lengths[order[i]])) * (len(batch) + 1) <= budget:
            m = max(m, int(data.lengths[order[i]]))
            batch.append(order[i])
            i += 1
        ids, mask, lens = pad_batch(data, batch, ex.pad_id)
        dev = ex.capture.device
        mask_d = mask.to(dev) if mask is not None else None
        hs = ex.capture.capture(ids.to(dev), mask_d)
        fin = finite_flags(hs, mask_d).tolist()
        for j, r in enumerate(batch):
            h = hs[j, : lens[j]]
            if not fin[j]:
                raise NonFiniteError(f"non-finite hidden states in sample id {data.ids[r]} (row {r}): "
                                     f"{first_non_finite(h.cpu(), ex.capture.stored_layers)}")
            yield {"token_ids": torch.from_numpy(data.tokens(r).copy()).to(out_device),
                   "loss_mask": torch.from_numpy(data.loss_mask(r).copy()).to(out_device),
                   "hidden_states": h.to(out_device)}
