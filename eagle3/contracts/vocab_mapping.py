"""The draft vocab mapping (stage 2's ``vocab_mapping.safetensors`` + ``mapping.json``): the ONLY
code that builds, checks, reads or writes it.

Convention (docs/DESIGN.md "Draft vocab mapping"; speculators
``speculators/train/vocab_mapping.py::build_vocab_mappings_from_distribution``): count loss-masked
tokens; rank ids by (-frequency, id); keep the top ``draft_vocab_size``, padding with the lowest
unused ids when the corpus has fewer distinct tokens; sort the kept ids ascending;
``d2t[i] = kept[i] - i`` (int64 offsets: target id = ``i + d2t[i]``); ``t2d`` is a bool mask over
the target vocab with ``t2d.sum() == draft_vocab_size``. A full-size draft vocab has no mapping
(``d2t``/``t2d`` None, no safetensors file).

Files (in the stage-2 folder of a run, :func:`mapping_paths`):

* ``vocab_mapping.safetensors``: ``d2t`` int64 ``[draft_vocab_size]``, ``t2d`` bool ``[V]``,
  metadata ``{"cache_key"}``; absent for a full-size draft vocab;
* ``mapping.json``: ``{draft_vocab_size, target_vocab_size, cache_key, coverage, corpus_hash,
  tokenizer_hash, cache_hit, full_size}``.

One check, :meth:`VocabMapping.problems`, is used by stage 2's writer, stage 4's loader and stage 5's
diagnosis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.errors import VocabError

__all__ = [
    "VocabMappingError",
    "VocabMapping",
    "rank_ids",
    "kept_ids",
    "mapping_paths",
    "write_mapping",
    "read_mapping",
    "save_tensors",
    "load_tensors",
    "mapping_digest",
    "MAPPING_FILE",
    "INFO_FILE",
]

MAPPING_FILE = "vocab_mapping.safetensors"  # eagle3.rundir.VOCAB_MAPPING_FILE
INFO_FILE = "mapping.json"  # eagle3.rundir.MAPPING_JSON_FILE


class VocabMappingError(VocabError):
    """A d2t/t2d mapping fails its check or its files are missing/unreadable (the message names the
    file and the failed check with its numbers)."""


# --------------------------------------------------------------------------- the pure builder


def _counts(counts) -> np.ndarray:
    c = np.asarray(counts.cpu() if hasattr(counts, "cpu") else counts, dtype=np.int64)
    if c.ndim != 1 or (c < 0).any():
        raise VocabError("token counts must be a 1-D array of non-negative integers [target_vocab_size]")
    return c


def rank_ids(counts) -> np.ndarray:
    """int64 ``[V]``: every target id ranked by (-count, id). Zero-count ids come last in ascending id
    order, so ``rank_ids(c)[:k]`` is exactly the kept set of a size-``k`` mapping, padding included."""
    c = _counts(counts)
    return np.lexsort((np.arange(c.size), -c))


def kept_ids(counts, draft_vocab_size: int) -> np.ndarray:
    """int64 ``[draft_vocab_size]``: the target ids a draft vocab of that size keeps, ascending (top
    ids by (-count, id), then the lowest unused ids: see :func:`rank_ids`)."""
    return np.sort(rank_ids(counts)[: int(draft_vocab_size)])


# --------------------------------------------------------------------------- the mapping


@dataclass
class VocabMapping:
    """A draft vocab mapping and what identifies it.

    Attributes:
        d2t: ``torch.int64 [draft_vocab_size]`` offsets (target id = ``i + d2t[i]``), None at full size.
        t2d: ``torch.bool [target_vocab_size]``, None at full size.
        draft_vocab_size, target_vocab_size: the sizes.
        cache_key: which corpus/tokenizer/size it was built for (see ``eagle3.vocab.mapping_cache_key``).
        info: the other ``mapping.json`` fields (coverage, hashes, cache_hit).
    """

    d2t: Any
    t2d: Any
    draft_vocab_size: int
    target_vocab_size: int
    cache_key: str | None = None
    info: dict = field(default_factory=dict)

    @property
    def full_size(self) -> bool:
        """True when the draft vocab is the target vocab (no d2t/t2d)."""
        return self.draft_vocab_size == self.target_vocab_size

    @classmethod
    def build(cls, counts, draft_vocab_size: int, cache_key: str | None = None) -> VocabMapping:
        """The mapping of the DESIGN rule from masked-token counts (pure; no file).

        Args:
            counts: int ``[V]`` masked-token frequencies (numpy, torch or list); V = target vocab size.
            draft_vocab_size: number of draft ids, 1..V (V = full size: d2t/t2d None).
            cache_key: recorded as is.

        Raises:
            VocabError: ``draft_vocab_size`` outside 1..V; counts not 1-D non-negative.
            VocabMappingError: the built mapping fails :meth:`problems` (a bug).
        """
        import torch

        c = _counts(counts)
        V, size = int(c.size), int(draft_vocab_size)
        if not 1 <= size <= V:
            raise VocabError(f"draft_vocab_size must be in 1..{V} (the target vocab size), got {draft_vocab_size}")
        if size == V:
            return cls(None, None, size, V, cache_key)
        kept = torch.from_numpy(kept_ids(c, size).astype(np.int64))
        d2t = kept - torch.arange(size, dtype=torch.int64)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[kept] = True
        m = cls(d2t, t2d, size, V, cache_key)
        m.check(counts=c)
        return m

    def kept(self) -> np.ndarray:
        """int64 ``[draft_vocab_size]`` target ids kept (``i + d2t[i]``; all ids at full size)."""
        if self.d2t is None:
            return np.arange(self.target_vocab_size, dtype=np.int64)
        return (np.arange(self.draft_vocab_size, dtype=np.int64) + self.d2t.numpy()).astype(np.int64)

    def kept_mask(self) -> np.ndarray:
        """bool ``[target_vocab_size]``: ``t2d`` as numpy (all true at full size)."""
        return np.ones(self.target_vocab_size, dtype=bool) if self.t2d is None else self.t2d.numpy().astype(bool)

    def problems(self, counts=None) -> list[str]:
        """Every way this mapping breaks the convention (module docstring); empty when valid.

        Checks: d2t/t2d present unless full size (absent at full size); dtypes int64 / bool; shapes
        ``[draft_vocab_size]`` / ``[target_vocab_size]``; kept ids ``i + d2t[i]`` inside ``[0, V)`` and
        strictly increasing; ``t2d.sum() == draft_vocab_size``; t2d true at every kept id; with
        ``counts`` (int ``[V]``), the kept ids hold the top ``min(size, distinct)`` ids by (-count, id).
        """
        import torch

        size, V = self.draft_vocab_size, self.target_vocab_size
        if self.d2t is None or self.t2d is None:
            if size != V:
                miss = ("d2t and t2d are" if self.d2t is None and self.t2d is None
                        else "d2t is" if self.d2t is None else "t2d is")
                return [f"draft_vocab_size {size} < target vocab {V} but {miss} missing"]
            return []
        if size == V:
            return [f"draft_vocab_size equals the target vocab {V} (full size) but d2t/t2d are present"]
        d2t, t2d = torch.as_tensor(self.d2t), torch.as_tensor(self.t2d)
        out: list[str] = []
        if d2t.dtype != torch.int64:
            out.append(f"d2t has dtype {d2t.dtype}, expected torch.int64")
        if t2d.dtype != torch.bool:
            out.append(f"t2d has dtype {t2d.dtype}, expected torch.bool")
        if tuple(d2t.shape) != (size,):
            out.append(f"d2t has shape {tuple(d2t.shape)}, expected ({size},) (draft_vocab_size)")
        if tuple(t2d.shape) != (V,):
            out.append(f"t2d has shape {tuple(t2d.shape)}, expected ({V},) (target vocab size)")
        if out:
            return out
        kept = torch.arange(size, dtype=torch.int64) + d2t
        bad = torch.nonzero((kept < 0) | (kept >= V)).flatten()
        if bad.numel():
            i = int(bad[0])
            return [f"d2t maps draft id {i} to target id {int(kept[i])}, outside [0, {V}) "
                    f"(i + d2t[i]; {bad.numel()} ids out of range)"]
        steps = kept[1:] - kept[:-1]
        if (steps <= 0).any():
            i = int(torch.nonzero(steps <= 0)[0]) + 1
            out.append(f"kept ids are not strictly increasing at i={i} ({int(kept[i - 1])}, {int(kept[i])})")
        if int(t2d.sum()) != size:
            out.append(f"t2d.sum() = {int(t2d.sum())}, expected {size} (t2d is inconsistent with d2t)")
        elif not bool(t2d[kept].all()):
            missing = kept[~t2d[kept]]
            out.append(f"t2d is inconsistent with d2t: target ids {missing[:5].tolist()} are mapped by d2t but not set in t2d")
        if counts is not None and not out:
            order = rank_ids(counts)
            distinct = int(np.count_nonzero(_counts(counts)))
            top = order[: min(size, distinct)]
            lost = top[~t2d.numpy()[top]]
            if lost.size:
                out.append(f"token id {int(lost[0])} is among the top {size} but not kept")
        return out

    def check(self, where: str = "vocab mapping", counts=None) -> VocabMapping:
        """Raise :class:`VocabMappingError` (``"<where>: <problems>"``) unless :meth:`problems` is empty."""
        probs = self.problems(counts)
        if probs:
            raise VocabMappingError(f"{where}: " + "; ".join(probs))
        return self


# --------------------------------------------------------------------------- files


def mapping_digest(d2t, t2d) -> str:
    """sha256 (16 hex) of a mapping's tensors: ``d2t`` as int64 bytes then ``t2d`` as bool bytes;
    ``"full-size"`` when both are None (no mapping). Stage 4's checkpoints record it, so a resume
    with another mapping is refused."""
    import hashlib

    import torch

    if d2t is None and t2d is None:
        return "full-size"
    h = hashlib.sha256()
    h.update(torch.as_tensor(d2t).to(torch.int64).contiguous().numpy().tobytes())
    h.update(b"|")
    h.update(torch.as_tensor(t2d).to(torch.bool).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def mapping_paths(run_dir: str | Path) -> tuple[Path, Path]:
    """``(vocab_mapping.safetensors, mapping.json)`` paths of a run."""
    from eagle3.rundir import RunDir

    rd = RunDir(run_dir)
    return rd.vocab_mapping, rd.mapping_json


def save_tensors(path: str | Path, d2t, t2d, metadata: dict[str, str]) -> None:
    """Write ``d2t``/``t2d`` to a safetensors file atomically with string ``metadata``."""
    from safetensors.torch import save_file

    from eagle3.io import atomic_path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(tmp), metadata=metadata)


def load_tensors(path: str | Path) -> tuple[Any, Any, dict]:
    """``(d2t, t2d, metadata)`` of a safetensors mapping file.

    Raises:
        VocabMappingError: unreadable file or a missing tensor (file named).
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            if not {"d2t", "t2d"} <= names:
                raise VocabMappingError(f"{path}: expected tensors 'd2t' and 't2d', found {sorted(names)}")
            return f.get_tensor("d2t"), f.get_tensor("t2d"), dict(f.metadata() or {})
    except VocabMappingError:
        raise
    except Exception as exc:  # noqa: BLE001 - name the file whatever safetensors says
        raise VocabMappingError(f"{path}: not a readable safetensors file ({exc})") from None


def write_mapping(run_dir: str | Path, mapping: VocabMapping, **info: Any) -> None:
    """Check ``mapping`` and write stage 2's two files (module docstring) atomically.

    ``info`` holds the other ``mapping.json`` fields, written in this order after the sizes and key:
    ``coverage, corpus_hash, tokenizer_hash, cache_hit`` (then ``full_size``).

    Raises:
        VocabMappingError: the mapping fails :meth:`VocabMapping.problems`.
    """
    from eagle3.io import atomic_write_json

    mpath, ipath = mapping_paths(run_dir)
    mapping.check(str(mpath))
    if mapping.full_size:
        mpath.unlink(missing_ok=True)  # a full-size draft vocab has no mapping file
    else:
        save_tensors(mpath, mapping.d2t, mapping.t2d, {"cache_key": str(mapping.cache_key)})
    atomic_write_json(ipath, {"draft_vocab_size": mapping.draft_vocab_size,
                              "target_vocab_size": mapping.target_vocab_size,
                              "cache_key": mapping.cache_key, **info, "full_size": mapping.full_size})


def read_mapping(run_dir: str | Path, target_vocab_size: int | None = None) -> VocabMapping:
    """Stage 2's mapping of a run, checked (sizes, cache key of both files, :meth:`VocabMapping.problems`).

    Args:
        run_dir: the run directory.
        target_vocab_size: the consumer's target vocab (stage 4/5 pass the model's); None = trust the file.

    Returns:
        VocabMapping: with ``d2t`` int64 / ``t2d`` bool tensors (None at full size) and ``info``.

    Raises:
        VocabMappingError: ``mapping.json`` missing (run stage 2); sizes that disagree with the target
            (mapping and target from different runs); the safetensors file missing, unreadable, or
            carrying another cache key; a mapping that fails its check. Every message names the file.
    """
    mpath, ipath = mapping_paths(run_dir)
    from eagle3.io import read_json

    meta = read_json(ipath)
    if meta is None:
        raise VocabMappingError(f"{ipath} does not exist: run stage 2 (vocab) first")
    size, V = int(meta["draft_vocab_size"]), int(meta["target_vocab_size"])
    if target_vocab_size is not None and V != int(target_vocab_size):
        raise VocabMappingError(
            f"{ipath}: target_vocab_size={V} but the target ({target_vocab_size} tokens) disagrees: the mapping "
            f"and the target/tokenizer come from different runs. Re-run stage 2 for this target."
        )
    info = {k: v for k, v in meta.items() if k not in ("draft_vocab_size", "target_vocab_size", "cache_key", "full_size")}
    if size == V:
        return VocabMapping(None, None, size, V, meta.get("cache_key"), info)
    if not mpath.is_file():
        raise VocabMappingError(f"{mpath} is missing although {ipath.name} has draft_vocab_size={size} < {V}: re-run stage 2")
    d2t, t2d, md = load_tensors(mpath)
    if md.get("cache_key") != meta.get("cache_key"):
        raise VocabMappingError(f"{mpath} has cache_key {md.get('cache_key')!r} but {ipath.name} says {meta.get('cache_key')!r}")
    return VocabMapping(d2t, t2d, size, V, meta.get("cache_key"), info).check(str(mpath))
