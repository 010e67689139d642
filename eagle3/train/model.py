"""The drafter: speculators' ``Eagle3DraftModel`` built from the run's params and stage folders,
exported in the speculators format, and checked against its target.

The drafter is exactly what vLLM's ``speculators_model_type: eagle3`` loader reads
(``vllm/transformers_utils/configs/speculators/algos.py`` -> ``Eagle3LlamaForCausalLM``): a
Llama-style decoder layer whose first layer takes ``cat(embed, hidden)``, an ``fc`` that fuses the
aux hidden states ``[n_aux * H] -> [H]``, the target's embeddings (frozen) and an ``lm_head`` over the
draft vocab, mapped back to target ids by ``d2t`` (target id = i + d2t[i], DESIGN.md).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import Params
from eagle3.io import atomic_write_json, read_json
from eagle3.errors import TrainError

__all__ = [
    "TrainError",
    "DrafterCheckError",
    "NORM_FLAGS",
    "DrafterInputs",
    "resolve_inputs",
    "load_vocab_mapping",
    "mapping_problems",
    "build_drafter",
    "loss_config",
    "trainable_state",
    "export_drafter",
    "check_drafter",
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
class DrafterInputs:
    """Everything the drafter is built from, resolved from params and the earlier stages' folders.

    Attributes:
        target_path: local target (verifier) model directory.
        target_name: the portable verifier name written into the export (``target.served_name``,
            else the hub id or the resolved local path; never a temp path of this run).
        target_config: the target's transformers config (text config for multimodal models).
        hidden_size: target hidden size H.
        num_hidden_layers: target decoder layers N.
        target_vocab_size: V, the target's (config) vocab size.
        aux_layer_ids: aux hidden state layer ids (transformers ``hidden_states[k]`` convention).
        draft_vocab_size: draft vocab size (== V when there is no mapping).
        d2t: int64 ``[draft_vocab_size]`` offsets or None; t2d: bool ``[V]`` or None.
        mapping_file: where d2t/t2d came from (for messages).
    """

    target_path: Path
    target_name: str
    target_config: Any
    hidden_size: int
    num_hidden_layers: int
    target_vocab_size: int
    aux_layer_ids: list[int]
    draft_vocab_size: int
    d2t: Any = None
    t2d: Any = None
    mapping_file: Path | None = None
    meta: dict = field(default_factory=dict)

    @property
    def n_aux(self) -> int:
        return len(self.aux_layer_ids)


def _text_config(cfg):
    return getattr(cfg, "text_config", None) or cfg


def mapping_problems(d2t, t2d, target_vocab_size: int, draft_vocab_size: int) -> list[str]:
    """Consistency problems of a draft vocab mapping (empty list when it is valid).

    Convention (DESIGN.md, speculators ``train/vocab_mapping.py``): ``d2t`` int64 ``[draft]`` with
    target id ``i + d2t[i]``, all distinct and in ``[0, V)``; ``t2d`` bool ``[V]`` with exactly the
    mapped target ids set.
    """
    import torch

    out: list[str] = []
    if d2t is None or t2d is None:
        if draft_vocab_size != target_vocab_size:
            out.append(
                f"draft_vocab_size {draft_vocab_size} < target vocab {target_vocab_size} but "
                f"{'d2t' if d2t is None else 't2d'} is missing"
            )
        return out
    if d2t.dim() != 1 or d2t.shape[0] != draft_vocab_size:
        out.append(f"d2t has shape {list(d2t.shape)}, expected [{draft_vocab_size}] (draft_vocab_size)")
        return out
    if d2t.dtype != torch.int64:
        out.append(f"d2t has dtype {d2t.dtype}, expected torch.int64")
    ids = torch.arange(d2t.shape[0], dtype=torch.int64) + d2t.to(torch.int64)
    bad = ((ids < 0) | (ids >= target_vocab_size)).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        out.append(
            f"d2t maps draft id {i} to target id {int(ids[i])}, outside [0, {target_vocab_size}) "
            f"({len(bad)} ids out of range)"
        )
        return out
    if len(torch.unique(ids)) != len(ids):
        out.append("d2t maps two draft ids to the same target id")
    if t2d.dim() != 1 or t2d.shape[0] != target_vocab_size:
        out.append(f"t2d has shape {list(t2d.shape)}, expected [{target_vocab_size}] (target vocab size)")
        return out
    if t2d.dtype != torch.bool:
        out.append(f"t2d has dtype {t2d.dtype}, expected torch.bool")
    t2d_b = t2d.bool()
    if int(t2d_b.sum()) != draft_vocab_size:
        out.append(f"t2d marks {int(t2d_b.sum())} target ids, but d2t has {draft_vocab_size}")
    elif not bool(t2d_b[ids].all()):
        missing = ids[~t2d_b[ids]]
        out.append(f"t2d is inconsistent with d2t: target ids {missing[:5].tolist()} are mapped by d2t but not set in t2d")
    return out


def load_vocab_mapping(run_dir: str | Path, target_vocab_size: int):
    """Read Stage 2's draft vocab mapping and check it against the target's vocab size.

    Returns:
        tuple: ``(d2t int64 [draft] | None, t2d bool [V] | None, draft_vocab_size, mapping_file | None)``.

    Raises:
        TrainError: ``02_vocab/mapping.json`` missing; vocab sizes that disagree (mapping and
            tokenizer/target from different runs); an inconsistent d2t/t2d (the file is named).
    """
    from safetensors.torch import load_file

    d = Path(run_dir) / "02_vocab"
    info_file = d / "mapping.json"
    info = read_json(info_file)
    if info is None:
        raise TrainError(f"{info_file} does not exist: Stage 4 needs Stage 2's vocab mapping. Run stage 2 first.")
    draft = int(info.get("draft_vocab_size", -1))
    tv = info.get("target_vocab_size")
    if tv is not None and int(tv) != target_vocab_size:
        raise TrainError(
            f"{info_file}: target_vocab_size={tv} but the target ({target_vocab_size} tokens) disagrees: "
            f"the mapping and the target/tokenizer come from different runs. Re-run stage 2 for this target."
        )
    f = d / "vocab_mapping.safetensors"
    if not f.exists():
        if draft != target_vocab_size:
            raise TrainError(
                f"{f} is missing but {info_file} says draft_vocab_size={draft} (target vocab {target_vocab_size}); "
                f"re-run stage 2."
            )
        return None, None, draft, None
    try:
        t = load_file(str(f))
    except Exception as exc:  # noqa: BLE001 - name the file whatever safetensors says
        raise TrainError(f"{f}: not a readable safetensors file ({exc})") from None
    if "d2t" not in t or "t2d" not in t:
        raise TrainError(f"{f}: expected tensors 'd2t' and 't2d', found {sorted(t)}")
    d2t, t2d = t["d2t"], t["t2d"]
    if t2d.dim() == 1 and t2d.shape[0] != target_vocab_size:
        raise TrainError(
            f"{f}: t2d covers {t2d.shape[0]} target tokens but the target has {target_vocab_size}: the mapping "
            f"and the target/tokenizer come from different runs (vocab sizes disagree). Re-run stage 2."
        )
    if d2t.dim() == 1 and d2t.shape[0] != draft:
        raise TrainError(f"{f}: d2t has {d2t.shape[0]} entries but {info_file} says draft_vocab_size={draft}")
    problems = mapping_problems(d2t, t2d, target_vocab_size, draft)
    if problems:
        raise TrainError(f"{f}: " + "; ".join(problems))
    import torch

    return d2t.to(torch.int64), t2d.bool(), draft, f


def resolve_inputs(params: Params, run_dir: str | Path) -> DrafterInputs:
    """Resolve the target, Stage 2's mapping and Stage 3's aux layer ids for this run.

    Offline (``train.online: false``) the aux ids and hidden size come from ``03_extract/meta.json``;
    online they come from ``extract.aux_layer_ids`` (default ``[2, N//2, N-3]``).

    Raises:
        TrainError: missing stage folders, a hidden size or layer count in ``meta.json`` that disagrees
            with the target, aux ids out of range, or a mapping from another run.
    """
    from transformers import AutoConfig

    from eagle3.target import resolve_target

    resolved = resolve_target(params.target)
    cfg = _text_config(AutoConfig.from_pretrained(resolved.path, trust_remote_code=params.target.trust_remote_code))
    H, N, V = int(cfg.hidden_size), int(cfg.num_hidden_layers), int(cfg.vocab_size)
    d2t, t2d, draft, mfile = load_vocab_mapping(run_dir, V)
    meta: dict = {}
    if params.train.online:
        aux = list(params.extract.aux_layer_ids or [2, N // 2, N - 3])
        src = "extract.aux_layer_ids"
    else:
        meta_file = Path(run_dir) / "03_extract" / "meta.json"
        meta = read_json(meta_file)
        if meta is None:
            raise TrainError(
                f"{meta_file} does not exist: offline training reads Stage 3's hidden states. Run stage 3 "
                f"first, or set train.online: true to train from the target directly."
            )
        for key, want in (("hidden_size", H), ("num_hidden_layers", N)):
            if key in meta and int(meta[key]) != want:
                raise TrainError(
                    f"{meta_file}: {key}={meta[key]} but the target {resolved.path} has {key}={want}: the "
                    f"hidden states come from another model. Re-run stage 3 for this target."
                )
        if "aux_layer_ids" not in meta:
            raise TrainError(f"{meta_file}: missing field 'aux_layer_ids'")
        aux = [int(x) for x in meta["aux_layer_ids"]]
        src = str(meta_file)
        if params.extract.aux_layer_ids is not None and list(params.extract.aux_layer_ids) != aux:
            raise TrainError(
                f"{meta_file}: aux_layer_ids={aux} but params extract.aux_layer_ids="
                f"{list(params.extract.aux_layer_ids)}: the stored hidden states are stale. Re-run stage 3."
            )
    bad = [k for k in aux if not (1 <= k < N)]
    if not aux or bad or len(set(aux)) != len(aux):
        raise TrainError(
            f"{src}: aux layer ids {aux} must be distinct and within [1, {N - 1}] for a target with {N} "
            f"layers (id k = transformers hidden_states[k])"
        )
    return DrafterInputs(
        target_path=Path(resolved.path), target_name=resolved.name, target_config=cfg, hidden_size=H,
        num_hidden_layers=N, target_vocab_size=V, aux_layer_ids=aux, draft_vocab_size=draft, d2t=d2t,
        t2d=t2d, mapping_file=mfile, meta=meta,
    )


def default_attn_implementation(device: str) -> str:
    """'simple_flex_attention' on CUDA (speculators' default), 'sdpa' elsewhere."""
    return "simple_flex_attention" if str(device).startswith("cuda") else "sdpa"


def build_drafter(params: Params, inputs: DrafterInputs, attn_implementation: str = "sdpa"):
    """A fresh ``Eagle3DraftModel`` for the target: draft layers initialised from the current torch
    seed, embeddings / lm_head / verifier head loaded from the target (frozen).

    The decoder-layer config is speculators' ``create_transformer_layer_config`` (head geometry,
    rope settings, rms eps from the target), with every draft layer on full attention.

    Args:
        params: ``train`` gives num_layers, norm flags and TTT steps.
        inputs: from :func:`resolve_inputs`.
        attn_implementation: 'sdpa' / 'eager' (CPU) or 'simple_flex_attention' (GPU).

    Returns:
        speculators.models.eagle3.Eagle3DraftModel (float32, on CPU).

    Raises:
        TrainError: speculators refuses the configuration (message included).
    """
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    from loguru import logger as _loguru

    tp = params.train
    # speculators logs every verifier file it opens (and warns about tied lm_heads); quiet here
    _loguru.disable("speculators")
    try:
        layer_cfg = create_transformer_layer_config(
            verifier_name_or_path=str(inputs.target_path), num_layers=tp.num_layers, draft_arch="llama",
            hidden_act=None, sliding_window=0, full_attention_indices=list(range(tp.num_layers)),
            trust_remote_code=params.target.trust_remote_code,
        )
        layer_cfg.sliding_window = None
        layer_cfg.use_sliding_window = False
        model = Eagle3DraftModel.from_training_args(
            layer_cfg, t2d=inputs.t2d, d2t=inputs.d2t, verifier_name_or_path=str(inputs.target_path),
            draft_vocab_size=inputs.draft_vocab_size, norm_before_residual=tp.norm_before_residual,
            norm_before_fc=tp.norm_before_fc, fc_norm=tp.fc_norm, norm_output=tp.norm_output,
            ttt_steps=tp.ttt_steps, target_layer_ids=list(inputs.aux_layer_ids), draft_attn_impl=attn_implementation,
            trust_remote_code=params.target.trust_remote_code,
        )
    except (ValueError, TypeError) as exc:
        raise TrainError(f"speculators refused the drafter configuration: {exc}") from None
    finally:
        _loguru.enable("speculators")
    model.config.target_hidden_size = inputs.hidden_size
    return model


def loss_config(loss: str, implementation: str):
    """speculators' loss config ``{name: (fn, weight)}`` for ``train.loss`` ('kl_div', a JSON dict, ...).

    The fused (Triton) losses are wrapped in ``torch.compiler.disable``: speculators compiles the
    drafter's forward on CUDA, and dynamo tracing into the fused kernels' autotuners fails
    ("ListVariable ... is already tracked for mutation", seen with torch 2.11 on an H200); the
    kernels need no compiling, so the graph simply breaks around the loss.

    Raises:
        TrainError: an unknown loss name or implementation.
    """
    import torch
    from speculators.losses import resolve_loss_config

    try:
        cfg = resolve_loss_config(loss, implementation)
    except ValueError as exc:
        raise TrainError(f"train.loss={loss!r}: {exc}") from None
    if implementation == "fused":
        cfg = {k: (torch.compiler.disable(fn), w) for k, (fn, w) in cfg.items()}
    return cfg


def trainable_state(model) -> dict:
    """The trainable parameters (requires_grad) of a drafter as a name -> tensor dict (detached)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


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

    Returns:
        Path: ``out_dir``.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    sd = model.state_dict()
    tensors = {}
    for k, v in sd.items():
        if k.startswith(("verifier_lm_head", "verifier_norm")) or ".rotary_emb." in k or k.startswith("rotary_emb"):
            continue
        if k == "embed_tokens.weight" and not include_embed_tokens:
            continue
        if v.is_floating_point() and dtype is not None and not k.endswith("norm.weight"):
            v = v.to(dtype)  # RMSNorm gains stay float32: a short run's updates (~lr) survive, see docstring
        tensors[k] = v.detach().cpu().contiguous().clone()
    cfg = _export_config(model, verifier_name, dtype or next(model.parameters()).dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", cfg)
        if info:
            atomic_write_json(tmp / "training_info.json", info)
        for f in tmp.iterdir():  # readable by whoever serves it (mkstemp/mkdtemp create 0600/0700)
            f.chmod(0o644)
        tmp.chmod(0o755)
        old = None
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _load_target_embed(target_dir: Path):
    from speculators.utils.loading import load_model_layers

    w = load_model_layers(["embed_tokens.weight"], str(target_dir))
    return w.get("embed_tokens.weight")


def check_drafter(drafter_dir: str | Path, target_dir: str | Path, raise_on_error: bool = False) -> list[str]:
    """Check an exported drafter against its target; returns the problems found (empty = fine).

    Catches: missing/duplicate/out-of-range ``eagle_aux_hidden_state_layer_ids`` (valid: 1 <= k < N,
    and as many as ``fc`` expects); a hidden size that disagrees with the target; a draft vocab whose
    ``d2t`` has the wrong length or maps outside the target vocab, or a ``t2d`` inconsistent with
    ``d2t``; ``embed_tokens`` that differ from the target's (bit for bit, dtype included); NaN/Inf
    weights; never-trained weights (every RMSNorm gain still exactly 1.0, its initial value); norm
    flags absent from ``config.json`` (vLLM would fill in its own defaults); rope settings that
    differ from the target's.

    Args:
        drafter_dir: folder with ``config.json`` and ``model.safetensors``.
        target_dir: the target model directory (config.json and weights).
        raise_on_error: raise :class:`DrafterCheckError` instead of returning a non-empty list.

    Returns:
        list[str]: one line per problem.
    """
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    problems: list[str] = []
    cfg_file, w_file = drafter_dir / "config.json", drafter_dir / "model.safetensors"
    if not cfg_file.exists() or not w_file.exists():
        problems.append(f"{drafter_dir}: config.json and model.safetensors are required")
        if raise_on_error:
            raise DrafterCheckError(drafter_dir, problems)
        return problems
    cfg = json.loads(cfg_file.read_text())
    w = load_file(str(w_file))
    tcfg = _text_config(AutoConfig.from_pretrained(target_dir))
    H, N, V = int(tcfg.hidden_size), int(tcfg.num_hidden_layers), int(tcfg.vocab_size)

    if cfg.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type is {cfg.get('speculators_model_type')!r}, expected 'eagle3'")
    missing_flags = [k for k in NORM_FLAGS if k not in cfg]
    if missing_flags:
        problems.append(f"norm flags absent from config.json: {missing_flags} (vLLM would apply its own defaults)")

    tl = cfg.get("transformer_layer_config") or {}
    dh = tl.get("hidden_size")
    if dh != H:
        problems.append(f"hidden size mismatch: transformer_layer_config.hidden_size={dh}, target hidden_size={H}")
    th = cfg.get("target_hidden_size")
    if th is not None and th != H:
        problems.append(f"hidden size mismatch: target_hidden_size={th}, target hidden_size={H}")
    if tl.get("vocab_size") not in (None, V):
        problems.append(f"transformer_layer_config.vocab_size={tl.get('vocab_size')} but the target has {V} tokens")
    rope_keys = ("rope_parameters", "rope_theta", "rope_scaling")
    t_rope = {k: getattr(tcfg, k, None) for k in rope_keys}
    for k in rope_keys:
        if k in tl and t_rope.get(k) is not None and tl[k] != t_rope[k]:
            problems.append(f"transformer_layer_config.{k}={tl[k]} differs from the target's {t_rope[k]}")

    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        problems.append("eagle_aux_hidden_state_layer_ids missing from config.json (vLLM would guess its defaults)")
    else:
        bad = [k for k in ids if not isinstance(k, int) or not (1 <= k < N)]
        if bad:
            problems.append(f"eagle_aux_hidden_state_layer_ids {ids}: {bad} out of range [1, {N - 1}] for a {N}-layer target")
        if len(set(ids)) != len(ids):
            problems.append(f"eagle_aux_hidden_state_layer_ids {ids} has duplicates")
    fc = w.get("fc.weight")
    if fc is None:
        problems.append("fc.weight missing from model.safetensors")
    else:
        if ids and fc.shape[1] != len(ids) * H:
            problems.append(
                f"fc.weight takes {fc.shape[1]} inputs but {len(ids)} aux layers x hidden {H} = {len(ids) * H}"
            )
        if fc.shape[0] != H:
            problems.append(f"hidden size mismatch: fc.weight outputs {fc.shape[0]}, target hidden_size={H}")

    draft = cfg.get("draft_vocab_size")
    lm = w.get("lm_head.weight")
    if lm is None:
        problems.append("lm_head.weight missing from model.safetensors")
    elif draft is not None and lm.shape[0] != draft:
        problems.append(f"lm_head.weight has {lm.shape[0]} rows but draft_vocab_size={draft}")
    if draft is None:
        problems.append("draft_vocab_size missing from config.json")
    elif draft != V or "d2t" in w:
        problems += [f"vocab mapping: {p}" for p in mapping_problems(w.get("d2t"), w.get("t2d"), V, int(draft))]

    if "embed_tokens.weight" in w:
        emb = w["embed_tokens.weight"]
        temb = _load_target_embed(target_dir)
        if temb is None:
            problems.append(f"embed_tokens present but the target {target_dir} has no embed_tokens to compare with")
        elif emb.shape != temb.shape or emb.dtype != temb.dtype or not torch.equal(emb, temb):
            same_shape = emb.shape == temb.shape
            why = (f"dtype {emb.dtype} vs {temb.dtype}" if same_shape and emb.dtype != temb.dtype else
                   f"shape {list(emb.shape)} vs {list(temb.shape)}" if not same_shape else
                   f"{int((emb != temb).any(dim=-1).sum())} rows differ")
            problems.append(f"embed_tokens differ from the target's ({why}); export them bit-identical or omit them")

    nonfinite = [k for k, v in w.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if nonfinite:
        problems.append(f"NaN/Inf in {nonfinite}")
    norms = {k: v for k, v in w.items() if k.endswith("norm.weight") or k.endswith("layernorm.weight")}
    if norms and all(bool((v == 1).all()) for v in norms.values()):
        problems.append(
            f"weights look never trained: every RMSNorm gain ({len(norms)} tensors) is still exactly 1.0, its initial value"
        )
    if raise_on_error and problems:
        raise DrafterCheckError(drafter_dir, problems)
    return problems


def norm_gains_untouched(model) -> bool:
    """True when every trainable RMSNorm gain of ``model`` is still exactly 1.0 (never trained)."""
    vals = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("norm.weight")]
    return bool(vals) and all(bool((v == 1).all()) for v in vals)

