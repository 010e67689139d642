"""Target loading: the embedded SmolLM2 (GGUF -> model dir), local paths, clear errors."""

from __future__ import annotations

import pytest

from eagle3.config import TargetParams
from eagle3.target import TargetError, resolve_target


def test_embedded_converted_once(embedded_target):
    import json

    cfg = json.loads((embedded_target.path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    mtime = (embedded_target.path / "config.json").stat().st_mtime
    again = resolve_target(TargetParams(model="embedded:smollm2-135m"))
    assert again.path == embedded_target.path
    assert (again.path / "config.json").stat().st_mtime == mtime  # reused, not converted again


def test_embedded_generates_sensible_answer(target_model):
    model, tok = target_model
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert text, "empty answer"
    assert "paris" in text.lower()


def test_missing_local_path(tmp_path):
    with pytest.raises(TargetError, match="does not exist"):
        resolve_target(TargetParams(model=str(tmp_path / "no-such-model")))


def test_directory_without_config(tmp_path):
    with pytest.raises(TargetError, match="without config.json"):
        resolve_target(TargetParams(model=str(tmp_path)))


def test_offline_hub_id_names_model(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(TargetError) as e:
        resolve_target(TargetParams(model="some-org/not-cached-model"))
    msg = str(e.value)
    assert "some-org/not-cached-model" in msg and "--local-dir" in msg and "target.model" in msg


def test_unknown_embedded():
    with pytest.raises(TargetError, match="unknown embedded model"):
        resolve_target(TargetParams(model="embedded:gpt-5"))


def test_cuda_on_a_machine_without_cuda_is_a_clear_error(monkeypatch):
    import torch

    from eagle3.errors import TargetError
    from eagle3.target import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == "cpu" and pick_device("cpu") == "cpu"
    with pytest.raises(TargetError, match=r"device 'cuda:1' was requested .* Set the device to 'auto' or 'cpu'"):
        pick_device("cuda:1")
