"""A thin wrapper over wandb: one W&B run per run directory, one key prefix per stage.

Mode comes from ``tracking.mode``: ``online``, ``offline`` or ``disabled``; ``auto`` is online
when an API key is configured (``WANDB_API_KEY`` or a netrc entry), offline otherwise, and off where
the ``wandb`` package is not installed. The W&B
run is named by ``run.name``; its config is the resolved params flattened to dotted keys
(:func:`flat_params`: ``train.lr``, ``synthesize.sources.0.limit``), the keys ``eagle3 compare``
names, so that W&B's own comparison of runs (its runs table, parallel coordinates) lines up with
the comparison page. Params never hold secrets (API keys are read from environment variables named
in params, never stored), and :func:`scrub_secrets` masks anything that looks like one. Every figure
is also saved as a PNG in the stage folder.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from eagle3.config import Params

__all__ = ["Tracker", "resolve_mode", "check_tracking", "wandb_installed", "scrub_secrets", "offline_fallback_id", "flat_params"]

log = logging.getLogger(__name__)

# Key names that hold secrets: exact names and suffixes, never substrings (`max_new_tokens`,
# `token_budget`, `num_speculative_tokens` are settings, not secrets).
_SECRET_NAMES = frozenset({"api_key", "apikey", "token", "access_token", "auth_token", "hf_token", "secret",
                           "client_secret", "password", "passwd"})
_SECRET_SUFFIXES = ("_api_key", "_apikey", "_access_token", "_auth_token", "_secret", "_password")
# Values that are credentials whatever the key: OpenAI/Anthropic-style, Hugging Face, W&B v1 keys.
_SECRET_VALUE_RE = re.compile(r"^(sk-[A-Za-z0-9_-]{8,}|hf_[A-Za-z0-9]{20,}|local-[0-9a-f]{30,}|[0-9a-f]{40})$")


def wandb_installed() -> bool:
    """Whether the ``wandb`` package can be imported here (a bare GPU image may lack it)."""
    import importlib.util

    return importlib.util.find_spec("wandb") is not None


def check_tracking(params: Params) -> None:
    """Refuse, before a stage runs, a ``tracking.mode`` that needs W&B where ``wandb`` is not installed
    (the stage would fail at its end, after its work, when it logs).

    Raises:
        ParamsError: ``tracking.mode`` online/offline without the package, naming both ways out.
    """
    from eagle3.errors import ParamsError

    if params.tracking.mode in ("online", "offline") and not wandb_installed():
        raise ParamsError(f"tracking.mode: {params.tracking.mode} needs the wandb package, which is not installed "
                          f"here: pip install wandb, or --set tracking.mode=disabled (auto skips W&B without it)")


def resolve_mode(mode: str) -> str:
    """'auto' -> 'online' if a W&B API key is configured, else 'offline', and 'disabled' where the
    ``wandb`` package is not installed (the figures are still written as PNGs); others unchanged."""
    if mode != "auto":
        return mode
    if not wandb_installed():
        log.warning("tracking.mode auto: the wandb package is not installed; W&B logging is off (figures "
                    "are still saved as PNG files)")
        return "disabled"
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


def _secret_key(key: str) -> bool:
    k = key.lower()
    return k in _SECRET_NAMES or k.endswith(_SECRET_SUFFIXES)


def scrub_secrets(obj: Any, _env_values: frozenset[str] | None = None) -> Any:
    """Copy of a JSON-like object with secrets replaced by ``'***'``.

    A string is a secret when its key is a secret name (``api_key``, ``token``, ``*_secret``, ...:
    exact names and suffixes, so ``max_new_tokens`` is kept), when it looks like a credential
    (``sk-...``, ``hf_...``, a 40-hex W&B key), or when it equals the current value of an
    environment variable that an ``*_env`` key names (``api_key_env: OPENAI_API_KEY``). Keys that
    only *name* an environment variable are kept.
    """
    if _env_values is None:
        names = _env_names(obj)
        _env_values = frozenset(v for n in names if len(v := os.environ.get(n, "")) >= 8)
    if isinstance(obj, dict):
        return {
            k: ("***" if isinstance(v, str) and v and _secret_key(str(k)) else scrub_secrets(v, _env_values))
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [scrub_secrets(v, _env_values) for v in obj]
    if isinstance(obj, str) and (obj in _env_values or _SECRET_VALUE_RE.match(obj)):
        return "***"
    return obj


def _env_names(obj: Any) -> list[str]:
    """Values of every ``*_env`` key (names of environment variables holding secrets)."""
    if isinstance(obj, dict):
        out = [v for k, v in obj.items() if str(k).endswith("_env") and isinstance(v, str)]
        return out + [n for v in obj.values() for n in _env_names(v)]
    if isinstance(obj, list):
        return [n for v in obj for n in _env_names(v)]
    return []


def flat_params(params: Params) -> dict[str, Any]:
    """The resolved params as one level of dotted keys, secrets masked (:func:`scrub_secrets`): the W&B
    run config. Nested sections join with ``.`` (``train.lr``); a list of sections is indexed
    (``synthesize.sources.0.name``), as :func:`eagle3.params_file.differing_values` names a key; a list of
    plain values stays one value (``evaluate.backends: ["offline", "vllm"]``); an empty section or list
    stays itself."""
    out: dict[str, Any] = {}

    def walk(v: Any, key: str) -> None:
        if isinstance(v, dict) and v:
            for k, x in v.items():
                walk(x, f"{key}.{k}" if key else str(k))
        elif isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v):
            for i, x in enumerate(v):
                walk(x, f"{key}.{i}")
        else:
            out[key] = v

    walk(scrub_secrets(params.model_dump(mode="json")), "")
    return out


def offline_fallback_id(run_id: str) -> dict:
    """The ``id`` and ``resume`` of the offline run that 'auto' falls back to: a fresh id
    (``<run_id>-offline-<6 hex>``, at most 64 characters), not resumed.

    The online attempt that timed out may still hold ``run_id`` in wandb's service process, where a
    second ``init`` with it fails about a minute later (``ServerResponseError: run ID ... is in
    use``); offline runs cannot resume anyway. ``wandb sync`` uploads the files as a run of their own.
    """
    import secrets

    return {"id": f"{run_id[:48]}-offline-{secrets.token_hex(3)}", "resume": None}


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
            kwargs = dict(
                project=params.tracking.project,
                entity=params.tracking.entity,
                name=params.run.name,
                id=re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[:64],
                resume="allow",
                dir=str(self.run_dir),
                config=flat_params(params),
                reinit="finish_previous",
            )
            auto_online = params.tracking.mode == "auto" and self.mode == "online"
            try:
                # 'auto' only guessed that W&B is reachable (a key exists): give it 20 s, not
                # wandb's 90, before falling back to offline files (`wandb sync` uploads them later).
                self.run = wandb.init(mode=self.mode, settings=wandb.Settings(
                    console="off", x_disable_stats=True, **({"init_timeout": 20} if auto_online else {})), **kwargs)
            except Exception as exc:  # wandb raises CommError/UsageError/TimeoutError variants
                if not auto_online:
                    raise
                log.warning("tracking.mode auto: W&B is not reachable (%s: %s); logging offline to %s/wandb "
                            "instead (upload later with `wandb sync`)", type(exc).__name__,
                            str(exc).splitlines()[0] if str(exc) else "", self.run_dir)
                self.mode = "offline"
                self.run = wandb.init(mode="offline", settings=wandb.Settings(console="off", x_disable_stats=True),
                                      **(kwargs | offline_fallback_id(kwargs["id"])))

    def _run_id_suffix(self) -> str:
        from eagle3.params_file import params_fingerprint

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
