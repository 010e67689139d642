"""Shared fixtures: the embedded SmolLM2 target (converted once per machine) and temp run dirs."""

from __future__ import annotations

import os
import subprocess
import sys
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


def run_eagle3(*args: str, timeout: int = 3600) -> subprocess.CompletedProcess:
    """The ``eagle3`` console script of this venv in a subprocess (W&B offline); asserts exit 0."""
    exe = Path(sys.executable).parent / "eagle3"
    env = dict(os.environ, WANDB_MODE="offline", PYTHONPATH=str(ROOT))
    r = subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, f"eagle3 {' '.join(args)}:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


@pytest.fixture(scope="session")
def ci_run(tmp_path_factory):
    """`eagle3 run params/ci.yaml` (the console script, in a subprocess) into a temp output folder,
    once per session: the finished CI run (read-only for the tests that use it)."""
    out = tmp_path_factory.mktemp("ci-outputs")
    r = run_eagle3("run", str(ROOT / "params" / "ci.yaml"), "--set", f"run.output_dir={out}", timeout=3000)
    (out / "run.log").write_text(r.stdout + "\n" + r.stderr)
    return out / "ci"


@pytest.fixture(scope="session")
def ci_sweep(ci_run):
    """`eagle3 sweep params/ci.yaml --vary train.lr=0.002` beside the CI run: the base's stages are
    finished (skipped), the variant ``ci--lr-0.002`` trains on its linked stages 1-3 and is evaluated.
    Returns (the base, the variant, the sweep command's stdout)."""
    out = ci_run.parent
    r = run_eagle3("sweep", str(ROOT / "params" / "ci.yaml"), "--vary", "train.lr=0.002",
                   "--set", f"run.output_dir={out}", timeout=3600)
    return ci_run, out / "ci--lr-0.002", r.stdout


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
