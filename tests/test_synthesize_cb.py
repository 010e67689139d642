"""Continuous batching (transformers ``generate_batch``) in stage 1 and self-prompting, on CPU with
the embedded target: the path the H200 recipe uses (params/smollm2-135m-h200.yaml)."""

from __future__ import annotations

import pytest

from eagle3.config import Params
from eagle3.errors import SynthesisError
from eagle3.synthesize import TurnRequest
from eagle3.synthesize.local import TransformersBackend, _cb_config, generate_continuous, use_continuous_batching

CHATS = [[{"role": "user", "content": "Hi!"}],
         [{"role": "user", "content": "Write a long poem about the sea and its many moods, in four stanzas."}],
         [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
         [{"role": "user", "content": "List three prime numbers."}]]


def _params(tmp_path, **syn) -> Params:
    return Params.model_validate({
        "run": {"name": "t", "output_dir": str(tmp_path / "out")}, "tracking": {"mode": "disabled"},
        "target": {"model": "embedded:smollm2-135m", "dtype": "float32", "device": "cpu", "max_model_len": 1024},
        "synthesize": {"backend": "transformers", **syn}})


def test_auto_is_padded_and_continuous_only_when_asked():
    import torch

    assert not use_continuous_batching("auto", torch.device("cuda", 0))  # measured slower without flash-attn
    assert not use_continuous_batching("auto", torch.device("cpu"))
    assert use_continuous_batching("continuous", torch.device("cpu"))
    assert not use_continuous_batching("padded", "cuda")


def test_cpu_cache_is_sized_from_the_workload_and_unknown_fields_are_refused():
    import torch

    cfg = _cb_config([[1] * 10, [1] * 70], 30, torch.device("cpu"), 5, {})
    page = getattr(cfg, "page_size", None) or cfg.block_size
    assert page == 32
    assert cfg.num_blocks == 2 * 4 + 1  # ceil((70 + 30) / 32) = 4 pages per request, both at once
    assert (cfg.max_batch_tokens, cfg.max_requests_per_batch, cfg.seed) == (82, 2, 5)
    with pytest.raises(SynthesisError, match="unknown ContinuousBatchingConfig field.*not_a_field"):
        _cb_config([[1]], 4, torch.device("cpu"), None, {"not_a_field": 1})


def test_continuous_greedy_equals_padded_generate(target_model, tmp_path):
    """Same turns (text, token counts, finish reasons) as the padded path, cut at each request's
    own cap; the model's attention implementation is restored after the call."""
    model, tok = target_model
    padded = TransformersBackend(_params(tmp_path, transformers_batching="padded"), model, tok)
    cont = TransformersBackend(_params(tmp_path, transformers_batching="continuous"), model, tok)
    assert (padded.continuous, cont.continuous) == (False, True)
    caps = [20, 6, 20, 20]
    reqs = [TurnRequest(f"r{i}", m, c, padded.renderer.count(m)) for i, (m, c) in enumerate(zip(CHATS, caps))]
    want, got = padded.generate(reqs), cont.generate(reqs)
    assert [(g.content, g.completion_tokens, g.finish_reason, g.prompt_tokens) for g in got] == \
           [(w.content, w.completion_tokens, w.finish_reason, w.prompt_tokens) for w in want]
    assert (got[1].finish_reason, got[1].completion_tokens) == ("length", 6)
    assert (got[2].finish_reason, got[2].content) == ("stop", "The capital of France is Paris.")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.slow
def test_continuous_sampling_is_seeded_and_stops_at_the_end_of_turn(target_model):
    model, tok = target_model
    rows = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False) for m in CHATS]
    rows = [list(r["input_ids"]) if isinstance(r, dict) else list(r) for r in rows]
    kw = dict(max_new_tokens=16, eos_ids=[2], pad_id=2, temperature=1.0, top_p=0.95)
    a = generate_continuous(model, rows, seed=3, **kw)
    b = generate_continuous(model, rows, seed=3, **kw)
    assert a == b and len(a) == len(rows)
    for toks in a:
        assert 1 <= len(toks) <= 16
        assert 2 not in toks[:-1]  # generation ends at the first stop id, which is kept
    assert generate_continuous(model, [], **kw) == []


@pytest.mark.slow
def test_self_prompt_sampling_continuous(target_model):
    from eagle3.config import Params, SelfPromptParams
    from eagle3.synthesize.local import TransformersBackend
    from eagle3.synthesize.self_prompt import plan_requests

    model, tok = target_model
    s = SelfPromptParams(count=4, max_new_tokens=24, seed=1)
    params = Params.model_validate({"target": {"model": "embedded:smollm2-135m", "dtype": "float32", "device": "cpu"},
                                    "synthesize": {"max_new_tokens": 8, "transformers_batching": "continuous"}})
    drv = TransformersBackend(params, model, tok)
    assert drv.continuous
    reqs = plan_requests(tok, s, range(4))
    c1, c2 = drv.sample_user_turns(reqs, s), drv.sample_user_turns(reqs, s)
    assert [c.text for c in c1] == [c.text for c in c2]  # seeded by the first request
    for c in c1:
        assert c.finish_reason in ("stop", "eos", "length") and 1 <= c.num_tokens <= 24
    assert [len(a) > 0 for a in drv.answer_user_turns([CHATS[2]])] == [True]
