"""Compatibility: moved to :mod:`eagle3.rundir` (import from there; this module is removed once unused)."""

from eagle3.rundir import notebooks_dir, project_root, resolve_run_dir

__all__ = ["project_root", "notebooks_dir", "resolve_run_dir"]
