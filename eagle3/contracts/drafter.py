"""Stage 4's exported drafter — the ONLY code that writes it and the ONE check of it.

A drafter folder is what vLLM's ``speculators_model_type: eagle3`` loader reads
(``vllm/transformers_utils/configs/speculators/algos.py`` -> ``Eagle3LlamaForCausalLM``):

* ``config.json``: speculators' ``Eagle3SpeculatorConfig`` with ``eagle_aux_hidden_state_layer_ids``,
  the four norm flags (:data:`NORM_FLAGS`, always written: vLLM and speculators disagree on the
  default of ``norm_before_residual``), ``draft_vocab_size``, ``target_hidden_size``, the Llama-style
  ``transformer_layer_config`` (rope settings from the target) and the verifier's portable name;
* ``model.safetensors``: the draft layer, ``fc`` (``[H, n_aux * H]``), ``norm``, ``lm_head`` over the
  draft vocab, ``d2t`` (int64 ``[draft]``, target id = i + d2t[i]) and ``t2d`` (bool ``[V]``) when
  the draft vocab is smaller, ``embed_tokens.weight`` only when exported bit-identical to the target's;
* ``training_info.json``: provenance (best step, reason).

:func:`export_drafter` writes it (Stage 4), :func:`settings_from_config` / :func:`settings_from_params`
say how it is wired to the target (as vLLM reads it, or as it was trained), :func:`check_drafter`
checks it against its target (Stage 4 after export, Stage 5 before measuring).
"""

from __future__ import annotations

import copy
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
    "settings_from_config",
    "settings_from_params",
    "export_drafter",
    "clean_export_temps",
    "check_drafter",
    "hidden_size_problems",
    "check_hidden_size",
    "verify_export",
]

# The four Eagle-3 norm switches. vLLM's converter and speculators disagree on the default of
# norm_before_residual (vLLM: True, speculators: False), so the export always writes all four.
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


class DrafterCheckError(TrainError):
    """``check_drafter(..., raise_on_error=True)`` found problems (listed in the message)."""

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


def _export_config(model, verifier_name: str, dtype) -> dict:
    cfg = copy.deepcopy(model.config)
    cfg.speculators_config.verifier.name_or_path = verifier_name
    d = json.loads(cfg.to_json_string(use_diff=False))
    for k in ("auto_map", "_name_or_path", "_attn_implementation_autoset"):
        d.pop(k, None)
    tl = d.get("transformer_layer_config", {})
    tl.pop("_attn_implementation_autoset", None)
    d["dtype"] = str(dtype).replace("torch.", "")
    for k in NORM_FLAGS:
        d[k] = bool(getattr(model.config, k))
    return d


def _export_tensors(model, dtype, include_embed_tokens: bool) -> dict:
    tensors = {}
    for k, v in model.state_dict().items():
        if k.startswith(("verifier_lm_head", "verifier_norm")) or ".rotary_emb." in k or k.startswith("rotary_emb"):
            continue
        if k == "embed_tokens.weight" and not include_embed_tokens:
            continue
        if v.is_floating_point() and dtype is not None and not k.endswith("norm.weight"):
            v = v.to(dtype)  # RMSNorm gains stay float32: a short run's updates (~lr) survive, see export_drafter
        tensors[k] = v.detach().cpu().contiguous().clone()
    return tensors


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
    """Remove what a killed :func:`export_drafter` left beside ``out_dir``: its temp folders
    (``.<name>.tmp-*``) and a previous export moved aside (``.<name>.old-*``). Returns them.

    Only one export of a folder runs at a time (one stage 4 per run directory), so any such folder
    is a dead one."""
    out_dir = Path(out_dir)
    gone = []
    for d in sorted(out_dir.parent.glob(f".{out_dir.name}.tmp-*")) + sorted(out_dir.parent.glob(f".{out_dir.name}.old-*")):
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    return gone


def export_drafter(model, out_dir: str | Path, verifier_name: str, dtype=None, include_embed_tokens: bool = False,
                   info: dict | None = None) -> Path:
    """Write a drafter in the speculators format (``config.json`` + ``model.safetensors``), atomically.

    Tensors written: the trained draft weights and the frozen ``lm_head`` cast to ``dtype`` (except
    the RMSNorm gains, kept in float32: they start at exactly 1.0 and move by about ``lr`` per step,
    which bfloat16's 2^-7 spacing near 1.0 would round away in a short run; vLLM and speculators cast
    on load), ``d2t`` (int64) and ``t2d`` (bool) when the draft vocab is smaller than the target's, and
    ``embed_tokens.weight`` only when ``include_embed_tokens`` (then it must equal the target's bit
    for bit: pass the target's dtype). Without it vLLM shares the target's embeddings. The
    verifier-only tensors (``verifier_lm_head``, ``verifier_norm``) are never written.

    Args:
        model: an ``Eagle3DraftModel`` (plain, not DDP-wrapped).
        out_dir: the drafter folder (replaced as a whole).
        verifier_name: written as ``speculators_config.verifier.name_or_path``.
        dtype: torch dtype of the floating tensors (default: as in the model).
        info: extra provenance written to ``training_info.json`` beside the weights.

    A killed export leaves ``out_dir`` as it was (or, killed between the two renames, absent) and a
    temp folder that the next export removes (:func:`clean_export_temps`).

    Returns:
        Path: ``out_dir``.
    """
    from safetensors.torch import save_file

    from eagle3.io import atomic_write_json

    out_dir = Path(out_dir)
    tensors = _export_tensors(model, dtype, include_embed_tokens)
    cfg = _export_config(model, verifier_name, dtype or next(model.parameters()).dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    clean_export_temps(out_dir)  # a killed export's temp folder does not stay for good
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", cfg)
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


# ----------------------------------------------------------------------------------------------
# The one check
# ----------------------------------------------------------------------------------------------


def _text_config(cfg):
    return getattr(cfg, "text_config", None) or cfg


def _load_target_embed(target_dir: Path):
    from speculators.utils.loading import load_model_layers

    w = load_model_layers(["embed_tokens.weight"], str(target_dir))
    return w.get("embed_tokens.weight")


def _check_shapes(cfg: dict, w: dict, tcfg) -> list[str]:
    """Config keys, hidden size, rope settings against the target."""
    H, V = int(tcfg.hidden_size), int(tcfg.vocab_size)
    out: list[str] = []
    if cfg.get("speculators_model_type") != "eagle3":
        out.append(f"speculators_model_type is {cfg.get('speculators_model_type')!r}, expected 'eagle3'")
    missing_flags = [k for k in NORM_FLAGS if k not in cfg]
    if missing_flags:
        out.append(f"norm flags absent from config.json: {missing_flags} (vLLM would apply its own defaults)")
    tl = cfg.get("transformer_layer_config") or {}
    out += hidden_size_problems(cfg, H)
    if tl.get("vocab_size") not in (None, V):
        out.append(f"transformer_layer_config.vocab_size={tl.get('vocab_size')} but the target has {V} tokens")
    for k in ("rope_parameters", "rope_theta", "rope_scaling"):
        t_val = getattr(tcfg, k, None)
        if k in tl and t_val is not None and tl[k] != t_val:
            out.append(f"transformer_layer_config.{k}={tl[k]} differs from the target's {t_val}")
    return out


def hidden_size_problems(cfg: dict, target_hidden_size: int) -> list[str]:
    """The drafter config's hidden sizes against the target's, from the ``config.json`` dict alone
    (no transformers config is built: one with a wrong hidden size fails there first with a message
    about attention heads). ``transformer_layer_config.hidden_size`` must equal the target's (the
    draft layer runs in the target's hidden space: ``fc`` maps ``n_aux * H -> H``, the embeddings
    are the target's), and so must ``target_hidden_size`` when given.

    Returns:
        list[str]: e.g. ``["hidden size 512 ≠ target 576 (transformer_layer_config.hidden_size)"]``.
    """
    H = int(target_hidden_size)
    tl = cfg.get("transformer_layer_config") or {}
    out = []
    for key, val in (("transformer_layer_config.hidden_size", tl.get("hidden_size")),
                     ("target_hidden_size", cfg.get("target_hidden_size"))):
        if (val is not None or key.startswith("transformer")) and val != H:
            out.append(f"hidden size {val} ≠ target {H} ({key})")
    return out


def check_hidden_size(drafter_dir: str | Path, target_hidden_size: int, error: type[Exception] = Eagle3Error) -> None:
    """Refuse a drafter whose ``config.json`` hidden sizes disagree with the target's, before any
    model or transformers config is built from it (:func:`hidden_size_problems`).

    Raises:
        error: no/invalid config.json (:func:`read_config`), or a hidden size that disagrees, e.g.
            ``<dir>/config.json: hidden size 512 ≠ target 576 (transformer_layer_config.hidden_size);
            this drafter was made for another target``.
    """
    probs = hidden_size_problems(read_config(drafter_dir, error), target_hidden_size)
    if probs:
        raise error(f"{Path(drafter_dir) / 'config.json'}: {'; '.join(probs)}; this drafter was made for another "
                    f"target (its hidden size must equal the target's)")


def _check_layer_ids(cfg: dict, w: dict, H: int, N: int) -> list[str]:
    """``eagle_aux_hidden_state_layer_ids``: present, in range, distinct, ascending, as many as ``fc`` takes."""
    out: list[str] = []
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        out.append("eagle_aux_hidden_state_layer_ids missing from config.json (vLLM would guess its defaults)")
    else:
        bad = [k for k in ids if not isinstance(k, int) or not (1 <= k < N)]
        if bad:
            out.append(f"eagle_aux_hidden_state_layer_ids {ids}: {bad} out of range [1, {N - 1}] for a {N}-layer target")
        if len(set(ids)) != len(ids):
            out.append(f"eagle_aux_hidden_state_layer_ids {ids} has duplicates")
        elif list(ids) != sorted(ids):
            out.append(f"eagle_aux_hidden_state_layer_ids {ids} not ascending: vLLM concatenates the aux states in "
                       f"ascending layer order, so fc would see them in another order than in training")
    fc = w.get("fc.weight")
    if fc is None:
        out.append("fc.weight missing from model.safetensors")
    else:
        if ids and fc.shape[1] != len(ids) * H:
            out.append(f"fc.weight takes {fc.shape[1]} inputs but {len(ids)} aux layers x hidden {H} = {len(ids) * H}")
        if fc.shape[0] != H:
            out.append(f"hidden size {fc.shape[0]} ≠ target {H} (fc.weight outputs)")
    return out


def _check_vocab(cfg: dict, w: dict, V: int) -> list[str]:
    """``draft_vocab_size``, ``lm_head`` rows and the d2t/t2d mapping."""
    out: list[str] = []
    draft = cfg.get("draft_vocab_size")
    lm = w.get("lm_head.weight")
    if lm is None:
        out.append("lm_head.weight missing from model.safetensors")
    elif draft is not None and lm.shape[0] != draft:
        out.append(f"lm_head.weight has {lm.shape[0]} rows but draft_vocab_size={draft}")
    if draft is None:
        out.append("draft_vocab_size missing from config.json")
    elif draft != V or "d2t" in w:
        # the one mapping check (contracts.vocab_mapping), on the tensors the drafter ships
        mapping = VocabMapping(w.get("d2t"), w.get("t2d"), int(draft), V)
        out += [f"vocab mapping: {p}" for p in mapping.problems()]
    return out


def _check_weights(cfg: dict, w: dict, target_dir: Path) -> list[str]:
    """Embeddings bit-identical to the target's, finite values, trained norms, norm flags vs weights."""
    import torch

    out: list[str] = []
    if "embed_tokens.weight" in w:
        emb, temb = w["embed_tokens.weight"], _load_target_embed(target_dir)
        if temb is None:
            out.append(f"embed_tokens present but the target {target_dir} has no embed_tokens to compare with")
        elif emb.shape != temb.shape or emb.dtype != temb.dtype or not torch.equal(emb, temb):
            same_shape = emb.shape == temb.shape
            why = (f"dtype {emb.dtype} vs {temb.dtype}" if same_shape and emb.dtype != temb.dtype else
                   f"shape {list(emb.shape)} vs {list(temb.shape)}" if not same_shape else
                   f"{int((emb != temb).any(dim=-1).sum())} rows differ")
            out.append(f"embed_tokens differ from the target's ({why}); export them bit-identical or omit them")
    nonfinite = [k for k, v in w.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if nonfinite:
        out.append(f"NaN/Inf in {nonfinite}")
    norms = {k: v for k, v in w.items() if k.endswith("norm.weight") or k.endswith("layernorm.weight")}
    if norms and all(bool((v == 1).all()) for v in norms.values()):
        out.append(f"weights look never trained: every RMSNorm gain ({len(norms)} tensors) is still exactly 1.0, "
                   f"its initial value")
    if "layers.0.hidden_norm.weight" not in w:
        out.append("norm flags: layers.0.hidden_norm.weight missing (vLLM would leave it at 1.0)")
    if "norm_before_fc" in cfg and bool(cfg["norm_before_fc"]) != ("input_norm.weight" in w):
        out.append(f"norm flags: norm_before_fc={cfg['norm_before_fc']} but input_norm.weight is "
                   f"{'present' if 'input_norm.weight' in w else 'absent'} in the weights")
    has_fcn = any(k.startswith("fc_norm.") for k in w)
    if "fc_norm" in cfg and bool(cfg["fc_norm"]) != has_fcn:
        out.append(f"norm flags: fc_norm={cfg['fc_norm']} but fc_norm.* weights are {'present' if has_fcn else 'absent'}")
    return out


def _check_reference(cfg: dict, reference: DrafterSettings) -> list[str]:
    """The config's layer ids and norm flags against what the drafter was trained with."""
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


def check_drafter(drafter_dir: str | Path, target_dir: str | Path, raise_on_error: bool = False,
                  reference: DrafterSettings | None = None) -> list[str]:
    """Check an exported drafter against its target; returns the problems found (empty = fine).

    Catches: missing/duplicate/out-of-range/unordered ``eagle_aux_hidden_state_layer_ids`` (valid:
    1 <= k < N, ascending, and as many as ``fc`` expects); a hidden size that disagrees with the
    target; a draft vocab whose ``d2t`` has the wrong length or maps outside the target vocab, or a
    ``t2d`` inconsistent with ``d2t``; ``embed_tokens`` that differ from the target's (bit for bit,
    dtype included); NaN/Inf weights; never-trained weights (every RMSNorm gain still exactly 1.0,
    its initial value); norm flags absent from ``config.json`` (vLLM would fill in its own defaults)
    or disagreeing with the weights present; rope settings that differ from the target's; with
    ``reference``, layer ids or norm flags other than those the drafter was trained with.

    Args:
        drafter_dir: folder with ``config.json`` and ``model.safetensors``.
        target_dir: the target model directory (config.json and weights).
        raise_on_error: raise :class:`DrafterCheckError` instead of returning a non-empty list.
        reference: the settings the drafter was trained with (:func:`settings_from_params`).

    Returns:
        list[str]: one line per problem.

    Raises:
        DrafterCheckError: with ``raise_on_error``, when a problem was found.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig

    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    cfg_file, w_file = drafter_dir / "config.json", drafter_dir / "model.safetensors"
    if not cfg_file.exists() or not w_file.exists():
        problems = [f"{drafter_dir}: config.json and model.safetensors are required"]
    else:
        cfg = json.loads(cfg_file.read_text())
        w = load_file(str(w_file))
        tcfg = _text_config(AutoConfig.from_pretrained(target_dir))
        problems = [*_check_shapes(cfg, w, tcfg),
                    *_check_layer_ids(cfg, w, int(tcfg.hidden_size), int(tcfg.num_hidden_layers)),
                    *_check_vocab(cfg, w, int(tcfg.vocab_size)),
                    *_check_weights(cfg, w, target_dir),
                    *(_check_reference(cfg, reference) if reference is not None else [])]
    if raise_on_error and problems:
        raise DrafterCheckError(drafter_dir, problems)
    return problems


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
