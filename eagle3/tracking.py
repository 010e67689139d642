"""A thin wrapper over wandb: one W&B run per run directory, one key prefix per stage.

Mode comes from ``tracking.mode``: ``online``, ``offline`` or ``disabled``; ``auto`` is online
when an API key is configured (``WANDB_API_KEY`` or a netrc entry) and offline otherwise. The run
config is the resolved params (which never hold secrets: API keys are read from environment
variables named in params, never stored). Every figure is also saved as a PNG in the stage folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from eagle3.config import Params

__all__ = ["Tracker", "resolve_mode", "scrub_secrets"]

_SECRET_RE = re.compile(r"(?i)(api[_-]?key|token|secret|password)")


def resolve_mode(mode: str) -> str:
    """'auto' -> 'online' if a W&B API key is configured, else 'offline'; others unchanged."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


def scrub_secrets(obj: Any) -> Any:
    """Copy of a JSON-like object with values of secret-looking keys replaced by '***'.

    Keys that only *name* an environment variable (ending in ``_env``) are kept.
    """
    if isinstance(obj, dict):
        return {
            k: ("***" if _SECRET_RE.search(str(k)) and not str(k).endswith("_env") and v else scrub_secrets(v))
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [scrub_secrets(v) for v in obj]
    return obj


class Tracker:
    """Log a stage's numbers and figures to W&B (or nowhere) and its figures to PNG files.

    Args:
        params: the resolved params (logged as the run config).
        run_dir: the run directory; the W&B files go to ``<run_dir>/wandb``.
        stage: the stage prefix for keys, e.g. ``"01_synthesize"``.
    """

    def __init__(self, params: Params, run_dir: str | Path, stage: str) -> None:
        self.params = params
        self.run_dir = Path(run_dir)
        self.stage = stage
        self.stage_dir = self.run_dir / stage
        self.stage_dir.mkdir(parents=True, exist_ok=True)
        self.mode = resolve_mode(params.tracking.mode)
        self.run = None
        if self.mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            # One W&B run per run directory; each stage resumes it (same id).
            run_id = f"{params.run.name}-{self._run_id_suffix()}"
            self.run = wandb.init(
                project=params.tracking.project,
                entity=params.tracking.entity,
                name=params.run.name,
                id=re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[:64],
                resume="allow",
                dir=str(self.run_dir),
                mode=self.mode,
                config=scrub_secrets(params.model_dump(mode="json")),
                reinit="finish_previous",
                settings=wandb.Settings(console="off", x_disable_stats=True),
            )

    def _run_id_suffix(self) -> str:
        from eagle3.config import params_fingerprint

        return params_fingerprint(self.params)[:8]

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Log scalar metrics under ``<stage>/<key>``."""
        if self.run is None:
            return
        flat = {f"{self.stage}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float, bool))}
        if flat:
            self.run.log(flat, step=step) if step is not None else self.run.log(flat)

    def summary(self, stats: dict[str, Any]) -> None:
        """Put a stage's summary numbers (``stats.json``) into the W&B run summary."""
        if self.run is None:
            return
        for k, v in stats.items():
            if isinstance(v, (int, float, str, bool)):
                self.run.summary[f"{self.stage}/{k}"] = v

    def figure(self, name: str, fig) -> Path:
        """Save a matplotlib figure as ``<stage_dir>/<name>.png`` and log it to W&B.

        Returns:
            Path: the PNG file.
        """
        from eagle3.io import atomic_path

        path = self.stage_dir / f"{name}.png"
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
        if self.run is not None:
            import wandb

            self.run.log({f"{self.stage}/{name}": wandb.Image(str(path))})
        return path

    def finish(self) -> None:
        """Close the W&B run (flushes offline files)."""
        if self.run is not None:
            self.run.finish()
            self.run = None
