"""Stage 2 (vocab): loss masks from turn-prefix renders, truncation, counting, mapping, cache, run()."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eagle3.chat import stop_token_ids
from eagle3.contracts.samples import SamplesError, read_samples
from eagle3.contracts.vocab_mapping import VocabMapping
from eagle3.vocab import (
    Coverage,
    LossMaskRenderer,
    VocabError,
    VocabMappingError,
    count_masked_tokens,
    tokenize_samples,
)
from eagle3.vocab import cached_vocab_mapping as cached

# A Qwen3-style template (the relevant parts of Qwen3's): reasoning of assistant turns after the last
# user message is rendered in a think block, earlier turns lose it; with enable_thinking=false the
# generation prompt injects an empty think block.
QWEN3_STYLE = """{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- set rc = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content is not none else '' -%}
{%- if loop.index0 > ns.last_user and (loop.last or rc) -%}
{{- '<|im_start|>assistant\\n<think>\\n' + rc.strip('\\n') + '\\n</think>\\n\\n' + m.content.lstrip('\\n') -}}
{%- else -%}
{{- '<|im_start|>assistant\\n' + m.content -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}"""


def sample(sid="s0", msgs=None, split="train", source="src", finish=None, settings=None) -> dict:
    msgs = msgs or [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    n = sum(m["role"] == "assistant" for m in msgs)
    return {"id": sid, "source": source, "split": split, "prompt_hash": "h", "messages": msgs,
            "finish_reasons": finish or ["stop"] * n, "prompt_tokens": 0, "completion_tokens": 0,
            "settings": settings or {}}


TWO_TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "See you."},
]


@pytest.fixture(scope="module")
def tok(embedded_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_target.path)


@pytest.fixture(scope="module")
def qwen_tok(embedded_target):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(embedded_target.path)
    t.chat_template = QWEN3_STYLE
    return t


def rows_of(samples, renderer, max_seq_len=4096, policy="explode"):
    chunks, rep = tokenize_samples(samples, renderer, max_seq_len, policy)
    return [r for c in chunks for r in c], rep


def supervised_text(tok, row) -> str:
    return tok.decode(row.input_ids[row.loss_mask.astype(bool)])


# --------------------------------------------------------------------------- loss masks


def test_smollm2_two_turn_mask_exact_positions(tok, embedded_target):
    r = LossMaskRenderer(tok, stop_token_ids(tok, embedded_target.path))
    assert r.stop_ids == {2}  # <|im_end|>
    assert r.empty_reasoning_block() is None  # ChatML renders no reasoning scaffold
    s = sample(msgs=TWO_TURNS)
    s["turn_usage"] = [{"completion_tokens": 3}, {"completion_tokens": 5}]  # the second disagrees
    rows, rep = rows_of([s], r, policy="explode")
    assert rep.turns_with_completion_tokens == 2 and rep.turns_matching_completion_tokens == 1
    assert len(rows) == 1 and rows[0].id == "s0"  # ChatML re-renders history identically: one row
    row = rows[0]
    # the row is exactly what the server renders for the whole conversation
    assert row.input_ids.tolist() == tok.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=False)
    assert len(row.input_ids) == 51
    # positions 0-30: injected system prompt, user turn, role header; 31-33 "Hello" "!" <|im_end|>;
    # 34 "\n" after <|im_end|> (template text, never generated); 35-45 user + header; 46-49 answer + <|im_end|>
    assert np.flatnonzero(row.loss_mask).tolist() == [31, 32, 33, 46, 47, 48, 49]
    assert row.input_ids[[31, 32, 33, 46, 47, 48, 49]].tolist() == [19556, 17, 2, 7574, 346, 30, 2]
    assert [tok.decode([t]) for t in row.input_ids[row.loss_mask.astype(bool)]] == \
        ["Hello", "!", "<|im_end|>", "See", " you", ".", "<|im_end|>"]
    assert tok.decode(row.input_ids[27:31]) == "<|im_start|>assistant\n"  # role header: not supervised
    assert row.loss_mask.dtype == np.int8 and row.input_ids.dtype == np.int64
    assert rep.supervised_tokens == 7 and rep.history_rerendered_samples == 0 and rep.assistant_turns == 2


def test_system_message_and_length_finish(tok):
    r = LossMaskRenderer(tok, {2})
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count"},
            {"role": "assistant", "content": "1 2 3"}]
    rows, rep = rows_of([sample(msgs=msgs, finish=["length"])], r)
    # cut by max_new_tokens: the model never produced <|im_end|>, so it is not supervised
    assert supervised_text(tok, rows[0]) == "1 2 3"
    assert rep.length_cut_turns == 1
    assert tok.decode(rows[0].input_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")  # no default system


def test_injected_empty_think_block_not_supervised(qwen_tok):
    r = LossMaskRenderer(qwen_tok, {2})
    s = sample(msgs=TWO_TURNS[:2], settings={"enable_thinking": False})
    rows, rep = rows_of([s], r)
    row = rows[0]
    assert qwen_tok.decode(row.input_ids) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n"
    )
    # the generation prompt the server feeds (with the injected block) is the unsupervised prefix ...
    P = qwen_tok.apply_chat_template(TWO_TURNS[:1], tokenize=True, return_dict=False,
                                     add_generation_prompt=True, enable_thinking=False)
    assert row.input_ids[: len(P)].tolist() == P
    assert not row.loss_mask[: len(P)].any()
    # ... and only the generated answer and <|im_end|> are supervised
    assert [qwen_tok.decode([t]) for t in row.input_ids[row.loss_mask.astype(bool)]] == ["Hello", "!", "<|im_end|>"]
    # "\n\n" closes the prompt as one token, while the turn render tokenizes "\n\nHello" differently:
    # the row is the served prompt followed by the tokens of the generated text
    assert rep.boundary_retokenized_turns == 1


# GLM-4.5-style: the generation prompt ends at the role header, an assistant turn always writes
# "\n<think>{reasoning}</think>\n" before the answer (empty block when there is no reasoning).
GLM_STYLE = """{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- set rc = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content is not none else '' -%}
{{- '<|im_start|>assistant' + '\n<think>' + rc.strip() + '</think>\n' + m.content.strip() + '<|im_end|>\n' -}}
{%- else -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant' -}}{%- endif -%}"""

# Harmony-style (gpt-oss): the answer's channel header follows the generation prompt and the target
# generates it; a reasoning goes into an analysis message before it. Not an empty reasoning block.
HARMONY_STYLE = """{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{- '<|im_start|>assistant' -}}
{%- if m.reasoning_content is defined and m.reasoning_content -%}
{{- '<|channel|>analysis<|message|>' + m.reasoning_content + '<|end|><|im_start|>assistant' -}}
{%- endif -%}
{{- '<|channel|>final<|message|>' + m.content + '<|im_end|>\n' -}}
{%- else -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant' -}}{%- endif -%}"""


def _with_template(embedded_target, template):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(embedded_target.path)
    t.chat_template = template
    return t


def test_template_injected_empty_think_block_is_not_generated_so_not_supervised(qwen_tok):
    """Qwen3-style template, thinking mode (no block in the generation prompt), a turn without
    reasoning: the template writes "<think>\n\n</think>\n\n" into the turn, the target never
    generated it. The row is what the server saw: the generation prompt, then the answer."""
    r = LossMaskRenderer(qwen_tok, {2})
    assert r.empty_reasoning_block() == "<think>\n\n</think>\n\n"
    assert r.empty_reasoning_block({"enable_thinking": False}) is None  # the block is in the prompt there
    s = sample(msgs=TWO_TURNS[:2])
    # what the served render holds: the full conversation render does contain the block
    assert "<think>\n\n</think>\n\nHello!" in qwen_tok.apply_chat_template(TWO_TURNS[:2], tokenize=False)
    rows, rep = rows_of([s], r)
    row = rows[0]
    P = qwen_tok.apply_chat_template(TWO_TURNS[:1], tokenize=True, return_dict=False, add_generation_prompt=True)
    assert row.input_ids.tolist() == P + qwen_tok("Hello!<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert [qwen_tok.decode([t]) for t in row.input_ids[row.loss_mask.astype(bool)]] == ["Hello", "!", "<|im_end|>"]
    assert np.flatnonzero(row.loss_mask).tolist() == [len(P), len(P) + 1, len(P) + 2]
    assert rep.empty_reasoning_block_removed_turns == 1 and rep.supervised_tokens == 3
    # two turns: each row is now what was served, so the conversation is history-stable: one row
    rows, rep = rows_of([sample(msgs=TWO_TURNS)], r)
    assert [x.id for x in rows] == ["s0"] and rep.history_rerendered_samples == 0
    assert qwen_tok.decode(rows[0].input_ids) == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                                                  "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nSee you.<|im_end|>\n")
    assert supervised_text(qwen_tok, rows[0]) == "Hello!<|im_end|>See you.<|im_end|>"
    assert rep.empty_reasoning_block_removed_turns == 2


def test_empty_think_block_the_target_wrote_itself_is_kept(qwen_tok):
    """Stage 1 recorded 13 completion tokens for the turn: the block (10 tokens) + "Hello!" + <|im_end|>;
    the target wrote the empty block itself, so it stays supervised. 3 tokens: removed."""
    r = LossMaskRenderer(qwen_tok, {2})
    s = sample(msgs=TWO_TURNS[:2])
    s["turn_usage"] = [{"prompt_tokens": 11, "completion_tokens": 13}]
    rows, rep = rows_of([s], r)
    assert supervised_text(qwen_tok, rows[0]) == "<think>\n\n</think>\n\nHello!<|im_end|>"
    assert (rep.empty_reasoning_block_kept_turns, rep.empty_reasoning_block_removed_turns) == (1, 0)
    assert rep.turns_matching_completion_tokens == 1
    s["turn_usage"] = [{"prompt_tokens": 11, "completion_tokens": 3}]
    rows, rep = rows_of([s], r)
    assert supervised_text(qwen_tok, rows[0]) == "Hello!<|im_end|>"
    assert (rep.empty_reasoning_block_kept_turns, rep.empty_reasoning_block_removed_turns) == (0, 1)
    assert rep.turns_matching_completion_tokens == 1


def test_glm_style_block_removed_and_harmony_channel_header_kept(embedded_target):
    glm = _with_template(embedded_target, GLM_STYLE)
    r = LossMaskRenderer(glm, {2})
    assert r.empty_reasoning_block() == "\n<think></think>\n"
    rows, rep = rows_of([sample(msgs=TWO_TURNS[:2])], r)
    assert glm.decode(rows[0].input_ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistantHello!<|im_end|>\n"
    assert supervised_text(glm, rows[0]) == "Hello!<|im_end|>" and rep.empty_reasoning_block_removed_turns == 1
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning": "Greet."}]
    rows, rep = rows_of([sample(msgs=msgs)], r)  # a reasoning is the target's: supervised with its tags
    assert supervised_text(glm, rows[0]) == "\n<think>Greet.</think>\nHello!<|im_end|>"
    assert rep.empty_reasoning_block_removed_turns == 0
    # Harmony: "<|channel|>final<|message|>" is not a reasoning scaffold (the analysis message is), and
    # the target generates it: it stays supervised
    harmony = _with_template(embedded_target, HARMONY_STYLE)
    r = LossMaskRenderer(harmony, {2})
    assert r.empty_reasoning_block() is None
    rows, rep = rows_of([sample(msgs=TWO_TURNS[:2])], r)
    assert supervised_text(harmony, rows[0]) == "<|channel|>final<|message|>Hello!<|im_end|>"
    assert rep.empty_reasoning_block_removed_turns == 0


def test_reasoning_present_is_supervised(qwen_tok):
    r = LossMaskRenderer(qwen_tok, {2})
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning": "Greet back."}]
    rows, rep = rows_of([sample(msgs=msgs)], r)
    assert supervised_text(qwen_tok, rows[0]) == "<think>\nGreet back.\n</think>\n\nHello!<|im_end|>"
    assert rep.reasoning_not_rendered_turns == 0


def test_reasoning_dropped_by_template_is_counted(tok):
    r = LossMaskRenderer(tok, {2})  # ChatML without reasoning support
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning": "Greet back."}]
    rows, rep = rows_of([sample(msgs=msgs)], r)
    assert supervised_text(tok, rows[0]) == "Hello!<|im_end|>"
    assert rep.reasoning_not_rendered_turns == 1


def test_history_rerendering_policies(qwen_tok):
    r = LossMaskRenderer(qwen_tok, {2})
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning": "Greet."},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "See you.", "reasoning": "Leave."}]
    rows, rep = rows_of([sample(msgs=msgs)], r, policy="explode")
    assert [x.id for x in rows] == ["s0#0", "s0#1"] and rep.history_rerendered_samples == 1
    assert supervised_text(qwen_tok, rows[0]) == "<think>\nGreet.\n</think>\n\nHello!<|im_end|>"
    assert supervised_text(qwen_tok, rows[1]) == "<think>\nLeave.\n</think>\n\nSee you.<|im_end|>"
    # the second row carries the history as the server renders it for turn 2: turn 1 without reasoning
    assert "Greet" not in qwen_tok.decode(rows[1].input_ids)
    rows, rep = rows_of([sample(msgs=msgs)], r, policy="last")
    assert [x.id for x in rows] == ["s0"]
    assert supervised_text(qwen_tok, rows[0]) == "<think>\nLeave.\n</think>\n\nSee you.<|im_end|>"
    assert rep.history_rerendered_samples == 1 and rep.exploded_rows == 0


# --------------------------------------------------------------------------- truncation, empty samples


def test_truncation_counts(tok):
    r = LossMaskRenderer(tok, {2})
    a = sample("a", TWO_TURNS)  # 51 tokens, supervised at 31-33 and 46-49
    b = sample("b")  # 35 tokens, supervised at 31-33
    long_q = [{"role": "user", "content": "Please answer with one word: yes or no?"}, {"role": "assistant", "content": "Yes"}]
    c = sample("c", long_q)  # 43 tokens, supervised at 40-41 ("Yes", <|im_end|>)
    rows, rep = rows_of([a, b, c], r, max_seq_len=42)
    assert [x.id for x in rows] == ["a", "b", "c"]
    assert [len(x.input_ids) for x in rows] == [42, 35, 42] and [x.full_len for x in rows] == [51, 35, 43]
    assert np.flatnonzero(rows[0].loss_mask).tolist() == [31, 32, 33]
    assert np.flatnonzero(rows[2].loss_mask).tolist() == [40, 41]
    assert rep.truncated_rows == 2 and rep.truncated_tokens == 9 + 1 and rep.truncated_supervised_tokens == 4
    assert rep.truncated_ids == ["a", "c"] and rep.dropped_rows_after_truncation == 0
    assert rep.tokens == 119 and rep.supervised_tokens == 3 + 3 + 2
    rows, rep = rows_of([a, b, c], r, max_seq_len=40)  # c keeps its context only: dropped
    assert [x.id for x in rows] == ["a", "b"]
    assert rep.truncated_rows == 2 and rep.truncated_tokens == 11 + 3 and rep.truncated_supervised_tokens == 4 + 2
    assert rep.dropped_rows_after_truncation == 1 and rep.rows == 2 and rep.supervised_tokens == 6


def test_no_supervised_sample_reported_and_all_empty_is_error(tok):
    r = LossMaskRenderer(tok, {2})
    empty = sample("e", [{"role": "user", "content": "only a question"}])
    rows, rep = rows_of([sample("ok"), empty], r)
    assert [x.id for x in rows] == ["ok"]
    assert rep.no_supervised_samples == 1 and rep.no_supervised_ids == ["e"]
    with pytest.raises(VocabError, match="none of the 2 samples yields a supervised token"):
        rows_of([empty, sample("e2", [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}])], r)
    with pytest.raises(VocabError, match="beyond max_seq_len=20"):
        rows_of([sample("ok")], r, max_seq_len=20)


def test_read_samples_errors_name_file_line_field(tmp_path):
    p = tmp_path / "samples.jsonl"
    good = json.dumps(sample("a"))
    p.write_text(good + "\n" + "{not json\n")
    with pytest.raises(SamplesError, match=r"samples.jsonl:2: not valid JSON"):
        read_samples(None, path=p)
    bad = sample("b")
    bad["messages"][1]["role"] = "bot"
    p.write_text(good + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(SamplesError, match=r"samples.jsonl:2: messages\[1\].role must be one of"):
        read_samples(None, path=p)
    p.write_text(good + "\n" + good + "\n")
    with pytest.raises(SamplesError, match=r"samples.jsonl:2: duplicate id 'a' \(first on line 1\)"):
        read_samples(None, path=p)
    bad = sample("c")
    bad["finish_reasons"] = ["stop", "stop"]
    p.write_text(json.dumps(bad) + "\n")
    with pytest.raises(SamplesError, match=r":1: field 'finish_reasons'"):
        read_samples(None, path=p)


def test_read_samples_skips_torn_last_line_and_filters_split(tmp_path):
    p = tmp_path / "samples.jsonl"
    a, b = sample("a"), sample("b", split="heldout")
    p.write_text(json.dumps(a) + "\n" + json.dumps(b) + "\n" + json.dumps(sample("c"))[:25])
    assert [s["id"] for s in read_samples(None, path=p)] == ["a", "b"]
    assert read_samples(None, "heldout", path=p) == [b]
    with pytest.raises(SamplesError, match="split must be"):
        read_samples(None, "dev", path=p)
    with pytest.raises(SamplesError, match=r"nope.jsonl does not exist: run stage 1"):
        read_samples(None, path=tmp_path / "nope.jsonl")


# --------------------------------------------------------------------------- counting, coverage


def _table(rows):
    import pyarrow as pa

    return pa.table({
        "id": [r[0] for r in rows], "source": ["s"] * len(rows),
        "input_ids": pa.array([r[1] for r in rows], pa.list_(pa.int64())),
        "loss_mask": pa.array([r[2] for r in rows], pa.list_(pa.int8())),
    })


def test_count_masked_tokens_matches_speculators(tmp_path):
    import datasets
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    t = _table([("a", [5, 5, 3, 9, 5], [0, 1, 1, 1, 1]), ("b", [3, 3, 7], [1, 0, 1])])
    counts = count_masked_tokens(t, 12)
    assert counts.dtype == np.int64 and counts.shape == (12,)
    assert {i: int(c) for i, c in enumerate(counts) if c} == {3: 2, 5: 2, 7: 1, 9: 1}
    assert np.array_equal(count_masked_tokens(datasets.Dataset(t), 12), counts)
    assert count_masked_tokens(datasets.Dataset(t).select([1]), 12)[[3, 5, 7]].tolist() == [1, 0, 1]
    pq_path = tmp_path / "t.parquet"
    import pyarrow.parquet as pq

    pq.write_table(t, pq_path)
    assert np.array_equal(count_masked_tokens(pq_path, 12, batch_rows=1), counts)
    save_token_frequency_distribution(datasets.Dataset(t).with_format("torch"), tmp_path / "f.pt")
    assert torch.load(tmp_path / "f.pt") == {3: 2, 5: 2, 7: 1, 9: 1}
    with pytest.raises(VocabError, match="row 'b': input_ids has 3 tokens but loss_mask has 2"):
        count_masked_tokens(_table([("a", [1], [1]), ("b", [1, 2, 3], [1, 1])]), 12)
    with pytest.raises(VocabError, match="token id 12 is outside the target vocab"):
        count_masked_tokens(_table([("a", [12], [1])]), 12)


def test_coverage_curve_and_size_from_target():
    c = np.zeros(12, np.int64)
    c[[0, 5, 7, 9, 2, 11]] = [10, 7, 7, 3, 1, 1]  # total 29
    cov = Coverage.from_counts(c)
    assert cov.order[:6].tolist() == [0, 5, 7, 9, 2, 11] and cov.distinct == 6 and cov.total == 29
    assert cov.at(4) == pytest.approx(27 / 29) and cov.lost(4) == 2 and cov.at(12) == 1.0
    assert cov.size_for(0.9) == 4  # 24/29 = 0.83 < 0.9 <= 27/29
    assert cov.size_for(0.95) == 5 and cov.size_for(1.0) == 6
    assert cov.size_for(27 / 29) == 4


# --------------------------------------------------------------------------- mapping


HAND = np.zeros(12, np.int64)
HAND[[0, 5, 7, 9, 2, 11]] = [10, 7, 7, 3, 1, 1]


def test_mapping_from_hand_table():
    m = VocabMapping.build(HAND, 4)
    d2t, t2d = m.d2t, m.t2d
    assert m.kept().tolist() == [0, 5, 7, 9] and m.draft_vocab_size == 4 and m.target_vocab_size == 12
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.tolist() == [0, 4, 5, 6]  # kept ids [0, 5, 7, 9]
    assert torch.nonzero(t2d).flatten().tolist() == [0, 5, 7, 9]
    d2t = VocabMapping.build(HAND, 5).d2t  # tie between ids 2 and 11 (count 1): lower id wins
    assert (torch.arange(5) + d2t).tolist() == [0, 2, 5, 7, 9] and d2t.tolist() == [0, 1, 3, 4, 5]


def test_mapping_padding_when_fewer_distinct():
    c = np.zeros(12, np.int64)
    c[[3, 8]] = [5, 2]
    m = VocabMapping.build(c, 4)  # 2 distinct tokens, padded with the lowest unused ids 0, 1
    assert (torch.arange(4) + m.d2t).tolist() == [0, 1, 3, 8] and m.d2t.tolist() == [0, 0, 1, 5]
    assert int(m.t2d.sum()) == 4
    # the coverage computation keeps the same padded ids
    assert np.flatnonzero(Coverage.from_counts(c).kept_mask(4)).tolist() == [0, 1, 3, 8]


def test_full_size_has_no_mapping_and_oversize_is_error():
    full = VocabMapping.build(HAND, 12)
    assert full.d2t is None and full.t2d is None and full.full_size and full.problems() == []
    assert full.kept_mask().all()
    with pytest.raises(VocabError, match=r"draft_vocab_size must be in 1..12"):
        VocabMapping.build(HAND, 13)


def test_validation_rejects_broken_mappings():
    m = VocabMapping.build(HAND, 4)
    d2t, t2d = m.d2t, m.t2d
    assert m.problems(counts=HAND) == []

    def check(d2t, t2d, counts=None):
        VocabMapping(d2t, t2d, 4, 12).check("where", counts=counts)

    with pytest.raises(VocabMappingError, match="where: kept ids are not strictly increasing at i=2"):
        check(torch.tensor([0, 4, 3, 6]), t2d)  # kept [0, 5, 5, 9]
    with pytest.raises(VocabMappingError, match=r"d2t maps draft id 3 to target id 12, outside \[0, 12\)"):
        check(torch.tensor([0, 4, 5, 9]), t2d)  # 3 + 9 = 12
    with pytest.raises(VocabMappingError, match=r"shape \(3,\)"):
        check(d2t[:3], t2d)
    with pytest.raises(VocabMappingError, match="d2t has dtype torch.int32"):
        check(d2t.int(), t2d)
    bad = t2d.clone()
    bad[1] = True
    with pytest.raises(VocabMappingError, match=r"t2d.sum\(\) = 5, expected 4"):
        check(d2t, bad)
    with pytest.raises(VocabMappingError, match="token id 9 is among the top 4 but not kept"):
        other = torch.zeros(12, dtype=torch.bool)
        other[[0, 5, 7, 8]] = True
        check(torch.tensor([0, 4, 5, 5]), other, counts=HAND)
    with pytest.raises(VocabMappingError, match="draft_vocab_size 4 < target vocab 12 but d2t and t2d are missing"):
        check(None, None)


def test_mapping_files_round_trip_and_checks(tmp_path):
    from eagle3.contracts.vocab_mapping import mapping_paths, read_mapping, write_mapping

    m = VocabMapping.build(HAND, 4, cache_key="k1")
    write_mapping(tmp_path, m, coverage=0.5, corpus_hash="c", tokenizer_hash="t", cache_hit=False)
    mfile, info = mapping_paths(tmp_path)
    assert list(json.loads(info.read_text())) == ["draft_vocab_size", "target_vocab_size", "cache_key", "coverage",
                                                  "corpus_hash", "tokenizer_hash", "cache_hit", "full_size"]
    got = read_mapping(tmp_path, target_vocab_size=12)
    assert torch.equal(got.d2t, m.d2t) and torch.equal(got.t2d, m.t2d) and got.cache_key == "k1"
    assert got.info == {"coverage": 0.5, "corpus_hash": "c", "tokenizer_hash": "t", "cache_hit": False}
    with pytest.raises(VocabMappingError, match=r"mapping.json: target_vocab_size=12 but the target \(13 tokens\)"):
        read_mapping(tmp_path, target_vocab_size=13)
    meta = json.loads(info.read_text())
    info.write_text(json.dumps({**meta, "cache_key": "k2"}))
    with pytest.raises(VocabMappingError, match=r"has cache_key 'k1' but mapping.json says 'k2'"):
        read_mapping(tmp_path)
    write_mapping(tmp_path, VocabMapping.build(HAND, 12, cache_key="k3"))  # full size: no tensor file
    assert not mfile.exists() and read_mapping(tmp_path).full_size
    info.write_text(json.dumps({**meta}))
    with pytest.raises(VocabMappingError, match="vocab_mapping.safetensors is missing"):
        read_mapping(tmp_path)


def test_cache_keyed_by_size_and_corpus(tmp_path):
    def cached_vocab_mapping(*args):  # (d2t, t2d, key, hit) as the assertions read them
        m, hit = cached(*args)
        return m.d2t, m.t2d, m.cache_key, hit

    a = cached_vocab_mapping(HAND, 4, "corpusA", "tok", tmp_path)
    assert a[1] is not None and a[3] is False and a[0].tolist() == [0, 4, 5, 6]
    again = cached_vocab_mapping(HAND, 4, "corpusA", "tok", tmp_path)
    assert again[2] == a[2] and again[3] is True and torch.equal(again[0], a[0])
    five = cached_vocab_mapping(HAND, 5, "corpusA", "tok", tmp_path)  # another size: another key
    assert five[2] != a[2] and five[3] is False and five[0].tolist() == [0, 1, 3, 4, 5]
    other = np.zeros(12, np.int64)
    other[[1, 2, 3, 4]] = [4, 3, 2, 1]
    b = cached_vocab_mapping(other, 4, "corpusB", "tok", tmp_path)  # another corpus: another key
    assert b[2] not in (a[2], five[2]) and b[3] is False and (torch.arange(4) + b[0]).tolist() == [1, 2, 3, 4]
    t = cached_vocab_mapping(HAND, 4, "corpusA", "tok2", tmp_path)  # another tokenizer
    assert t[2] != a[2] and t[3] is False
    assert len(list(tmp_path.glob("*.safetensors"))) == 4
    # a file made for another corpus, placed under this key, is not picked up
    (tmp_path / f"{a[2]}.safetensors").write_bytes((tmp_path / f"{b[2]}.safetensors").read_bytes())
    fixed = cached_vocab_mapping(HAND, 4, "corpusA", "tok", tmp_path)
    assert fixed[3] is False and fixed[0].tolist() == [0, 4, 5, 6]
    # same key but different counts (stale corpus hash): rebuilt from the counts given
    stale = cached_vocab_mapping(other, 4, "corpusA", "tok", tmp_path)
    assert stale[3] is False and (torch.arange(4) + stale[0]).tolist() == [1, 2, 3, 4]
    assert cached_vocab_mapping(HAND, 12, "corpusA", "tok", tmp_path)[:2] == (None, None)


# ChatML that renders reasoning wherever it is given (history included)
KEEPS_REASONING = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and m.reasoning_content is defined and m.reasoning_content -%}"
    "{{ '<think>' + m.reasoning_content + '</think>' }}{%- endif -%}{{ m.content + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def test_history_reasoning_drop_or_keep(embedded_target):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(embedded_target.path)
    t.chat_template = KEEPS_REASONING
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning": "Greet."},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "See you.", "reasoning": "Leave."}]
    # stage 1 sends history without reasoning: turn 2 was generated after "Hello!" alone
    rows, rep = rows_of([sample(msgs=msgs)], LossMaskRenderer(t, {2}), policy="explode")
    assert [x.id for x in rows] == ["s0#0", "s0#1"] and rep.history_rerendered_samples == 1
    assert supervised_text(t, rows[0]) == "<think>Greet.</think>Hello!<|im_end|>"
    assert t.decode(rows[1].input_ids).startswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>")
    assert supervised_text(t, rows[1]) == "<think>Leave.</think>See you.<|im_end|>"
    # history sent back with its reasoning: the template renders history as written, one row, both turns
    rows, rep = rows_of([sample(msgs=msgs)], LossMaskRenderer(t, {2}, history_reasoning="keep"), policy="explode")
    assert [x.id for x in rows] == ["s0"] and rep.history_rerendered_samples == 0
    assert supervised_text(t, rows[0]) == "<think>Greet.</think>Hello!<|im_end|><think>Leave.</think>See you.<|im_end|>"


def test_vllm_shipped_thinking_template(embedded_target):
    """vLLM's MiniCPM-V 4.5 template (Qwen3-based): with thinking on, the generation prompt itself
    opens the think block, so ``<think>\\n`` is the server's, and the reasoning after it the model's."""
    from pathlib import Path

    import vllm
    from transformers import AutoTokenizer

    path = Path(vllm.__file__).parent / "transformers_utils" / "chat_templates" / "template_minicpmv45.jinja"
    t = AutoTokenizer.from_pretrained(embedded_target.path)
    t.chat_template = path.read_text()
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning": "Greet."}]
    rows, _ = rows_of([sample(msgs=msgs, settings={"enable_thinking": True})], LossMaskRenderer(t, {2}))
    assert t.decode(rows[0].input_ids) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nGreet.\n</think>\n\nHello!<|im_end|>\n"
    )
    assert supervised_text(t, rows[0]) == "Greet.\n</think>\n\nHello!<|im_end|>"
    rows, _ = rows_of([sample(msgs=msgs[:1] + [{"role": "assistant", "content": "Hello!"}],
                              settings={"enable_thinking": False})], LossMaskRenderer(t, {2}))
    assert supervised_text(t, rows[0]) == "Hello!<|im_end|>"  # the injected empty think block is not


def test_explorer_numbers_and_slider(tok):
    from eagle3.vocab.report import CoverageExplorer

    held = np.zeros(12, np.int64)
    held[[0, 9, 2, 4]] = [5, 2, 2, 1]  # 10 held-out masked tokens; 2 and 4 fall outside the top 4
    by_source = {"a": HAND.copy(), "b": np.bincount([2, 2, 0], minlength=12)}
    ex = CoverageExplorer(HAND, held, by_source, tokenizer=tok, chosen_size=4, lengths=np.array([10, 50, 90]), max_seq_len=64)
    s = ex.summary(4)
    assert s["coverage"] == pytest.approx(27 / 29) and s["masked_tokens_lost"] == 2 and s["distinct_tokens_lost"] == 2
    assert s["heldout_coverage"] == pytest.approx(0.7) and s["heldout_oov_rate"] == pytest.approx(0.3)
    lost = ex.top_lost(4)
    assert lost["token_id"].tolist() == [2, 11] and lost["rank"].tolist() == [5, 6]
    assert lost["token"].tolist() == [repr(tok.decode([2])), repr(tok.decode([11]))]
    assert lost["mass_%"].tolist() == pytest.approx([100 / 29, 100 / 29])
    src = ex.by_source_table(4).set_index("source")
    assert src.loc["a", "coverage"] == pytest.approx(27 / 29) and src.loc["b", "coverage"] == pytest.approx(1 / 3)
    # fractions of the 6 distinct tokens, the chosen 4 and all 6 (8K.. exceed this 12-token vocab)
    assert ex.sizes_table()["draft_vocab_size"].tolist() == [1, 2, 3, 4, 6]
    assert set(ex.figures()) == {"coverage_curve", "rank_frequency", "sequence_lengths"}
    box = ex.widget()
    slider, out = box.children[0].children[0], box.children[1]
    assert "draft vocab 4</b>" in out.value and "93.1034%" in out.value
    slider.value = 6
    assert "draft vocab 6</b>" in out.value and "100.0000%" in out.value and "lost 0 of 29" in out.value


def test_explorer_sizes_say_something_about_a_small_corpus():
    """The default run: 7,061 distinct masked tokens, draft vocab 8,192. 8K/16K/32K all cover 1.0 of
    it: the table shows fractions of the distinct count instead, and the explorer opens where
    something is lost (half of them), not on "nothing lost at this size"."""
    from eagle3.vocab.report import CoverageExplorer

    counts = np.zeros(49152, np.int64)
    counts[:7061] = np.arange(7061, 0, -1)
    ex = CoverageExplorer(counts, chosen_size=8192)
    sizes = ex.sizes_table()["draft_vocab_size"].tolist()
    assert sizes == [441, 883, 1765, 3530, 8192]
    assert [c < 1.0 for c in ex.sizes_table()["coverage"]] == [True, True, True, True, False]
    assert ex.start_size() == 3530 and "nothing lost" not in ex.render_html(ex.start_size())
    static = ex.widget()._repr_mimebundle_()["text/html"]
    assert ("Static view at draft vocab size 3,530, half of the corpus's 7,061 distinct tokens (the run's 8,192 keeps "
            "every one)") in static
    big = CoverageExplorer(np.arange(60000, 0, -1), chosen_size=16384)  # a GPU-recipe corpus: common sizes stay
    assert big.telling_sizes() == [3750, 7500, 8192, 15000, 16384, 30000, 32768, 60000] and big.start_size() == 16384


def test_explorer_counts_padding_ids_up_to_the_full_vocab():
    """The explorer's held-out OOV at a size is the mapping's (padding ids included): 0 at the
    full vocab 49,152, and equal to the stage's formula at every size."""
    from eagle3.vocab.report import CoverageExplorer

    V = 49152
    train = np.zeros(V, np.int64)
    train[[100, 200, 300]] = [50, 30, 20]
    held = np.zeros(V, np.int64)
    held[[100, 5, 40000]] = [8, 1, 1]  # id 5 is a padding id from size 4 on; 40000 only at the full size
    ex = CoverageExplorer(train, held, chosen_size=V)
    assert ex.summary(V)["heldout_oov_rate"] == 0.0 and ex.heldout_coverage(V) == 1.0
    assert ex.summary(3)["heldout_oov_rate"] == pytest.approx(0.2)
    assert ex.summary(9)["heldout_oov_rate"] == pytest.approx(0.1)  # padded with ids 0..5
    for size in (3, 9, 8192, V - 1):
        kept = VocabMapping.build(train, size).kept_mask()
        assert ex.heldout_oov_rate(size) == float(held[~kept].sum() / held.sum())
    curve = ex.cov.curve(held)
    assert curve[V - 1] == 1.0 and curve[2] == pytest.approx(0.8) and curve[8] == pytest.approx(0.9)


def test_boundary_fallback_and_unstable_template_rejected(embedded_target):
    from transformers import AutoTokenizer

    chatml = ("{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor -%}"
              "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif -%}")
    t = AutoTokenizer.from_pretrained(embedded_target.path)
    # DeepSeek-R1-like: the generation prompt opens a think block that the rendered turn does not have;
    # the boundary falls back to the common prefix (the history render is a prefix of the turn render)
    t.chat_template = chatml
    rows, rep = rows_of([sample()], LossMaskRenderer(t, {2}))
    assert supervised_text(t, rows[0]) == "Hello!<|im_end|>" and rep.boundary_fallback_turns == 1
    # a template whose history differs with and without the generation prompt: no boundary, rejected
    t.chat_template = "{%- if add_generation_prompt -%}A{%- else -%}B{%- endif -%}" + chatml
    with pytest.raises(VocabError, match=r"rejected \(template error / unstable boundary\): 1"):
        rows_of([sample("bad")], LossMaskRenderer(t, {2}))
    chunks, rep = tokenize_samples([sample("bad")], LossMaskRenderer(t, {2}), 4096)
    with pytest.raises(VocabError):
        list(chunks)
    assert rep.failed_samples == 1 and rep.failed[0]["id"] == "bad" and "boundary unstable" in rep.failed[0]["reason"]


def test_tokenized_contract_round_trip_and_row_checks(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3.contracts import tokenized

    rows = [tokenized.TokenizedRow("a", "s1", np.array([5, 6, 7]), np.array([0, 1, 1], np.int8), 9),
            tokenized.TokenizedRow("b", "s2", np.array([8]), np.array([1], np.int8), 1)]
    assert tokenized.write_split(tmp_path, "train", [rows[:1], rows[1:]]) == [9, 1]
    t = tokenized.read_table(tmp_path, "train")
    assert t.schema == tokenized.schema() and t.column("input_ids").to_pylist() == [[5, 6, 7], [8]]
    assert tokenized.read_ids(tmp_path) == ["a", "b"] and tokenized.read_row_lengths(tmp_path).tolist() == [9, 1]
    ids, lens = tokenized.read_row_tokens(tmp_path)
    assert ids == ["a", "b"] and lens.tolist() == [3, 1]
    split = tokenized.read_rows(tmp_path, "train")
    assert len(split) == 2 and split.tokens(0).tolist() == [5, 6, 7] and split.mask(1).tolist() == [1]
    assert split.sources == ["s1", "s2"] and split.offsets.tolist() == [0, 3, 4]
    assert tokenized.read_dataset(tmp_path)["id"] == ["a", "b"]
    assert tokenized.split_complete(tmp_path, "train") and not tokenized.split_complete(tmp_path, "heldout")
    bad = pa.table({"id": ["x"], "source": ["s"], "input_ids": pa.array([[1, 2]], pa.list_(pa.int64())),
                    "loss_mask": pa.array([[1]], pa.list_(pa.int8()))})
    pq.write_table(bad, tokenized.split_path(tmp_path, "heldout"))
    with pytest.raises(tokenized.TokenizedError, match=r"heldout.parquet: row 0 \(id x\): loss_mask has 1 entries"):
        tokenized.read_rows(tmp_path, "heldout")
    with pytest.raises(tokenized.TokenizedError, match="split must be one of"):
        tokenized.read_table(tmp_path, "dev")


def test_loss_mask_of_a_mis_converted_tokenizer_is_unchanged(tok, embedded_target):
    """The GGUF converted by transformers 5.17 names <|im_start|> as eos and has no pad token;
    the supervised span still ends at the template's end of turn, exactly as with the right tokenizer."""
    import copy

    bad = copy.deepcopy(tok)
    bad.pad_token = None
    bad.eos_token = "<|im_start|>"
    assert bad.eos_token_id == 1
    renderer = LossMaskRenderer(bad, stop_token_ids(bad, embedded_target.path))
    assert renderer.stop_ids == {2}
    got, _ = rows_of([sample(msgs=TWO_TURNS)], renderer)
    want, _ = rows_of([sample(msgs=TWO_TURNS)], LossMaskRenderer(tok, stop_token_ids(tok, embedded_target.path)))
    assert [(r.id, r.input_ids.tolist(), r.loss_mask.tolist()) for r in got] == \
        [(r.id, r.input_ids.tolist(), r.loss_mask.tolist()) for r in want]
    assert supervised_text(tok, got[0]) == "Hello!<|im_end|>See you.<|im_end|>"


# DeepSeek-V3.1-style (the relevant parts of its template, SmolLM2's ChatML markers instead of
# <｜User｜>/<｜Assistant｜>/<｜end▁of▁sentence｜>): the generation prompt ends in "<think>" (thinking)
# or "</think>" (not); an assistant turn is rendered as "</think>" + answer, its reasoning dropped.
DEEPSEEK_V31_STYLE = """{%- set ns = namespace(is_last_user=false) -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{%- set ns.is_last_user = true -%}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' -}}
{%- elif m.role == 'assistant' -%}
{%- if ns.is_last_user -%}{{- '<|im_start|>assistant\\n</think>' -}}{%- endif -%}
{%- set ns.is_last_user = false -%}
{{- m.content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.is_last_user -%}{{- '<|im_start|>assistant\\n' -}}
{%- if thinking is defined and thinking -%}{{- '<think>' -}}{%- else -%}{{- '</think>' -}}{%- endif -%}
{%- endif -%}"""


def test_deepseek_v31_style_prompt_that_opens_the_think_block(embedded_target):
    """Only what the target generated is supervised. Non-thinking: the prompt ends in
    "</think>", the answer alone is supervised. Thinking: the prompt ends in "<think>", the target
    wrote reasoning + "</think>" + answer (the template's turn render has "</think>" + answer):
    the row is the served prompt followed by exactly that, all of it supervised."""
    t = _with_template(embedded_target, DEEPSEEK_V31_STYLE)
    r = LossMaskRenderer(t, {2})
    assert r.empty_reasoning_block() is None and r.empty_reasoning_block({"thinking": True}) is None
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    rows, rep = rows_of([sample(msgs=msgs)], r)
    P = t.apply_chat_template(msgs[:1], tokenize=True, return_dict=False, add_generation_prompt=True)
    assert t.decode(P).endswith("<|im_start|>assistant\n</think>")
    assert rows[0].input_ids[: len(P)].tolist() == P and not rows[0].loss_mask[: len(P)].any()
    assert supervised_text(t, rows[0]) == "Hello!<|im_end|>" and rep.reasoning_opened_by_prompt_turns == 0

    think = {"chat_template_kwargs": {"thinking": True}}
    msgs_r = [msgs[0], {"role": "assistant", "content": "Hello!", "reasoning": "A greeting; greet back."}]
    rows, rep = rows_of([sample(msgs=msgs_r, settings=think)], r)
    P = t.apply_chat_template(msgs[:1], tokenize=True, return_dict=False, add_generation_prompt=True, thinking=True)
    assert t.decode(P).endswith("<|im_start|>assistant\n<think>")
    row = rows[0]
    gen = t("A greeting; greet back.</think>Hello!<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert row.input_ids.tolist() == P + gen  # what the server saw, then what the target wrote
    assert np.flatnonzero(row.loss_mask).tolist() == list(range(len(P), len(P) + len(gen) - 1))  # not the "\n"
    assert supervised_text(t, row) == "A greeting; greet back.</think>Hello!<|im_end|>"
    assert rep.reasoning_opened_by_prompt_turns == 1 and rep.boundary_fallback_turns == 0
    assert rep.reasoning_not_rendered_turns == 0
    # thinking, the target closed the block at once (no reasoning): "</think>" is its first token
    rows, rep = rows_of([sample(msgs=msgs, settings=think)], r)
    assert rows[0].input_ids.tolist()[: len(P)] == P and supervised_text(t, rows[0]) == "</think>Hello!<|im_end|>"
    # two turns in thinking mode: the second turn's context holds the first as the template re-renders
    # it ("</think>" + answer, reasoning dropped): one row per turn, each as served
    two = [*msgs_r, {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "See you.", "reasoning": "Leave."}]
    rows, rep = rows_of([sample(msgs=two, settings=think)], r)
    assert [x.id for x in rows] == ["s0#0", "s0#1"] and rep.reasoning_opened_by_prompt_turns == 2
    assert supervised_text(t, rows[1]) == "Leave.</think>See you.<|im_end|>"
    assert t.decode(rows[1].input_ids).startswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n</think>Hello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n<think>")
