"""Self-prompting (eagle3.synthesize.self_prompt): template cut, filters, and real sampling on the embedded target."""

from __future__ import annotations

import pytest

from eagle3.config import Params, SelfPromptParams
from eagle3.synthesize.local import TransformersBackend, VllmBackend
from eagle3.synthesize.self_prompt import (
    FILTER_REASONS,
    SENTINEL,
    NearDuplicateIndex,
    PromptFilter,
    distinct_n,
    plan_requests,
    run_self_prompting,
    settings_record,
    user_turn_format,
)
from eagle3.synthesize.self_prompt.template import UserTurn as Candidate
from eagle3.synthesize.server import ServerBackend

SMOL_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _params(answer_max_new_tokens: int = 16, **syn) -> Params:
    """Stage 1 params on the embedded target: ``synthesize.max_new_tokens`` limits the target's
    answers before a follow-up user turn."""
    return Params.model_validate({
        "target": {"model": "embedded:smollm2-135m", "dtype": "float32", "device": "cpu"},
        "synthesize": {"max_new_tokens": answer_max_new_tokens, **syn},
    })


def _server(base_url: str, answer_max_new_tokens: int, tok, **server) -> ServerBackend:
    return ServerBackend(_params(answer_max_new_tokens, backend="server",
                                 server={"base_url": base_url, "model": "m", "backoff_s": 0.0, **server}), tok)


@pytest.fixture(scope="module")
def smol(target_model):
    import torch

    torch.set_num_threads(2)
    return target_model


# ----------------------------------------------------------------------------- no model


def test_distinct_n():
    assert distinct_n(["a b c", "a b d"], 1) == pytest.approx(4 / 6)
    assert distinct_n(["a b c", "a b d"], 2) == pytest.approx(3 / 4)
    assert distinct_n(["one"], 2) == 0.0


def test_near_duplicate_index_finds_rewordings_only():
    idx = NearDuplicateIndex(threshold=0.6, ngram=3)
    idx.add("How do I bake sourdough bread at home without a stand mixer or a proofing basket?")
    idx.add("Write a poem about the sea at night.")
    sim, who = idx.query("How do I bake sourdough bread at home without a stand mixer or proofing basket?")
    assert who == 0 and 0.6 <= sim < 1.0
    sim, _ = idx.query("Explain the causes of the First World War in three paragraphs.")
    assert sim < 0.2


def test_filter_reasons_and_counts_add_up():
    s = SelfPromptParams(min_chars=12, max_chars=200, min_words=3)
    f = PromptFilter(s)
    cases = [
        (Candidate("What is a good name for a goldfish?", "length"), "not_terminated"),
        (Candidate("   \n", "stop"), "empty"),
        (Candidate("hi there", "stop"), "too_short"),
        (Candidate("word " * 60, "stop"), "too_long"),
        (Candidate("ok so }{}{)(*&^%$#@!~ ]]]][[[ ;;;;;;:::: //// hm", "stop"), "garbage"),
        (Candidate("the the the the the the the the the the the the the the", "stop"), "garbage"),
        (Candidate("I'm sorry, but I cannot help with that request.", "stop"), "refusal"),
        (Candidate("As an AI language model, I would suggest these books.", "stop"), "refusal"),
        (Candidate("What is a good name for a pet goldfish?", "stop"), "kept"),
        (Candidate("what is a good name for a pet goldfish", "stop"), "exact_duplicate"),
        (Candidate("What is a good name for a pet goldfish? Mine is orange.", "stop"), "near_duplicate"),
        (Candidate("Can you explain how compound interest works?", "eos"), "not_terminated"),
    ]
    got = [f(c) for c, _ in cases]
    assert got == [w for _, w in cases]
    assert set(f.counts) == set(FILTER_REASONS)
    assert sum(f.counts.values()) == len(cases)
    assert f.counts["garbage"] == 2 and f.counts["kept"] == 1


class _Tok:
    """A tokenizer whose template appends a turn marker that is a special token."""

    eos_token_id = 0
    all_special_ids = [0, 7]
    added_tokens_decoder: dict = {}

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False):
        return "".join(f"[{m['role']}]{m['content']}<eot>" for m in msgs)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [7 if text.startswith("<eot>") else 5] + [5] * (len(text) // 4)}


def test_plan_requests_cycles_systems_and_topics():
    s = SelfPromptParams(system_prompts=["S1", "S2"], seed_topics=["cooking", "tax law"], seed=3)
    reqs = plan_requests(_Tok(), s, range(5))
    assert [(r.system, r.topic) for r in reqs] == [
        ("S1 The user will ask you about cooking.", "cooking"), ("S2 The user will ask you about cooking.", "cooking"),
        ("S1 The user will ask you about tax law.", "tax law"), ("S2 The user will ask you about tax law.", "tax law"),
        ("S1 The user will ask you about cooking.", "cooking")]
    assert reqs[0].prefix_text == "[system]S1 The user will ask you about cooking.<eot>[user]"
    assert reqs[0].stop_ids == (7,) and reqs[0].end_text == "<eot>"
    assert len({r.seed for r in reqs}) == 5
    assert [r.seed for r in plan_requests(_Tok(), s, range(5))] == [r.seed for r in reqs]


# ----------------------------------------------------------------------------- the embedded target


def test_user_turn_format_smollm2(smol):
    _, tok = smol
    fmt = user_turn_format(tok)
    assert fmt.prefix_text == f"<|im_start|>system\n{SMOL_DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n"
    assert fmt.end_text == "<|im_end|>\n"
    assert fmt.eot_ids == (tok.convert_tokens_to_ids("<|im_end|>"),) == (2,)
    hist = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}]
    f2 = user_turn_format(tok, "Be terse.", hist)
    assert f2.prefix_text == ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                              "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n")
    assert SENTINEL not in f2.prefix_text


def _run(smol, done=(), **kw):
    model, tok = smol
    s = SelfPromptParams(**{"count": 2, "temperature": 1.0, "top_p": 0.95, "max_new_tokens": 48, **kw})
    be = TransformersBackend(_params(16), model, tok)
    batches = []
    res = run_self_prompting(be, s, batch_size=4, done=done, on_batch=lambda reqs, cands: batches.append((reqs, cands)))
    return s, res, batches


@pytest.fixture(scope="module")
def multi_turn_run(smol):
    """One real multi-turn run (2 prompts steered to a topic, follow-ups written by the target)."""
    return _run(smol, seed=11, multi_turn=True, seed_topics=["gardening", "travel"])


def test_real_sampling_ends_at_end_of_turn(smol, multi_turn_run):
    _, tok = smol
    s, res, batches = multi_turn_run
    cands = [c for _, cs in batches for c in cs]
    assert sum(res.counts.values()) == res.attempts <= len(cands)
    assert res.counts["kept"] == len(res.prompts) >= 1
    kept_texts = {p.user for p in res.prompts}
    for (reqs, cs) in batches:
        for r, c in zip(reqs, cs):
            assert c.num_tokens == len(c.token_ids) <= s.max_new_tokens
            if c.text.strip() in kept_texts:
                # a kept prompt was ended by the template's end-of-turn token, and re-rendering it as a
                # user message gives back exactly the prefix the target continued + the message + end
                assert c.finish_reason == "stop" and c.token_ids[-1] == 2
                msgs = [{"role": "system", "content": r.system}, {"role": "user", "content": c.text}]
                assert tok.apply_chat_template(msgs, tokenize=False) == r.prefix_text + c.text + "<|im_end|>\n"
            elif c.finish_reason == "length":
                assert len(c.token_ids) == s.max_new_tokens and 2 not in c.token_ids
    st = res.stats(s)
    assert 0 < st["distinct_1"] <= 1 and st["distinct_2"] >= st["distinct_1"]
    assert st["kept"] == len(res.prompts) and st["filtered"] == res.counts


def test_same_seed_same_prompts_and_resume(smol, multi_turn_run):
    """A second run with the same seed (single-turn: the first turns do not depend on multi_turn)
    writes the same prompts with the same counts; so does one resumed from the first run's first
    batch of candidates; another seed plans other sampling seeds."""
    model, tok = smol
    s, res, batches = multi_turn_run
    _, again, _ = _run(smol, seed=11, seed_topics=["gardening", "travel"])
    assert [p.user for p in again.prompts] == [p.user for p in res.prompts]
    assert again.counts == res.counts
    single = s.model_copy(update={"multi_turn": False})
    resumed = run_self_prompting(TransformersBackend(_params(), model, tok), single, batch_size=4, done=batches[0][1])
    assert [p.user for p in resumed.prompts] == [p.user for p in res.prompts]
    other = plan_requests(tok, SelfPromptParams(seed=12), range(4))
    assert [r.seed for r in other] != [r.seed for r in batches[0][0]]


def test_near_greedy_sampling_duplicates_are_removed(smol):
    """At a near-zero temperature every request with the same prefix writes the same user turn:
    one is kept, the others are counted as exact duplicates (and the counts add up)."""
    s, res, _ = _run(smol, count=2, temperature=1e-4, top_p=1.0, max_attempts=4, max_new_tokens=32, seed=0)
    c = res.counts
    if c["kept"] == 0:  # greedy turn did not end within the limit: then every candidate is the same failure
        assert c["not_terminated"] + c["too_short"] + c["garbage"] + c["refusal"] == 4
    else:
        assert c["kept"] == 1 and c["exact_duplicate"] == 3
    assert res.attempts == sum(c.values()) == 4 and len(res.prompts) == c["kept"]


def test_multi_turn_target_writes_the_followup(multi_turn_run):
    _, res, _ = multi_turn_run
    assert {p.topic for p in res.prompts} <= {"gardening", "travel"}
    assert all(p.topic in p.system for p in res.prompts)
    assert sum(res.followup_counts.values()) == len(res.prompts)
    assert sum(p.followup is not None for p in res.prompts) == res.followup_counts["kept"]
    for p in res.prompts:
        turns = p.turns()
        assert turns[0][0] == {"role": "system", "content": p.system}
        assert turns[0][1] == {"role": "user", "content": p.user}
        if p.followup:
            assert turns[1] == [{"role": "user", "content": p.followup}] and p.answer


# ----------------------------------------------------------------------------- server backend (completions endpoint)


class _FakeCompletions:
    """A local OpenAI-style server: /v1/completions writes a user turn from the request's seed
    (every 4th one runs to the length limit), /v1/chat/completions answers 'Sure.'; bodies are kept."""

    def __enter__(self):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        owner = self
        self.bodies: list[dict] = []

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.bodies.append(body)
                if self.path.endswith("/completions") and "messages" not in body:
                    k = body["seed"] % 1000
                    if k % 4 == 0:
                        ch = {"text": "and then it went on", "finish_reason": "length", "stop_reason": None}
                    else:
                        ch = {"text": f"Can you tell me about the number {k} and its history?", "finish_reason": "stop",
                              "stop_reason": body["stop_token_ids"][0]}
                    out = {"choices": [ch], "usage": {"completion_tokens": 9}}
                else:
                    out = {"choices": [{"message": {"role": "assistant", "content": "Sure."}}]}
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.srv.server_address[1]}/v1"
        return self

    def __exit__(self, *exc):
        self.srv.shutdown()
        self.srv.server_close()


def test_server_backend_posts_the_raw_prefix_to_completions(embedded_target):
    from eagle3.target import load_tokenizer

    tok = load_tokenizer(embedded_target)
    s = SelfPromptParams(count=3, temperature=1.0, max_new_tokens=20, seed=2, multi_turn=True)
    with _FakeCompletions() as srv:
        res = run_self_prompting(_server(srv.base_url, 8, tok, concurrency=2), s, batch_size=2)
    comp = [b for b in srv.bodies if "prompt" in b]
    fmt = user_turn_format(tok)
    assert comp[0]["prompt"] == fmt.prefix_text and comp[0]["stop_token_ids"] == [2]
    assert comp[0]["stop"] == ["<|im_end|>"] and comp[0]["max_tokens"] == 20 and comp[0]["top_p"] == 1.0
    assert "top_k" not in comp[0]  # off: OpenAI's completions have no top_k (vLLM's extra parameter)
    length = sum(b["seed"] % 1000 % 4 == 0 for b in comp[: res.attempts])
    assert res.counts["not_terminated"] == length and res.counts["kept"] == len(res.prompts) == 3
    assert sum(res.counts.values()) == res.attempts
    assert sorted(b["messages"][-1]["content"] for b in srv.bodies if "messages" in b) == sorted(p.user for p in res.prompts)
    # follow-up requests continue the conversation: prefix = system, user, assistant answer, user header
    follow = comp[-3:]
    assert sorted(b["seed"] for b in follow) != sorted(b["seed"] for b in comp[:3])
    assert all(b["prompt"].endswith("<|im_start|>assistant\nSure.<|im_end|>\n<|im_start|>user\n") for b in follow)
    assert res.tokens == 9 * len(comp)


def test_top_k_reaches_every_backend(smol, embedded_target):
    """``top_k``: top-k 1 sampling at T=1 is the greedy output (transformers' padded generate);
    the vLLM backend's sampling params and the server body carry it; the settings record omits it when off (self-prompts
    written without it keep their fingerprint)."""
    from eagle3.synthesize.local import generate_padded

    model, tok = smol
    rows = [r.prefix_ids for r in plan_requests(tok, SelfPromptParams(seed_topics=["tea", "maths"]), range(2))]
    kw = dict(pad_id=2, eos_ids=[2], max_new_tokens=12)
    greedy = generate_padded(model, rows, **kw)
    assert generate_padded(model, rows, temperature=1.0, top_k=1, seed=7, **kw) == greedy
    assert generate_padded(model, rows, temperature=1.0, seed=7, **kw) != greedy  # T=1 without top-k: sampled

    assert "top_k" not in settings_record(SelfPromptParams()) and settings_record(SelfPromptParams(top_k=50))["top_k"] == 50
    s = SelfPromptParams(count=1, temperature=1.0, top_k=50, max_new_tokens=5)
    req = plan_requests(tok, s, range(1))

    class _LLM:  # records the SamplingParams VllmBackend builds
        def generate(self, prompts, sampling_params, use_tqdm):
            self.sps = sampling_params
            out = type("O", (), {"outputs": [type("C", (), {"text": "Hi there you", "token_ids": [5, 2],
                                                            "finish_reason": "stop", "stop_reason": 2})()]})
            return [out() for _ in prompts]

    llm = _LLM()
    VllmBackend(_params(), llm=llm, tokenizer=tok).sample_user_turns(req, s)
    assert [(sp.top_k, sp.top_p, sp.temperature) for sp in llm.sps] == [(50, 1.0, 1.0)]
    with _FakeCompletions() as srv:
        _server(srv.base_url, 4, tok).sample_user_turns(req, s)
    assert srv.bodies[0]["top_k"] == 50
