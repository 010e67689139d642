"""Integrity checks of stored samples: one file's header, shapes, dtypes, token ids and loss mask
(:func:`check_sample_file`, without reading the hidden states), and the full re-check of a finished
folder against its manifest and Stage 2's rows (:func:`verify_folder`, ``eagle3 verify``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from eagle3.contracts.hidden_states.codec import FP8, SCALES, first_non_finite, read_states
from eagle3.contracts.hidden_states.layout import manifest_path
from eagle3.contracts.hidden_states.manifest import read_entries, read_meta, sha256_file
from eagle3.errors import ExtractError

__all__ = ["check_sample_file", "verify_folder"]

# safetensors' dtype names in a file header
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn,
              "I64": torch.int64, "I8": torch.int8}


def check_sample_file(path: str | Path, tokens: np.ndarray | None, num_slots: int, hidden_size: int,
                      dtype: torch.dtype, loss_mask: np.ndarray | None = None) -> str | None:
    """Check one stored sample without reading its hidden states; None when it is good.

    Checks: the safetensors header parses and covers the file exactly (safetensors' own validation),
    the three tensors exist with shapes ``[seq]``, ``[seq]``, ``[seq, num_slots, hidden_size]``, the
    dtypes (int64, int8, ``dtype``), for fp8 the float32 scales ``[seq, num_slots, 1]``, and that
    ``token_ids`` (and ``loss_mask``) equal the expected ones.

    Returns:
        str | None: the first problem found, as a short reason.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            need = {"token_ids", "loss_mask", "hidden_states"}
            if not need <= keys:
                return f"missing tensors {sorted(need - keys)}"
            seq = len(tokens) if tokens is not None else None
            hs = f.get_slice("hidden_states")
            shape = list(hs.get_shape())
            if seq is None:
                seq = shape[0]
            if shape != [seq, num_slots, hidden_size]:
                return f"hidden_states shape {shape} != {[seq, num_slots, hidden_size]}"
            if _ST_DTYPES.get(hs.get_dtype()) != dtype:
                return f"hidden_states dtype {hs.get_dtype()} != {dtype}"
            if dtype == FP8:
                if SCALES not in keys:
                    return f"fp8 hidden_states without {SCALES}"
                sc = f.get_slice(SCALES)
                if list(sc.get_shape()) != [seq, num_slots, 1] or sc.get_dtype() != "F32":
                    return f"{SCALES} {sc.get_dtype()} {list(sc.get_shape())} != F32 {[seq, num_slots, 1]}"
            tok = f.get_tensor("token_ids")
            lm = f.get_tensor("loss_mask")
            if tok.dtype != torch.int64 or list(tok.shape) != [seq]:
                return f"token_ids {tok.dtype} {list(tok.shape)} != int64 [{seq}]"
            if lm.dtype != torch.int8 or list(lm.shape) != [seq]:
                return f"loss_mask {lm.dtype} {list(lm.shape)} != int8 [{seq}]"
            if tokens is not None and not np.array_equal(tok.numpy(), tokens):
                return "token_ids differ from the dataset row"
            if loss_mask is not None and not np.array_equal(lm.numpy(), loss_mask):
                return "loss_mask differs from the dataset row"
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a reason to redo it
        return f"unreadable ({type(exc).__name__}: {str(exc)[:200]})"
    return None


def _check_entry(sd: Path, e: dict, rows, meta: dict, check_hashes: bool, check_values: bool) -> str | None:
    from safetensors.torch import load_file

    r, path = int(e["row"]), sd / e["file"]
    if r >= len(rows) or rows.ids[r] != e.get("id"):
        return "row/id not in the dataset"
    if not path.is_file():
        return "missing"
    if path.stat().st_size != int(e["bytes"]):
        return f"size {path.stat().st_size} != manifest {e['bytes']}"
    dtype = getattr(torch, meta["dtype"])
    reason = check_sample_file(path, rows.tokens(r), len(meta["stored_layers"]), meta["hidden_size"], dtype,
                               rows.mask(r))
    if reason:
        return reason
    if check_hashes and sha256_file(path) != e["sha256"]:
        return "sha256 differs from the manifest"
    if check_values:
        hs = read_states(load_file(str(path)))["hidden_states"]
        if not bool(torch.isfinite(hs).all()):
            return "non-finite hidden states: " + first_non_finite(hs, meta["stored_layers"])
    return None


def verify_folder(stage_dir: str | Path, rows, *, check_hashes: bool = True, check_values: bool = True,
                  raise_on_problem: bool = False) -> dict:
    """Full re-check of a Stage 3 folder against its manifest and Stage 2's rows.

    For every manifest line: the file exists with the recorded size and sha256, its header, shapes,
    dtypes, token ids and loss mask are right, and its hidden states are finite.

    Args:
        stage_dir: the Stage 3 folder. rows: Stage 2's tokenized rows (``ids``, ``tokens(r)``,
            ``loss_mask(r)``, ``len``).

    Returns:
        dict: ``files``, ``bytes``, ``problems`` (list of ``{"row", "id", "file", "problem"}``).

    Raises:
        ExtractError: no manifest (the stage has not finished); with ``raise_on_problem``, any problem.
    """
    sd = Path(stage_dir)
    meta = read_meta(sd)
    manifest = read_entries(manifest_path(sd))
    if not meta or not manifest:
        raise ExtractError(f"{sd}: no meta.json/manifest.jsonl; run Stage 3 to completion first")
    problems = []
    for e in manifest:
        why = _check_entry(sd, e, rows, meta, check_hashes, check_values)
        if why:
            problems.append({"row": int(e["row"]), "id": e.get("id"), "file": str(sd / e["file"]), "problem": why})
    seen = {int(e["row"]) for e in manifest}
    problems += [{"row": r, "id": rows.ids[r], "file": None, "problem": "no manifest line"}
                 for r in range(len(rows)) if r not in seen]
    if meta.get("num_samples") is not None and int(meta["num_samples"]) != len(manifest):
        problems.append({"row": None, "id": None, "file": str(manifest_path(sd)),
                         "problem": f"{len(manifest)} manifest lines but meta.json says num_samples = {meta['num_samples']}"})
    report = {"files": len(manifest), "bytes": sum(int(e["bytes"]) for e in manifest), "problems": problems}
    if problems and raise_on_problem:
        p = problems[0]
        raise ExtractError(f"verify {sd}: {len(problems)} problem(s); first: row {p['row']} (id {p['id']}) "
                           f"{p['file']}: {p['problem']}")
    return report
