"""Stage 4's kind-agnostic drafter set-up: the inputs a drafter is built from (target, Stage 2's
mapping, Stage 3's aux layer ids), the loss config, what ``torch.compile`` covers, and which rows the
heads compute. The drafter itself comes from its kind (:mod:`eagle3.drafters`, ``train.drafter``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import Params
from eagle3.contracts import hidden_states as hsc
from eagle3.contracts.vocab_mapping import VocabMappingError, read_mapping
from eagle3.errors import TrainError
from eagle3.hooks import default_aux_layer_ids
from eagle3.rundir import EXTRACT, RunDir

__all__ = [
    "DrafterInputs",
    "resolve_inputs",
    "load_vocab_mapping",
    "loss_config",
    "COMPILE_MODES",
    "configure_compile",
    "compile_static",
    "trainable_state",
    "default_attn_implementation",
    "use_supervised_rows",
]


@dataclass
class DrafterInputs:
    """Everything the drafter is built from, resolved from params and the earlier stages' folders.

    Attributes:
        target_path: local target (verifier) model directory.
        target_name: the portable verifier name written into the export
            (:func:`eagle3.target.verifier_name`; never one machine's cache folder).
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


def load_vocab_mapping(run_dir: str | Path, target_vocab_size: int):
    """Stage 2's draft vocab mapping through its contract (``contracts.vocab_mapping.read_mapping``:
    sizes against the target, cache keys of both files, the one ``VocabMapping.problems()`` check).

    Returns:
        tuple: ``(d2t int64 [draft] | None, t2d bool [V] | None, draft_vocab_size, mapping_file | None)``.

    Raises:
        TrainError: the contract's error (missing files, vocab sizes that disagree, an inconsistent
            d2t/t2d), with the file named, re-raised as a Stage 4 error.
    """
    try:
        mapping = read_mapping(run_dir, target_vocab_size)
    except VocabMappingError as exc:
        raise TrainError(f"{exc} (Stage 4 needs Stage 2's vocab mapping for this target: re-run stage 2)") from None
    if mapping.full_size:
        return None, None, mapping.draft_vocab_size, None
    return mapping.d2t, mapping.t2d, mapping.draft_vocab_size, RunDir(run_dir).vocab_mapping

def resolve_inputs(params: Params, run_dir: str | Path) -> DrafterInputs:
    """Resolve the target, Stage 2's mapping and Stage 3's aux layer ids for this run.

    Offline (``train.online: false``) the aux ids and hidden size come from Stage 3's ``meta.json``;
    online they come from ``extract.aux_layer_ids`` (default ``[2, N//2, N-3]``).

    Raises:
        TrainError: missing stage folders, a hidden size or layer count in ``meta.json`` that disagrees
            with the target, aux ids out of range, or a mapping from another run.
    """
    from transformers import AutoConfig

    from eagle3.target import resolve_target, verifier_name

    resolved = resolve_target(params.target)
    cfg = _text_config(AutoConfig.from_pretrained(resolved.path, trust_remote_code=params.target.trust_remote_code))
    H, N, V = int(cfg.hidden_size), int(cfg.num_hidden_layers), int(cfg.vocab_size)
    d2t, t2d, draft, mfile = load_vocab_mapping(run_dir, V)
    meta: dict = {}
    if params.train.online:
        aux = list(params.extract.aux_layer_ids or default_aux_layer_ids(N))
        src = "extract.aux_layer_ids"
    else:
        meta_file = RunDir(run_dir).extract_meta
        meta = hsc.read_meta(RunDir(run_dir).stage(EXTRACT))
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
        # an embedded or GGUF target's resolved folder is one machine's cache: the portable name instead
        target_path=Path(resolved.path), target_name=verifier_name(params.target), target_config=cfg, hidden_size=H,
        num_hidden_layers=N, target_vocab_size=V, aux_layer_ids=aux, draft_vocab_size=draft, d2t=d2t,
        t2d=t2d, mapping_file=mfile, meta=meta,
    )


def default_attn_implementation(device: str) -> str:
    """'simple_flex_attention' on CUDA (speculators' default), 'sdpa' elsewhere."""
    return "simple_flex_attention" if str(device).startswith("cuda") else "sdpa"


COMPILE_MODES = ("attention", "speculators", "none")


def compile_static(fn, max_graphs: int, what: str):
    """``torch.compile(fn, dynamic=False)`` called under a recompile limit of ``max_graphs``.

    Static shapes give one graph per distinct input shape (and grad mode). dynamo's own
    ``recompile_limit`` (8 by default, process-wide) makes the next call fall back *silently* to the
    eager function; here every call runs under ``torch._dynamo.config.patch(recompile_limit=max_graphs,
    fail_on_recompile_limit_hit=True)``, so the first ``max_graphs`` shapes compile and one more raises.

    Returns:
        The wrapper, with attributes ``compiled`` (the ``torch.compile`` object) and ``max_graphs``.

    Raises:
        TrainError (from the wrapper): a call would need graph ``max_graphs + 1`` (``what`` names the
            function in the message).
    """
    import functools

    import torch
    import torch._dynamo

    compiled = torch.compile(fn, dynamic=False)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            with torch._dynamo.config.patch(recompile_limit=max_graphs, fail_on_recompile_limit_hit=True):
                return compiled(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            raise TrainError(
                f"{what} needed more than {max_graphs} compiled graphs (one per input shape and grad mode); "
                "stopped instead of running it eagerly (eager flex attention materialises the [T, KV] "
                "scores: out of memory at GPU token budgets). Use train.compile: none to debug.") from None

    call.compiled, call.max_graphs = compiled, int(max_graphs)
    return call


def _compiled_flex_attention(ttt_steps: int):
    """``flex_attention`` compiled with static shapes (:func:`compile_static`), one per TTT count and process.

    TTT step ``k`` attends its ``T`` queries to ``k * T`` keys, in training and again under no_grad in
    validation: ``2 * ttt_steps`` graphs (plus 2 spare). With dynamo's default limit of 8 a drafter of
    TTT 5 fell back to eager flex attention at its first validation (step 500) and ran out of memory
    with 110 GiB allocated on an H200 (token budget 16,384; benchmarks/RESULTS.md).
    """
    from torch.nn.attention.flex_attention import flex_attention

    n = 2 * int(ttt_steps) + 2
    if n not in _FLEX_COMPILED:
        _FLEX_COMPILED[n] = compile_static(flex_attention, n, "flex_attention")
    return _FLEX_COMPILED[n]


_FLEX_COMPILED: dict[int, object] = {}


def configure_compile(model, mode: str, attn_implementation: str, ttt_steps: int) -> str:
    """Choose what ``torch.compile`` covers in a drafter; returns the mode applied.

    speculators wraps ``Eagle3DraftModel.forward`` in ``torch.compile`` whenever CUDA is visible
    (``speculators.models.utils.conditional_torch_compile``). That forward graph-breaks in every
    decoder layer (speculators' own ``torch._dynamo.graph_break()`` for torch >= 2.10), around the
    fused loss (``torch.compiler.disable``, see :func:`loss_config`) and in the metrics, and each
    TTT step's shapes differ (``[T - k]`` slices, KV ``k * T``), so dynamo compiles ~45 frames
    (automatic-dynamic recompiles included) before the first step can run: 101 s of CPU
    compilation with the GPU idle, measured on an H200 for the 135M target (benchmarks/RESULTS.md).

    Modes:
        'attention': run the forward eagerly and compile only ``flex_attention`` (it must be
            compiled: eager flex materialises the [T, KV] scores), by rebinding the name that
            speculators' ``flex_attention_forward`` calls, under a recompile limit that covers
            ``ttt_steps``' graphs (:func:`_compiled_flex_attention`). With sdpa/eager attention
            nothing is compiled.
        'speculators': keep speculators' compiled forward (its whole forward compiled).
        'none': nothing compiled (debugging; eager flex attention is slow and memory-hungry).

    Raises:
        TrainError: an unknown mode.
    """
    if mode not in COMPILE_MODES:
        raise TrainError(f"train compile mode {mode!r}: expected one of {list(COMPILE_MODES)}")
    import types

    import speculators.models.attention as spec_attn
    from torch.nn.attention.flex_attention import flex_attention

    # the rebinding below is process-wide: every mode sets it, so one run cannot leak into the next
    spec_attn.flex_attention = flex_attention
    if mode == "speculators":
        return mode
    eager = getattr(type(model).forward, "_torchdynamo_orig_callable", None)
    if eager is not None:  # forward is speculators' torch.compile wrapper (CUDA visible)
        model.forward = types.MethodType(eager, model)
    if mode == "attention" and attn_implementation == "simple_flex_attention":
        spec_attn.flex_attention = _compiled_flex_attention(ttt_steps)
    return mode


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


def use_supervised_rows(setting: bool | str, device_type: str, compile_mode: str) -> bool:
    """Whether stage 4 computes the heads and loss on the supervised rows only (``train.supervised_rows``,
    where the kind has that path: :meth:`eagle3.drafters.DrafterKind.supervise_rows`).

    ``'auto'``: on CPU only. There it is measured (1.09-1.17x the step rate at the embedded default's
    shapes, benchmarks/RESULTS.md); on a GPU it is not, and its row selection (``nonzero``, one
    per head and TTT step) waits for the device, against the loop's one host sync per step. Never with
    ``train.compile: speculators`` (its Python state would recompile the compiled forward).
    """
    if compile_mode == "speculators":
        return False
    return device_type == "cpu" if setting == "auto" else bool(setting)
