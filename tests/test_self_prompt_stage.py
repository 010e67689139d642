"""``kind: self`` prompt sources in stage 1: params, files, reuse, refusal of other settings, resume after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3.config import Params, PromptSource
from eagle3.errors import SynthesisError
from eagle3.rundir import SELF_PROMPTS_DIR
from eagle3.synthesize import prepare_self_sources

SELF = {"count": 2, "max_new_tokens": 40, "top_p": 0.95, "seed": 3, "seed_topics": ["cooking", "maths"]}


def _params(tmp_path: Path, name: str = "t", **self_prompt) -> Params:
    return Params.model_validate({
        "run": {"name": name, "output_dir": str(tmp_path / "outputs")},
        "tracking": {"mode": "disabled"},
        "target": {"model": "embedded:smollm2-135m", "dtype": "float32", "device": "cpu"},
        "synthesize": {"backend": "transformers", "batch_size": 2, "max_new_tokens": 16,
                       "sources": [{"kind": "embedded", "name": "human-eval", "limit": 2},
                                   {"kind": "self", "self_prompt": {**SELF, **self_prompt}}]},
    })


def test_params_kind_self():
    src = PromptSource(kind="self")
    assert src.self_prompt.count == 64 and src.self_prompt.temperature == 1.0
    assert PromptSource().self_prompt is None  # other kinds carry no self_prompt (ci/default params unchanged)
    with pytest.raises(ValueError, match="kind: self"):
        PromptSource(kind="file", path="x.jsonl", self_prompt={"count": 2})


def test_prepare_self_sources_writes_reuses_and_refuses_other_settings(tmp_path, embedded_target):
    import torch

    torch.set_num_threads(2)
    from eagle3.stage import Progress

    params = _params(tmp_path)
    run_dir = params.run_dir()
    prog = Progress(run_dir / "01_synthesize", total=2, unit="self prompts")
    sources, stats = prepare_self_sources(params, run_dir, progress=prog)
    prog.close("running")
    pj = json.loads((run_dir / "01_synthesize" / "progress.json").read_text())
    assert pj["done"] == pj["total"] == 2 and pj["tokens"] == stats[0]["generated_tokens"] > 0
    assert pj["extra"]["phase"] == "self-prompting" and pj["extra"]["self_source"] == 1
    assert sources[0] == params.synthesize.sources[0]
    assert sources[1].kind == "file" and sources[1].label == "self" and sources[1].format == "openai"
    d = run_dir / "01_synthesize" / SELF_PROMPTS_DIR
    recs = [json.loads(x) for x in (d / "source_1.jsonl").read_text().splitlines()]
    (st,) = stats
    assert st["kept"] == len(recs) == 2 and st["requested"] == 2
    assert sum(st["filtered"].values()) == st["attempts"]
    cands = (d / "source_1.candidates.jsonl").read_text().splitlines()
    assert len(cands) >= st["attempts"] and len(cands) % 2 == 0  # whole batches of 2
    for r in recs:
        # the steering system prompt wrote the user turn but is not in the conversation stage 1
        # answers (keep_system_prompt: false), so the drafter trains under the template's default
        (user,) = r["messages"]
        assert r["self_prompt"]["topic"] in r["self_prompt"]["system"]
        assert user["role"] == "user" and user["content"].strip() == user["content"] != ""

    # the prompts load like any file source: source "self", dedup/split as usual
    from eagle3.prompts import load_prompts

    prompts, _ = load_prompts(params.synthesize.model_copy(update={"sources": sources}))
    mine = [p for p in prompts if p.source == "self"]
    assert sorted(p.turns[0][0]["content"] for p in mine) == sorted(r["messages"][0]["content"] for r in recs)
    assert all(p.id.startswith("self-") for p in mine)

    # what notebook 01 shows: the prompts and one figure (lengths, filter counts, distinct-1/2)
    from eagle3.synthesize.self_prompt import read_self_prompts, self_prompt_figures

    shown = read_self_prompts(run_dir)
    assert [p["user"] for p in shown] == [r["messages"][0]["content"] for r in recs]
    assert [p["system"] for p in shown] == [r["self_prompt"]["system"] for r in recs]
    fig = self_prompt_figures(run_dir)["self_prompts"]
    assert len(fig.axes) == 3 and fig.axes[1].get_title() == "candidates by filter"

    # a second call reuses the finished files (nothing sampled: the candidates file is untouched)
    before = (d / "source_1.candidates.jsonl").stat().st_mtime_ns
    prog = Progress(run_dir / "01_synthesize", total=2, unit="self prompts")
    again, stats2 = prepare_self_sources(params, run_dir, progress=prog)
    prog.close("running")
    assert again == sources and stats2 == stats
    # counted as resumed: in done and tokens, not in the rates (restored prompts once read 280M tokens/s)
    pj = json.loads((run_dir / "01_synthesize" / "progress.json").read_text())
    assert pj["done"] == 2 and pj["tokens"] == stats[0]["generated_tokens"] and pj["tokens_per_s"] == 0
    assert (d / "source_1.candidates.jsonl").stat().st_mtime_ns == before

    # other settings in the same run dir are refused, never silently reused
    with pytest.raises(SynthesisError, match="other settings"):
        prepare_self_sources(_params(tmp_path, seed=4), run_dir)


_CHILD = r"""
import sys, torch
torch.set_num_threads(1)
from eagle3.config import Params
from eagle3.synthesize import prepare_self_sources
p = Params.model_validate_json(open(sys.argv[1]).read())
prepare_self_sources(p, p.run_dir())
"""


@pytest.mark.slow
def test_resume_after_sigkill_gives_the_same_prompts(tmp_path, embedded_target):
    """Kill the self-prompting child after its first batch is on disk; the resumed run writes the
    same prompts as an uninterrupted one."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    kw = {"count": 4, "max_attempts": 8}
    killed, clean = _params(tmp_path, "killed", **kw), _params(tmp_path, "clean", **kw)
    pj = tmp_path / "killed.json"
    pj.write_text(killed.model_dump_json())
    cand = killed.run_dir() / "01_synthesize" / SELF_PROMPTS_DIR / "source_1.candidates.jsonl"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(pj)], env=env)
    try:
        t0 = time.time()
        while time.time() - t0 < 300 and child.poll() is None:
            if cand.is_file() and len(cand.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert child.poll() is None, "the child finished before it could be killed"
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    final = cand.parent / "source_1.jsonl"
    assert not final.exists()
    _, st_resumed = prepare_self_sources(killed, killed.run_dir())
    assert st_resumed[0]["resumed_candidates"] >= 2
    _, st_clean = prepare_self_sources(clean, clean.run_dir())
    clean_final = clean.run_dir() / "01_synthesize" / SELF_PROMPTS_DIR / "source_1.jsonl"
    assert final.read_text() == clean_final.read_text()
    assert st_resumed[0]["filtered"] == st_clean[0]["filtered"]


@pytest.mark.slow
def test_vllm_offline_self_prompting(tmp_path, embedded_target):
    """``kind: self`` on the vLLM offline backend (real model, real sampling): every kept prompt
    ended at the template's end of turn, the filter counts add up (duplicates removed and counted),
    progress.json follows the kept prompts, and the same seed gives the same prompts again (vLLM's
    per-request seeds)."""
    from eagle3.stage import Progress

    def params(name):
        p = _params(tmp_path, name, count=8, max_new_tokens=48)
        p.synthesize.backend = "vllm"
        p.synthesize.batch_size = 8
        return p

    a = params("vllm-a")
    prog = Progress(a.run_dir() / "01_synthesize", total=8, unit="self prompts")
    _, (st,) = prepare_self_sources(a, a.run_dir(), progress=prog)
    prog.close("running")
    d = a.run_dir() / "01_synthesize" / SELF_PROMPTS_DIR
    cands = [json.loads(x) for x in (d / "source_1.candidates.jsonl").read_text().splitlines()]
    recs = [json.loads(x) for x in (d / "source_1.jsonl").read_text().splitlines()]
    assert st["kept"] == len(recs) >= 1 and sum(st["filtered"].values()) == st["attempts"] <= len(cands)
    assert st["filtered"]["kept"] == st["kept"]
    by_index = {c["index"]: c for c in cands}
    for r in recs:  # a kept prompt is a whole user turn: it stopped on the end-of-turn id
        assert by_index[r["self_prompt"]["index"]]["finish_reason"] == "stop"
        assert r["messages"][-1]["content"] == by_index[r["self_prompt"]["index"]]["text"].strip() != ""
    users = [r["messages"][-1]["content"] for r in recs]
    assert len(set(users)) == len(users)  # exact duplicates never kept
    pj = json.loads((a.run_dir() / "01_synthesize" / "progress.json").read_text())
    assert pj["done"] == st["kept"] and pj["tokens"] == st["generated_tokens"] > 0
    b = params("vllm-b")
    prepare_self_sources(b, b.run_dir())
    assert (b.run_dir() / "01_synthesize" / SELF_PROMPTS_DIR / "source_1.jsonl").read_text() == \
        (d / "source_1.jsonl").read_text()


def test_stage1_with_a_self_source(tmp_path, embedded_target):
    """Stage 1 answers the self-written prompts like any others: samples record ``source: self`` and
    the self-prompting settings, stats.json has the filter counts; a second run resumes (nothing new)."""
    import torch

    from eagle3.synthesize import run as synthesize_run

    torch.set_num_threads(2)
    params = _params(tmp_path, "stage", keep_system_prompt=True)  # the steering system prompt is answered under
    params.synthesize.sources[0].limit = 1
    run_dir = params.run_dir()
    stats = synthesize_run(params, run_dir)
    samples = [json.loads(x) for x in (run_dir / "01_synthesize" / "samples.jsonl").read_text().splitlines()]
    mine = [s for s in samples if s["source"] == "self"]
    assert len(samples) == 3 and len(mine) == 2
    sp = stats.prompts["self_prompt"][0]
    assert sp["kept"] == 2 and sum(sp["filtered"].values()) == sp["attempts"]
    for s in mine:
        assert s["settings"]["self_prompt"]["1"] == sp["settings"]
        assert s["messages"][0]["role"] == "system" and s["messages"][1]["role"] == "user"
        assert s["messages"][2]["role"] == "assistant" and s["finish_reasons"]
    on_disk = json.loads((run_dir / "01_synthesize" / "stats.json").read_text())
    assert on_disk["prompts"]["self_prompt"][0]["filtered"] == sp["filtered"]
    # the sources table names where each source came from (the self source is read from a file the
    # target wrote, but it is no user file)
    assert [(row["kind"], row["selected"]) for row in on_disk["prompts"]["sources"]] == [("embedded", 1), ("self", 2)]
    progress = (run_dir / "01_synthesize" / "progress.json").read_bytes()
    again = synthesize_run(params, run_dir)  # finished: returned as it is, nothing rewritten
    assert again == stats and (run_dir / "01_synthesize" / "progress.json").read_bytes() == progress
    assert [json.loads(x) for x in (run_dir / "01_synthesize" / "samples.jsonl").read_text().splitlines()] == samples


def test_a_self_source_is_not_read_directly():
    from eagle3.errors import PromptsError
    from eagle3.prompts import load_source

    with pytest.raises(PromptsError, match="written by the target in stage 1"):
        load_source(PromptSource(kind="self"))
