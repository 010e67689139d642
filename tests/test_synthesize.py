"""Stage 1 synthesize through the server backend: real local HTTP servers that misbehave (retries,
circuit breaker, error report), resume after SIGKILL and torn lines, multi-turn order, reasoning
capture from recorded responses, prompts too long for the context, the samples contract."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _synthesize_fixtures import FakeChatServer

from eagle3.config import Params
from eagle3.contracts.samples import SamplesError, SampleStore, read_samples
from eagle3.io import read_json
from eagle3.params_file import dump_params
from eagle3.prompts import load_prompts
from eagle3.rundir import SYNTHESIZE, RunDir, prepare_run_dir
from eagle3.synthesize import (
    SynthesisError,
    SynthesizeStats,
    make_figures,
    parse_chat_completion,
    split_reasoning,
)
from eagle3.synthesize import run as run_stage

ROOT = Path(__file__).resolve().parent.parent


def _prompt_file(tmp_path: Path, n: int, name: str = "p.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps({"prompt": f"Question number {i}: what is {i} + {i}?"}) + "\n" for i in range(n)))
    return p


def _params(tmp_path: Path, base_url: str, prompts: Path, name: str = "t", server: dict | None = None, **syn) -> Params:
    srv = {"base_url": base_url, "concurrency": 1, "timeout_s": 5.0, "max_retries": 2, "backoff_s": 0.01,
           "breaker_failures": 3, **(server or {})}
    return Params.model_validate({
        "run": {"name": name, "output_dir": str(tmp_path / "out")},
        "tracking": {"mode": "disabled"},
        "target": {"model": "embedded:smollm2-135m", "dtype": "float32", "device": "cpu", "max_model_len": 1024},
        "synthesize": {"sources": [{"kind": "file", "path": str(prompts), "label": "q"}], "backend": "server",
                       "server": srv, "max_new_tokens": 16, "heldout_fraction": 0.25, **syn},
    })


def run(params: Params, rd: Path) -> dict:
    """Stage 1; checks that the returned stats are what stats.json holds, returns stats.json."""
    st = run_stage(params, rd)
    on_disk = read_json(RunDir(rd).stats(SYNTHESIZE))
    assert isinstance(st, SynthesizeStats)
    assert list(st.to_dict()) == [k for k in on_disk if k not in ("complete", "finished_at")]
    assert st.to_dict() == {k: v for k, v in on_disk.items() if k not in ("complete", "finished_at")}
    return on_disk


def _go(params: Params) -> tuple[dict, Path]:
    rd = prepare_run_dir(params, Path(params.run.output_dir) / params.run.name)
    return run(params, rd), rd


def load_samples(rd: Path, split: str | None = None) -> list[dict]:
    return read_samples(rd, split)


# ----------------------------------------------------------------------------- reasoning parsing

# Recorded response bodies. vLLM >= 0.10 serializes ChatMessage.reasoning
# (vllm/entrypoints/openai/chat_completion/protocol.py); vLLM <= 0.9 and DeepSeek's API send
# reasoning_content. Both below are as such servers return them (trimmed of logprobs).
VLLM_REASONING = {
    "id": "chatcmpl-9f1c", "object": "chat.completion", "created": 1764540000, "model": "Qwen/Qwen3-8B",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "\n\nThe answer is 4.", "refusal": None,
                                         "annotations": None, "audio": None, "function_call": None,
                                         "reasoning": "\nOkay, the user asks 2+2. That is 4.\n"},
                 "logprobs": None, "finish_reason": "stop", "stop_reason": None, "token_ids": None}],
    "service_tier": None, "system_fingerprint": None,
    "usage": {"prompt_tokens": 14, "total_tokens": 40, "completion_tokens": 26, "prompt_tokens_details": None},
    "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None,
}
DEEPSEEK_REASONING_CONTENT = {
    "id": "4f0b", "object": "chat.completion", "created": 1737000000, "model": "deepseek-reasoner",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris.",
                                         "reasoning_content": "The capital of France is Paris."},
                 "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 11, "completion_tokens": 19, "total_tokens": 30},
}
TAGGED_CONTENT = {
    "choices": [{"index": 0, "message": {"role": "assistant",
                                         "content": "<think>\nCount: 1, 2, 3.\n</think>\n\nThree.", "reasoning": None},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 15},
}


def test_reasoning_from_both_field_styles_and_from_tags():
    r = parse_chat_completion(VLLM_REASONING)
    assert (r.content, r.reasoning, r.finish_reason, r.prompt_tokens, r.completion_tokens) == (
        "\n\nThe answer is 4.", "Okay, the user asks 2+2. That is 4.", "stop", 14, 26)
    r = parse_chat_completion(DEEPSEEK_REASONING_CONTENT)
    assert (r.content, r.reasoning) == ("Paris.", "The capital of France is Paris.")
    r = parse_chat_completion(TAGGED_CONTENT)
    assert (r.content, r.reasoning) == ("Three.", "Count: 1, 2, 3.")
    # configurable: fields only leaves tags in the text; off keeps everything as content
    assert parse_chat_completion(TAGGED_CONTENT, reasoning="fields").content.startswith("<think>")
    assert parse_chat_completion(VLLM_REASONING, reasoning="off").reasoning is None
    assert parse_chat_completion(VLLM_REASONING, reasoning="tags").reasoning is None
    with pytest.raises(ValueError, match="no choices.*rate limited"):
        parse_chat_completion({"error": {"message": "rate limited"}})


def test_split_reasoning_cases():
    assert split_reasoning("<think>a b</think>\n\nanswer") == ("a b", "answer")
    assert split_reasoning("template opened it</think>answer") == ("template opened it", "answer")
    assert split_reasoning("<think>cut off by max_tokens") == ("cut off by max_tokens", "")
    assert split_reasoning("plain answer") == (None, "plain answer")
    assert split_reasoning("<think>\n\n</think>\n\nno thinking") == (None, "no thinking")
    assert split_reasoning("[R]why[/R]what", ("[R]", "[/R]")) == ("why", "what")


# ----------------------------------------------------------------------------- server backend


def test_server_samples_contract_concurrency_and_api_key(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_TEST_KEY", "sekrit-123")
    prompts = _prompt_file(tmp_path, 9)
    with FakeChatServer(delay_s=0.2) as srv:
        params = _params(tmp_path, srv.base_url, prompts, server={"concurrency": 3, "api_key_env": "EAGLE3_TEST_KEY"})
        stats, rd = _go(params)
    assert srv.max_inflight == 3  # bounded by server.concurrency, and used
    assert all(h.get("Authorization") == "Bearer sekrit-123" for _, _, h in srv.requests)
    assert "sekrit" not in (rd / "params.yaml").read_text() and "sekrit" not in json.dumps(stats)
    body = srv.requests[0][1]
    assert body["model"] == "fake-model" and body["max_tokens"] == 16 and body["temperature"] == 0.0
    assert "chat_template_kwargs" not in body  # enable_thinking is None: not sent

    samples = load_samples(rd)
    expected, _ = load_prompts(params.synthesize)
    assert [s["id"] for s in samples] == [p.id for p in expected]  # prompt order after the final rewrite
    s = samples[0]
    q = expected[0].turns[0][0]["content"]
    assert s["messages"] == [{"role": "user", "content": q}, {"role": "assistant", "content": f"echo[0]: {q[:40]}"}]
    assert s["finish_reasons"] == ["stop"] and s["completion_tokens"] == 7 and s["prompt_tokens"] == len(q) // 4
    assert s["settings"] == {"backend": "server", "model": "fake-model", "temperature": 0.0, "top_p": 1.0,
                             "max_new_tokens": 16, "seed": 0, "enable_thinking": None, "reasoning": "auto"}
    assert {x["split"] for x in samples} <= {"train", "heldout"}
    assert [x["split"] for x in samples] == [p.split for p in expected]
    assert load_samples(rd, split="heldout") == [x for x in samples if x["split"] == "heldout"]
    assert stats["samples"] == 9 and stats["completion_tokens"] == 63 and stats["finish_reasons"] == {"stop": 9}
    assert stats["complete"] is True and stats["errors"] == {} and stats["retries"] == 0
    prog = read_json(RunDir(rd).progress(SYNTHESIZE))
    assert prog["status"] == "done" and prog["done"] == prog["total"] == 9 and prog["tokens"] == 63
    assert {p.name for p in RunDir(rd).stage(SYNTHESIZE).glob("*.png")} == {"completion_lengths.png", "finish_reasons.png",
                                                                      "throughput.png"}


def test_retries_on_500_hang_closed_connection_and_non_json(tmp_path):
    prompts = _prompt_file(tmp_path, 2)
    with FakeChatServer(script=["500", "hang", "close", "notjson"], hang_s=2.0) as srv:
        params = _params(tmp_path, srv.base_url, prompts, server={"max_retries": 4, "timeout_s": 0.5})
        stats, rd = _go(params)
    assert srv.actions() == ["500", "hang", "close", "notjson", "ok", "ok"]
    assert stats["errors"] == {"bad_json": 1, "connection": 1, "http_5xx": 1, "timeout": 1}
    assert stats["retries"] == 4 and stats["failed"] == 0 and stats["samples"] == 2 and stats["complete"]


def test_breaker_trips_names_ids_keeps_written_samples_and_resumes(tmp_path):
    prompts = _prompt_file(tmp_path, 6)
    with FakeChatServer(script=["ok", "ok"], default="500") as srv:
        params = _params(tmp_path, srv.base_url, prompts, server={"max_retries": 1, "breaker_failures": 2})
        order = [p.id for p in load_prompts(params.synthesize)[0]]
        with pytest.raises(SynthesisError) as ei:
            _go(params)
        rd = Path(params.run.output_dir) / "t"
        sd = RunDir(rd).stage(SYNTHESIZE)
        msg = str(ei.value)
        assert "circuit breaker opened after 2 consecutive failed samples" in msg
        assert f"Failed sample ids: {order[2]}, {order[3]}" in msg and "2 samples written so far are kept" in msg
        assert srv.actions() == ["ok", "ok", "500", "500", "500", "500"]  # 2 samples x (1 try + 1 retry)
        before = (sd / "samples.jsonl").read_bytes()
        assert [json.loads(x)["id"] for x in before.splitlines()] == order[:2]
        st = read_json(sd / "stats.json")
        assert st["complete"] is False and st["circuit_breaker_open"] is True
        assert [f["id"] for f in st["failed_samples"]] == order[2:4] and st["errors"] == {"http_5xx": 4}
        assert read_json(sd / "errors.json")["failed_samples"][0]["kind"] == "http_5xx"
        assert read_json(sd / "progress.json")["status"] == "failed"

        srv.default = "ok"  # the server recovers; re-running resumes
        n0 = len(srv.requests)
        stats = run(params, rd)
        assert len(srv.requests) - n0 == 4  # only the 4 missing samples are generated
    assert (sd / "samples.jsonl").read_bytes().startswith(before)  # nothing written before was lost
    assert [s["id"] for s in load_samples(rd)] == order and stats["complete"] and stats["resumed_from"] == 2
    assert not (sd / "errors.json").exists()


def test_non_retryable_4xx_allowed_failures(tmp_path):
    prompts = _prompt_file(tmp_path, 3)
    with FakeChatServer(script=["ok", "401"]) as srv:
        params = _params(tmp_path, srv.base_url, prompts, max_failed_samples=1)
        stats, rd = _go(params)
    assert srv.actions() == ["ok", "401", "ok"]  # the 401 is not retried
    assert stats["complete"] and stats["samples"] == 2 and stats["failed"] == 1
    assert stats["failed_samples"][0]["kind"] == "http_4xx" and stats["failed_samples"][0]["attempts"] == 1
    assert "invalid api key" in stats["failed_samples"][0]["message"]


def test_multi_turn_regenerated_in_order(tmp_path):
    conv = {"conversations": [{"from": "human", "value": "First question"}, {"from": "gpt", "value": "OLD ANSWER 1"},
                              {"from": "human", "value": "Second question"}, {"from": "gpt", "value": "OLD ANSWER 2"}]}
    f = tmp_path / "mt.jsonl"
    f.write_text(json.dumps(conv) + "\n")
    with FakeChatServer(reasoning_style="reasoning") as srv:
        stats, rd = _go(_params(tmp_path, srv.base_url, f))
    second = srv.requests[1][1]["messages"]
    assert second == [{"role": "user", "content": "First question"},
                      {"role": "assistant", "content": "echo[0]: First question"},  # regenerated, no reasoning sent
                      {"role": "user", "content": "Second question"}]
    s = load_samples(rd)[0]
    assert [m["role"] for m in s["messages"]] == ["user", "assistant", "user", "assistant"]
    assert s["messages"][3] == {"role": "assistant", "content": "echo[1]: Second question",
                                "reasoning": "thinking about Second question"}
    assert "OLD ANSWER" not in json.dumps(s)
    assert s["finish_reasons"] == ["stop", "stop"] and s["completion_tokens"] == 14
    assert [u["completion_tokens"] for u in s["turn_usage"]] == [7, 7]
    assert stats["turns"] == 2 and stats["multi_turn_samples"] == 1 and stats["reasoning_capture_rate"] == 1.0


@pytest.mark.parametrize("style", ["reasoning_content", "reasoning", "tags"])
def test_reasoning_captured_through_the_server(tmp_path, style):
    prompts = _prompt_file(tmp_path, 2)
    with FakeChatServer(reasoning_style=style) as srv:
        stats, rd = _go(_params(tmp_path, srv.base_url, prompts, enable_thinking=True))
    assert srv.requests[0][1]["chat_template_kwargs"] == {"enable_thinking": True}
    for s in load_samples(rd):
        a = s["messages"][-1]
        q = s["messages"][0]["content"]
        assert a == {"role": "assistant", "content": f"echo[0]: {q[:40]}", "reasoning": f"thinking about {q[:20]}"}
        assert s["settings"]["enable_thinking"] is True
    assert stats["reasoning_capture_rate"] == 1.0 and stats["reasoning_turns"] == 2
    assert 0 < stats["reasoning_char_share"] < 1
    assert "reasoning_share" in make_figures(rd)
    assert (RunDir(rd).stage(SYNTHESIZE) / "reasoning_share.png").exists()


def test_prompt_longer_than_context_skipped_and_counted(tmp_path, capsys):
    f = tmp_path / "mix.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["short one", "word " * 200, "short two"]))
    mt = tmp_path / "mt.jsonl"
    mt.write_text(json.dumps({"conversations": [{"from": "human", "value": "fits"}, {"from": "gpt", "value": "x"},
                                                {"from": "human", "value": "long " * 120}]}) + "\n")
    with FakeChatServer() as srv:
        params = _params(tmp_path, srv.base_url, f, shuffle=False,
                         sources=[{"kind": "file", "path": str(f)}, {"kind": "file", "path": str(mt)}])
        params = params.model_copy(update={"target": params.target.model_copy(update={"max_model_len": 64})})
        stats, rd = _go(params)
    # the 200-word prompt never reaches the server; the 2-turn one stops after its first turn
    assert len(srv.requests) == 3
    assert stats["bad_input"]["prompt_too_long"] == 1 and stats["skipped"][0]["reason"].startswith("prompt_too_long (")
    assert stats["samples"] == 3 and stats["dropped_turns"] == 1
    out = capsys.readouterr().out
    assert "1 prompt(s) longer than the context (target.max_model_len); 1 later turn(s) dropped (context full)" in out
    mt = [s for s in load_samples(rd) if s.get("dropped_turns")][0]
    assert [m["role"] for m in mt["messages"]] == ["user", "assistant"]
    # max_tokens shrinks to what the context leaves: 64 - rendered prompt tokens
    from eagle3.chat import ChatRenderer
    from eagle3.target import load_tokenizer, resolve_target

    r = ChatRenderer(load_tokenizer(resolve_target(params.target)))
    n = r.count([{"role": "user", "content": "short one"}])
    assert srv.requests[0][1]["max_tokens"] == min(16, 64 - n)
    prog = read_json(RunDir(rd).progress(SYNTHESIZE))
    assert prog["done"] == prog["total"] == 4


def test_server_context_error_counts_as_too_long(tmp_path):
    prompts = _prompt_file(tmp_path, 2)
    with FakeChatServer(script=["400ctx"]) as srv:
        stats, rd = _go(_params(tmp_path, srv.base_url, prompts))
    assert srv.actions() == ["400ctx", "ok"] and stats["bad_input"]["prompt_too_long"] == 1 and stats["samples"] == 1


def test_bad_input_lines_counted_in_stats(tmp_path, capsys):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "fine"}\n{"prompt": ""}\n{"prompt": "x\n{"prompt": "caf\xe9"}\n'
                  b'{"messages": [{"role": "assistant", "content": "a"}]}\n{"messages": [{"role": "system", "content": "s"}]}\n'
                  b'{"messages": [{"role": "user", "content": "chat"}]}\n')
    with FakeChatServer() as srv:
        stats, rd = _go(_params(tmp_path, srv.base_url, f, sources=[{"kind": "file", "path": str(f), "format": "auto"}]))
    b = stats["bad_input"]
    # line 1 starts with a BOM and is read; the format is detected per record, so the OpenAI-style
    # lines after the 'prompt' ones are read as conversations (not missing_field)
    assert (b["empty_prompt"], b["malformed_json"], b["invalid_utf8"]) == (1, 1, 1)
    assert (b["assistant_only"], b["no_user_turn"], b["missing_field"]) == (1, 1, 0) and stats["samples"] == 2
    assert any(e["where"] == f"{f}:4" for e in stats["prompts"]["bad_input_examples"])
    # the console gets one line saying what was skipped and why
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("eagle3 synthesize: ")]
    assert line == [f"eagle3 synthesize: 2 samples from 2 prompts selected of 7 records; 5 bad prompt record(s) "
                    f"(malformed_json 1, invalid_utf8 1, empty_prompt 1, no_user_turn 1, assistant_only 1; first "
                    f"{f}:2 a user turn is empty)"] and stats["finish_reasons"] == {"stop": 2}
    # opened again on the finished stage (notebook 01 on a finished run): the same line, no file rewritten
    kept = {n: (RunDir(rd).stage(SYNTHESIZE) / n).read_bytes() for n in ("stats.json", "progress.json", "samples.jsonl")}
    with FakeChatServer() as srv:
        again = run(_params(tmp_path, srv.base_url, f, sources=[{"kind": "file", "path": str(f), "format": "auto"}]), rd)
    assert srv.actions() == [] and again["samples"] == 2
    assert [x for x in capsys.readouterr().out.splitlines() if x.startswith("eagle3 synthesize: ")] == [
        line[0] + " (stage 1 already complete)"]
    assert {n: (RunDir(rd).stage(SYNTHESIZE) / n).read_bytes() for n in kept} == kept


def test_skip_summary_names_every_kind_of_loss():
    from eagle3.synthesize.summary import skip_summary

    stats = {"samples": 7, "turns": 9, "finish_reasons": {"length": 3, "stop": 6}, "dropped_turns": 2, "failed": 1,
             "bad_input": {"prompt_too_long": 1, "malformed_json": 0},
             "prompts": {"records": 12, "kept": 9, "duplicates_removed": 1, "bad_input": {"malformed_json": 2},
                         "bad_input_examples": [{"kind": "malformed_json", "where": "p.jsonl:3:1", "message": "malformed JSON: x"}]}}
    assert skip_summary(stats) == (
        "7 samples from 9 prompts selected of 12 records; 2 bad prompt record(s) (malformed_json 2; first p.jsonl:3:1 "
        "malformed JSON: x); 1 duplicate prompt(s); 1 prompt(s) longer than the context (target.max_model_len); "
        "2 later turn(s) dropped (context full); 3 of 9 answer(s) cut at max_new_tokens (finish_reason length); "
        "1 sample(s) failed")
    assert skip_summary({"samples": 1, "prompts": {"records": 1, "kept": 1}}) == (
        "1 samples from 1 prompts selected of 1 records; nothing skipped or truncated")
    # the default's sources ("1008 prompts selected of 1124 records" alone does not say what was left out)
    sources = [{"label": "self", "records": 960, "usable": 960, "selected": 960},
               {"label": "human-eval", "records": 164, "usable": 164, "selected": 48}]
    assert skip_summary({"samples": 1008, "prompts": {"records": 1124, "kept": 1008, "sources": sources}}) == (
        "1008 samples from 1008 prompts selected of 1124 records; 116 prompt(s) over the sources' limit "
        "(human-eval 116)")


def test_torn_last_line_dropped_and_regenerated(tmp_path):
    prompts = _prompt_file(tmp_path, 4)
    with FakeChatServer() as srv:
        params = _params(tmp_path, srv.base_url, prompts)
        stats, rd = _go(params)
        path = RunDir(rd).samples
        good = path.read_bytes()
        lines = good.splitlines(keepends=True)
        path.write_bytes(b"".join(lines[:3]) + lines[3][: len(lines[3]) // 2])  # killed mid-write
        n0 = len(srv.requests)
        stats2 = run(params, rd)
        assert len(srv.requests) - n0 == 1
    assert stats2["torn_lines_dropped"] == 1 and stats2["resumed_from"] == 3 and stats2["generated_this_session"] == 1
    assert path.read_bytes() == good
    assert stats2["tokens_per_s"] > 0  # over both sessions
    # a complete run re-run does no work at all and rewrites nothing (a notebook opened on a
    # finished run leaves its records as they were)
    sd = RunDir(rd).stage(SYNTHESIZE)
    before = {f.name: f.read_bytes() for f in sorted(sd.iterdir()) if f.is_file()}
    stats3 = run(params, rd)
    assert stats3 == stats2 and path.read_bytes() == good
    assert {f.name: f.read_bytes() for f in sorted(sd.iterdir()) if f.is_file()} == before


def test_corrupt_middle_line_is_reported(tmp_path):
    prompts = _prompt_file(tmp_path, 3)
    with FakeChatServer() as srv:
        params = _params(tmp_path, srv.base_url, prompts)
        stats, rd = _go(params)
        path = RunDir(rd).samples
        lines = path.read_text().splitlines()
        path.write_text("\n".join([lines[0], "garbage", lines[2]]) + "\n")
        with pytest.raises(SamplesError, match=r"samples.jsonl:2: not a sample line \(not valid JSON"):
            run(params, rd)
    assert path.read_text().splitlines()[1] == "garbage"  # not touched


_CHILD = """
import sys
from eagle3.params_file import load_params
from eagle3.rundir import prepare_run_dir
from eagle3.synthesize import run
p = load_params(sys.argv[1])
run(p, prepare_run_dir(p, sys.argv[2]))
"""


def test_sigkill_mid_run_then_resume_gives_the_same_file(tmp_path):
    prompts = _prompt_file(tmp_path, 16)
    with FakeChatServer(delay_s=0.15) as srv:
        # uninterrupted reference run
        ref_params = _params(tmp_path, srv.base_url, prompts, name="ref", server={"concurrency": 2})
        ref_stats, ref_rd = _go(ref_params)
        # the same stage in a subprocess, SIGKILLed once 5 samples are on disk
        params = _params(tmp_path, srv.base_url, prompts, name="killed", server={"concurrency": 2})
        rd = prepare_run_dir(params, Path(params.run.output_dir) / "killed")
        pfile = tmp_path / "killed.yaml"
        pfile.write_text(dump_params(params))
        path = RunDir(rd).samples
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(pfile), str(rd)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 120
        while time.time() < deadline:
            if path.exists() and path.read_bytes().count(b"\n") >= 5:
                break
            if proc.poll() is not None:
                pytest.fail(f"child exited early: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.02)
        proc.kill()  # SIGKILL
        proc.wait(timeout=30)
        assert proc.returncode == -9
        n_before = path.read_bytes().count(b"\n")
        assert 5 <= n_before < 16
        assert read_json(RunDir(rd).progress(SYNTHESIZE))["status"] == "running"  # died without cleanup
        assert not RunDir(rd).stats(SYNTHESIZE).exists()
        stats = run(params, rd)
    ids = [s["id"] for s in load_samples(rd)]
    assert len(ids) == len(set(ids)) == 16
    assert set(ids) == {s["id"] for s in load_samples(ref_rd)}
    assert path.read_bytes() == RunDir(ref_rd).samples.read_bytes()
    assert stats["resumed_from"] == n_before and stats["samples"] == ref_stats["samples"] == 16
    assert stats["completion_tokens"] == ref_stats["completion_tokens"]


def test_unreachable_server_is_a_clear_error(tmp_path):
    from eagle3.vllm_utils import free_port

    prompts = _prompt_file(tmp_path, 1)
    params = _params(tmp_path, f"http://127.0.0.1:{free_port()}/v1", prompts, server={"max_retries": 1})
    with pytest.raises(SynthesisError, match=r"cannot list models at http://127.0.0.1:\d+/v1/models .*ConnectError"):
        _go(params)


def test_throughput_series_batched_and_streaming_writes():
    from eagle3.synthesize import throughput_series

    # a batched backend writes 8 samples at once: one batch of 8 x 48 tokens every 32 s -> 12 tokens/s;
    # a resumed session starts its own clock
    ev = ([{"t": 100.0, "session_start": True}]
          + [{"t": 132.0, "id": f"a{i}", "completion_tokens": 48} for i in range(8)]
          + [{"t": 164.0, "id": f"b{i}", "completion_tokens": 48} for i in range(8)]
          + [{"t": 500.0, "session_start": True}, {"t": 510.0, "id": "c", "completion_tokens": 100}])
    assert throughput_series(ev) == [((100.0, 132.0), 12.0), ((132.0, 164.0), 12.0), ((500.0, 510.0), 10.0)]
    from eagle3.synthesize import overall_rate

    assert overall_rate(ev) == round((16 * 48 + 100) / (64 + 10), 2)  # the gap between sessions not counted
    # a server writes one sample every 0.1 s: groups of >= 1/30 of the session, 10 tokens / 0.1 s
    ev = [{"t": 0.0, "session_start": True}] + [{"t": 0.1 * (i + 1), "id": str(i), "completion_tokens": 10}
                                                for i in range(100)]
    series = throughput_series(ev)
    assert len(series) == 25 and all(abs(r - 100.0) < 1e-6 for _, r in series)


def test_a_second_writer_is_refused(tmp_path):
    path = RunDir(tmp_path).samples
    first = SampleStore(path)
    first.append({"id": "a", "source": "s", "split": "train", "messages": [{"role": "user", "content": "q"}],
                  "completion_tokens": 3})
    with pytest.raises(SamplesError, match="being written by another process"):
        SampleStore(path)
    first.close()
    again = SampleStore(path)  # the lock is released on close (and by the OS when a process dies)
    assert again.done == {"a": 3}
    again.close()


def test_a_full_disk_names_the_file_being_written(tmp_path, monkeypatch):
    """A write on a full disk raises ENOSPC with no file name (Python names the file of an open(), not
    of a write()); stage 1 re-raises it naming samples.jsonl, so `eagle3 run` says which file."""
    import errno

    from eagle3.contracts.samples import SampleStore

    real = SampleStore.append

    def append(self, sample):
        if self.done:  # the second sample meets a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, sample)

    monkeypatch.setattr(SampleStore, "append", append)
    prompts = _prompt_file(tmp_path, 3)
    with FakeChatServer() as srv:
        params = _params(tmp_path, srv.base_url, prompts)
        with pytest.raises(OSError) as e:
            _go(params)
    rd = Path(params.run.output_dir) / params.run.name
    assert (e.value.errno, e.value.strerror, e.value.filename) == (errno.ENOSPC, "No space left on device",
                                                                   str(RunDir(rd).samples))
    prog = read_json(RunDir(rd).progress(SYNTHESIZE))
    assert prog["status"] == "failed" and str(RunDir(rd).samples) in json.dumps(prog)
