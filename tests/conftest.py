"""Shared fixtures: the embedded SmolLM2 target (converted once per machine) and temp run dirs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def embedded_target():
    """The embedded target resolved to its converted model directory (ResolvedTarget)."""
    from eagle3.config import TargetParams
    from eagle3.target import resolve_target

    return resolve_target(TargetParams(model="embedded:smollm2-135m", dtype="float32", device="cpu"))


@pytest.fixture(scope="session")
def target_model(embedded_target):
    """(model, tokenizer) of the embedded target in float32 on CPU, loaded once per session."""
    from eagle3.config import TargetParams
    from eagle3.target import load_target

    model, tok, _ = load_target(TargetParams(model=str(embedded_target.path), dtype="float32", device="cpu"))
    return model, tok


@pytest.fixture
def tmp_params(tmp_path):
    """Write a params YAML into tmp_path (output_dir inside tmp_path) and return its path."""

    def make(text: str = "", name: str = "p.yaml") -> Path:
        p = tmp_path / name
        # Default sections, unless `text` states that section itself (a key given twice is an error).
        defaults = {"run": f"run:\n  name: t\n  output_dir: {tmp_path / 'outputs'}\n",
                    "tracking": "tracking:\n  mode: disabled\n"}
        body = "".join(v for k, v in defaults.items() if not any(ln.startswith(f"{k}:") for ln in text.splitlines()))
        p.write_text(body + text)
        return p

    return make
