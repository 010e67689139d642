"""Stage 4 checkpoints: ``checkpoints/step_NNNNNN/`` written atomically, loaded exactly, resume checks.

A checkpoint holds the trainable weights in float32 (``model.safetensors``), the optimizer and the
scheduler (``torch.save``), the RNG states (torch CPU/CUDA in ``rng.safetensors``, numpy and Python
in ``rng.json``), the params (``params.yaml``) and the loop's state (``state.json``: step, tokens
seen, best step, validation history, global batch, plan digest, ``mapping_digest`` of the d2t/t2d it
trained with), so a resumed run continues bit for bit, and a resume with other data or another vocab
mapping is refused.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np

from eagle3.config import Params
from eagle3.errors import TrainError
from eagle3.io import atomic_write_json, atomic_write_text, format_bytes, free_bytes, is_disk_full, read_json
from eagle3.params_file import diff_params, dump_params, load_params
from eagle3.train.model import trainable_state

__all__ = ["list_checkpoints", "checkpoint_path", "save_checkpoint", "load_checkpoint", "resume_state", "prune",
           "truncate_metrics", "verify_checkpoints", "CHECKPOINT_FILES"]

# What save_checkpoint writes into every step folder (state.json last: its presence marks the folder complete).
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng.safetensors", "rng.json",
                    "params.yaml", "state.json")

# Keys that may change between an interrupted run and its resumption without changing the weights.
_RESUME_EXEMPT = (
    "evaluate.",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.eval_every",
    "train.num_workers",
    "train.data_parallel",
    "train.grad_accum",
    "train.device",
    "train.export_embed_tokens",
    "target.served_name",
    "target.device",
    "target.max_model_len",
    "target.tensor_parallel_size",
)


def list_checkpoints(root: str | Path) -> list[int]:
    """Steps of the complete checkpoints under ``root`` (``step_NNNNNN`` folders), ascending."""
    root = Path(root)
    if not root.exists():
        return []
    out = []
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith("step_") and (d / "state.json").exists():
            try:
                out.append(int(d.name[5:]))
            except ValueError:
                continue
    return sorted(out)


def checkpoint_path(root: Path, step: int) -> Path:
    """``root/step_NNNNNN``."""
    return root / f"step_{step:06d}"


def _rng_state(device) -> tuple[dict, dict]:
    import torch

    tensors = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    np_state = np.random.get_state()
    py = random.getstate()
    meta = {
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py[0], list(py[1]), py[2]],
    }
    return tensors, meta


def _set_rng_state(tensors: dict, meta: dict, device) -> None:
    import torch

    torch.set_rng_state(tensors["torch_cpu"])
    if device.type == "cuda":
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
        if states:
            torch.cuda.set_rng_state_all(states)
    n = meta["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = meta["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


def save_checkpoint(root: Path, step: int, model, opt, sched, state: dict, params: Params) -> Path:
    """Write ``root/step_NNNNNN`` atomically (temp folder + rename); no-op when it already exists.

    Raises:
        TrainError: the disk filled up while writing (:func:`eagle3.io.is_disk_full`; torch.save says
            only "unexpected pos"): the temp folder is removed, earlier checkpoints are untouched and a
            re-run resumes from the last one.
    """
    import torch
    from safetensors.torch import save_file

    final = checkpoint_path(root, step)
    if (final / "state.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        weights = {k: v.float().cpu().contiguous() for k, v in trainable_state(model).items()}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt", "step": str(step)})
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
        torch.save(sched.state_dict(), tmp / "scheduler.pt")
        rng_t, rng_m = _rng_state(next(model.parameters()).device)
        save_file(rng_t, str(tmp / "rng.safetensors"))
        atomic_write_json(tmp / "rng.json", rng_m)
        atomic_write_text(tmp / "params.yaml", dump_params(params))
        atomic_write_json(tmp / "state.json", state)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():  # an incomplete folder from a crash during a previous rename
            shutil.rmtree(final)
        os.replace(tmp, final)
    except (OSError, RuntimeError) as exc:
        if not is_disk_full(exc, root):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        last = list_checkpoints(root)
        raise TrainError(
            f"disk full while writing checkpoint {final} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; "
            f"{format_bytes(free_bytes(root))} free): free space or set run.output_dir to a larger disk, then re-run: "
            + (f"training resumes from {checkpoint_path(root, last[-1]).name}" if last else "training starts again")
            + " (train.keep_checkpoints bounds how many are kept)") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model, opt, sched, device) -> dict:
    """Load a checkpoint folder into ``model``, ``opt`` and ``sched`` and the RNGs; returns its
    ``state.json``.

    Raises:
        TrainError: weights that do not match the drafter; any file that does not load (damaged or cut
            short outside the atomic save: a copy, a disk fault), naming the folder and the way on.
    """
    import torch
    from safetensors.torch import load_file

    try:
        weights = load_file(str(path / "model.safetensors"))
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if set(weights) != set(params):
            raise TrainError(
                f"{path}/model.safetensors does not match the drafter: missing {sorted(set(params) - set(weights))}, "
                f"unexpected {sorted(set(weights) - set(params))}"
            )
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(weights[n].to(p.dtype))
        opt.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
        sched.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        _set_rng_state(load_file(str(path / "rng.safetensors")), read_json(path / "rng.json"), device)
        return read_json(path / "state.json")
    except TrainError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors, torch and json raise many types; name the folder
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise TrainError(f"cannot resume from {path}: it does not load ({type(exc).__name__}: {first}). Delete that "
                         f"folder to resume from the checkpoint before it, or delete {path.parent} to start stage 4 "
                         f"over") from None


def resume_state(root: Path, params: Params, global_batch: int, digest: str,
                 mapping: str | None = None) -> Path | None:
    """The newest checkpoint under ``root`` when this run may resume from it exactly (None: none yet).

    Args:
        global_batch: micro-batches per optimizer step now (``data_parallel x grad_accum``).
        digest: :func:`eagle3.train.data.plan_digest` of the training samples now.
        mapping: :func:`eagle3.contracts.vocab_mapping.mapping_digest` of the d2t/t2d now (a
            checkpoint written before checkpoints recorded it is not checked).

    Raises:
        TrainError: the checkpoint was trained with other params (keys outside the bookkeeping ones
            listed in ``_RESUME_EXEMPT``), another global batch, other training samples, or another
            draft vocab mapping.
    """
    steps = list_checkpoints(root)
    if not steps:
        return None
    path = checkpoint_path(root, steps[-1])
    diffs = [d for d in diff_params(load_params(path / "params.yaml"), params) if not d.startswith(_RESUME_EXEMPT)]
    if diffs:
        raise TrainError(
            f"refusing to resume from {path}: it was trained with different params:\n  "
            + "\n  ".join(diffs) + f"\nUse a new run directory, or delete {root} to start over."
        )
    st = read_json(path / "state.json")
    if st.get("global_batch") != global_batch:
        raise TrainError(
            f"refusing to resume from {path}: global batch {st.get('global_batch')} micro-batches there, "
            f"{global_batch} now (train.data_parallel x train.grad_accum); keep the product equal to resume exactly"
        )
    if st.get("plan_digest") != digest:
        raise TrainError(
            f"refusing to resume from {path}: the training samples changed since it was written "
            f"(stage 3 was re-run?). Start stage 4 over: `eagle3 run PARAMS --stages 4-5 --redo 4`, or delete {root}."
        )
    then = st.get("mapping_digest")
    if mapping is not None and then is not None and then != mapping:
        raise TrainError(
            f"refusing to resume from {path}: its steps trained with another draft vocab mapping (d2t/t2d digest "
            f"{then} there, {mapping} now in Stage 2's vocab_mapping.safetensors: stage 2 was re-run or the file "
            f"replaced). Restore the mapping it trained with, or start stage 4 over "
            f"(`eagle3 run PARAMS --stages 4-5 --redo 4`, or delete {root})."
        )
    return path


def verify_checkpoints(root: str | Path, mapping: str | None = None) -> list[str]:
    """``eagle3 verify``'s check of Stage 4's checkpoints: for each ``step_NNNNNN``, every file of
    :data:`CHECKPOINT_FILES` present and loadable (the weights finite; the optimizer and scheduler
    through ``torch.load(weights_only=True)``, as a resume reads them), ``state.json``'s step equal
    to the folder's, and its ``mapping_digest`` equal to ``mapping`` (Stage 2's d2t/t2d now; None:
    not compared). Cost: one read of each checkpoint (the optimizer is 2x the weights).

    Returns:
        list[str]: one line per problem, naming the folder or file. Temp folders of a killed write
        (``.tmp-step_*``) are not problems: the next stage-4 run removes them.
    """
    import torch
    from safetensors.torch import load_file

    problems = []
    root = Path(root)
    for d in sorted(root.glob("step_*")) if root.is_dir() else []:
        if not d.name[5:].isdigit():
            continue
        missing = [f for f in CHECKPOINT_FILES if not (d / f).is_file()]
        if missing:
            problems.append(f"{d}: missing {', '.join(missing)}" + (" (an incomplete checkpoint)" if "state.json" in missing else ""))
            continue
        try:
            w = load_file(str(d / "model.safetensors"))
            bad = [k for k, t in w.items() if t.is_floating_point() and not torch.isfinite(t).all()]
            if bad:
                problems.append(f"{d / 'model.safetensors'}: NaN/Inf in {', '.join(bad[:3])}")
            for f in ("optimizer.pt", "scheduler.pt"):
                torch.load(d / f, map_location="cpu", weights_only=True)
            load_file(str(d / "rng.safetensors"))
            rng = json.loads((d / "rng.json").read_text())
            st = json.loads((d / "state.json").read_text())
            load_params(d / "params.yaml")
        except Exception as exc:  # noqa: BLE001 - any failure to load is the finding; name the folder
            problems.append(f"{d}: not loadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
            continue
        if not isinstance(rng, dict) or st.get("step") != int(d.name[5:]):
            problems.append(f"{d / 'state.json'}: step {st.get('step')} in a folder named {d.name}")
        if mapping is not None and st.get("mapping_digest") not in (None, mapping):
            problems.append(f"{d / 'state.json'}: trained with draft vocab mapping {st['mapping_digest']}, Stage 2's is "
                            f"{mapping} now: a resume from it is refused; redo stage 4 (`--stages 4-5 --redo 4`)")
    return problems


def prune(root: Path, keep: int, protect: set[int]) -> None:
    steps = list_checkpoints(root)
    keep_set = set(steps[-keep:]) | protect
    for s in steps:
        if s not in keep_set:
            d = checkpoint_path(root, s)
            trash = root / f".trash-{d.name}-{os.getpid()}"
            os.replace(d, trash)
            shutil.rmtree(trash, ignore_errors=True)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics.jsonl records of steps after ``step`` (they are recomputed on resume)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    atomic_write_text(path, "".join(x + "\n" for x in keep))
