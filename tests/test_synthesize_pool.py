"""The multi-process transformers generate pool (``synthesize.transformers_processes``), on CPU with
the embedded target: the path the H200 recipe uses to keep one GPU busy with a small target
(params/smollm2-135m-h200.yaml, issue 13)."""

from __future__ import annotations

import pytest

from eagle3.config import Params, TargetParams
from eagle3.errors import SynthesisError
from eagle3.synthesize import TurnRequest
from eagle3.synthesize.local import GeneratePool, TransformersBackend, generate_padded

CHATS = [[{"role": "user", "content": "Hi!"}],
         [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
         [{"role": "user", "content": "List three prime numbers."}],
         [{"role": "user", "content": "Name a colour."}],
         [{"role": "user", "content": "Write a haiku about rain."}]]


def _rows(tok):
    out = []
    for m in CHATS:
        r = tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append(list(r["input_ids"]) if isinstance(r, dict) else list(r))
    return out


@pytest.fixture(scope="module")
def pool(embedded_target):
    p = GeneratePool(TargetParams(model=str(embedded_target.path), dtype="float32", device="cpu"), 2)
    yield p
    p.close()


@pytest.mark.slow
def test_pool_equals_in_process_generate_on_the_same_slices(pool, target_model):
    """5 rows over 2 workers = slices of 3 and 2; greedy and sampled (slice i seeded seed + i) results
    are those of generate_padded on each slice, in order."""
    model, tok = target_model
    rows = _rows(tok)
    kw = dict(pad_id=2, eos_ids=[2], max_new_tokens=12)
    greedy = pool.generate(rows, **kw)
    assert greedy == generate_padded(model, rows[:3], **kw) + generate_padded(model, rows[3:], **kw)
    assert len(greedy) == 5 and all(len(g) == len(greedy[0]) for g in greedy[:3])
    sampled = pool.generate(rows, temperature=1.0, top_p=0.9, seed=7, **kw)
    assert sampled == (generate_padded(model, rows[:3], temperature=1.0, top_p=0.9, seed=7, **kw)
                       + generate_padded(model, rows[3:], temperature=1.0, top_p=0.9, seed=8, **kw))
    assert sampled != greedy
    assert pool.generate(rows[:1], **kw) == generate_padded(model, rows[:1], **kw)  # one busy worker
    from eagle3.self_prompt import SelfPromptSettings, TransformersDriver

    settings = SelfPromptSettings(count=2, max_new_tokens=8, seed=1)
    pooled, alone = (TransformersDriver(model, tok, settings, answer_max_new_tokens=8, pool=p) for p in (pool, None))
    assert pooled.answer(CHATS[:2]) == alone.answer(CHATS[:1]) + alone.answer(CHATS[1:2])


@pytest.mark.slow
def test_backend_with_processes_gives_the_in_process_turns(target_model, tmp_path, monkeypatch):
    """Stage 1's TransformersBackend with transformers_processes: 2 returns the turns of the
    in-process backend on the same slices (texts, token counts, finish reasons), then closes."""

    model, tok = target_model
    params = Params.model_validate({
        "run": {"name": "t", "output_dir": str(tmp_path / "out")}, "tracking": {"mode": "disabled"},
        "target": {"model": str(model.name_or_path), "dtype": "float32", "device": "cpu", "max_model_len": 1024},
        "synthesize": {"backend": "transformers", "transformers_processes": 2}})
    pooled = TransformersBackend(params, model, tok)
    assert pooled.pool is not None and len(pooled.pool.workers) == 2
    reqs = [TurnRequest(f"r{i}", m, 10, pooled.renderer.count(m)) for i, m in enumerate(CHATS[:4])]
    got = pooled.generate(reqs)
    pooled.close()
    assert pooled.pool is None
    params1 = params.model_copy(deep=True)
    params1.synthesize.transformers_processes = 1
    alone = TransformersBackend(params1, model, tok)
    assert alone.pool is None
    want = alone.generate(reqs[:2]) + alone.generate(reqs[2:])
    assert [(g.content, g.completion_tokens, g.finish_reason) for g in got] == \
           [(w.content, w.completion_tokens, w.finish_reason) for w in want]
    assert got[1].finish_reason == "stop" and "Paris" in got[1].content


@pytest.mark.slow
def test_a_worker_that_cannot_load_the_target_is_named(tmp_path):
    with pytest.raises(SynthesisError, match=r"worker 0: .*"):
        GeneratePool(TargetParams(model=str(tmp_path / "missing-model"), dtype="float32", device="cpu"), 2)


def test_processes_must_be_at_least_one():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="transformers_processes"):
        Params.model_validate({"synthesize": {"transformers_processes": 0}})
