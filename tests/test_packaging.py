"""The project's own packaging: `pip install -e .` (scripts/setup_venv.sh) builds without a setuptools
warning banner."""

from __future__ import annotations

import contextlib
import io
import shutil
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_editable_build_prints_no_setuptools_banner(tmp_path, monkeypatch):
    """Without `package-dir = {"" = "."}` setuptools installs a meta path finder for the flat layout
    and says so in an "Editable installation" banner (InformationOnly, shown by pip as a
    BuildBackendWarning) on every set-up; with it the editable wheel is one .pth file."""
    import zipfile

    import setuptools.build_meta as backend

    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path)
    shutil.copytree(ROOT / "eagle3", tmp_path / "eagle3", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("always")
        wheel = backend.build_editable(str(tmp_path / "dist"))
    setuptools_warnings = [f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught
                           if w.category.__module__.startswith("setuptools")]
    assert setuptools_warnings == []
    names = zipfile.ZipFile(tmp_path / "dist" / wheel).namelist()
    assert [n for n in names if n.endswith(".pth")] == ["__editable__.eagle3-0.1.0.pth"]
