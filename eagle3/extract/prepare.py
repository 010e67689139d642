"""Stage 3 before the model loads: inputs, target shape, meta, folder checks, resume scan, preflight.

Shared by both backends (transformers in :mod:`eagle3.extract.stage`, vLLM in
:mod:`eagle3.extract.vllm_backend`): :func:`prepare` does everything up to the point where
compute starts, :func:`preflight` only the projection.
"""

from __future__ import annotations

import time
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
from eagle3.io import atomic_write_json, free_bytes
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
    return {
        "aux_layer_ids": aux,
        "num_hidden_layers": n_layers,
        "hidden_size": hidden,
        "dtype": hs.dtype_name(sdtype),
        "target": str(resolved.path),
        "verifier": resolved.name,
        "stored_layers": [*aux, n_layers],
        "layout": hs.tensor_layout(sdtype, len(aux) + 1, hidden),
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
    done = hs.scan(sd, setup.meta).finished()
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


def prepare(params: Params, run_dir: Path, sd: Path, dist: DistContext) -> Prepared:
    """Inputs, folder checks, resume scan and preflight (refusal) — everything before the model loads.

    Raises:
        ExtractError: as :func:`build_setup`; a folder of another configuration; a foreign file; a
            preflight refusal (not enough disk, with the numbers and the options).
    """
    setup = build_setup(params, run_dir)
    found = hs.scan(sd, setup.meta)
    found.refuse_foreign()
    dist.barrier()  # every rank has read the journals
    if dist.rank == 0:
        found.remove_stale(dist.world)
    my_batches = [b for i, b in enumerate(setup.plan) if i % dist.world == dist.rank]
    my_rows = [r for b in my_batches for r in b]
    valid, redone = found.recheck(setup.rows, my_rows)
    journal = hs.write_journal(sd, dist.rank, valid.values())
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
        if not found.found_meta:
            hs.write_meta(sd, setup.meta)
    pf = dist.broadcast(pf)
    if not pf["fits"]:
        raise ExtractError(_refusal(pf))
    return Prepared(setup, valid, [x for m in allr for x in m["redone"]], pf, journal, my_batches, my_rows,
                    done["done_rows"], done["done_tokens"], done["done_bytes"])
