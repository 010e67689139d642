"""Where things are: the project root, notebooks, and run directories."""

from __future__ import annotations

from pathlib import Path

__all__ = ["project_root", "notebooks_dir", "resolve_run_dir"]


def project_root() -> Path:
    """The repository root (the folder holding pyproject.toml above this package), else the cwd."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / "pyproject.toml").exists() else Path.cwd()


def notebooks_dir() -> Path:
    """``<project_root>/notebooks``."""
    return project_root() / "notebooks"


def resolve_run_dir(params) -> Path:
    """``<run.output_dir>/<run.name>``, a relative output_dir taken from the project root (absolute)."""
    out = Path(params.run.output_dir).expanduser()
    if not out.is_absolute():
        out = project_root() / out
    return (out / params.run.name).resolve()
