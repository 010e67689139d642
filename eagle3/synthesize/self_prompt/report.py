"""What notebook 01 and stage 1's figures show of the self-written prompts."""

from __future__ import annotations

import json
from collections import Counter

from eagle3.contracts.samples import read_samples
from eagle3.io import read_json
from eagle3.synthesize.self_prompt.filters import FILTER_REASONS, distinct_n
from eagle3.synthesize.self_prompt.run import self_prompts_dir

__all__ = ["read_self_prompts", "self_prompt_figures"]


def read_self_prompts(run_dir) -> list[dict]:
    """The kept self-written prompts of a run, all ``kind: self`` sources: ``{"source_index", "system",
    "user", "followup", "topic"}`` in file order (empty when the run has none)."""
    d = self_prompts_dir(run_dir)
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


def _other_first_turns(run_dir) -> list[str]:
    """First user turns of the run's samples from other sources (none before stage 1 wrote samples)."""
    try:
        return [next(m["content"] for m in s["messages"] if m["role"] == "user")
                for s in read_samples(run_dir) if s.get("source") != "self"]
    except Exception:  # noqa: BLE001 - no samples yet (figures right after self-prompting): self only
        return []


def self_prompt_figures(run_dir) -> dict:
    """Figures of the self-written prompts (``matplotlib.figure.Figure``, no pyplot state): the length
    distribution (characters), the filter counts per reason, distinct-1/2 beside the run's other
    sources' first user turns. Empty dict when the run has no self source."""
    from matplotlib.figure import Figure

    prompts = read_self_prompts(run_dir)
    if not prompts:
        return {}
    stats = [read_json(p) for p in sorted(self_prompts_dir(run_dir).glob("source_*.stats.json"))]
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
    others = _other_first_turns(run_dir)
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
