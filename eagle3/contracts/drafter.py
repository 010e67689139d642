"""Stage 4's exported drafter folder: the parts every drafter kind shares.

A drafter folder is what the serving engine loads (speculators' format, e.g. vLLM's
``speculators_model_type: eagle3`` loader):

* ``config.json``: the kind's config; ``speculators_model_type`` names the kind (the registry key,
  :mod:`eagle3.drafters`), ``eagle_aux_hidden_state_layer_ids`` the target layers it reads and the
  four norm flags (:data:`NORM_FLAGS`) how they are combined;
* ``model.safetensors``: the kind's tensors (``d2t``, int64 ``[draft]`` with target id = i + d2t[i],
  and ``t2d``, bool ``[V]``, when the draft vocab is smaller than the target's);
* ``training_info.json``: provenance (best step, reason).

Here: reading it (:func:`read_config`, :func:`kind_name`), how it is wired to the target
(:func:`settings_from_config` as vLLM reads it, :func:`settings_from_params` as it was trained, and
:func:`reference_problems` between the two), the one atomic writer (:func:`write_drafter_dir`) and
``eagle3 verify``'s check without the target (:func:`verify_export`). What a kind writes and how it is
checked against its target live in its folder, ``eagle3/drafters/<kind>/``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from eagle3.contracts.vocab_mapping import VocabMapping
from eagle3.errors import Eagle3Error, TrainError

__all__ = [
    "NORM_FLAGS",
    "DrafterCheckError",
    "DrafterSettings",
    "read_config",
    "kind_name",
    "settings_from_config",
    "settings_from_params",
    "write_drafter_dir",
    "clean_export_temps",
    "reference_problems",
    "verify_export",
]

# The four Eagle-3 norm switches. vLLM's converter and speculators disagree on the default of
# norm_before_residual (vLLM: True, speculators: False), so the export always writes all four.
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


class DrafterCheckError(TrainError):
    """:func:`eagle3.drafters.check_drafter` with ``raise_on_error`` found problems (listed in the message)."""

    def __init__(self, drafter_dir: str | Path, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"Drafter {drafter_dir} failed its checks:\n  - " + "\n  - ".join(problems))


@dataclass
class DrafterSettings:
    """How the drafter is wired to the target: aux layer ids and norm flags.

    Attributes:
        aux_layer_ids: aux hidden state layer ids, in the order they are concatenated for ``fc``.
        norm_before_residual, norm_before_fc, fc_norm, norm_output: speculators' norm flags.
        source: where these values came from (e.g. "config.json", "03_extract/meta.json").
        vocab_mapping: a ``vocab_mapping.safetensors`` (``d2t``, ``t2d``) to use instead of the
            checkpoint's (the mapping the training data used); None = the checkpoint's.
    """

    aux_layer_ids: list[int]
    norm_before_residual: bool
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    source: str = "config.json"
    vocab_mapping: str | None = None


def read_config(drafter_dir: str | Path, error: type[Exception] = Eagle3Error) -> dict:
    """A drafter's ``config.json`` as a dict.

    Raises:
        error: no config.json, or invalid JSON (line named).
    """
    p = Path(drafter_dir) / "config.json"
    if not p.is_file():
        raise error(f"{p}: not found; a speculators-format drafter dir holds config.json + model.safetensors")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{p}: invalid JSON at line {exc.lineno}: {exc.msg}") from None


def kind_name(drafter_dir: str | Path, error: type[Exception] = Eagle3Error) -> str:
    """The drafter kind recorded in a drafter's ``config.json`` (``speculators_model_type``).

    Raises:
        error: no/invalid config.json (:func:`read_config`), or no ``speculators_model_type``.
    """
    kind = read_config(drafter_dir, error).get("speculators_model_type")
    if not kind:
        raise error(f"{Path(drafter_dir) / 'config.json'}: speculators_model_type is missing (it names the drafter kind)")
    return str(kind)


def settings_from_config(drafter_dir: str | Path, vllm_view: bool = True,
                         error: type[Exception] = Eagle3Error) -> DrafterSettings:
    """The settings vLLM derives from a speculators config (``transformers_utils/configs/speculators``).

    vLLM concatenates the target's aux states in ascending layer order (it collects them while
    iterating the layers) and defaults ``norm_before_residual`` to True when the key is absent
    (speculators defaults it to False). ``vllm_view=False`` gives the values as written.

    Raises:
        error: no config.json, or no ``eagle_aux_hidden_state_layer_ids``.
    """
    cfg = read_config(drafter_dir, error)
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise error(f"{Path(drafter_dir) / 'config.json'}: eagle_aux_hidden_state_layer_ids is missing")
    ids = [int(i) for i in ids]
    return DrafterSettings(
        aux_layer_ids=sorted(set(ids)) if vllm_view else ids,
        norm_before_residual=bool(cfg.get("norm_before_residual", True if vllm_view else False)),
        norm_before_fc=bool(cfg.get("norm_before_fc", False)),
        fc_norm=bool(cfg.get("fc_norm", False)),
        norm_output=bool(cfg.get("norm_output", False)),
        source="config.json (as vLLM reads it)" if vllm_view else "config.json",
    )


def settings_from_params(params, aux_layer_ids, source: str = "params.train") -> DrafterSettings:
    """The settings a drafter is trained (and exported) with: ``aux_layer_ids`` (Stage 3's) and the
    norm flags of ``params.train``."""
    t = params.train
    return DrafterSettings(aux_layer_ids=[int(i) for i in aux_layer_ids], norm_before_residual=t.norm_before_residual,
                           norm_before_fc=t.norm_before_fc, fc_norm=t.fc_norm, norm_output=t.norm_output,
                           source=source)


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` over ``out_dir`` (the old folder moved aside first, then removed)."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def clean_export_temps(out_dir: str | Path) -> list[Path]:
    """Remove what a killed :func:`write_drafter_dir` left beside ``out_dir``: its temp folders
    (``.<name>.tmp-*``) and a previous export moved aside (``.<name>.old-*``). Returns them.

    Only one export of a folder runs at a time (one stage 4 per run directory), so any such folder
    is a dead one."""
    out_dir = Path(out_dir)
    gone = []
    for d in sorted(out_dir.parent.glob(f".{out_dir.name}.tmp-*")) + sorted(out_dir.parent.glob(f".{out_dir.name}.old-*")):
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    return gone


def write_drafter_dir(out_dir: str | Path, tensors: dict, config: dict, info: dict | None = None) -> Path:
    """Write a drafter folder (``model.safetensors``, ``config.json``, ``training_info.json``) atomically.

    The files go to a temp folder beside ``out_dir`` that is renamed over it: a killed export leaves
    ``out_dir`` as it was (or, killed between the two renames, absent) and a temp folder that the next
    export removes (:func:`clean_export_temps`). Every kind's export writes through here.

    Args:
        out_dir: the drafter folder (replaced as a whole).
        tensors: name -> tensor, written as given (contiguous CPU tensors).
        config: the ``config.json`` dict; its ``speculators_model_type`` names the drafter kind.
        info: provenance written to ``training_info.json`` (none when empty).

    Returns:
        Path: ``out_dir``.
    """
    from safetensors.torch import save_file

    from eagle3.io import atomic_write_json

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    clean_export_temps(out_dir)  # a killed export's temp folder does not stay for good
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", config)
        if info:
            atomic_write_json(tmp / "training_info.json", info)
        for f in tmp.iterdir():  # readable by whoever serves it (mkstemp/mkdtemp create 0600/0700)
            f.chmod(0o644)
        tmp.chmod(0o755)
        _replace_dir(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def reference_problems(cfg: dict, reference: DrafterSettings) -> list[str]:
    """A drafter ``config.json``'s layer ids and norm flags against what the drafter was trained with
    (:func:`settings_from_params`; every kind's check ends with these)."""
    out: list[str] = []
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids and list(reference.aux_layer_ids) != list(ids):
        out.append(f"layer ids: config.json lists {list(ids)} but the drafter was trained on "
                   f"{list(reference.aux_layer_ids)} ({reference.source})")
    for flag in NORM_FLAGS:
        if flag in cfg and bool(cfg[flag]) != bool(getattr(reference, flag)):
            out.append(f"norm flags: config.json has {flag}={cfg[flag]} but the drafter was trained with "
                       f"{getattr(reference, flag)} ({reference.source})")
    return out


def verify_export(drafter_dir: str | Path, mapping: VocabMapping | None) -> list[str]:
    """``eagle3 verify``'s check of an exported drafter on its own (no target needed): ``config.json``
    parses and names the layer ids and draft vocab size; every tensor of ``model.safetensors`` loads
    and is finite; its ``d2t``/``t2d`` are the mapping of Stage 2 (``mapping``; digests compared:
    :func:`eagle3.contracts.vocab_mapping.mapping_digest`), or both absent for a full-size vocab.

    Args:
        drafter_dir: the export folder.
        mapping: Stage 2's mapping as read now (None: unreadable or absent, the mapping is not compared).

    Returns:
        list[str]: one line per problem, each naming the file.
    """
    import torch
    from safetensors import safe_open

    from eagle3.contracts.vocab_mapping import mapping_digest

    d = Path(drafter_dir)
    cfg_file, w_file = d / "config.json", d / "model.safetensors"
    problems = []
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        missing = [k for k in ("eagle_aux_hidden_state_layer_ids", "draft_vocab_size") if k not in cfg]
        if missing:
            problems.append(f"{cfg_file}: no {', '.join(missing)}")
    except (OSError, ValueError) as exc:
        problems.append(f"{cfg_file}: unreadable ({type(exc).__name__}: {exc})")
    tensors = {}
    try:
        with safe_open(str(w_file), framework="pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                if t.is_floating_point() and not torch.isfinite(t).all():
                    problems.append(f"{w_file}: tensor {k} has NaN/Inf values")
                if k in ("d2t", "t2d"):
                    tensors[k] = t
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types; name the file
        problems.append(f"{w_file}: not a readable safetensors file ({type(exc).__name__}: {exc})")
        return problems
    if mapping is not None:
        want = mapping_digest(mapping.d2t, mapping.t2d)
        got = mapping_digest(tensors.get("d2t"), tensors.get("t2d")) if len(tensors) == 2 else (
            "full-size" if not tensors else f"only {sorted(tensors)}")
        if got != want:
            problems.append(f"{w_file}: d2t/t2d digest {got}, but Stage 2's vocab_mapping.safetensors is {want}: the "
                            f"drafter was exported with another draft vocab mapping (stage 2 re-run after stage 4?); "
                            f"redo stage 4: `eagle3 run PARAMS --stages 4-5 --redo 4`")
    return problems
