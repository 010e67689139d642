"""Acceptance filters of self-written user turns, near-duplicate detection, and distinct-n.

Filters (:class:`PromptFilter`), applied in this order, each counted (the counts add up to the
candidates seen): ``not_terminated`` (no end-of-turn within ``max_new_tokens``), ``empty``,
``too_short``, ``too_long``, ``garbage`` (mostly non-text, long character runs, a few words
repeated), ``refusal`` (the "user" refuses or speaks as an assistant), ``exact_duplicate``
(normalised text), ``near_duplicate`` (word n-gram Jaccard >= threshold, candidates found with MinHash
LSH, then checked exactly); the rest are ``kept``. datasketch (MinHash LSH on PyPI) pulls in scipy
(not otherwise installed), so the few lines of MinHash/LSH here are used instead.

Diversity: :func:`distinct_n` (distinct-1/2: unique word n-grams over all n-grams, Li et al. 2016).
"""

from __future__ import annotations

import hashlib
import random
import re
import struct
import unicodedata
from collections import Counter
from collections.abc import Iterable

from eagle3.config import SelfPromptParams
from eagle3.errors import SelfPromptError
from eagle3.synthesize.self_prompt.template import UserTurn

__all__ = ["FILTER_REASONS", "NGRAM", "normalise", "NearDuplicateIndex", "PromptFilter", "distinct_n"]

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

NGRAM = 3  # words per shingle of the near-duplicate check (near_dup_threshold is a word 3-gram Jaccard)

# The "user" refuses or writes as the assistant (Magpie's typical failure on small targets).
_REFUSAL = re.compile(
    r"^\W*(i'?m sorry|i am sorry|sorry,? (but )?i|i can(not|'t)|i am (not able|unable)|i'?m (not able|unable)|"
    r"as an ai\b|i am an ai\b|i'?m an ai\b|i apologi[sz]e|i won'?t be able|unfortunately,? i (can|am))",
    re.IGNORECASE,
)
_WORD = re.compile(r"\w+", re.UNICODE)


def normalise(text: str) -> str:
    """NFKC, lower case, words (``\\w+``) joined by single spaces: what duplicates are judged on."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(_WORD.findall(text))


def _shingles(text: str, n: int) -> set[str]:
    words = normalise(text).split()
    if len(words) <= n:
        return {" ".join(words)}
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


_PRIME31 = (1 << 31) - 1  # a*h + b < 2**62 for 31-bit a, h, b: exact in uint64


class NearDuplicateIndex:
    """Near-duplicate detection on word n-gram sets: MinHash signatures, LSH banding for candidates,
    exact Jaccard to confirm (so there are no false positives; misses need J near the threshold and
    an unlucky band split).

    Signatures use the universal hashes ``(a*h + b) mod (2**31 - 1)`` of 31-bit blake2b shingle
    hashes, computed with numpy (one ``[num_perm, shingles]`` array per text; a pure-Python loop
    takes ~2.5 ms per text, over a minute for 59K candidates); the last text's shingles and
    signature are kept, so ``query`` then ``add`` of the same text hashes it once.

    Args:
        threshold: Jaccard similarity at or above which two texts are near duplicates.
        ngram: shingle size in words.
        num_perm: MinHash permutations (``bands * rows``).
        bands: LSH bands; with ``rows = num_perm // bands`` a pair of similarity s becomes a candidate
            with probability 1 - (1 - s**rows)**bands (64 perms in 32 bands of 2: 0.99 at s = 0.5).
        seed: permutation seed.

    Raises:
        SelfPromptError: ``num_perm`` is not a multiple of ``bands``.
    """

    def __init__(self, threshold: float = 0.6, ngram: int = NGRAM, num_perm: int = 64, bands: int = 32,
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
    words = normalise(text).split()
    return len(words) >= 12 and len(set(words)) < 0.25 * len(words)


class PromptFilter:
    """Stateful filter over candidates in order; duplicates are judged against earlier kept ones.

    Args:
        settings: length limits and the near-duplicate threshold (``kind: self`` source settings).
        dedup: check exact / near duplicates (off for follow-up turns: "thanks, and ...?" repeats).

    Attributes:
        counts: Counter over :data:`FILTER_REASONS`.
    """

    def __init__(self, settings: SelfPromptParams, dedup: bool = True) -> None:
        self.s = settings
        self.dedup = dedup
        self.counts: Counter = Counter({r: 0 for r in FILTER_REASONS})
        self.exact: set[str] = set()
        self.near = NearDuplicateIndex(settings.near_dup_threshold, NGRAM)

    def reason(self, cand: UserTurn) -> str:
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
            if normalise(text) in self.exact:
                return "exact_duplicate"
            if self.near.query(text)[0] >= self.s.near_dup_threshold:
                return "near_duplicate"
        return "kept"

    def __call__(self, cand: UserTurn) -> str:
        """Judge, count, and (when kept) remember ``cand``; returns the reason."""
        why = self.reason(cand)
        self.counts[why] += 1
        if why == "kept" and self.dedup:
            text = cand.text.strip()
            self.exact.add(normalise(text))
            self.near.add(text)
        return why


def distinct_n(texts: Iterable[str], n: int) -> float:
    """Distinct-n: unique word n-grams divided by all word n-grams over ``texts`` (lower-cased word
    tokens; Li et al. 2016). 0.0 when there is no n-gram; 1.0 when no n-gram repeats."""
    total = 0
    seen: set[tuple] = set()
    for t in texts:
        w = normalise(t).split()
        grams = [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]
        total += len(grams)
        seen.update(grams)
    return len(seen) / total if total else 0.0
