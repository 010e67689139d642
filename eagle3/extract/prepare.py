"""Stage 3 before the model loads: inputs, target shape, meta, folder checks, resume scan, preflight.

Shared by both backends (transformers in :mod:`eagle3.extract.stage`, vLLM in
:mod:`eagle3.extract.vllm_backend`): :func:`prepare` does everything up to the point where
compute starts, :func:`preflight` only the projection.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle3.config import Params
from eagle3.contracts import hidden_states as hs
from eagle3.contracts import tokenized
from eagle3.contracts.tokenized import TokenizedSplit
from eagle3.distributed import DistContext
from eagle3.errors import ExtractError, VocabError
from eagle3.extract.core import batch_cost, plan_batches, resolve_batching
from eagle3.hooks import resolve_layer_ids, text_config
from eagle3.io import atomic_write_json, atomic_write_text, free_bytes, read_json
from eagle3.rundir import EXTRACT, RunDir

__all__ = [
    "HEADER_BYTES_ESTIMATE",
    "Setup",
    "Prepared",
    "load_rows",
    "extract_dir",
    "build_setup",
    "preflight",
    "prepare",
]

# safetensors header of one sample file (JSON with 3 tensors + metadata, padded to 8 bytes), measured
# at ~330 bytes; the projection counts it per file.
HEADER_BYTES_ESTIMATE = 384
# meta.json keys that must agree for a folder to be resumed.
_META_KEYS = ("aux_layer_ids", "num_hidden_layers", "hidden_size", "dtype", "stored_layers",
              "dataset_fingerprint", "shard_size")


def extract_dir(run_dir: str | Path, create: bool = True) -> Path:
    """The run's Stage 3 folder."""
    return RunDir(run_dir).stage(EXTRACT, create=create)


def load_rows(run_dir: str | Path, split: str = "train") -> TokenizedSplit:
    """Stage 2's tokenized samples (``<split>.parquet``) through their contract (``contracts.tokenized``).

    Raises:
        ExtractError: the contract's error (missing file, missing column, a null or empty row, a loss
            mask whose length differs from its input_ids; file, row and id named).
    """
    try:
        return tokenized.read_rows(run_dir, split)
    except VocabError as exc:
        raise ExtractError(f"{exc} (Stage 3 reads Stage 2's tokenized samples: run stage 2 first)") from None


@dataclass
class Setup:
    """What Stage 3 extracts: the rows, the target's shape, the stored layers, dtypes and the batch plan."""

    rows: TokenizedSplit
    meta: dict
    aux: list[int]
    stored: list[int]
    num_layers: int
    hidden: int
    sdtype: torch.dtype
    cdtype: torch.dtype
    target_path: Path
    plan: list[list[int]]
    batching: str = "packed"

    @property
    def packed(self) -> bool:
        """The batches are packed rows (:data:`eagle3.extract.core.BATCHINGS`)."""
        return self.batching == "packed"


def _meta(params: Params, rows: TokenizedSplit, aux: list[int], n_layers: int, hidden: int,
          sdtype: torch.dtype, cdtype: torch.dtype, resolved) -> dict:
    name = hs.dtype_name(sdtype)
    layout = {"token_ids": "int64 [seq]", "loss_mask": "int8 [seq]",
              "hidden_states": f"{name} [seq, {len(aux) + 1}, {hidden}]"}
    if sdtype == hs.FP8:
        layout[hs.SCALES] = f"float32 [seq, {len(aux) + 1}, 1] (value = hidden_states x scale)"
    return {
        "aux_layer_ids": aux,
        "num_hidden_layers": n_layers,
        "hidden_size": hidden,
        "dtype": name,
        "target": str(resolved.path),
        "verifier": resolved.name,
        "stored_layers": [*aux, n_layers],
        "layout": layout,
        "convention": "slot i = layer id stored_layers[i]; id k < N = transformers hidden_states[k]; "
                      "id N = last decoder layer output before the final norm",
        "num_samples": len(rows),
        "num_tokens": rows.total_tokens,
        "dataset": str(rows.path),
        "dataset_fingerprint": rows.fingerprint(),
        "shard_size": params.extract.shard_size,
        "compute_dtype": hs.dtype_name(cdtype),
    }


def build_setup(params: Params, run_dir: Path) -> Setup:
    """Read Stage 2's rows and the target's config (not its weights) and plan the batches.

    Raises:
        ExtractError: missing/malformed rows, a row longer than ``vocab.max_seq_len``, bad aux ids.
    """
    from transformers import AutoConfig

    from eagle3.target import resolve_target, target_dtype, torch_dtype

    ep = params.extract
    rows = load_rows(run_dir)
    rows.check_max_len(params.vocab.max_seq_len, error=ExtractError)
    resolved = resolve_target(params.target)
    cfg = text_config(AutoConfig.from_pretrained(resolved.path, trust_remote_code=params.target.trust_remote_code))
    n_layers, hidden = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    aux = resolve_layer_ids(ep.aux_layer_ids, n_layers, error=ExtractError)
    cdtype = torch_dtype(target_dtype(params.target), resolved.path)
    sdtype = hs.storage_dtype(ep.dtype, cdtype)
    batching = resolve_batching(ep.batching, cfg)
    meta = _meta(params, rows, aux, n_layers, hidden, sdtype, cdtype, resolved)
    meta["batching"] = batching
    return Setup(rows, meta, aux, meta["stored_layers"], n_layers, hidden, sdtype, cdtype, resolved.path,
                 plan_batches(rows.lengths, ep.token_budget, packed=batching == "packed"), batching)


def _check_meta(sd: Path, meta: dict) -> None:
    """Refuse to resume a folder written for another model, layer set, dtype or dataset."""
    old = hs.read_meta(sd)
    if not old:
        return
    diffs = [f"{k}: {old.get(k)!r} in {sd / 'meta.json'}, {meta[k]!r} now" for k in _META_KEYS if old.get(k) != meta[k]]
    if diffs:
        hint = ""
        if any(d.startswith(("hidden_size", "num_hidden_layers")) for d in diffs):
            hint = " The target model's hidden size / layer count disagrees with the stored files."
        if all(d.startswith("dataset_fingerprint") for d in diffs):
            hint = (" Stage 2's train split changed since these files were written: redo stage 3 with "
                    "`eagle3 run PARAMS --stages 3-5 --redo 3` (it starts over on the new split).")
        raise ExtractError(
            f"{sd} holds hidden states of a different configuration:\n  " + "\n  ".join(diffs) +
            f"\n{hint} Delete {sd} to extract again, or start a new run (run.name)."
        )


def _scan_output_dir(sd: Path, n_rows: int, shard_size: int) -> tuple[list[Path], list[Path]]:
    """``(foreign, stale_temps)`` in the ``rows_*`` folders: files this stage did not write, and
    temp files of a killed writer (:func:`eagle3.contracts.hidden_states.is_stale_temp`: ours, or
    safetensors' ``.tmpXXXXXX`` left by writers older than the stage's own temp folder). The temp
    folder itself (``.writing/``) is not scanned: everything in it is a temp file."""
    foreign: list[Path] = []
    temps: list[Path] = []
    for d in sorted(sd.iterdir()) if sd.exists() else []:
        if hs.is_stale_temp(d):
            temps.append(d)
            continue
        if not d.name.startswith("rows_"):
            continue
        m = hs.SHARD_DIR_RE.match(d.name)
        if not d.is_dir() or not m or int(m.group(2)) - int(m.group(1)) != shard_size:
            foreign.append(d)
            continue
        for f in sorted(d.iterdir()):
            if hs.is_stale_temp(f):
                temps.append(f)
                continue
            fm = hs.ROW_FILE_RE.match(f.name)
            row = int(fm.group(1)) if fm else -1
            if not fm or not f.is_file() or row >= n_rows or hs.shard_name(row, shard_size) != d.name:
                foreign.append(f)
    return foreign, temps


def _scan_rows(sd: Path, setup: Setup, rows_to_check: Iterable[int], known: dict[int, dict]) -> tuple[dict[int, dict], list[dict]]:
    """Check the files of ``rows_to_check``: ``(valid entries by row, redone [{row, id, reason}])``.

    A file is valid when its header parses, its shapes / dtypes / token ids / loss mask are right
    and, when a journal or the manifest records it, its size and sha256 match the record (every such
    file is hashed again: a bit flip that keeps the header and the size is caught here); an
    unrecorded good file is hashed. Invalid files are deleted (they are redone).
    """
    shard = setup.meta["shard_size"]
    rows = setup.rows
    valid: dict[int, dict] = {}
    redone: list[dict] = []
    existing = {p.name: p for d in sd.glob("rows_*") if d.is_dir() for p in d.iterdir()}
    for r in rows_to_check:
        rel = hs.sample_relpath(r, shard)
        path = sd / rel
        if path.name not in existing or existing[path.name] != path:
            continue
        reason = hs.check_sample_file(path, rows.tokens(r), len(setup.stored), setup.hidden, setup.sdtype,
                                      rows.mask(r))
        size = path.stat().st_size
        e = known.get(r)
        recorded = e is not None and e.get("file") == rel
        if reason is None and recorded and int(e["bytes"]) != size:
            reason = f"size {size} != {e['bytes']} recorded when it was written (truncated?)"
        digest = hs.sha256_file(path) if reason is None else None
        if reason is None and recorded and digest != e["sha256"]:
            reason = "sha256 differs from the one recorded when it was written (the file changed on disk)"
        if reason is not None:
            path.unlink(missing_ok=True)
            redone.append({"row": r, "id": rows.ids[r], "reason": reason})
            continue
        valid[r] = {"row": r, "id": rows.ids[r], "num_tokens": int(rows.lengths[r]), "file": rel,
                    "bytes": size, "sha256": digest}
    return valid, redone


# ----------------------------------------------------------------------------------------------
# Preflight
# ----------------------------------------------------------------------------------------------


def _fmt_gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def _projection(setup: Setup) -> dict:
    lengths = setup.rows.lengths
    tokens = int(np.sum(lengths)) if len(lengths) else 0
    hidden_bytes = tokens * hs.bytes_per_token(len(setup.stored), setup.hidden, setup.sdtype)
    return {"samples": int(len(lengths)), "tokens": tokens, "hidden_bytes": hidden_bytes,
            "bytes": hidden_bytes + tokens * 9 + int(len(lengths)) * HEADER_BYTES_ESTIMATE}


def _preflight_dict(params: Params, setup: Setup, sd: Path, done_rows: int, done_tokens: int, done_bytes: int,
                    world: int) -> dict:
    ep = params.extract
    total = _projection(setup)
    todo_samples = total["samples"] - done_rows
    todo_tokens = total["tokens"] - done_tokens
    bpt = hs.bytes_per_token(len(setup.stored), setup.hidden, setup.sdtype)
    todo_bytes = todo_tokens * (bpt + 9) + todo_samples * HEADER_BYTES_ESTIMATE
    free = free_bytes(sd)
    required = int(todo_bytes * ep.disk_margin)
    padded = sum(batch_cost(setup.rows.lengths, b, setup.packed) for b in setup.plan)
    rows = setup.rows
    elem = hs.DTYPE_BYTES[setup.sdtype]
    return {
        "samples": total["samples"], "tokens": total["tokens"],
        "max_seq_len": int(rows.lengths.max()) if len(rows) else 0,
        "mean_seq_len": round(float(rows.lengths.mean()), 1) if len(rows) else 0.0,
        "aux_layer_ids": setup.aux, "stored_layers": setup.stored, "num_hidden_layers": setup.num_layers,
        "hidden_size": setup.hidden, "dtype": hs.dtype_name(setup.sdtype), "bytes_per_element": elem,
        "bytes_per_token": bpt,
        "formula": f"tokens x (n_aux+1) x hidden x bytes = {total['tokens']} x {len(setup.stored)} x "
                   f"{setup.hidden} x {elem}" + (f" (+ tokens x {len(setup.stored)} x 4 for the fp8 scales)"
                                                 if setup.sdtype == hs.FP8 else ""),
        "projected_hidden_bytes": total["hidden_bytes"], "projected_bytes": total["bytes"],
        "done_samples": done_rows, "done_tokens": done_tokens, "done_bytes": done_bytes,
        "todo_samples": todo_samples, "todo_tokens": todo_tokens, "todo_bytes": todo_bytes,
        "disk_margin": ep.disk_margin, "required_free_bytes": required, "free_bytes": free,
        "fits": required <= free, "output_dir": str(sd), "token_budget": ep.token_budget, "batching": setup.batching,
        "num_batches": len(setup.plan),
        "padding_efficiency": round(total["tokens"] / padded, 4) if padded else 1.0,
        "world_size": world, "backend": ep.backend, "projected_seconds": None, "calibration": None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _refusal(pf: dict) -> str:
    return (
        f"Stage 3 preflight: not enough free disk in {pf['output_dir']}.\n"
        f"  samples {pf['samples']} ({pf['todo_samples']} to do), tokens {pf['tokens']} ({pf['todo_tokens']} to do)\n"
        f"  per token: {len(pf['stored_layers'])} layers x {pf['hidden_size']} hidden x {pf['bytes_per_element']} bytes"
        f"{' + 4 per layer for the fp8 scales' if pf['dtype'] == 'float8_e4m3fn' else ''}"
        f" = {pf['bytes_per_token']} bytes (+9 for token ids and loss mask)\n"
        f"  to write: {_fmt_gib(pf['todo_bytes'])}; x margin {pf['disk_margin']} = {_fmt_gib(pf['required_free_bytes'])} "
        f"needed; free: {_fmt_gib(pf['free_bytes'])}\n"
        "Options: fewer samples (synthesize.limit or a smaller prompt set); a shorter vocab.max_seq_len; "
        "a smaller storage dtype (extract.dtype: bfloat16 instead of float32, float8_e4m3fn for half of "
        "bf16); fewer aux layers "
        "(extract.aux_layer_ids); online mode (train.online: true: the target runs beside training and "
        "nothing is stored); or a disk with more space (run.output_dir)."
    )


def preflight(params: Params, run_dir: str | Path, write: bool = True) -> dict:
    """Project Stage 3's disk footprint without loading the model (``preflight.json``).

    Projected bytes = Σ tokens × (n_aux + 1) × hidden × bytes per element (DESIGN "Scale"), plus
    9 bytes per token (token ids, loss mask) and ~384 bytes of header per file. Files that a journal or
    the manifest records and that exist count as done (:func:`prepare` checks them fully before it starts).

    Returns:
        dict: the preflight numbers (``fits`` says whether ``todo_bytes x disk_margin <= free_bytes``).

    Raises:
        ExtractError: bad inputs (see :func:`eagle3.extract.run`); not a refusal (check ``fits``).
    """
    run_dir = Path(run_dir)
    setup = build_setup(params, run_dir)
    sd = extract_dir(run_dir)
    _check_meta(sd, setup.meta)
    known = hs.known_entries(sd)
    done = {r: e for r, e in known.items() if r < len(setup.rows) and (sd / e["file"]).is_file()}
    pf = _preflight_dict(params, setup, sd, len(done), sum(int(setup.rows.lengths[r]) for r in done),
                         sum(int(e["bytes"]) for e in done.values()), 1)
    if write:
        atomic_write_json(sd / "preflight.json", pf)
    return pf


# ----------------------------------------------------------------------------------------------
# prepare(): everything before the model loads
# ----------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    """The outcome of :func:`prepare` for this rank: its batches, the files already valid, the preflight."""

    setup: Setup
    valid: dict[int, dict]
    redone: list[dict]
    pf: dict
    journal: Path
    my_batches: list[list[int]]
    my_rows: list[int]
    done_rows: int
    done_tokens: int
    done_bytes: int


def _refuse_foreign(sd: Path, foreign: list[Path]) -> None:
    if foreign:
        shown = "\n  ".join(str(p) for p in foreign[:5]) + ("\n  ..." if len(foreign) > 5 else "")
        raise ExtractError(
            f"{len(foreign)} file(s) in {sd} were not written by Stage 3 (the rows_* folders hold only "
            f"<row:06d>.safetensors files of this dataset):\n  {shown}\nMove them elsewhere and re-run; "
            f"nothing was changed."
        )


def _clean_stale(sd: Path, temps: list[Path], world: int) -> None:
    """Remove a killed writer's temp files (the stage's ``.writing/`` folder and stray temps in the
    ``rows_*`` folders) and journals of ranks that no longer exist."""
    hs.clean_temp(sd)
    for p in temps:
        p.unlink(missing_ok=True)
    for p in sd.glob("manifest.part-*.jsonl"):
        m = p.name[len("manifest.part-"):-len(".jsonl")]
        if not m.isdigit() or int(m) >= world:
            p.unlink(missing_ok=True)


def prepare(params: Params, run_dir: Path, sd: Path, dist: DistContext) -> Prepared:
    """Inputs, folder checks, resume scan and preflight (refusal) — everything before the model loads.

    Raises:
        ExtractError: as :func:`build_setup`; a folder of another configuration; a foreign file; a
            preflight refusal (not enough disk, with the numbers and the options).
    """
    setup = build_setup(params, run_dir)
    rows = setup.rows
    _check_meta(sd, setup.meta)
    foreign, temps = _scan_output_dir(sd, len(rows), params.extract.shard_size)
    _refuse_foreign(sd, foreign)
    known = hs.known_entries(sd)
    dist.barrier()  # every rank has read the journals
    if dist.rank == 0:
        _clean_stale(sd, temps, dist.world)
    my_batches = [b for i, b in enumerate(setup.plan) if i % dist.world == dist.rank]
    my_rows = [r for b in my_batches for r in b]
    valid, redone = _scan_rows(sd, setup, my_rows, known)
    journal = sd / hs.journal_name(dist.rank)
    atomic_write_text(journal, "".join(json.dumps(e) + "\n" for e in valid.values()))
    for r in redone:
        print(f"eagle3 extract: redoing row {r['row']} (id {r['id']}): {r['reason']}", flush=True)
    mine = {"done_rows": len(valid), "done_tokens": sum(e["num_tokens"] for e in valid.values()),
            "done_bytes": sum(e["bytes"] for e in valid.values()), "redone": redone}
    allr = dist.gather(mine)
    done = {k: sum(m[k] for m in allr) for k in ("done_rows", "done_tokens", "done_bytes")}
    pf = None
    if dist.rank == 0:
        pf = _preflight_dict(params, setup, sd, done["done_rows"], done["done_tokens"], done["done_bytes"], dist.world)
        atomic_write_json(sd / "preflight.json", pf)
        if not read_json(sd / "meta.json", None):
            hs.write_meta(sd, setup.meta)
    pf = dist.broadcast(pf)
    if not pf["fits"]:
        raise ExtractError(_refusal(pf))
    return Prepared(setup, valid, [x for m in allr for x in m["redone"]], pf, journal, my_batches, my_rows,
                    done["done_rows"], done["done_tokens"], done["done_bytes"])
