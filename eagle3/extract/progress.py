"""Stage 3's ``progress.json`` and ``timeline.jsonl``: a token-based ETA, bytes written and the other
data-parallel ranks folded in (rank 0 reports the whole stage)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from eagle3.distributed import DistContext
from eagle3.io import read_json
from eagle3.stage import Progress

__all__ = ["ExtractProgress", "make_progress"]



class ExtractProgress(Progress):
    """:class:`eagle3.stage.Progress` with a token-based ETA, bytes written, other ranks folded in and a
    ``timeline.jsonl`` point per write (the notebook's throughput-over-time plot).

    ``bytes_on_disk`` is counted, never walked: the bytes of the files found done at the start
    (``done_bytes``, from the journals/manifest) plus the writer's own count (``writer_ref()``), plus
    the other ranks' counts from their progress files."""

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
        # bytes on disk = the files the resume scan found (their manifest sizes) + what the writer has
        # written since: no directory walk in the heartbeat (a stage folder may hold 100K files)
        super().__init__(own_dir, total=total, unit="samples", done=done, tokens=tokens, desc=sd.name,
                         projected_bytes=projected_bytes, bytes_fn=lambda: self.done_bytes + self.writer_ref())

    def snapshot(self, status: str) -> dict:
        snap = super().snapshot(status)
        done, tokens, written = snap["done"], snap["tokens"], self.writer_ref()
        rate = snap["tokens_per_s"]
        eta_rate = self.eta_rate("tokens")  # this rank's recent rate (Progress.eta_rate), the others' average
        for d in self.other_dirs:
            o = read_json(d / "progress.json", None) or {}
            done += o.get("done", 0) - o.get("extra", {}).get("start_done", 0)
            tokens += o.get("tokens", 0) - o.get("extra", {}).get("start_tokens", 0)
            written += o.get("extra", {}).get("bytes_written", 0)
            rate += o.get("tokens_per_s", 0.0) or 0.0
            eta_rate += o.get("tokens_per_s", 0.0) or 0.0
        snap.update(done=done, tokens=tokens, tokens_per_s=round(rate, 2))
        remaining = max(self.total_tokens - tokens, 0)
        snap["eta_s"] = 0.0 if remaining == 0 or status == "done" else (
            round(remaining / eta_rate, 1) if eta_rate > 0 else None)
        snap["total_tokens"] = self.total_tokens
        snap["bytes_written"] = written
        snap["bytes_on_disk"] = self.done_bytes + written
        snap["extra"] = dict(snap["extra"], bytes_written=self.writer_ref(), start_done=self._start_done,
                             start_tokens=self._start_tokens)
        # called by Progress._write (under its lock, also from its heartbeat thread): one timeline point
        # elapsed_s of this execution (not the stage's): it restarts on a resume, which the
        # throughput plot takes as a new run (extract.report.throughput_windows)
        self.last_point = {"t": round(time.time(), 3), "elapsed_s": round(self.elapsed_s, 2), "done": done,
                           "tokens": tokens, "tokens_per_s": snap["tokens_per_s"], "bytes_written": written,
                           "status": status}
        if self.timeline is not None:
            with open(self.timeline, "a", encoding="utf-8") as f:
                f.write(json.dumps(self.last_point) + "\n")
        return snap


def make_progress(sd: Path, dist: DistContext, prep, writer_ref: Callable[[], int]) -> ExtractProgress:
    """Rank 0 reports the whole stage in ``progress.json`` (other ranks' shares folded in from their
    ``.rankRRR/progress.json``); other ranks report their own share there."""
    rows = prep.setup.rows
    if dist.rank == 0:
        return ExtractProgress(
            sd, sd, total=len(rows), total_tokens=rows.total_tokens, done=prep.done_rows, tokens=prep.done_tokens,
            projected_bytes=prep.pf["projected_bytes"], done_bytes=prep.done_bytes, writer_ref=writer_ref,
            other_dirs=[sd / f".rank{r:03d}" for r in range(1, dist.world)], timeline=sd / "timeline.jsonl")
    own = prep.valid.values()
    return ExtractProgress(
        sd, sd / f".rank{dist.rank:03d}", total=len(prep.my_rows),
        total_tokens=int(sum(rows.lengths[r] for r in prep.my_rows)), done=len(prep.valid),
        tokens=sum(e["num_tokens"] for e in own), projected_bytes=prep.pf["projected_bytes"],
        done_bytes=sum(e["bytes"] for e in own), writer_ref=writer_ref, other_dirs=[], timeline=None)
