"""The self-prompting loop: fixed batches of requests, sampled by a stage 1 backend, judged by the
filters, until ``count`` prompts are kept (and, multi-turn, a follow-up user turn for each).

The idea and the recipe are Magpie's (Xu et al. 2024, "Magpie: Alignment Data Synthesis from
Scratch by Prompting Aligned LLMs with Nothing"): an aligned model, given only the pre-query
template, writes a plausible user query.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from eagle3.config import SelfPromptParams
from eagle3.errors import SelfPromptError
from eagle3.synthesize.self_prompt.filters import NGRAM, PromptFilter, distinct_n
from eagle3.synthesize.self_prompt.template import (
    SelfPrompt,
    UserTurn,
    UserTurnRequest,
    followup_request,
    plan_requests,
)

__all__ = ["UserTurnSampler", "SelfPromptResult", "max_attempts", "settings_record", "run_self_prompting"]


class UserTurnSampler(Protocol):
    """What self-prompting needs of a stage 1 backend (:mod:`eagle3.synthesize.local`,
    :mod:`eagle3.synthesize.server`): the target's tokenizer, user-turn sampling and greedy answers."""

    tok: Any

    def sample_user_turns(self, reqs: list[UserTurnRequest], settings: SelfPromptParams) -> list[UserTurn]: ...

    def answer_user_turns(self, convs: list[list[dict]]) -> list[str]: ...


def max_attempts(settings: SelfPromptParams) -> int:
    """The most first-turn candidates sampled: ``max_attempts``, default ``4 * count``."""
    return settings.max_attempts if settings.max_attempts is not None else 4 * settings.count


def settings_record(settings: SelfPromptParams) -> dict:
    """JSON-ready settings, recorded per sample, in ``stats.json`` and in the fingerprint of
    ``self_prompts/source_N.meta.json``: the fields in order, with the shingle size ``ngram``
    (:data:`~eagle3.synthesize.self_prompt.filters.NGRAM`) after ``near_dup_threshold``; ``top_k``
    only when set, so self-prompts written without it keep their fingerprint (resume stays allowed)."""
    out: dict = {}
    for key, value in settings.model_dump().items():
        if key == "top_k" and not value:
            continue
        if key == "max_attempts":
            out["ngram"] = NGRAM
        out[key] = value
    return out


@dataclass
class SelfPromptResult:
    """Kept prompts and the counts.

    Attributes:
        prompts: kept prompts in request order.
        counts: first-turn candidates by :data:`~eagle3.synthesize.self_prompt.filters.FILTER_REASONS`
            (sum = ``attempts``).
        followup_counts: follow-up candidates by reason (multi-turn only).
        attempts: first-turn candidates judged.
        tokens: generated tokens (all candidates, both turns).
    """

    prompts: list[SelfPrompt]
    counts: dict
    followup_counts: dict
    attempts: int
    tokens: int

    def stats(self, settings: SelfPromptParams) -> dict:
        """JSON-ready numbers for ``stats.json`` (with distinct-1/2 of the kept first turns)."""
        users = [p.user for p in self.prompts]
        lens = sorted(len(u) for u in users)
        return {
            "requested": settings.count,
            "kept": len(self.prompts),
            "attempts": self.attempts,
            "filtered": dict(self.counts),
            "followup_filtered": dict(self.followup_counts),
            "multi_turn_kept": sum(p.followup is not None for p in self.prompts),
            "generated_tokens": self.tokens,
            "distinct_1": round(distinct_n(users, 1), 4),
            "distinct_2": round(distinct_n(users, 2), 4),
            "chars_median": lens[len(lens) // 2] if lens else None,
        }


@dataclass
class _Loop:
    """The state of one self-prompting run: kept prompts, candidates sampled, tokens."""

    backend: UserTurnSampler
    settings: SelfPromptParams
    batch_size: int
    template_kwargs: dict | None
    on_progress: Callable[[int, int, int], None] | None
    filt: PromptFilter
    kept: list[SelfPrompt]
    sampled: int = 0
    tokens: int = 0

    def plan(self, start: int, stop: int) -> list[UserTurnRequest]:
        return plan_requests(self.backend.tok, self.settings, range(start, stop), self.template_kwargs)

    def consume(self, reqs: list[UserTurnRequest], cands: Sequence[UserTurn]) -> None:
        """Judge a batch's candidates in order; those after the count is reached are not judged."""
        for req, cand in zip(reqs, cands):
            self.tokens += cand.num_tokens
            if len(self.kept) < self.settings.count and self.filt(cand) == "kept":
                self.kept.append(SelfPrompt(req.index, req.system, req.topic, cand.text.strip()))
        self.sampled = reqs[-1].index + 1 if reqs else self.sampled

    def report(self) -> None:
        if self.on_progress is not None:
            self.on_progress(len(self.kept), self.sampled, self.tokens)

    def followups(self) -> dict:
        """The target answers each kept prompt and writes a follow-up user turn; the follow-up counts."""
        ffilt = PromptFilter(self.settings, dedup=False)
        for start in range(0, len(self.kept), self.batch_size):
            chunk = self.kept[start:start + self.batch_size]
            answers = self.backend.answer_user_turns([p.turns()[0] for p in chunk])
            reqs = [followup_request(self.backend.tok, self.settings, p, a, self.template_kwargs)
                    for p, a in zip(chunk, answers)]
            for p, a, c in zip(chunk, answers, self.backend.sample_user_turns(reqs, self.settings)):
                self.tokens += c.num_tokens
                if ffilt(c) == "kept":
                    p.followup, p.answer = c.text.strip(), a
            self.report()
        return dict(ffilt.counts)


def run_self_prompting(backend: UserTurnSampler, settings: SelfPromptParams, *, batch_size: int = 8,
                       template_kwargs: dict | None = None, done: Sequence[UserTurn] = (),
                       on_batch: Callable[[list[UserTurnRequest], list[UserTurn]], None] | None = None,
                       on_progress: Callable[[int, int, int], None] | None = None,
                       ) -> SelfPromptResult:
    """Write ``settings.count`` user prompts with the target (and follow-ups when ``multi_turn``).

    Requests are made in fixed batches of ``batch_size`` (request numbers ``b*batch_size ...``), so
    the candidates, and hence the kept prompts, depend only on the settings, the batch size and the
    backend's seeded sampling: the same seed gives the same prompts, and a run resumed from the
    candidates of its finished batches (``done``) gives the same prompts as one uninterrupted run.

    Args:
        backend: a stage 1 backend (:class:`UserTurnSampler`): the tokenizer, user-turn sampling,
            and (multi-turn) the target's answers.
        settings: a ``kind: self`` source's settings.
        batch_size: requests per ``sample_user_turns`` call.
        template_kwargs: chat-template variables (``{"enable_thinking": bool}`` or ``{}``).
        done: first-turn candidates of earlier runs, in request order (resume).
        on_batch: called after each sampled first-turn batch (to persist the candidates).
        on_progress: called after each first-turn batch (replayed ones included) and each
            follow-up batch with ``(kept prompts, candidates sampled, tokens sampled)`` so far
            (stage 1 keeps ``progress.json`` current with it).

    Returns:
        SelfPromptResult

    Raises:
        SelfPromptError: a backend returning the wrong number of candidates; see
            :func:`~eagle3.synthesize.self_prompt.template.user_turn_format`.
    """
    loop = _Loop(backend, settings, batch_size, template_kwargs, on_progress, PromptFilter(settings), [])
    # Replay candidates of earlier runs (their requests are re-planned: a pure function of the index).
    for start in range(0, len(done), batch_size):
        chunk = list(done[start:start + batch_size])
        loop.consume(loop.plan(start, start + len(chunk)), chunk)
    loop.report()
    limit = max_attempts(settings)
    while len(loop.kept) < settings.count and loop.sampled < limit:
        reqs = loop.plan(loop.sampled, min(loop.sampled + batch_size, limit))
        cands = backend.sample_user_turns(reqs, settings)
        if len(cands) != len(reqs):
            raise SelfPromptError(f"backend returned {len(cands)} candidates for {len(reqs)} requests")
        if on_batch is not None:
            on_batch(reqs, cands)
        loop.consume(reqs, cands)
        loop.report()
    # Candidates sampled in the last batch after the count was reached are not judged (not counted).
    counted = sum(loop.filt.counts.values())
    follow = loop.followups() if settings.multi_turn else {}
    return SelfPromptResult(loop.kept, dict(loop.filt.counts), follow, counted, loop.tokens)
