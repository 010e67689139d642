"""The project's own general-chat evaluation set (eagle3/data/general_chat.jsonl)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from eagle3.config import PromptSource
from eagle3.data import GENERAL_CHAT_CATEGORIES, load_general_chat
from eagle3.prompts import HUMAN_EVAL_TEMPLATE, load_source

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "prompts"


def _norm(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def _shingles(text: str, n: int = 3) -> set:
    w = _norm(text).split()
    return {tuple(w[i:i + n]) for i in range(max(1, len(w) - n + 1))}


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def test_counts_categories_ids():
    recs = load_general_chat()
    assert len(recs) == 96
    assert Counter(r["category"] for r in recs) == {c: 12 for c in GENERAL_CHAT_CATEGORIES}
    ids = [r["id"] for r in recs]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(rf"gc-{r['category']}-\d\d", r["id"]) for r in recs)
    assert all(set(r) <= {"id", "category", "prompt", "followup"} for r in recs)
    # varied lengths: short questions and long pasted-text tasks
    lens = sorted(len(r["prompt"]) for r in recs)
    assert lens[0] < 40 and lens[-1] > 350
    assert sum("followup" in r for r in recs) >= 8


def test_no_duplicates_or_near_duplicates():
    recs = load_general_chat()
    texts = [r["prompt"] for r in recs] + [r["followup"] for r in recs if "followup" in r]
    assert len({_norm(t) for t in texts}) == len(texts)
    sh = [_shingles(t) for t in texts]
    worst = max(_jaccard(sh[i], sh[j]) for i in range(len(sh)) for j in range(i + 1, len(sh)))
    assert worst < 0.3, worst


def test_not_a_copy_of_public_benchmarks():
    """No prompt equals (after normalisation) or nearly copies an AlpacaEval instruction or a
    self-instruct seed task (the public sets in ../shared, when that folder exists)."""
    ours = [r["prompt"] for r in load_general_chat()]
    files = [SHARED / "alpaca_eval_instructions.jsonl", SHARED / "selfinstruct_seed_tasks.jsonl"]
    theirs = []
    for f in files:
        if f.is_file():
            for line in f.read_text(encoding="utf-8").splitlines():
                rec = json.loads(line)
                theirs.append(rec.get("instruction") or rec.get("prompt") or "")
    if not theirs:
        return
    assert len(theirs) > 700
    their_norm = {_norm(t) for t in theirs}
    assert not [p for p in ours if _norm(p) in their_norm]
    their_sh = [_shingles(t) for t in theirs if t]
    for p in ours:
        s = _shingles(p)
        assert max(_jaccard(s, t) for t in their_sh) < 0.5, p


def test_embedded_source_general_chat():
    prompts = load_source(PromptSource(kind="embedded", name="general-chat"))
    assert len(prompts) == 96
    by_origin = {p.origin: p for p in prompts}
    rec = next(r for r in load_general_chat() if "followup" in r)
    p = by_origin[rec["id"]]
    # two turn groups: the prompt, then the follow-up (the target answers each); no human-eval wrapper
    assert p.turns == [[{"role": "user", "content": rec["prompt"]}], [{"role": "user", "content": rec["followup"]}]]
    single = by_origin["gc-math-01"]
    assert single.turns == [[{"role": "user", "content": "What is 17% of 2,350?"}]]
    assert HUMAN_EVAL_TEMPLATE.split("{")[0] not in single.turns[0][0]["content"]
    assert p.source == "general-chat" and p.id.startswith("general-chat-")


def test_package_data_declared():
    """The JSONL travels in wheels: pyproject declares it as package data of eagle3.data."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    cfg = tomllib.loads((root / "pyproject.toml").read_text())
    assert "*.jsonl" in cfg["tool"]["setuptools"]["package-data"]["eagle3.data"]
