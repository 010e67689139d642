"""Self-prompting (Magpie-style): the target writes the user turns itself.

The chat template is rendered up to and including the user-turn header (derived from the target's
own template: a conversation whose last user message is a sentinel is rendered and cut before the
sentinel), and the target samples the user message at a high temperature until the template's
end-of-turn token. The idea and the recipe are Magpie's (Xu et al. 2024, "Magpie: Alignment Data
Synthesis from Scratch by Prompting Aligned LLMs with Nothing"): an aligned model, given only the
pre-query template, writes a plausible user query.

The module is backend-agnostic. It produces :class:`SelfPromptRequest` (the prefix as text and as
token ids, the stop ids, a per-request seed) and consumes :class:`Candidate` (the generated text and
why it stopped), so any backend can drive it:

* transformers: :class:`TransformersDriver` (batched left-padded sampling, here);
* vLLM offline: ``LLM.generate`` on ``TokensPrompt(prompt_token_ids=req.prefix_ids)`` with
  ``SamplingParams(stop_token_ids=req.stop_ids, seed=req.seed, skip_special_tokens=True)``;
* an OpenAI-compatible server: ``POST /v1/completions`` with ``prompt=req.prefix_text`` (the raw
  rendered prefix, no chat endpoint) and ``stop_token_ids`` / ``stop=[fmt.end_text]``.

Filters (:class:`PromptFilter`), applied in this order, each counted (the counts add up to the
candidates seen): ``not_terminated`` (no end-of-turn within ``max_new_tokens``), ``empty``,
``too_short``, ``too_long``, ``garbage`` (mostly non-text, long character runs, a few words
repeated), ``refusal`` (the "user" refuses or speaks as an assistant), ``exact_duplicate``
(normalised text), ``near_duplicate`` (word n-gram Jaccard ≥ threshold, candidates found with MinHash
LSH, then checked exactly); the rest are ``kept``. datasketch (MinHash LSH on PyPI) was considered:
it pulls in scipy (not otherwise installed), so the few lines of MinHash/LSH here are used instead.

Diversity: :func:`distinct_n` (distinct-1/2: unique word n-grams over all n-grams, Li et al. 2016).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import struct
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagle3.rundir import SELF_PROMPTS_DIR  # the folder of 01_synthesize/ the target's prompts go to

__all__ = [
    "SelfPromptError",
    "SENTINEL",
    "FILTER_REASONS",
    "UserTurnFormat",
    "user_turn_format",
    "SelfPromptSettings",
    "SelfPromptRequest",
    "Candidate",
    "SelfPrompt",
    "SelfPromptResult",
    "NearDuplicateIndex",
    "PromptFilter",
    "plan_requests",
    "followup_request",
    "run_self_prompting",
    "distinct_n",
    "TransformersDriver",
    "VllmDriver",
    "ServerDriver",
    "prepare_self_sources",
    "self_sources_pending",
]

# A user message no template rewrites (no leading/trailing whitespace, no markup); it must appear
# exactly once in the render, which is checked.
SENTINEL = "SELFPROMPTSENTINEL7f3a"

FILTER_REASONS = (
    "not_terminated",
    "empty",
    "too_short",
    "too_long",
    "garbage",
    "refusal",
    "exact_duplicate",
    "near_duplicate",
    "kept",
)

# The "user" refuses or writes as the assistant (Magpie's typical failure on small targets).
_REFUSAL = re.compile(
    r"^\W*(i'?m sorry|i am sorry|sorry,? (but )?i|i can(not|'t)|i am (not able|unable)|i'?m (not able|unable)|"
    r"as an ai\b|i am an ai\b|i'?m an ai\b|i apologi[sz]e|i won'?t be able|unfortunately,? i (can|am))",
    re.IGNORECASE,
)
_WORD = re.compile(r"\w+", re.UNICODE)


class SelfPromptError(ValueError):
    """The chat template cannot be cut into a user-turn prefix, or self-prompting settings are invalid."""


# ----------------------------------------------------------------------------- the template


@dataclass(frozen=True)
class UserTurnFormat:
    """What the chat template puts around one user message.

    Attributes:
        prefix_text: the render of the conversation up to and including the user-turn header
            (e.g. SmolLM2: ``"<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n"``).
        end_text: what the template writes right after the user message (``"<|im_end|>\\n"``).
        eot_ids: token ids that end a user turn: the first token of ``end_text`` when it is a
            special token, else the tokenizer's EOS ids (a template without a special end marker).
    """

    prefix_text: str
    end_text: str
    eot_ids: tuple[int, ...]


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, t in added.items() if getattr(t, "special", False))
    return ids


def _eos_ids(tokenizer, model=None) -> list[int]:
    """Sorted eos ids of the tokenizer and the model's generation config (:func:`eagle3.chat.eos_ids`)."""
    from eagle3.chat import eos_ids

    return sorted(set(eos_ids(tokenizer, None, getattr(model, "generation_config", None))))


def user_turn_format(tokenizer, system: str | None = None, history: Sequence[dict] = (),
                     template_kwargs: dict | None = None) -> UserTurnFormat:
    """Cut the target's chat template at the start of a new user message.

    Renders ``[system?] + history + [{"role": "user", "content": SENTINEL}]`` with
    ``add_generation_prompt=False`` and splits at the sentinel.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        system: a system prompt (None: the template's own default, if it has one).
        history: earlier ``{"role", "content"}`` messages (for a follow-up user turn).
        template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``).

    Returns:
        UserTurnFormat

    Raises:
        SelfPromptError: the sentinel is missing from the render or appears more than once
            (a template that rewrites or drops user content cannot be self-prompted this way).
    """
    msgs = ([{"role": "system", "content": system}] if system else []) + [dict(m) for m in history]
    msgs.append({"role": "user", "content": SENTINEL})
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, **(template_kwargs or {}))
    if text.count(SENTINEL) != 1:
        raise SelfPromptError(
            f"the chat template rendered the sentinel user message {text.count(SENTINEL)} times "
            f"(expected once); cannot derive the user-turn header from it"
        )
    prefix, end = text.split(SENTINEL)
    end_ids = tokenizer(end, add_special_tokens=False)["input_ids"] if end else []
    if end_ids and end_ids[0] in _special_ids(tokenizer):
        eot = (int(end_ids[0]),)
    else:
        eot = tuple(_eos_ids(tokenizer))
    if not eot:
        raise SelfPromptError("the chat template ends a user turn without a special token and the tokenizer has no EOS")
    return UserTurnFormat(prefix, end, eot)


# ----------------------------------------------------------------------------- settings and requests


@dataclass
class SelfPromptSettings:
    """How many prompts to write and how.

    Attributes:
        count: user prompts to keep.
        temperature, top_p, top_k: sampling of the user turn (Magpie samples at 1.0; higher = more
            diverse; ``top_k`` 0 = off).
        max_new_tokens: limit of one user turn in tokens (a turn not ended by then is dropped).
        system_prompts: system prompts cycled over requests (empty: the template's default).
        seed_topics: topics cycled over requests; each is added to the system prompt with
            ``topic_template`` to steer what the user asks about (empty: no steering).
        topic_template: format string with ``{topic}``.
        multi_turn: also let the target write a follow-up user turn after its first answer.
        keep_system_prompt: keep the steering system prompt in the conversation stage 1 answers (and
            the drafter trains on). False: it only steers the user turn; the answer is written under
            the template's default system prompt, as general chat is served (a drafter trained under
            "The user will ask you about physics." saw another context than it serves in).
        seed: base seed; request ``i`` samples with :func:`_request_seed` of (seed, kind, i).
        min_chars, max_chars: length filter of a user turn (characters after stripping).
        min_words: fewer words than this is ``too_short``.
        near_dup_threshold: word n-gram Jaccard at or above which a prompt is a near duplicate.
        ngram: n of the word n-grams (shingles) for near duplicates.
        max_attempts: candidates sampled at most (default ``4 * count``) before giving up short.
    """

    count: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    system_prompts: list[str] = field(default_factory=list)
    seed_topics: list[str] = field(default_factory=list)
    topic_template: str = "The user will ask you about {topic}."
    multi_turn: bool = False
    keep_system_prompt: bool = False
    seed: int = 0
    min_chars: int = 12
    max_chars: int = 2000
    min_words: int = 3
    near_dup_threshold: float = 0.6
    ngram: int = 3
    max_attempts: int | None = None

    def attempts(self) -> int:
        """The most candidates sampled for first turns."""
        return self.max_attempts if self.max_attempts is not None else 4 * self.count

    def to_dict(self) -> dict:
        """JSON-ready settings (recorded per sample and in ``stats.json``). ``top_k`` only when set, so
        that self-prompts written before it existed keep their fingerprint (resume stays allowed)."""
        d = asdict(self)
        if not d["top_k"]:
            del d["top_k"]
        return d


@dataclass
class SelfPromptRequest:
    """One prefix for the backend to continue.

    Attributes:
        index: request number (0, 1, ...; follow-ups share their first turn's index).
        kind: ``"first"`` or ``"followup"``.
        system: the system prompt rendered (None = the template's default).
        topic: the seed topic steering it (or None).
        history: the messages before the new user turn (follow-ups: system?, user, assistant).
        prefix_text: rendered prefix ending with the user-turn header.
        prefix_ids: ``prefix_text`` tokenized without extra special tokens (list[int]).
        stop_ids: end-of-turn ids (:attr:`UserTurnFormat.eot_ids`).
        end_text: what the template writes after a user message (a stop string for servers).
        seed: the sampling seed of this request (int < 2**31).
    """

    index: int
    kind: str
    system: str | None
    topic: str | None
    history: list[dict]
    prefix_text: str
    prefix_ids: list[int]
    stop_ids: tuple[int, ...]
    end_text: str
    seed: int


@dataclass
class Candidate:
    """What a backend generated for one request.

    Attributes:
        text: the user message (decoded without special tokens, the end-of-turn token excluded).
        finish_reason: ``"stop"`` when an id of ``stop_ids`` ended it, ``"length"`` at
            ``max_new_tokens``, ``"eos"`` when another EOS id ended it.
        num_tokens: generated tokens including the end-of-turn token.
        token_ids: the generated ids (optional; the transformers driver fills them).
    """

    text: str
    finish_reason: str
    num_tokens: int = 0
    token_ids: list[int] | None = None


@dataclass
class SelfPrompt:
    """One kept self-written conversation start.

    Attributes:
        index: the request number it came from.
        system, topic: as in :class:`SelfPromptRequest`.
        user: the self-written first user message.
        followup: the self-written second user message (multi-turn), or None.
        answer: the target's first answer used to write ``followup`` (not a training target:
            stage 1 regenerates the assistant turns).
    """

    index: int
    system: str | None
    topic: str | None
    user: str
    followup: str | None = None
    answer: str | None = None

    def turns(self) -> list[list[dict]]:
        """Turn groups as :class:`eagle3.prompts.Prompt` holds them (one group per assistant turn)."""
        first = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": self.user}]
        return [first] + ([[{"role": "user", "content": self.followup}]] if self.followup else [])


@dataclass
class SelfPromptResult:
    """Kept prompts and the counts.

    Attributes:
        prompts: kept prompts in request order.
        counts: first-turn candidates by :data:`FILTER_REASONS` (sum = ``attempts``).
        followup_counts: follow-up candidates by reason (multi-turn only).
        attempts: first-turn candidates sampled.
        tokens: generated tokens (all candidates, both turns).
    """

    prompts: list[SelfPrompt]
    counts: dict
    followup_counts: dict
    attempts: int
    tokens: int

    def stats(self, settings: SelfPromptSettings) -> dict:
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


def _request_seed(seed: int, kind: str, index: int) -> int:
    h = hashlib.sha256(f"{seed}\0{kind}\0{index}".encode()).digest()
    return int.from_bytes(h[:4], "little") % (2**31)


def plan_requests(tokenizer, settings: SelfPromptSettings, indices: Iterable[int],
                  template_kwargs: dict | None = None) -> list[SelfPromptRequest]:
    """First-turn requests for the given request numbers (a pure function of settings and index).

    Request ``i`` takes ``system_prompts[i % len]`` and ``seed_topics[(i // len(system_prompts)) % len]``
    (so every pair occurs when both lists are given), the topic appended to the system prompt with
    ``topic_template`` (or used alone when there is no system prompt).
    """
    systems = list(settings.system_prompts) or [None]
    topics = list(settings.seed_topics) or [None]
    fmts: dict = {}
    out = []
    for i in indices:
        system = systems[i % len(systems)]
        topic = topics[(i // len(systems)) % len(topics)]
        if topic is not None:
            steer = settings.topic_template.replace("{topic}", topic)
            system = f"{system} {steer}" if system else steer
        if system not in fmts:
            fmt = user_turn_format(tokenizer, system, (), template_kwargs)
            fmts[system] = (fmt, tokenizer(fmt.prefix_text, add_special_tokens=False)["input_ids"])
        fmt, ids = fmts[system]
        out.append(SelfPromptRequest(i, "first", system, topic, [], fmt.prefix_text, list(ids), fmt.eot_ids,
                                     fmt.end_text, _request_seed(settings.seed, "first", i)))
    return out


def followup_request(tokenizer, settings: SelfPromptSettings, prompt: SelfPrompt, answer: str,
                     template_kwargs: dict | None = None) -> SelfPromptRequest:
    """The request for the follow-up user turn after the target's ``answer`` to ``prompt.user``."""
    history = [{"role": "user", "content": prompt.user}, {"role": "assistant", "content": answer}]
    fmt = user_turn_format(tokenizer, prompt.system, history, template_kwargs)
    ids = tokenizer(fmt.prefix_text, add_special_tokens=False)["input_ids"]
    return SelfPromptRequest(prompt.index, "followup", prompt.system, prompt.topic, history, fmt.prefix_text,
                             list(ids), fmt.eot_ids, fmt.end_text,
                             _request_seed(settings.seed, "followup", prompt.index))


# ----------------------------------------------------------------------------- filters


def _normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(_WORD.findall(text))


def _shingles(text: str, n: int) -> set[str]:
    words = _normalise(text).split()
    if len(words) <= n:
        return {" ".join(words)}
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


_PRIME31 = (1 << 31) - 1  # a*h + b < 2**62 for 31-bit a, h, b: exact in uint64


class NearDuplicateIndex:
    """Near-duplicate detection on word n-gram sets: MinHash signatures, LSH banding for candidates,
    exact Jaccard to confirm (so there are no false positives; misses need J near the threshold and
    an unlucky band split).

    Signatures use the universal hashes ``(a*h + b) mod (2**31 - 1)`` of 31-bit blake2b shingle
    hashes, computed with numpy (one ``[num_perm, shingles]`` array per text; the pure-Python loop
    took ~2.5 ms per text, ~75 s for the 59K candidates of the issue-13 GPU run); the last text's
    shingles and signature are kept, so ``query`` then ``add`` of the same text hashes it once.

    Args:
        threshold: Jaccard similarity at or above which two texts are near duplicates.
        ngram: shingle size in words.
        num_perm: MinHash permutations (``bands * rows``).
        bands: LSH bands; with ``rows = num_perm // bands`` a pair of similarity s becomes a candidate
            with probability 1 - (1 - s**rows)**bands (64 perms in 32 bands of 2: 0.99 at s = 0.5).
        seed: permutation seed.
    """

    def __init__(self, threshold: float = 0.6, ngram: int = 3, num_perm: int = 64, bands: int = 32,
                 seed: int = 1) -> None:
        import numpy as np

        if num_perm % bands:
            raise SelfPromptError(f"num_perm {num_perm} is not a multiple of bands {bands}")
        self.threshold, self.ngram, self.bands, self.rows = threshold, ngram, bands, num_perm // bands
        rng = random.Random(seed)
        self._a = np.array([rng.randrange(1, _PRIME31) for _ in range(num_perm)], dtype=np.uint64)[:, None]
        self._b = np.array([rng.randrange(0, _PRIME31) for _ in range(num_perm)], dtype=np.uint64)[:, None]
        self.buckets: dict[tuple, list[int]] = {}
        self.sets: list[set[str]] = []
        self._last: tuple[str, set[str], list[tuple]] | None = None

    def _hashed(self, text: str) -> tuple[set[str], list[tuple]]:
        """``(shingles, LSH band keys)`` of a text (the last one memoised)."""
        import numpy as np

        if self._last is not None and self._last[0] == text:
            return self._last[1], self._last[2]
        sh = _shingles(text, self.ngram)
        hs = np.array([struct.unpack("<Q", hashlib.blake2b(x.encode(), digest_size=8).digest())[0] & _PRIME31
                       for x in sh], dtype=np.uint64)
        sig = ((self._a * hs[None, :] + self._b) % np.uint64(_PRIME31)).min(axis=1).tolist()
        r = self.rows
        keys = [(b, *sig[b * r:(b + 1) * r]) for b in range(self.bands)]
        self._last = (text, sh, keys)
        return sh, keys

    def query(self, text: str) -> tuple[float, int | None]:
        """Highest Jaccard with an indexed text among LSH candidates: ``(similarity, its number)``."""
        sh, keys = self._hashed(text)
        best, who = 0.0, None
        seen: set[int] = set()
        for key in keys:
            for j in self.buckets.get(key, ()):
                if j in seen:
                    continue
                seen.add(j)
                other = self.sets[j]
                jac = len(sh & other) / len(sh | other)
                if jac > best:
                    best, who = jac, j
        return best, who

    def add(self, text: str) -> int:
        """Index a text; returns its number."""
        sh, keys = self._hashed(text)
        j = len(self.sets)
        self.sets.append(sh)
        for key in keys:
            self.buckets.setdefault(key, []).append(j)
        return j


def _garbage(text: str) -> bool:
    """Mostly non-text: under half letters/digits/whitespace, a run of 24+ equal characters, or 12+
    words of which under a quarter are distinct."""
    n = len(text)
    if sum(c.isalnum() or c.isspace() for c in text) < 0.5 * n:
        return True
    if re.search(r"(.)\1{23,}", text, re.DOTALL):
        return True
    words = _normalise(text).split()
    return len(words) >= 12 and len(set(words)) < 0.25 * len(words)


class PromptFilter:
    """Stateful filter over candidates in order; duplicates are judged against earlier kept ones.

    Args:
        settings: length limits, near-duplicate threshold and n-gram size.
        dedup: check exact / near duplicates (off for follow-up turns: "thanks, and ...?" repeats).

    Attributes:
        counts: Counter over :data:`FILTER_REASONS`.
    """

    def __init__(self, settings: SelfPromptSettings, dedup: bool = True) -> None:
        self.s = settings
        self.dedup = dedup
        self.counts: Counter = Counter({r: 0 for r in FILTER_REASONS})
        self.exact: set[str] = set()
        self.near = NearDuplicateIndex(settings.near_dup_threshold, settings.ngram)

    def reason(self, cand: Candidate) -> str:
        """Why ``cand`` is dropped (a reason of :data:`FILTER_REASONS`), or ``"kept"``; not counted."""
        text = cand.text.strip()
        if cand.finish_reason != "stop":
            return "not_terminated"
        if not text:
            return "empty"
        if len(text) < self.s.min_chars or len(_WORD.findall(text)) < self.s.min_words:
            return "too_short"
        if len(text) > self.s.max_chars:
            return "too_long"
        if _garbage(text):
            return "garbage"
        if _REFUSAL.search(text):
            return "refusal"
        if self.dedup:
            if _normalise(text) in self.exact:
                return "exact_duplicate"
            if self.near.query(text)[0] >= self.s.near_dup_threshold:
                return "near_duplicate"
        return "kept"

    def __call__(self, cand: Candidate) -> str:
        """Judge, count, and (when kept) remember ``cand``; returns the reason."""
        why = self.reason(cand)
        self.counts[why] += 1
        if why == "kept" and self.dedup:
            text = cand.text.strip()
            self.exact.add(_normalise(text))
            self.near.add(text)
        return why


# ----------------------------------------------------------------------------- the loop


SampleFn = Callable[[list[SelfPromptRequest]], list[Candidate]]
AnswerFn = Callable[[list[list[dict]]], list[str]]


def run_self_prompting(tokenizer, settings: SelfPromptSettings, sample: SampleFn, *, batch_size: int = 8,
                       answer: AnswerFn | None = None, template_kwargs: dict | None = None,
                       done: Sequence[Candidate] = (),
                       on_batch: Callable[[list[SelfPromptRequest], list[Candidate]], None] | None = None,
                       on_progress: Callable[[int, int, int], None] | None = None,
                       ) -> SelfPromptResult:
    """Write ``settings.count`` user prompts with the target (and follow-ups when ``multi_turn``).

    Requests are made in fixed batches of ``batch_size`` (request numbers ``b*batch_size ...``), so
    the candidates, and hence the kept prompts, depend only on the settings, the batch size and the
    backend's seeded sampling: the same seed gives the same prompts, and a run resumed from the
    candidates of its finished batches (``done``) gives the same prompts as one uninterrupted run.

    Args:
        tokenizer: the target's tokenizer (chat template).
        settings: see :class:`SelfPromptSettings`.
        sample: backend call: requests -> one :class:`Candidate` each, in order.
        batch_size: requests per ``sample`` call.
        answer: backend call for multi-turn: conversations (lists of messages ending with a user
            turn) -> the target's answers; needed when ``settings.multi_turn``.
        done: first-turn candidates of earlier sessions, in request order (resume).
        on_batch: called after each sampled first-turn batch (to persist the candidates).
        on_progress: called after each first-turn batch (replayed ones included) and each
            follow-up batch with ``(kept prompts, candidates sampled, tokens sampled)`` so far
            (stage 1 keeps ``progress.json`` current with it).

    Returns:
        SelfPromptResult

    Raises:
        SelfPromptError: ``multi_turn`` without ``answer``; a backend returning the wrong number of
            candidates; see :func:`user_turn_format`.
    """
    if settings.multi_turn and answer is None:
        raise SelfPromptError("multi_turn self-prompting needs an answer function (the target's first answers)")
    filt = PromptFilter(settings)
    kept: list[SelfPrompt] = []
    tokens = 0
    n = 0
    limit = settings.attempts()

    def consume(req: SelfPromptRequest, cand: Candidate) -> None:
        nonlocal tokens
        tokens += cand.num_tokens
        if len(kept) < settings.count and filt(cand) == "kept":
            kept.append(SelfPrompt(req.index, req.system, req.topic, cand.text.strip()))

    # Replay candidates of earlier sessions (their requests are re-planned: a pure function of the index).
    for start in range(0, len(done), batch_size):
        chunk = list(done[start:start + batch_size])
        for req, cand in zip(plan_requests(tokenizer, settings, range(start, start + len(chunk)), template_kwargs), chunk):
            consume(req, cand)
        n = start + len(chunk)
    if on_progress is not None:
        on_progress(len(kept), n, tokens)
    while len(kept) < settings.count and n < limit:
        reqs = plan_requests(tokenizer, settings, range(n, min(n + batch_size, limit)), template_kwargs)
        cands = sample(reqs)
        if len(cands) != len(reqs):
            raise SelfPromptError(f"backend returned {len(cands)} candidates for {len(reqs)} requests")
        if on_batch is not None:
            on_batch(reqs, cands)
        for req, cand in zip(reqs, cands):
            consume(req, cand)
        n += len(reqs)
        if on_progress is not None:
            on_progress(len(kept), n, tokens)
    # Candidates sampled in the last batch after the count was reached are not judged (not counted).
    counted = sum(filt.counts.values())

    ffilt = PromptFilter(settings, dedup=False)
    if settings.multi_turn and kept:
        for start in range(0, len(kept), batch_size):
            chunk = kept[start:start + batch_size]
            convs = [p.turns()[0] for p in chunk]
            answers = answer(convs)
            reqs = [followup_request(tokenizer, settings, p, a, template_kwargs) for p, a in zip(chunk, answers)]
            cands = sample(reqs)
            for p, a, c in zip(chunk, answers, cands):
                tokens += c.num_tokens
                if ffilt(c) == "kept":
                    p.followup, p.answer = c.text.strip(), a
            if on_progress is not None:
                on_progress(len(kept), n, tokens)
    return SelfPromptResult(kept, dict(filt.counts), dict(ffilt.counts) if settings.multi_turn else {},
                            counted, tokens)


# ----------------------------------------------------------------------------- diversity


def distinct_n(texts: Iterable[str], n: int) -> float:
    """Distinct-n: unique word n-grams divided by all word n-grams over ``texts`` (lower-cased word
    tokens; Li et al. 2016). 0.0 when there is no n-gram; 1.0 when no n-gram repeats."""
    total = 0
    seen: set[tuple] = set()
    for t in texts:
        w = _normalise(t).split()
        grams = [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]
        total += len(grams)
        seen.update(grams)
    return len(seen) / total if total else 0.0


# ----------------------------------------------------------------------------- transformers driver


class TransformersDriver:
    """Drives self-prompting with transformers ``generate`` (batched, left-padded).

    Args:
        model: a causal LM (the target).
        tokenizer: its tokenizer.
        settings: sampling settings (temperature, top_p, max_new_tokens).
        answer_max_new_tokens: limit of the target's first answers (multi-turn), greedy.

    A batch is seeded with the first request's seed (``torch.manual_seed``, or the continuous-batching
    manager's seed), so a batch's samples depend on its requests and the batch size;
    :func:`run_self_prompting` keeps batches fixed. ``batching``/``cb_kwargs``: see
    :func:`eagle3.synthesize.local.generate_continuous` (``synthesize.transformers_batching`` /
    ``transformers_kwargs``).
    """

    def __init__(self, model, tokenizer, settings: SelfPromptSettings, answer_max_new_tokens: int = 128,
                 template_kwargs: dict | None = None, batching: str = "padded",
                 cb_kwargs: dict | None = None) -> None:
        from eagle3.chat import pad_token_id
        from eagle3.synthesize.local import use_continuous_batching

        self.model, self.tok, self.s = model, tokenizer, settings
        # batching: synthesize.transformers_batching ('continuous' = transformers' generate_batch);
        # cb_kwargs: synthesize.transformers_kwargs
        self.continuous = use_continuous_batching(batching, next(model.parameters()).device)
        self.cb_kwargs = dict(cb_kwargs or {})
        self.answer_max_new_tokens = answer_max_new_tokens
        self.template_kwargs = dict(template_kwargs or {})
        self.eos_ids = _eos_ids(tokenizer, model)
        self.pad_id = pad_token_id(tokenizer, self.eos_ids)

    def _generate(self, ids: list[list[int]], stop_ids: list[int], max_new: int, seed: int | None) -> list[list[int]]:
        """New ids per row: sampled with ``seed``, greedy when ``seed`` is None."""
        if self.continuous:
            from eagle3.synthesize.local import generate_continuous

            return generate_continuous(self.model, ids, max_new_tokens=max_new, eos_ids=stop_ids, pad_id=self.pad_id,
                                       temperature=self.s.temperature if seed is not None else 0.0,
                                       top_p=self.s.top_p, top_k=self.s.top_k, seed=seed, config_kwargs=self.cb_kwargs)
        from eagle3.synthesize.local import generate_padded

        kw = dict(pad_id=self.pad_id, eos_ids=stop_ids, max_new_tokens=max_new, temperature=self.s.temperature,
                  top_p=self.s.top_p, top_k=self.s.top_k, seed=seed)
        return generate_padded(self.model, ids, **kw)

    def sample(self, reqs: list[SelfPromptRequest]) -> list[Candidate]:
        """One sampled user turn per request (stops at the end-of-turn ids or any EOS id)."""
        stops = sorted(set(reqs[0].stop_ids) | set(self.eos_ids))
        outs = self._generate([r.prefix_ids for r in reqs], stops, self.s.max_new_tokens, reqs[0].seed)
        cands = []
        for r, toks in zip(reqs, outs):
            end = next((i for i, t in enumerate(toks) if t in stops), None)
            if end is None:
                body, finish = toks, "length"
            else:
                body, finish = toks[:end], ("stop" if toks[end] in r.stop_ids else "eos")
                toks = toks[: end + 1]
            cands.append(Candidate(self.tok.decode(body, skip_special_tokens=True), finish, len(toks), toks))
        return cands

    def answer(self, convs: list[list[dict]]) -> list[str]:
        """The target's greedy answers to conversations ending with a user turn (multi-turn)."""
        ids = [self.tok(self.tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True,
                                                     **self.template_kwargs),
                        add_special_tokens=False)["input_ids"] for c in convs]
        outs = self._generate(ids, self.eos_ids, self.answer_max_new_tokens, None)
        res = []
        for toks in outs:
            end = next((i for i, t in enumerate(toks) if t in self.eos_ids), len(toks))
            res.append(self.tok.decode(toks[:end], skip_special_tokens=True).strip())
        return res



# ----------------------------------------------------------------------------- vLLM offline and server drivers


def _finish(finish_reason: str | None, last_id: int | None, stop_reason, stop_ids: Sequence[int],
            eos_ids: Sequence[int]) -> str:
    """``"stop"`` / ``"length"`` / ``"eos"`` from vLLM's finish_reason and stop_reason (the stop token
    id or string, None for an EOS stop) or the last generated id."""
    if finish_reason == "length":
        return "length"
    if last_id is not None and last_id in stop_ids:
        return "stop"
    if isinstance(stop_reason, int):
        return "stop" if stop_reason in stop_ids else "eos"
    if stop_reason is None and finish_reason == "stop":  # EOS: a turn end when an eos id is the end of turn
        return "stop" if set(eos_ids) & set(stop_ids) else "eos"
    return "stop" if finish_reason == "stop" else "length"


class VllmDriver:
    """Drives self-prompting with an in-process ``vllm.LLM``: ``generate`` on the prefix token ids
    (``TokensPrompt``), per-request seeds (vLLM's per-request generator: outputs do not depend on
    batch composition), ``stop_token_ids`` = the end-of-turn ids; answers through ``LLM.chat`` at T=0.
    """

    def __init__(self, llm, tokenizer, settings: SelfPromptSettings, answer_max_new_tokens: int = 128,
                 template_kwargs: dict | None = None) -> None:
        self.llm, self.tok, self.s = llm, tokenizer, settings
        self.answer_max_new_tokens = answer_max_new_tokens
        self.template_kwargs = dict(template_kwargs or {}) or None
        self.eos_ids = _eos_ids(tokenizer)

    def sample(self, reqs: list[SelfPromptRequest]) -> list[Candidate]:
        """One sampled user turn per request."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sps = [SamplingParams(temperature=self.s.temperature, top_p=self.s.top_p, top_k=self.s.top_k or 0,
                              max_tokens=self.s.max_new_tokens,
                              seed=r.seed, stop_token_ids=list(r.stop_ids), skip_special_tokens=True) for r in reqs]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=r.prefix_ids) for r in reqs], sampling_params=sps,
                                 use_tqdm=False)
        cands = []
        for r, o in zip(reqs, outs):
            c = o.outputs[0]
            ids = [int(t) for t in c.token_ids]
            fin = _finish(c.finish_reason, ids[-1] if ids else None, getattr(c, "stop_reason", None), r.stop_ids,
                          self.eos_ids)
            cands.append(Candidate(c.text, fin, len(ids), ids))
        return cands

    def answer(self, convs: list[list[dict]]) -> list[str]:
        """The target's greedy answers (multi-turn)."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=self.answer_max_new_tokens, skip_special_tokens=True)
        outs = self.llm.chat(convs, sampling_params=sp, use_tqdm=False, chat_template_kwargs=self.template_kwargs)
        return [o.outputs[0].text.strip() for o in outs]


class ServerDriver:
    """Drives self-prompting through an OpenAI-compatible server: ``POST /completions`` on the raw
    rendered prefix (no chat endpoint: it would add its own user-turn header), with vLLM's
    ``stop_token_ids`` / ``skip_special_tokens`` extensions and ``stop=[end_text]`` for servers without
    them; answers through ``POST /chat/completions`` at T=0.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model name.
        tokenizer: the target's tokenizer (EOS ids; the prefixes are rendered locally).
        headers: e.g. ``{"Authorization": "Bearer ..."}``.
        timeout_s, max_retries, backoff_s: per request; transport errors and 5xx are retried.

    Raises:
        SelfPromptError: a request still fails after the retries (the message has the status and body).
    """

    def __init__(self, base_url: str, model: str, tokenizer, settings: SelfPromptSettings,
                 answer_max_new_tokens: int = 128, headers: dict | None = None, timeout_s: float = 300.0,
                 max_retries: int = 4, backoff_s: float = 1.0, concurrency: int = 8) -> None:
        self.base_url, self.model, self.s = base_url.rstrip("/"), model, settings
        self.tok, self.headers = tokenizer, dict(headers or {})
        self.answer_max_new_tokens = answer_max_new_tokens
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.concurrency = concurrency
        self.eos_ids = _eos_ids(tokenizer)

    def _post(self, client, path: str, body: dict) -> dict:
        import time

        import httpx

        err = ""
        for attempt in range(self.max_retries + 1):
            try:
                r = client.post(f"{self.base_url}{path}", json=body, headers=self.headers)
                if r.status_code < 500:
                    if r.status_code >= 400:
                        raise SelfPromptError(f"POST {path}: HTTP {r.status_code}: {r.text[:300]}")
                    return r.json()
                err = f"HTTP {r.status_code}: {r.text[:300]}"
            except (httpx.TransportError, ValueError) as exc:
                if isinstance(exc, SelfPromptError):
                    raise
                err = f"{type(exc).__name__}: {exc}"
            time.sleep(self.backoff_s * 2**attempt)
        raise SelfPromptError(f"POST {path} failed after {self.max_retries + 1} attempts: {err}")

    def _map(self, fn, items: list) -> list:
        from concurrent.futures import ThreadPoolExecutor

        import httpx

        if getattr(self, "_client", None) is None:  # one connection pool for the whole run
            self._client = httpx.Client(timeout=self.timeout_s)
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(lambda x: fn(self._client, x), items))

    def close(self) -> None:
        """Close the HTTP connection pool."""
        if getattr(self, "_client", None) is not None:
            self._client.close()
            self._client = None

    def sample(self, reqs: list[SelfPromptRequest]) -> list[Candidate]:
        """One sampled user turn per request."""
        def one(client, r: SelfPromptRequest) -> Candidate:
            body = {"model": self.model, "prompt": r.prefix_text, "max_tokens": self.s.max_new_tokens,
                    "temperature": self.s.temperature, "top_p": self.s.top_p, "seed": r.seed,
                    "stop_token_ids": list(r.stop_ids), "skip_special_tokens": True}
            if self.s.top_k:  # vLLM's extra sampling parameter (OpenAI's completions have none)
                body["top_k"] = self.s.top_k
            if r.end_text.strip():
                body["stop"] = [r.end_text.strip()]
            resp = self._post(client, "/completions", body)
            ch = resp["choices"][0]
            stop_reason = ch.get("stop_reason")
            if isinstance(stop_reason, str):  # the end text itself stopped it
                stop_reason = r.stop_ids[0] if stop_reason == r.end_text.strip() else stop_reason
            fin = _finish(ch.get("finish_reason"), None, stop_reason, r.stop_ids, self.eos_ids)
            usage = resp.get("usage") or {}
            return Candidate(ch.get("text") or "", fin, int(usage.get("completion_tokens", 0) or 0))

        return self._map(one, reqs)

    def answer(self, convs: list[list[dict]]) -> list[str]:
        """The target's greedy answers (multi-turn)."""
        def one(client, msgs: list[dict]) -> str:
            body = {"model": self.model, "messages": msgs, "temperature": 0.0,
                    "max_tokens": self.answer_max_new_tokens}
            return (self._post(client, "/chat/completions", body)["choices"][0]["message"].get("content") or "").strip()

        return self._map(one, convs)


# ----------------------------------------------------------------------------- stage 1: kind: self sources



def settings_from_params(p) -> SelfPromptSettings:
    """:class:`SelfPromptSettings` from a source's ``self_prompt`` section (:class:`eagle3.config.SelfPromptParams`)."""
    return SelfPromptSettings(**p.model_dump())


def _fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


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


def _open_driver(params, settings: SelfPromptSettings, tkw: dict, backend=None):
    """``(driver, tokenizer, close)`` for ``synthesize.backend`` (transformers, vllm or server).

    ``backend``: an open :class:`eagle3.synthesize.local.VllmBackend` to write the prompts with (stage 1
    then answers them on the same engine: one engine start instead of two); the caller closes it."""
    syn = params.synthesize
    if backend is not None:
        return VllmDriver(backend.llm, backend.tok, settings, syn.max_new_tokens, tkw), backend.tok, lambda: None
    if syn.backend == "transformers":
        from eagle3.target import load_target

        model, tok, _ = load_target(params.target)
        drv = TransformersDriver(model, tok, settings, syn.max_new_tokens, tkw, batching=syn.transformers_batching,
                                 cb_kwargs=syn.transformers_kwargs)
        return drv, tok, lambda: None
    if syn.backend == "vllm":
        from eagle3.synthesize.local import VllmBackend  # the stage's own vLLM engine settings

        be = VllmBackend(params)
        return VllmDriver(be.llm, be.tok, settings, syn.max_new_tokens, tkw), be.tok, be.close
    import httpx

    from eagle3.target import load_tokenizer, resolve_target

    sp = syn.server
    key = os.environ.get(sp.api_key_env) if sp.api_key_env else None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model = sp.model
    if model is None:
        try:
            model = httpx.get(f"{sp.base_url.rstrip('/')}/models", headers=headers, timeout=sp.timeout_s).json()["data"][0]["id"]
        except Exception as exc:  # noqa: BLE001 - connection errors, non-JSON, empty list
            raise SelfPromptError(f"self-prompting: cannot list the models of {sp.base_url} ({type(exc).__name__}: {exc}); "
                                  f"set synthesize.server.model") from None
    tok = load_tokenizer(resolve_target(params.target), params.target.trust_remote_code)
    drv = ServerDriver(sp.base_url, model, tok, settings, syn.max_new_tokens, headers, sp.timeout_s, sp.max_retries,
                       sp.backoff_s, sp.concurrency)
    return drv, tok, drv.close


def self_sources_pending(params, run_dir) -> bool:
    """True when some ``kind: self`` source of ``synthesize.sources`` has no finished prompt file
    (``source_N.jsonl`` and ``source_N.stats.json``) in the run dir yet, i.e. the target still has
    prompts to write (stage 1 opens its self-prompting ``progress.json`` only then)."""
    from eagle3.rundir import RunDir

    d = RunDir(run_dir).stage(1, create=False) / SELF_PROMPTS_DIR
    return any(src.kind == "self" and not ((d / f"source_{i}.jsonl").is_file() and (d / f"source_{i}.stats.json").is_file())
               for i, src in enumerate(params.synthesize.sources))


def prepare_self_sources(params, run_dir, progress=None, backend=None) -> tuple[list, list[dict]]:
    """Write the prompts of every ``kind: self`` source of ``synthesize.sources`` with the target,
    and return the sources with each such source replaced by a ``kind: file`` source of them.

    Files, in ``01_synthesize/self_prompts/`` (``N`` = the source's position in the list):

    * ``source_N.meta.json``: the settings and their fingerprint (target, template variables,
      batch size included); a run dir written with other settings is refused, never reused.
    * ``source_N.candidates.jsonl``: every sampled first-turn candidate, appended one whole batch at
      a time (``{"batch", "index", "text", "finish_reason", "num_tokens"}``). A killed run resumes
      from its whole batches, and as sampling is seeded per batch, writes the same prompts.
    * ``source_N.jsonl``: the kept prompts as OpenAI-style records (``messages``: the steering system
      prompt only with ``keep_system_prompt``, user, and with a follow-up an empty assistant
      placeholder and the second user turn; ``self_prompt``: index, topic, system), written
      atomically once complete; a finished source is not sampled again.
    * ``source_N.stats.json``: :meth:`SelfPromptResult.stats` (filter counts, distinct-1/2, ...).

    The replacing source has ``label`` ``"self"`` (unless the source names one), so each sample
    records ``source: self``; stage 1 then answers these prompts like any other (dedup, split, limits).

    Args:
        params: run params (``target``, ``synthesize``).
        run_dir: the run directory.
        progress: an :class:`eagle3.io.Progress` (stage 1's ``progress.json`` while the target writes
            prompts): ``done`` = prompts kept over all self sources, ``total`` = their ``count`` sum,
            ``tokens`` = tokens sampled, ``extra`` = ``{"phase": "self-prompting", "self_source",
            "candidates"}``. None: no progress file.
        backend: an open vLLM backend of stage 1 (``synthesize.backend: vllm``) to sample with instead
            of starting an engine here; left open (the same settings: :func:`_open_driver`).

    Returns:
        ``(sources, stats)``: the new source list and one stats dict per self source (with
        ``source_index``, ``label`` and ``settings``).

    Raises:
        SynthesisError: self-prompt files written with other settings, or no prompt surviving the
            filters. SelfPromptError: see :func:`user_turn_format` (and :class:`ServerDriver`).
    """
    from eagle3.config import PromptSource
    from eagle3.errors import SynthesisError
    from eagle3.io import atomic_write_json, atomic_write_text, read_json, read_jsonl
    from eagle3.rundir import RunDir
    from eagle3.target import target_dtype

    syn = params.synthesize
    out_sources, all_stats = [], []
    drv = tok = close = None
    kept_before = tokens_before = 0  # earlier self sources' share of the progress counts
    try:
        for i, src in enumerate(syn.sources):
            if src.kind != "self":
                out_sources.append(src)
                continue
            settings = settings_from_params(src.self_prompt)
            tkw = {} if syn.enable_thinking is None else {"enable_thinking": bool(syn.enable_thinking)}
            d = RunDir(run_dir).stage(1, create=True) / SELF_PROMPTS_DIR
            d.mkdir(parents=True, exist_ok=True)
            meta_p, cand_p = d / f"source_{i}.meta.json", d / f"source_{i}.candidates.jsonl"
            final_p, stats_p = d / f"source_{i}.jsonl", d / f"source_{i}.stats.json"
            meta = {"settings": settings.to_dict(), "backend": syn.backend, "target": params.target.model,
                    "dtype": target_dtype(params.target),
                    "template_kwargs": tkw, "batch_size": syn.batch_size,
                    "answer_max_new_tokens": syn.max_new_tokens}
            if syn.backend == "transformers" and syn.transformers_batching != "padded":
                # continuous batching samples other numbers than the padded generate (the key is left
                # out for padded batching, so run dirs written before it keep their fingerprint)
                from eagle3.synthesize.local import use_continuous_batching
                from eagle3.target import pick_device

                if use_continuous_batching(syn.transformers_batching, pick_device(params.target.device)):
                    meta["transformers_batching"] = "continuous"
            meta["fingerprint"] = _fingerprint(meta)
            old = read_json(meta_p)
            if old is not None and old.get("fingerprint") != meta["fingerprint"]:
                raise SynthesisError(
                    f"{meta_p}: self-prompts in this run dir were written with other settings "
                    f"({old.get('settings')} vs {meta['settings']}); use another run name or delete {d}")
            label = src.label or "self"
            sampled_now = not (final_p.is_file() and stats_p.is_file())
            if sampled_now:
                atomic_write_json(meta_p, meta)
                if drv is None:  # one backend for all self sources (the settings differ per source, not the model)
                    drv, tok, close = _open_driver(params, settings, tkw, backend)
                drv.s = settings
                rows = _complete_batches(read_jsonl(cand_p, missing_ok=True), syn.batch_size, settings.attempts())
                atomic_write_text(cand_p, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
                done = [Candidate(r["text"], r["finish_reason"], r["num_tokens"]) for r in rows]
                with open(cand_p, "a", encoding="utf-8") as fh:
                    def persist(reqs, cands):
                        b = reqs[0].index // syn.batch_size
                        fh.write("".join(json.dumps({"batch": b, "index": r.index, "text": c.text,
                                                     "finish_reason": c.finish_reason, "num_tokens": c.num_tokens},
                                                    ensure_ascii=False) + "\n" for r, c in zip(reqs, cands)))
                        fh.flush()
                        os.fsync(fh.fileno())

                    def report(kept, sampled, tokens, i=i, k0=kept_before, t0=tokens_before):
                        if progress is not None:
                            progress.update(k0 + kept - progress.done, t0 + tokens - progress.tokens,
                                            phase="self-prompting", self_source=i, candidates=sampled)

                    res = run_self_prompting(tok, settings, drv.sample, batch_size=syn.batch_size, answer=drv.answer,
                                             template_kwargs=tkw, done=done, on_batch=persist, on_progress=report)
                recs = []
                for p in res.prompts:
                    # the steering system prompt stays only when asked for (keep_system_prompt): by
                    # default the target answers, and the drafter trains, under the template's default
                    keep = settings.keep_system_prompt and p.system
                    msgs = ([{"role": "system", "content": p.system}] if keep else []) + [
                        {"role": "user", "content": p.user}]
                    if p.followup:
                        msgs += [{"role": "assistant", "content": ""}, {"role": "user", "content": p.followup}]
                    recs.append({"messages": msgs,
                                 "self_prompt": {"index": p.index, "topic": p.topic, "system": p.system}})
                if not recs:
                    raise SynthesisError(f"synthesize.sources[{i}] (kind: self): no prompt survived the filters "
                                         f"({res.counts}); raise max_new_tokens or max_attempts")
                st = {"source_index": i, "label": label, **res.stats(settings), "settings": settings.to_dict(),
                      "resumed_candidates": len(done)}
                atomic_write_json(stats_p, st)
                atomic_write_text(final_p, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
            all_stats.append(read_json(stats_p))
            kept_before += all_stats[-1].get("kept", 0)
            tokens_before += all_stats[-1].get("generated_tokens", 0)
            if progress is not None:
                # a source finished by an earlier run is counted as resumed: in done and tokens, not in the
                # rates (a run that restored 45,000 prompts showed 280M tokens/s)
                progress.extra.update(phase="self-prompting", self_source=i)
                count = progress.update if sampled_now else progress.resumed
                count(kept_before - progress.done, tokens_before - progress.tokens)
            out_sources.append(PromptSource(kind="file", path=str(Path(final_p).resolve()), format="openai",
                                            label=label, limit=src.limit))
    finally:
        if close is not None:
            close()
    return out_sources, all_stats


# ----------------------------------------------------------------------------- report (notebook 01, stage figures)


def read_self_prompts(run_dir) -> list[dict]:
    """The kept self-written prompts of a run, all ``kind: self`` sources: ``{"source_index", "system",
    "user", "followup", "topic"}`` in file order (empty when the run has none)."""
    from eagle3.rundir import RunDir

    d = RunDir(run_dir).stage(1) / SELF_PROMPTS_DIR
    out = []
    for f in sorted(d.glob("source_*.jsonl")) if d.is_dir() else []:
        if f.name.endswith(".candidates.jsonl"):
            continue
        idx = int(f.stem.split("_")[1])
        for line in f.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            msgs = rec["messages"]
            users = [m["content"] for m in msgs if m["role"] == "user"]
            system = next((m["content"] for m in msgs if m["role"] == "system"),
                          rec.get("self_prompt", {}).get("system"))  # the steering one, when not kept
            out.append({"source_index": idx, "system": system, "user": users[0],
                        "followup": users[1] if len(users) > 1 else None, "topic": rec.get("self_prompt", {}).get("topic")})
    return out


def self_prompt_figures(run_dir) -> dict:
    """Figures of the self-written prompts (``matplotlib.figure.Figure``, no pyplot state): the length
    distribution (characters), the filter counts per reason, distinct-1/2 beside the run's other
    sources' first user turns. Empty dict when the run has no self source."""
    from matplotlib.figure import Figure

    from eagle3.io import read_json
    from eagle3.rundir import RunDir

    prompts = read_self_prompts(run_dir)
    if not prompts:
        return {}
    d = RunDir(run_dir).stage(1) / SELF_PROMPTS_DIR
    stats = [read_json(p) for p in sorted(d.glob("source_*.stats.json"))]
    fig = Figure(figsize=(13, 3.6), layout="constrained")
    a1, a2, a3 = fig.subplots(1, 3)
    a1.hist([len(p["user"]) for p in prompts], bins=20, color="tab:blue")
    a1.set(title=f"self-written user turns ({len(prompts)})", xlabel="characters", ylabel="prompts")
    counts = Counter()
    for st in stats:
        counts.update(st.get("filtered", {}))
    reasons = [r for r in FILTER_REASONS if r != "kept"] + ["kept"]
    a2.barh(reasons, [counts.get(r, 0) for r in reasons], color=["tab:red"] * (len(reasons) - 1) + ["tab:green"])
    a2.set(title="candidates by filter", xlabel="candidates")
    users = [p["user"] for p in prompts]
    others = []
    try:
        from eagle3.contracts.samples import read_samples

        others = [next(m["content"] for m in s["messages"] if m["role"] == "user")
                  for s in read_samples(run_dir) if s.get("source") != "self"]
    except Exception:  # noqa: BLE001 - no samples yet (figures right after self-prompting): self only
        others = []
    labels, d1, d2 = ["self"], [distinct_n(users, 1)], [distinct_n(users, 2)]
    if others:
        labels.append("other sources")
        d1.append(distinct_n(others, 1))
        d2.append(distinct_n(others, 2))
    x = range(len(labels))
    a3.bar([i - 0.2 for i in x], d1, 0.4, label="distinct-1")
    a3.bar([i + 0.2 for i in x], d2, 0.4, label="distinct-2")
    a3.set_xticks(list(x), labels)
    a3.set(title="diversity (unique / all word n-grams)", ylim=(0, 1))
    a3.legend()
    return {"self_prompts": fig}
