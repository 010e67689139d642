"""Stage 1's ``kind: self`` sources: the target writes their prompts into ``01_synthesize/self_prompts/``
(resumable), and each such source is replaced by a ``kind: file`` source of them. The one writer
(:func:`write_self_prompts`) and reader (:func:`self_prompts_dir`, :func:`self_sources_pending`,
:mod:`~eagle3.synthesize.self_prompt.report`) of that folder.

Files (``N`` = the source's position in ``synthesize.sources``):

* ``source_N.meta.json``: the settings and their fingerprint (target, template variables,
  batch size included); a run dir written with other settings is refused, never reused.
* ``source_N.candidates.jsonl``: every sampled first-turn candidate, appended one whole batch at
  a time (``{"batch", "index", "text", "finish_reason", "num_tokens"}``). A killed run resumes
  from its whole batches, and as sampling is seeded per batch, writes the same prompts.
* ``source_N.jsonl``: the kept prompts as OpenAI-style records (``messages``: the steering system
  prompt only with ``keep_system_prompt``, user, and with a follow-up an empty assistant
  placeholder and the second user turn; ``self_prompt``: index, topic, system), written
  atomically once complete; a finished source is not sampled again.
* ``source_N.stats.json``: :meth:`~eagle3.synthesize.self_prompt.sampling.SelfPromptResult.stats`
  (filter counts, distinct-1/2, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.chat import template_kwargs
from eagle3.config import Params, PromptSource, SelfPromptParams
from eagle3.errors import SynthesisError
from eagle3.io import atomic_write_json, atomic_write_text, read_json, read_jsonl
from eagle3.rundir import SELF_PROMPTS_DIR, RunDir
from eagle3.stage import Progress
from eagle3.synthesize.self_prompt.sampling import (
    SelfPromptResult,
    UserTurnSampler,
    max_attempts,
    run_self_prompting,
    settings_record,
)
from eagle3.synthesize.self_prompt.template import UserTurn, UserTurnRequest
from eagle3.target import target_dtype

__all__ = ["self_prompts_dir", "self_sources_pending", "write_self_prompts"]


def self_prompts_dir(run_dir, create: bool = False) -> Path:
    """``01_synthesize/self_prompts/`` of a run (created with ``create``)."""
    d = RunDir(run_dir).stage(1, create=create) / SELF_PROMPTS_DIR
    if create:
        d.mkdir(parents=True, exist_ok=True)
    return d


@dataclass(frozen=True)
class _Files:
    """The four files of self source ``index`` (see the module docstring)."""

    dir: Path
    index: int

    @property
    def meta(self) -> Path:
        return self.dir / f"source_{self.index}.meta.json"

    @property
    def candidates(self) -> Path:
        return self.dir / f"source_{self.index}.candidates.jsonl"

    @property
    def prompts(self) -> Path:
        return self.dir / f"source_{self.index}.jsonl"

    @property
    def stats(self) -> Path:
        return self.dir / f"source_{self.index}.stats.json"

    def finished(self) -> bool:
        return self.prompts.is_file() and self.stats.is_file()


def self_sources_pending(params: Params, run_dir) -> bool:
    """True when some ``kind: self`` source of ``synthesize.sources`` has no finished prompt file
    (``source_N.jsonl`` and ``source_N.stats.json``) in the run dir yet, i.e. the target still has
    prompts to write (stage 1 opens its self-prompting ``progress.json`` only then)."""
    d = self_prompts_dir(run_dir)
    return any(src.kind == "self" and not _Files(d, i).finished() for i, src in enumerate(params.synthesize.sources))


def _fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _meta(params: Params, settings: SelfPromptParams, variant: dict) -> dict:
    """What the prompts of a self source depend on, with its fingerprint."""
    syn = params.synthesize
    meta = {"settings": settings_record(settings), "backend": syn.backend, "target": params.target.model,
            "dtype": target_dtype(params.target), "template_kwargs": template_kwargs(params),
            "batch_size": syn.batch_size, "answer_max_new_tokens": syn.max_new_tokens, **variant}
    meta["fingerprint"] = _fingerprint(meta)
    return meta


def _complete_batches(rows: list[dict], batch_size: int, limit: int) -> list[dict]:
    """The rows of the leading batches that were written whole (a batch is appended in one write,
    but a kill can tear it); later rows are dropped and sampled again."""
    out: list[dict] = []
    b = 0
    while True:
        want = min(batch_size, limit - b * batch_size)
        chunk = [r for r in rows if r.get("batch") == b]
        if want <= 0 or len(chunk) != want or [r["index"] for r in chunk] != list(range(b * batch_size, b * batch_size + want)):
            return out
        out += chunk
        b += 1


def _records(res: SelfPromptResult, settings: SelfPromptParams) -> list[dict]:
    """The kept prompts as OpenAI-style records (``source_N.jsonl``)."""
    recs = []
    for p in res.prompts:
        # the steering system prompt stays only when asked for (keep_system_prompt): by
        # default the target answers, and the drafter trains, under the template's default
        keep = settings.keep_system_prompt and p.system
        msgs = ([{"role": "system", "content": p.system}] if keep else []) + [{"role": "user", "content": p.user}]
        if p.followup:
            msgs += [{"role": "assistant", "content": ""}, {"role": "user", "content": p.followup}]
        recs.append({"messages": msgs, "self_prompt": {"index": p.index, "topic": p.topic, "system": p.system}})
    return recs


@dataclass
class _Writer:
    """Writes the prompts of the self sources with one backend (opened on first need) and keeps
    stage 1's ``progress.json`` counting prompts kept and tokens sampled over all of them."""

    params: Params
    open_backend: Callable[[], UserTurnSampler]
    progress: Progress | None
    variant: dict = field(default_factory=dict)
    backend: UserTurnSampler | None = None
    kept_before: int = 0  # earlier self sources' share of the progress counts
    tokens_before: int = 0

    def open(self) -> UserTurnSampler:
        if self.backend is None:
            self.backend = self.open_backend()
        return self.backend

    def report(self, index: int, kept: int, sampled: int, tokens: int) -> None:
        if self.progress is not None:
            self.progress.update(self.kept_before + kept - self.progress.done,
                                 self.tokens_before + tokens - self.progress.tokens,
                                 phase="self-prompting", self_source=index, candidates=sampled)

    def sample(self, files: _Files, settings: SelfPromptParams, meta: dict, label: str) -> None:
        """Sample one self source (resuming from its whole batches); write its prompts and stats."""
        syn = self.params.synthesize
        atomic_write_json(files.meta, meta)
        backend = self.open()
        rows = _complete_batches(read_jsonl(files.candidates, missing_ok=True), syn.batch_size, max_attempts(settings))
        atomic_write_text(files.candidates, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        done = [UserTurn(r["text"], r["finish_reason"], r["num_tokens"]) for r in rows]
        with open(files.candidates, "a", encoding="utf-8") as fh:
            def persist(reqs: list[UserTurnRequest], cands: list[UserTurn]) -> None:
                b = reqs[0].index // syn.batch_size
                fh.write("".join(json.dumps({"batch": b, "index": r.index, "text": c.text, "finish_reason": c.finish_reason,
                                             "num_tokens": c.num_tokens}, ensure_ascii=False) + "\n"
                                 for r, c in zip(reqs, cands)))
                fh.flush()
                os.fsync(fh.fileno())

            res = run_self_prompting(backend, settings, batch_size=syn.batch_size, template_kwargs=template_kwargs(self.params),
                                     done=done, on_batch=persist,
                                     on_progress=lambda k, s, t: self.report(files.index, k, s, t))
        recs = _records(res, settings)
        if not recs:
            raise SynthesisError(f"synthesize.sources[{files.index}] (kind: self): no prompt survived the filters "
                                 f"({res.counts}); raise max_new_tokens or max_attempts")
        st = {"source_index": files.index, "label": label, **res.stats(settings),
              "settings": settings_record(settings), "resumed_candidates": len(done)}
        atomic_write_json(files.stats, st)
        atomic_write_text(files.prompts, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))

    def source(self, index: int, src: PromptSource, d: Path) -> tuple[PromptSource, dict]:
        """The file source replacing self source ``index`` and its stats (sampled now or read back)."""
        files, settings = _Files(d, index), src.self_prompt
        meta = _meta(self.params, settings, self.variant)
        old = read_json(files.meta)
        if old is not None and old.get("fingerprint") != meta["fingerprint"]:
            raise SynthesisError(
                f"{files.meta}: self-prompts in this run dir were written with other settings "
                f"({old.get('settings')} vs {meta['settings']}); use another run name or delete {d}")
        label = src.label or "self"
        sampled_now = not files.finished()
        if sampled_now:
            self.sample(files, settings, meta, label)
        stats = read_json(files.stats)
        self.kept_before += stats.get("kept", 0)
        self.tokens_before += stats.get("generated_tokens", 0)
        if self.progress is not None:
            # a source finished by an earlier run is counted as resumed: in done and tokens, not in
            # the rates (restored prompts would otherwise read as millions of tokens per second)
            self.progress.extra.update(phase="self-prompting", self_source=index)
            count = self.progress.update if sampled_now else self.progress.resumed
            count(self.kept_before - self.progress.done, self.tokens_before - self.progress.tokens)
        return PromptSource(kind="file", path=str(Path(files.prompts).resolve()), format="openai", label=label,
                            limit=src.limit), stats


def write_self_prompts(params: Params, run_dir, open_backend: Callable[[], UserTurnSampler],
                       progress: Progress | None = None, variant: dict | None = None,
                       ) -> tuple[list[PromptSource], list[dict]]:
    """Write the prompts of every ``kind: self`` source of ``synthesize.sources`` with the target
    (files: see the module docstring), and return the sources with each such source replaced by a
    ``kind: file`` source of them.

    The replacing source has ``label`` ``"self"`` (unless the source names one), so each sample
    records ``source: self``; stage 1 then answers these prompts like any other (dedup, split, limits).

    Args:
        params: run params (``target``, ``synthesize``).
        run_dir: the run directory.
        open_backend: returns the stage 1 backend to sample with; called once, on first need (not
            at all when every self source is written already); the caller closes it.
        progress: stage 1's ``progress.json`` while the target writes prompts: ``done`` = prompts
            kept over all self sources, ``total`` = their ``count`` sum, ``tokens`` = tokens sampled,
            ``extra`` = ``{"phase": "self-prompting", "self_source", "candidates"}``. None: no progress file.
        variant: what about the backend changes the sampled numbers beyond the params (e.g.
            ``{"transformers_batching": "continuous"}``); part of the fingerprint.

    Returns:
        ``(sources, stats)``: the new source list and one stats dict per self source (with
        ``source_index``, ``label`` and ``settings``).

    Raises:
        SynthesisError: self-prompt files written with other settings, or no prompt surviving the
            filters. SelfPromptError: the chat template cannot be cut into a user-turn prefix, or
            the server refused a request or kept failing.
    """
    writer = _Writer(params, open_backend, progress, dict(variant or {}))
    out_sources, all_stats = [], []
    for i, src in enumerate(params.synthesize.sources):
        if src.kind != "self":
            out_sources.append(src)
            continue
        source, stats = writer.source(i, src, self_prompts_dir(run_dir, create=True))
        out_sources.append(source)
        all_stats.append(stats)
    return out_sources, all_stats
