"""eagle3.chat: one renderer, stop ids from the chat template (never the tokenizer's eos alone), no pad assumed."""

from __future__ import annotations

import copy

import pytest

from eagle3.chat import ChatRenderer, chat_message, end_of_turn_id, pad_token_id, stop_token_ids, template_kwargs
from eagle3.config import Params
from eagle3.errors import TargetError


@pytest.fixture(scope="module")
def tok(embedded_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_target.path)


def _gguf_517(tok):
    """What transformers 5.17 makes of the embedded GGUF: eos <|im_start|>, no pad token."""
    t = copy.deepcopy(tok)
    t.pad_token = None
    t.eos_token = "<|im_start|>"
    return t


def test_end_of_turn_and_stop_ids_of_the_embedded_target(tok, embedded_target):
    assert end_of_turn_id(tok) == 2 == tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(tok, embedded_target.path) == [2]
    assert pad_token_id(tok, [2]) == tok.pad_token_id == 2


def test_a_wrong_eos_and_no_pad_token_still_stop_at_the_end_of_turn(tok, embedded_target):
    bad = _gguf_517(tok)
    assert bad.eos_token_id == 1 and bad.pad_token_id is None
    assert end_of_turn_id(bad) == 2
    # <|im_start|> opens every turn of the template: never a stop id, whatever the configs say
    assert stop_token_ids(bad, None, {"eos_token_id": 1}) == [2]
    assert stop_token_ids(bad, embedded_target.path) == [2]
    assert pad_token_id(bad, [2]) == 2


def test_no_stop_token_anywhere_is_an_error(tok):
    t = copy.deepcopy(tok)
    t.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    t.eos_token = None
    with pytest.raises(TargetError, match="no end-of-turn/eos token"):
        stop_token_ids(t)


def test_prompt_ids_are_the_served_render(tok):
    r = ChatRenderer(tok)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert r.render(msgs) == text and text.endswith("<|im_start|>assistant\n")
    assert r.prompt_ids(msgs) == tok(text, add_special_tokens=False)["input_ids"] and r.count(msgs) == len(r.prompt_ids(msgs))
    conv = msgs + [{"role": "assistant", "content": "4", "reasoning": "add"}]
    assert chat_message(conv[1]) == {"role": "assistant", "content": "4", "reasoning": "add", "reasoning_content": "add"}
    assert r.render_ids([conv], False) == [tok.apply_chat_template([chat_message(m) for m in conv], tokenize=True,
                                                                   return_dict=False)]
    t = copy.deepcopy(tok)
    t.chat_template = None
    with pytest.raises(TargetError, match="has no chat template"):
        ChatRenderer(t)


def test_template_kwargs_from_params():
    assert template_kwargs(Params.model_validate({"synthesize": {"enable_thinking": None}})) == {}
    p = Params.model_validate({"synthesize": {"enable_thinking": False}})
    assert template_kwargs(p) == {"enable_thinking": False}
