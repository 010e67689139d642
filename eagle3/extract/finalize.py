"""Stage 3 after the last file: manifest, optional full verify, stats, figures."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import eagle3.extract.report as report
from eagle3.config import Params
from eagle3.contracts import hidden_states as hs
from eagle3.errors import ExtractError
from eagle3.extract.prepare import Setup, extract_dir, load_rows
from eagle3.stage import StageRun, Stats, write_stats

__all__ = ["ExtractStats", "finalize", "verify"]


@dataclass
class ExtractStats(Stats):
    """Stage 3's summary numbers: exactly the keys of ``stats.json`` (bytes in B, times in s)."""

    HEADLINE: ClassVar[tuple[str, ...]] = ("num_samples", "num_tokens", "aux_layer_ids", "dtype", "bytes",
                                           "bytes_per_token", "tokens_per_s", "elapsed_s", "world_size")

    backend: str
    num_samples: int
    num_tokens: int
    aux_layer_ids: list[int]
    stored_layers: list[int]
    num_hidden_layers: int
    hidden_size: int
    dtype: str
    bytes: int
    bytes_per_token: float
    hidden_bytes_per_token: int
    projected_bytes: int
    projection_error: float
    samples_extracted: int
    tokens_extracted: int
    computed_tokens: int
    samples_skipped: int
    files_redone: int
    elapsed_s: float
    tokens_per_s: float | None
    write_bytes_per_s: float | None
    writer_busy_s: float
    calibration_tokens_per_s: float | None
    preflight_projected_seconds: float | None
    world_size: int
    verified: bool
    batching: str = "padded"  # extract.batching as resolved (a stats.json without the key is from a padded-only run)
    attention_kernel: str | None = None  # packed: "varlen" (flash over cu_seqlens) or "sdpa" (one call per sample)


def verify(run_dir: str | Path, *, check_hashes: bool = True, check_values: bool = True,
           raise_on_problem: bool = False) -> dict:
    """Full re-check of an existing Stage 3 folder against its manifest and Stage 2's rows
    (:func:`eagle3.contracts.hidden_states.verify_folder`).

    Returns:
        dict: ``files``, ``bytes``, ``problems`` (list of ``{"row", "id", "file", "problem"}``).

    Raises:
        ExtractError: no manifest (the stage has not finished); with ``raise_on_problem``, any problem.
    """
    return hs.verify_folder(extract_dir(run_dir, create=False), load_rows(run_dir), check_hashes=check_hashes,
                            check_values=check_values, raise_on_problem=raise_on_problem)


def _stats(params: Params, setup: Setup, pf: dict, loops: list[dict], redone: list[dict], world: int,
           total_bytes: int, verified: bool) -> ExtractStats:
    rows = setup.rows
    secs = max((lp["seconds"] for lp in loops), default=0.0)
    new_tokens = sum(lp["tokens"] for lp in loops)
    written = sum(lp["bytes_written"] for lp in loops)
    calib = loops[0].get("calibration") or {}
    return ExtractStats(
        backend=params.extract.backend, num_samples=len(rows), num_tokens=rows.total_tokens,
        aux_layer_ids=setup.aux, stored_layers=setup.stored, num_hidden_layers=setup.num_layers,
        hidden_size=setup.hidden, dtype=hs.dtype_name(setup.sdtype), bytes=total_bytes,
        bytes_per_token=round(total_bytes / max(rows.total_tokens, 1), 2),
        hidden_bytes_per_token=hs.bytes_per_token(len(setup.stored), setup.hidden, setup.sdtype),
        projected_bytes=pf["projected_bytes"],
        projection_error=round(total_bytes / pf["projected_bytes"] - 1, 5) if pf["projected_bytes"] else 0.0,
        samples_extracted=sum(lp["samples"] for lp in loops), tokens_extracted=new_tokens,
        computed_tokens=sum(lp["computed_tokens"] for lp in loops),
        samples_skipped=len(rows) - sum(lp["samples"] for lp in loops), files_redone=len(redone),
        elapsed_s=round(secs, 3), tokens_per_s=round(new_tokens / secs, 2) if secs > 0 else None,
        write_bytes_per_s=round(written / secs, 1) if secs > 0 else None,
        writer_busy_s=round(sum(lp["writer_busy_s"] for lp in loops), 3),
        calibration_tokens_per_s=calib.get("tokens_per_s"),
        preflight_projected_seconds=calib.get("projected_seconds"), world_size=world, verified=verified,
        batching=setup.batching if params.extract.backend == "transformers" else "vllm",
        attention_kernel=next((lp["attention_kernel"] for lp in loops if lp.get("attention_kernel")), None),
    )


def _figures(run_dir: Path, st) -> None:
    for name, fn in (("throughput", report.fig_throughput), ("bytes_per_token", report.fig_bytes_per_token),
                     ("layer_norms", report.fig_layer_norms)):
        try:
            fig = fn(run_dir)
        except Exception as exc:  # noqa: BLE001 - a plot must not fail the stage
            print(f"eagle3 extract: figure {name} skipped: {exc}", flush=True)
            continue
        st.figure(name, fig)


def finalize(params: Params, run_dir: Path, sd: Path, setup: Setup, pf: dict, loops: list[dict],
             redone: list[dict], world: int, st: StageRun | None) -> dict:
    """Write the manifest (every row must have its file), verify when ``extract.verify``, write
    ``stats.json`` and the figures; returns the stats as written.

    Args:
        st: the stage's :class:`eagle3.stage.StageRun` (figures, W&B summary, ``stats.json``); None
            writes only ``stats.json`` (adopting vLLM files by hand).
        loops: one dict per rank (``samples``, ``tokens``, ``computed_tokens``, ``seconds``,
            ``bytes_written``, ``writer_busy_s``, ``calibration``).

    Raises:
        ExtractError: a row without a file (re-running resumes); a verify problem.
    """
    rows = setup.rows
    entries = hs.finished_records(sd, hs.known_entries(sd), len(rows))
    missing = [r for r in range(len(rows)) if r not in entries]
    if missing:
        r = missing[0]
        raise ExtractError(f"{len(missing)} row(s) have no file after the run (first: row {r}, id {rows.ids[r]}); "
                           f"re-run to resume.")
    total_bytes = hs.write_manifest(sd, entries, len(rows))
    verified = False
    if params.extract.verify:
        verify(run_dir, raise_on_problem=True)
        verified = True
    stats = (_stats(params, setup, pf, loops, redone, world, total_bytes, verified)).to_dict()
    for d in sd.glob(".rank*"):
        shutil.rmtree(d, ignore_errors=True)
    hs.clean_temp(sd)  # every writer has finished: nothing of it is left there (an empty folder at most)
    if st is None:
        return write_stats(sd, stats)
    _figures(run_dir, st)
    return st.finish(stats)
