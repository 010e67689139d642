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


def _cpu_flags() -> set[str]:
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    if not info.exists():
        pytest.skip("no /proc/cpuinfo (not Linux)")
    line = next(ln for ln in info.read_text().splitlines() if ln.startswith("flags"))
    return set(line.split(":", 1)[1].split())


def test_native_bf16_check_agrees_with_the_cpu_flags():
    """oneDNN's bf16 check (what 'auto' decides by) matches the CPU's own flags: AMX-BF16 or
    AVX512-BF16 present <=> native bf16 (an AVX2-only AMD EPYC here emulated it at 1/125 of float32)."""
    from eagle3.target import cpu_has_native_bf16

    flags = _cpu_flags()
    assert cpu_has_native_bf16() == bool({"amx_bf16", "avx512_bf16"} & flags)


def test_target_dtype_auto_is_bf16_only_on_a_cpu_that_has_it(monkeypatch):
    import eagle3.target as target

    for name in ("float32", "bfloat16", "float16"):  # explicit values are kept on any machine
        assert target.target_dtype(TargetParams(dtype=name, device="cpu")) == name
    monkeypatch.setattr(target, "cpu_has_native_bf16", lambda: True)
    assert target.target_dtype(TargetParams(device="cpu")) == "bfloat16"
    monkeypatch.setattr(target, "cpu_has_native_bf16", lambda: False)
    assert target.target_dtype(TargetParams(device="cpu")) == "float32"
    monkeypatch.setattr(target, "pick_device", lambda device: "cuda")  # a GPU: the checkpoint's / vLLM's own rule
    assert target.target_dtype(TargetParams()) == "auto"


def test_the_default_run_loads_the_target_in_the_dtype_this_cpu_runs_fast(embedded_target):
    """params/smollm2-135m.yaml leaves target.dtype to 'auto': the loaded target is bfloat16 exactly
    where the CPU has native bf16, float32 elsewhere, and the vLLM jobs get the same name."""
    import torch

    from eagle3.evaluate.vllm_jobs import build_job
    from eagle3.params_file import load_params
    from eagle3.target import cpu_has_native_bf16, load_target

    params = load_params("params/smollm2-135m.yaml", ["tracking.mode=disabled"])
    assert params.target.dtype == "auto"
    model, _, _ = load_target(params.target)
    want = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert model.dtype == want and next(model.parameters()).dtype == want
    job = build_job(params, "ngram", embedded_target.path, "unused", [], None)
    assert job["dtype"] == str(want).replace("torch.", "")
