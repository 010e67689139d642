"""Stage 1 driver: ``run(params, run_dir) -> SynthesizeStats``.

Resume: ``samples.jsonl`` is append-only while the stage runs (:class:`eagle3.contracts.samples.SampleStore`);
on start a torn last line is cut off and the ids already present are skipped, and at the end the
file is rewritten atomically in prompt order, so that an interrupted-and-resumed run and an
uninterrupted one give the same file (given deterministic generation).

``kind: self`` sources are written first (:func:`prepare_self_sources`, resumable too) and then
loaded as file sources; with ``synthesize.backend: vllm`` one engine writes and answers them.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from eagle3.config import Params, PromptSource, SynthesizeParams
from eagle3.contracts.samples import SampleStore, read_samples, samples_path
from eagle3.errors import SynthesisError
from eagle3.io import atomic_write_json
from eagle3.prompts import LoadReport, Prompt, load_prompts
from eagle3.rundir import SYNTHESIZE, stage_dir
from eagle3.stage import Progress, StageRun, Stats, completed_stats
from eagle3.synthesize.backends import Backend, make_backend, sampling_variant, user_turn_backend
from eagle3.synthesize.conversation import Session, run_batched
from eagle3.synthesize.report import make_figures
from eagle3.synthesize.self_prompt import self_prompt_figures, self_sources_pending, write_self_prompts
from eagle3.synthesize.server import run_server, server_renderer
from eagle3.synthesize.summary import (
    errors_path,
    overall_rate,
    read_timeline,
    skip_summary,
    summarize_samples,
    timeline_path,
)
from eagle3.vllm_utils import engine_logs_to

__all__ = ["SynthesizeStats", "run", "prepare_self_sources"]

_MAX_LISTED = 50
ENGINE_LOG = "vllm_engine.log"  # backend vllm: what the in-process engine prints (eagle3.vllm_utils.engine_logs_to)


@dataclass
class SynthesizeStats(Stats):
    """What stage 1 writes to ``stats.json`` (same keys, same order; ``complete``/``finished_at`` are
    added on writing). Counts are over the whole file unless ``_this_session``; times in seconds;
    ``tokens_per_s`` is completion tokens per second of generation over all sessions."""

    HEADLINE: ClassVar[tuple[str, ...]] = (
        "samples", "samples_train", "samples_heldout", "turns", "completion_tokens", "completion_tokens_mean",
        "length_fraction", "reasoning_capture_rate", "failed", "tokens_per_s", "elapsed_s")

    samples: int
    samples_train: int
    samples_heldout: int
    turns: int
    multi_turn_samples: int
    dropped_turns: int
    prompt_tokens: int
    completion_tokens: int
    completion_tokens_mean: float
    completion_tokens_p50: float
    completion_tokens_p90: float
    completion_tokens_max: int
    finish_reasons: dict
    length_fraction: float
    reasoning_turns: int
    reasoning_capture_rate: float
    reasoning_char_share: float
    backend: str
    settings: dict
    prompts: dict
    bad_input: dict
    skipped: list
    errors: dict
    retries: int
    failed_samples: list
    failed: int
    interrupted_samples: int
    circuit_breaker_open: bool
    extra_samples_not_in_prompts: int
    torn_lines_dropped: int
    resumed_from: int
    generated_this_session: int
    completion_tokens_this_session: int
    load_s: float
    generation_s: float
    tokens_per_s_this_session: float | None
    tokens_per_s: float | None
    elapsed_s: float


def _settings(params: Params, model_name: str | None) -> dict:
    syn = params.synthesize
    return {"backend": syn.backend, "model": model_name, "temperature": syn.temperature, "top_p": syn.top_p,
            "max_new_tokens": syn.max_new_tokens, "seed": syn.seed, "enable_thinking": syn.enable_thinking,
            "reasoning": syn.reasoning}


@dataclass
class _Outcome:
    """One session's generation: the backend used (or None), whether the breaker opened, times."""

    backend: Any = None
    tripped: bool = False
    load_s: float = 0.0
    gen_s: float = 0.0


def _generate(params: Params, pending: list[Prompt], sess: Session, backend=None) -> _Outcome:
    """Load the backend and generate every pending prompt (nothing when none is pending). An open
    ``backend`` (the engine that wrote the self-prompts) is used instead, and left to its owner to close."""
    syn = params.synthesize
    out = _Outcome()
    if not pending:
        return out
    t0 = time.time()
    own = backend is None
    try:
        out.backend = make_backend(params) if own else backend
        sess.settings["model"] = out.backend.model_name
        server = out.backend.name == "server"
        if server:
            renderer = server_renderer(params)
        out.load_s = time.time() - t0
        t1 = time.time()
        sess.timeline.write(json.dumps({"t": round(t1, 3), "session_start": True}) + "\n")
        if server:
            out.tripped = run_server(out.backend, pending, sess, renderer, params.target.max_model_len,
                                     syn.max_new_tokens, syn.server.breaker_failures)
        else:
            run_batched(out.backend, pending, sess, syn.batch_size, syn.max_new_tokens)
        out.gen_s = time.time() - t1
    finally:
        if own and out.backend is not None:
            out.backend.close()
    return out


def _stats(params: Params, run_dir: Path, samples: list[dict], report: LoadReport, sess: Session, store: SampleStore,
           out: _Outcome, extra: int, resumed_from: int, t_start: float) -> SynthesizeStats:
    bad = report.to_dict()["bad_input"]
    bad["prompt_too_long"] = len(sess.skipped)
    errors = dict(sorted(getattr(out.backend, "errors", Counter()).items()))
    return SynthesizeStats(
        **summarize_samples(samples),
        backend=params.synthesize.backend,
        settings=dict(sess.settings),
        prompts=report.to_dict(),
        bad_input=bad,
        skipped=sess.skipped[:_MAX_LISTED],
        errors=errors,
        retries=getattr(out.backend, "retries", 0),
        failed_samples=sess.failed[:_MAX_LISTED],
        failed=len(sess.failed),
        interrupted_samples=len(sess.interrupted),
        circuit_breaker_open=out.tripped,
        extra_samples_not_in_prompts=extra,
        torn_lines_dropped=store.torn_lines,
        resumed_from=resumed_from,
        generated_this_session=sess.written,
        completion_tokens_this_session=sess.tokens,
        load_s=round(out.load_s, 2),
        generation_s=round(out.gen_s, 2),
        tokens_per_s_this_session=round(sess.tokens / out.gen_s, 2) if out.gen_s > 0 else None,
        tokens_per_s=overall_rate(read_timeline(timeline_path(run_dir))),
        elapsed_s=round(time.time() - t_start, 2),
    )


def _stopped(params: Params, run_dir: Path, stats: SynthesizeStats, sess: Session, store: SampleStore,
             st: StageRun) -> SynthesisError:
    """Write ``errors.json`` and the incomplete stats; the error that says why the stage stopped."""
    syn, failed = params.synthesize, sess.failed
    atomic_write_json(errors_path(run_dir), {"failed_samples": failed, "interrupted": sess.interrupted,
                                             "errors": stats.errors, "circuit_breaker_open": stats.circuit_breaker_open})
    st.finish(stats, complete=False)
    ids_s = ", ".join(f["id"] for f in failed[:20]) + (" ..." if len(failed) > 20 else "")
    kinds = Counter(f["kind"] for f in failed)
    why = (f"circuit breaker opened after {syn.server.breaker_failures} consecutive failed samples"
           if stats.circuit_breaker_open
           else f"{len(failed)} samples failed (synthesize.max_failed_samples = {syn.max_failed_samples})")
    last = failed[-1]["message"] if failed else ""
    return SynthesisError(
        f"Stage 1 stopped: {why}. Failed sample ids: {ids_s} (kinds: {dict(kinds)}; last error: {last}). "
        f"{stats.samples} samples written so far are kept in {store.path}; details in {errors_path(run_dir)}. "
        f"Fix the server and re-run to resume."
    )


def run(params: Params, run_dir: str | Path) -> SynthesizeStats:
    """Run stage 1: synthesize ``samples.jsonl`` (resumable), then stats and figures.

    Args:
        params: validated run params.
        run_dir: the run directory.

    Returns:
        SynthesizeStats: what ``stats.json`` holds.

    Raises:
        PromptsError: unreadable prompt sources (see :mod:`eagle3.prompts`).
        SynthesisError: the circuit breaker opened, more than ``max_failed_samples`` samples failed
            (``stats.json`` then says ``complete: false`` and lists them; ``errors.json`` too), or
            ``samples.jsonl`` is corrupt (:class:`~eagle3.contracts.samples.SamplesError`). Samples
            written before stay; re-running resumes.
        TargetError: the target cannot be loaded.
    """
    if params.synthesize.backend != "vllm" or completed_stats(run_dir, SYNTHESIZE, SynthesizeStats) is not None:
        # a finished stage normally returns at once (nothing printed, no log file touched)
        return _run(params, Path(run_dir))
    log = stage_dir(run_dir, SYNTHESIZE) / ENGINE_LOG
    print(f"vLLM engine log: {log}", flush=True)  # the engine's INFO/WARNING lines go there, not here
    with engine_logs_to(log):
        return _run(params, Path(run_dir))


def _run(params: Params, run_dir: Path) -> SynthesizeStats:
    shared: list = []  # vLLM: the engine that writes the self-prompts answers them too (one engine start)
    try:
        return _run_stage(params, Path(run_dir), shared)
    finally:
        for be in shared:
            be.close()


def prepare_self_sources(params: Params, run_dir: str | Path, progress: Progress | None = None,
                         backend: Backend | None = None) -> tuple[list[PromptSource], list[dict]]:
    """Write the prompts of every ``kind: self`` source with the target and return the sources with
    each replaced by a ``kind: file`` source of them, and one stats dict per self source
    (:func:`eagle3.synthesize.self_prompt.run.write_self_prompts`, files in ``self_prompts/``).

    Args:
        params: run params.
        run_dir: the run directory.
        progress: stage 1's ``progress.json`` while the target writes prompts (None: none).
        backend: an open backend to sample with (the vLLM engine that answers the prompts afterwards:
            one engine start instead of two), left open. None: the backend of ``synthesize.backend``
            is opened on first need and closed at the end.

    Raises:
        SynthesisError, SelfPromptError: see :func:`~eagle3.synthesize.self_prompt.run.write_self_prompts`.
        TargetError: the target cannot be loaded.
    """
    opened: list[Backend] = []

    def open_backend() -> Backend:
        if backend is not None:
            return backend
        opened.append(user_turn_backend(params))
        return opened[-1]

    try:
        return write_self_prompts(params, run_dir, open_backend, progress, sampling_variant(params))
    finally:
        for be in opened:
            be.close()


def _self_sources(params: Params, run_dir: Path, shared: list) -> tuple[SynthesizeParams, list[dict]]:
    """``params.synthesize`` with each ``kind: self`` source replaced by the file source of the prompts
    the target wrote (resumable, ``self_prompts/``; loaded with the label ``self``), and their stats;
    the settings unchanged and no stats when there is no self source.

    ``progress.json`` counts the prompts kept meanwhile (the stage's :class:`StageRun` replaces it);
    it is not opened when every self source is written already (a finished stage rewrites nothing).
    ``shared`` receives the vLLM engine opened here, which then answers the prompts too.
    """
    syn = params.synthesize
    if not any(src.kind == "self" for src in syn.sources):
        return syn, []
    prog = None
    if self_sources_pending(params, run_dir):
        sdir = stage_dir(run_dir, SYNTHESIZE)
        total = sum(src.self_prompt.count for src in syn.sources if src.kind == "self")
        prog = Progress(sdir, total=total, unit="self prompts", desc=f"{sdir.name} self-prompting")
    try:
        if prog is not None and syn.backend == "vllm":
            shared.append(make_backend(params))
        sources, self_stats = prepare_self_sources(params, run_dir, progress=prog, backend=shared[0] if shared else None)
    except BaseException as exc:
        if prog is not None:
            prog.extra["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            prog.close("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
        raise
    if prog is not None:
        prog.close("running")  # stage 1 goes on: answering the prompts
    return syn.model_copy(update={"sources": sources}), self_stats


def _load(params: Params, run_dir: Path, shared: list) -> tuple[list[Prompt], LoadReport, list[dict]]:
    """The prompts to answer (self sources written first), the load report and the self-prompting stats."""
    syn, self_stats = _self_sources(params, run_dir, shared)
    prompts, report = load_prompts(syn)
    for row, src in zip(report.sources, params.synthesize.sources, strict=True):
        if src.kind == "self":  # loaded from the file the target wrote; the sources table says where it came from
            row["kind"] = "self"
    return prompts, report, self_stats


def _finish(params: Params, run_dir: Path, st: StageRun, stats: SynthesizeStats, self_stats: list[dict]) -> None:
    """Figures, ``stats.json`` and the console line of a complete stage."""
    errors_path(run_dir).unlink(missing_ok=True)
    figures = make_figures(run_dir)
    if self_stats:
        figures.update(self_prompt_figures(run_dir))
    for name, fig in figures.items():
        st.figure(name, fig)
    st.finish(stats, log=True)
    print(f"eagle3 synthesize: {skip_summary(stats.to_dict())}", flush=True)  # the console sees this line


def _run_stage(params: Params, run_dir: Path, shared: list) -> SynthesizeStats:
    t_start = time.time()
    prompts, report, self_stats = _load(params, run_dir, shared)
    ids = [p.id for p in prompts]
    store = SampleStore(samples_path(run_dir))
    finished = completed_stats(run_dir, SYNTHESIZE, SynthesizeStats)
    if finished is not None and set(store.done) == set(ids):
        # nothing to generate: a finished stage is returned as it is, no file rewritten; the console
        # (and notebook 01 opened on the run) still get the one line of what was skipped
        store.close()
        print(f"eagle3 synthesize: {skip_summary(finished.to_dict())} (stage 1 already complete)", flush=True)
        return finished
    try:
        resumed_from = sum(1 for i in ids if i in store.done)
        with StageRun(params, run_dir, SYNTHESIZE, total=len(prompts), unit="samples", done=resumed_from,
                      tokens=sum(store.done.get(i, 0) for i in ids)) as st:
            with open(timeline_path(run_dir), "a", encoding="utf-8") as timeline:
                settings = _settings(params, None)
                if self_stats:  # each sample records the self-prompting settings beside the generation ones
                    settings["self_prompt"] = {str(x["source_index"]): x["settings"] for x in self_stats}
                sess = Session(store=store, progress=st.progress, settings=settings, timeline=timeline)
                out = _generate(params, [p for p in prompts if p.id not in store.done], sess,
                                backend=shared[0] if shared else None)
            ok = not out.tripped and len(sess.failed) <= params.synthesize.max_failed_samples
            extra = store.finalize(ids) if ok else 0
            store.close()
            stats = _stats(params, run_dir, read_samples(run_dir), report, sess, store, out, extra, resumed_from, t_start)
            if self_stats:  # filter counts, diversity, settings of each kind: self source
                stats.prompts["self_prompt"] = self_stats
            if not ok:
                raise _stopped(params, run_dir, stats, sess, store, st)
            _finish(params, run_dir, st, stats, self_stats)
    finally:
        store.close()
    return stats
