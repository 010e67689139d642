"""The evaluation sets: stage 1's held-out split, the project's general-chat set, the user's sources.

Each set is named (``heldout``, ``general-chat``, or a user source's label) and marked
``in-distribution`` (the held-out split; any set whose source label is also a training source) or
``out-of-domain``. A prompt is the turns before the first assistant turn (system/user), rendered
exactly as vLLM's chat endpoint renders it (:class:`eagle3.chat.ChatRenderer`), so that offline and
vLLM decode the same token ids.

**Never a training prompt.** A candidate is excluded when its prompt hash — stage 1's
``prompt_hash`` (:func:`eagle3.prompts.prompt_hash`: sha256 of the canonical JSON of its turn groups)
or the hash of its first system/user turns — belongs to a ``split == "train"`` sample, or its id is
in stage 2's ``train.parquet``; the count is reported per set (``excluded_training``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.chat import ChatRenderer, template_kwargs
from eagle3.contracts import tokenized
from eagle3.contracts.samples import read_samples
from eagle3.errors import EvaluateError
from eagle3.rundir import RunDir

__all__ = ["EvalSet", "HELDOUT", "GENERAL_CHAT", "evaluation_sets", "heldout_prompts", "spread", "training_data"]

HELDOUT = "heldout"
GENERAL_CHAT = "general-chat"
IN_DOMAIN, OUT_OF_DOMAIN = "in-distribution", "out-of-domain"


def out_of_domain_first(domain: str) -> bool:
    """Sort key that puts out-of-domain sets first (every table, figure and stats.json listing of the
    sets: the report answers the out-of-domain question first: will the drafter help on traffic unlike
    its training data)."""
    return domain != OUT_OF_DOMAIN


@dataclass
class EvalSet:
    """One named evaluation set.

    Attributes:
        name: ``heldout``, ``general-chat`` or the user source's label.
        domain: ``in-distribution`` or ``out-of-domain``; ``domain_reason`` says why.
        prompts: ``{"id", "set", "source", "category", "prompt_hash", "messages", "prompt_ids"}``.
        info: ``candidates``, ``excluded_training``, ``duplicates`` (already in an earlier set),
            ``skipped_too_long``, ``capped`` (over ``prompts_per_category`` / ``num_prompts``),
            ``bad_records`` (records of the source its loader skipped; ``bad_first``: the first's place),
            ``count``, ``by_category`` {category: prompts}.
    """

    name: str
    domain: str
    domain_reason: str
    prompts: list[dict] = field(default_factory=list)
    info: dict = field(default_factory=dict)


def _prompt_prefix(messages: list[dict]) -> list[dict]:
    """The turns before the first assistant turn (system/user), as ``{"role", "content"}``."""
    out = []
    for m in messages:
        if m.get("role") == "assistant":
            break
        out.append({"role": m["role"], "content": m.get("content", "")})
    return out


def _prefix_hash(prefix: list[dict]) -> str:
    blob = json.dumps([[m["role"], m["content"]] for m in prefix], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _train_ids(run_dir: Path) -> set[str]:
    """Row ids of stage 2's training split (empty when that split is absent)."""
    if not tokenized.split_path(run_dir, "train").is_file():
        return set()
    return set(tokenized.read_ids(run_dir, "train"))


def _source_candidates(source) -> tuple[str, list[dict], dict]:
    """``(label, records, bad)`` of one prompt source through Stage 1's loader; records
    ``{"id", "source", "category", "messages", "prompt_hash"}`` (the first system/user turn group);
    ``bad``: ``{"bad_records": n, "bad_first": "file:line message"}`` of the records the loader skipped
    (printed here, as stage 1 prints its own, and kept in the set's info for the report)."""
    from eagle3.prompts import LoadReport, bad_input_detail, load_source

    report = LoadReport()
    prompts = load_source(source, report, dedup=True, field="evaluate.sources")
    label = prompts[0].source if prompts else (source.label or source.name)
    n_bad = sum(report.bad.values())
    bad = {"bad_records": n_bad}
    if n_bad:
        first = report.examples[0]
        bad["bad_first"] = f"{first['where']} {first['message']}"
        print(f"eagle3 evaluate: evaluate.sources[{label}]: skipped {n_bad} bad record{'s' * (n_bad != 1)} "
              f"({bad_input_detail(report.bad, report.examples)})", flush=True)
    return label, [{"id": p.id, "source": p.source, "category": p.category or p.source, "messages": p.first_messages(),
                    "prompt_hash": p.prompt_hash} for p in prompts], bad


def training_data(samples: list[dict]) -> dict:
    """What the drafter was trained on, from stage 1's samples (``split == "train"``).

    Returns:
        dict: ``conversations``, ``completion_tokens`` (sum of the samples' counts), ``sources``
        {label: conversations}, ``categories`` {category: conversations} (samples without a
        ``category`` count under their source), ``hashes`` (set: prompt hashes and first-turn
        prefix hashes), ``known`` (False when there is no samples file).
    """
    train = [s for s in samples if s.get("split") == "train"]
    hashes: set[str] = set()
    sources: dict[str, int] = {}
    cats: dict[str, int] = {}
    for s in train:
        hashes.add(_prefix_hash(_prompt_prefix(s.get("messages", []))))
        if s.get("prompt_hash"):
            hashes.add(str(s["prompt_hash"]))
        src = str(s.get("source", "?"))
        sources[src] = sources.get(src, 0) + 1
        cat = str(s.get("category") or src)
        cats[cat] = cats.get(cat, 0) + 1
    return {"known": bool(samples), "conversations": len(train),
            "completion_tokens": int(sum(int(s.get("completion_tokens") or 0) for s in train)),
            "sources": dict(sorted(sources.items())), "categories": dict(sorted(cats.items())), "hashes": hashes}


def spread(prompts: list[dict], n: int | None) -> list[dict]:
    """At most ``n`` prompts taken round-robin over their ``category`` (first-appearance order), in
    their original order, so that a subset covers every category; all of them when ``n`` is None or
    not smaller."""
    if n is None or n >= len(prompts):
        return list(prompts)
    by_cat: dict[str, list] = {}
    for p in prompts:
        by_cat.setdefault(p["category"], []).append(p)
    picked: set[int] = set()
    while len(picked) < n:
        for q in by_cat.values():
            if q and len(picked) < n:
                picked.add(id(q.pop(0)))
    return [p for p in prompts if id(p) in picked]


# Why a set holds fewer prompts than its source has records: the set-info key and what it means, in the
# words the terminal (an empty set's line below) and the report's set labels (eagle3.report) both print.
LEFT_OUT_REASONS = (("excluded_training", "training prompts"), ("duplicates", "in an earlier set"),
                    ("skipped_too_long", "too long"), ("capped", "over evaluate.num_prompts / prompts_per_category"))


def left_out_reasons(info: dict) -> str:
    """The prompts a set left out and why, from its ``info`` (:func:`evaluation_sets`), e.g.
    ``"4 training prompts, 1 in an earlier set"``; empty when nothing was left out (or not recorded)."""
    return ", ".join(f"{info[key]} {words}" for key, words in LEFT_OUT_REASONS if info.get(key))


def _select(name: str, domain: tuple[str, str], cands: list[dict], train: dict, train_ids: set[str],
            seen: set[str], renderer: ChatRenderer, limit: int, ev) -> EvalSet:
    """One set from its candidates: training prompts excluded by hash, earlier sets' prompts dropped,
    too-long prompts skipped, at most ``prompts_per_category`` per category, then at most
    ``num_prompts`` spread over the categories (:func:`spread`)."""
    es = EvalSet(name=name, domain=domain[0], domain_reason=domain[1])
    excluded = dups = too_long = capped = 0
    per_cat: dict[str, int] = {}
    eligible: list[tuple[str, dict]] = []
    for s in cands:
        prefix = _prompt_prefix(s.get("messages", []))
        if not prefix:
            continue
        h = _prefix_hash(prefix)
        ph = str(s.get("prompt_hash") or h)
        if h in train["hashes"] or ph in train["hashes"] or s.get("id") in train_ids:
            excluded += 1
            continue
        if h in seen:
            dups += 1
            continue
        cat = str(s.get("category") or s.get("source") or "?")
        if ev.prompts_per_category is not None and per_cat.get(cat, 0) >= ev.prompts_per_category:
            capped += 1
            continue
        ids = renderer.prompt_ids(prefix)
        if len(ids) > limit:
            too_long += 1
            continue
        per_cat[cat] = per_cat.get(cat, 0) + 1
        eligible.append((h, {"id": str(s["id"]), "set": name, "source": str(s.get("source", "?")), "category": cat,
                             "prompt_hash": ph, "messages": prefix, "prompt_ids": ids}))
    es.prompts = spread([p for _, p in eligible], ev.num_prompts)
    capped += len(eligible) - len(es.prompts)
    chosen = {id(p) for p in es.prompts}
    seen.update(h for h, p in eligible if id(p) in chosen)
    by_cat: dict[str, int] = {}
    for p in es.prompts:
        by_cat[p["category"]] = by_cat.get(p["category"], 0) + 1
    es.info = {"candidates": len(cands), "excluded_training": excluded, "duplicates": dups,
               "skipped_too_long": too_long, "capped": capped, "count": len(es.prompts),
               "by_category": dict(sorted(by_cat.items())), "domain": es.domain, "domain_reason": es.domain_reason}
    return es


def evaluation_sets(params, run_dir: str | Path, tokenizer) -> tuple[list[EvalSet], dict]:
    """The evaluation sets of ``params.evaluate``, in order: held-out split, general-chat, user sources.

    Prompts longer than ``target.max_model_len - max_new_tokens - k - 1`` tokens are skipped (they
    could not finish in vLLM); a prompt already in an earlier set is dropped from the later one.

    Returns:
        ``(sets, training)``: the non-empty sets (:class:`EvalSet`) and :func:`training_data` of the
        run's samples (without ``hashes``).

    Raises:
        SamplesError: a corrupt samples file (file and line named).
        PromptError: a user source that cannot be read.
        EvaluateError: no set has a prompt left (the counts say why).
    """
    ev = params.evaluate
    run_dir = Path(run_dir)
    samples = read_samples(run_dir) if RunDir(run_dir).samples.exists() else []
    train = training_data(samples)
    train_ids = _train_ids(run_dir)
    renderer = ChatRenderer(tokenizer, template_kwargs(params))  # as vLLM's chat endpoint renders it
    limit = params.target.max_model_len - ev.max_new_tokens - ev.num_speculative_tokens - 1
    wanted: list[tuple[str, tuple[str, str], list[dict]]] = []
    if ev.heldout:
        if not samples:
            raise EvaluateError(f"evaluate.heldout: no samples in {run_dir} (run stage 1 first, or set "
                                f"evaluate.heldout: false and name evaluation sets in evaluate.sources)")
        held = [s | {"category": s.get("category") or s.get("source")} for s in samples if s.get("split") == "heldout"]
        wanted.append((HELDOUT, (IN_DOMAIN, "stage 1's held-out split of the training sources"), held, {"bad_records": 0}))
    srcs = []
    if ev.general_chat:
        from eagle3.config import PromptSource

        srcs.append(PromptSource(kind="embedded", name=GENERAL_CHAT))
    srcs += list(ev.sources)
    for src in srcs:
        label, cands, bad = _source_candidates(src)
        if label in train["sources"]:
            dom = (IN_DOMAIN, f"its source {label!r} is also a training source ({train['sources'][label]} conversations)")
        else:
            dom = (OUT_OF_DOMAIN, "no training sample comes from this source")
        if any(w[0] == label for w in wanted):
            raise EvaluateError(f"evaluate.sources: two evaluation sets are named {label!r}; give one a label")
        wanted.append((label, dom, cands, bad))
    seen: set[str] = set()
    sets = []
    for n, d, c, bad in wanted:
        sets.append(_select(n, d, c, train, train_ids, seen, renderer, limit, ev))
        sets[-1].info |= bad
    if not any(s.prompts for s in sets):
        counts = "; ".join(f"{s.name}: {s.info}" for s in sets) or "no set enabled"
        raise EvaluateError(f"no evaluation prompt left in {run_dir} ({counts}); raise synthesize.heldout_fraction, "
                            f"or name evaluation sets in evaluate.sources")
    for s in sets:  # a set left empty is not measured: say so, with why, instead of dropping it unseen
        if not s.prompts:
            print(f"eagle3 evaluate: evaluation set {s.name!r} has no prompt left of its {s.info['candidates']} "
                  f"({left_out_reasons(s.info) or 'none usable'}); it is not measured", flush=True)
    return [s for s in sets if s.prompts], {k: v for k, v in train.items() if k != "hashes"}


def heldout_prompts(params, run_dir: str | Path, tokenizer) -> tuple[list[dict], dict]:
    """Every evaluation prompt of :func:`evaluation_sets`, flattened in set order.

    Returns:
        ``(prompts, info)``: prompts as in :class:`EvalSet` and ``info`` with ``count``,
        ``excluded_training`` (all sets), ``sets`` {name: the set's info}.
    """
    sets, _ = evaluation_sets(params, run_dir, tokenizer)
    prompts = [p for s in sets for p in s.prompts]
    return prompts, {"count": len(prompts), "excluded_training": sum(s.info["excluded_training"] for s in sets),
                     "sets": {s.name: s.info for s in sets}}
