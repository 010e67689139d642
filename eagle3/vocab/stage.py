"""Stage 2 driver: ``run(params, run_dir)`` and the helpers later stages call.

Reads ``01_synthesize/samples.jsonl``; writes into ``02_vocab/``:

* ``train.parquet``, ``heldout.parquet``: ``id`` (str), ``source`` (str), ``input_ids``
  (list<int64>), ``loss_mask`` (list<int8>, 1 = supervised) - one row per training sequence;
* ``row_lengths_train.npy``, ``row_lengths_heldout.npy``: int64 row lengths before truncation;
* ``token_counts.npy``: int64 ``[target_vocab_size]`` masked-token frequencies of the train split;
  ``heldout_token_counts.npy`` the same for the held-out split;
* ``vocab_mapping.safetensors`` (``d2t`` int64 ``[draft_vocab_size]``, ``t2d`` bool ``[V]``), absent
  for a full-size draft vocab; ``mapping.json`` ``{draft_vocab_size, target_vocab_size, cache_key,
  coverage, ...}``;
* ``tokenize_meta.json`` (hashes that make tokenization resumable), figures, ``progress.json``,
  ``stats.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.config import Params
from eagle3.io import Progress, atomic_path, atomic_write_json, read_json, stage_dir, write_stats
from eagle3.vocab.mapping import COMMON_SIZES, Coverage, cached_vocab_mapping, count_masked_tokens, default_cache_dir, validate_vocab_mapping
from eagle3.vocab.render import ChatRenderer, VocabError, read_samples, stop_token_ids, tokenize_samples

__all__ = [
    "run",
    "load_tokenized",
    "load_mapping",
    "tokenizer_hash",
    "corpus_hash",
    "target_vocab_size",
    "write_tokenized",
    "SCHEMA_COLUMNS",
]

log = logging.getLogger(__name__)

STAGE = 2
SCHEMA_COLUMNS = ("id", "source", "input_ids", "loss_mask")
SPLITS = ("train", "heldout")
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "tiktoken.model", "chat_template.jinja",
    "chat_template.json", "generation_config.json",
)


def _schema():
    import pyarrow as pa

    return pa.schema([
        ("id", pa.string()), ("source", pa.string()),
        ("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int8())),
    ])


# --------------------------------------------------------------------------- hashes


def tokenizer_hash(model_dir: str | Path, tokenizer=None) -> str:
    """sha256 (16 hex) of the target's tokenizer files, generation config and chat template text."""
    h = hashlib.sha256()
    d = Path(model_dir)
    for name in _TOKENIZER_FILES:
        p = d / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    if tokenizer is not None:
        h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return h.hexdigest()[:16]


def corpus_hash(samples: list[dict], settings: dict) -> str:
    """sha256 (16 hex) of the samples (ids, sources, messages, finish reasons, template settings)
    plus the stage settings that change which tokens are supervised (``settings``)."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for s in samples:
        keep = {k: s.get(k) for k in ("id", "source", "messages", "finish_reasons")}
        st = s.get("settings") or {}
        keep["template"] = {k: st.get(k) for k in ("chat_template_kwargs", "enable_thinking")}
        h.update(json.dumps(keep, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()[:16]


def target_vocab_size(model_dir: str | Path, trust_remote_code: bool = False) -> int:
    """The target's vocab size (rows of its LM head): ``config.vocab_size`` (``text_config`` for
    multimodal configs), as speculators' ``get_target_vocab_size`` reads it."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    cfg = getattr(cfg, "text_config", None) or cfg
    return int(cfg.vocab_size)


# --------------------------------------------------------------------------- files


def write_tokenized(path: str | Path, row_chunks, row_group_rows: int = 1024) -> list[int]:
    """Stream row chunks (lists of :class:`~eagle3.vocab.render.TokenizedRow`) to a parquet file atomically.

    Returns:
        list[int]: the rows' lengths before truncation, in file order.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _schema()
    lengths: list[int] = []

    def table(rows) -> pa.Table:
        offs = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum([len(r.input_ids) for r in rows], out=offs[1:])
        ids = np.concatenate([r.input_ids for r in rows]) if rows else np.zeros(0, np.int64)
        mask = np.concatenate([r.loss_mask for r in rows]) if rows else np.zeros(0, np.int8)
        return pa.Table.from_arrays([
            pa.array([r.id for r in rows], pa.string()),
            pa.array([r.source for r in rows], pa.string()),
            pa.ListArray.from_arrays(pa.array(offs), pa.array(ids.astype(np.int64))),
            pa.ListArray.from_arrays(pa.array(offs), pa.array(mask.astype(np.int8))),
        ], schema=schema)

    with atomic_path(path) as tmp:
        with pq.ParquetWriter(tmp, schema) as w:
            buf: list = []
            for chunk in row_chunks:
                buf.extend(chunk)
                lengths.extend(r.full_len for r in chunk)
                while len(buf) >= row_group_rows:
                    w.write_table(table(buf[:row_group_rows]))
                    buf = buf[row_group_rows:]
            if buf or not lengths:
                w.write_table(table(buf))
    return lengths


def load_tokenized(run_dir: str | Path, split: str = "train", as_table: bool = False):
    """The tokenized rows of one split written by stage 2.

    Args:
        run_dir: the run directory.
        split: ``"train"`` or ``"heldout"``.
        as_table: return the ``pyarrow.Table`` instead of a ``datasets.Dataset``.

    Returns:
        datasets.Dataset | pyarrow.Table: columns ``id`` (str), ``source`` (str), ``input_ids``
        (list<int64> ``[seq]``), ``loss_mask`` (list<int8> ``[seq]``, 1 = supervised), memory-mapped.

    Raises:
        VocabError: unknown split or stage 2 has not written the file.
    """
    import pyarrow.parquet as pq

    if split not in SPLITS:
        raise VocabError(f"split must be one of {SPLITS}, got {split!r}")
    p = stage_dir(run_dir, STAGE, create=False) / f"{split}.parquet"
    if not p.is_file():
        raise VocabError(f"{p} does not exist: run stage 2 (vocab) first")
    table = pq.read_table(p, memory_map=True)
    if as_table:
        return table
    import datasets

    return datasets.Dataset(table)


def load_mapping(run_dir: str | Path):
    """The draft vocab mapping written by stage 2, validated.

    Returns:
        tuple: ``(d2t, t2d)`` - ``torch.int64 [draft_vocab_size]`` (target id = i + d2t[i]) and
        ``torch.bool [target_vocab_size]`` - or ``(None, None)`` for a full-size draft vocab.

    Raises:
        VocabError: stage 2 has not written ``mapping.json``; the safetensors file is missing or
            belongs to another mapping (cache key differs); the mapping fails validation.
    """
    from safetensors import safe_open

    d = stage_dir(run_dir, STAGE, create=False)
    meta = read_json(d / "mapping.json")
    if meta is None:
        raise VocabError(f"{d / 'mapping.json'} does not exist: run stage 2 (vocab) first")
    size, V = int(meta["draft_vocab_size"]), int(meta["target_vocab_size"])
    if size == V:
        return None, None
    p = d / "vocab_mapping.safetensors"
    if not p.is_file():
        raise VocabError(f"{p} is missing although mapping.json has draft_vocab_size={size} < {V}")
    with safe_open(str(p), framework="pt") as f:
        got = (f.metadata() or {}).get("cache_key")
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    if got != meta.get("cache_key"):
        raise VocabError(f"{p} has cache_key {got!r} but mapping.json says {meta.get('cache_key')!r}")
    validate_vocab_mapping(d2t, t2d, size, V)
    return d2t, t2d


# --------------------------------------------------------------------------- stage


def _template_defaults(params: Params) -> dict:
    return {} if params.synthesize.enable_thinking is None else {"enable_thinking": params.synthesize.enable_thinking}


def _tokenize_split(params, out_dir, split, samples, renderer, hashes, prog) -> dict:
    """Tokenize one split unless its parquet, lengths and meta already match ``hashes``."""
    meta_path = out_dir / "tokenize_meta.json"
    meta = read_json(meta_path, {}) or {}
    done = meta.get(split)
    pq_path = out_dir / f"{split}.parquet"
    len_path = out_dir / f"row_lengths_{split}.npy"
    if done and done.get("hashes") == hashes and pq_path.is_file() and len_path.is_file():
        prog.update(len(samples), tokens=int(done["report"]["tokens"]), **{f"{split}_resumed": True})
        return done["report"]
    chunks, rep = tokenize_samples(
        samples, renderer, params.vocab.max_seq_len, params.vocab.multi_turn_policy,
        on_chunk=lambda n, t: prog.update(n, tokens=t),
    )
    lengths = write_tokenized(pq_path, chunks) if samples else write_tokenized(pq_path, [])
    with atomic_path(len_path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, np.asarray(lengths, dtype=np.int64))
    report = rep.as_dict()
    if rep.no_supervised_samples or rep.failed_samples:
        log.warning(
            "%s: %d samples without a supervised token (%s...), %d rejected (%s)", split,
            rep.no_supervised_samples, rep.no_supervised_ids[:5], rep.failed_samples, rep.failed[:2],
        )
    meta = read_json(meta_path, {}) or {}
    meta[split] = {"hashes": hashes, "report": report}
    atomic_write_json(meta_path, meta)
    return report


def run(params: Params, run_dir: str | Path) -> dict:
    """Stage 2: tokenize as served, count masked tokens, pick the draft vocab size, build the mapping.

    Resumable: a split whose parquet file was written for the same corpus hash and tokenizer hash
    is not tokenized again; counts, coverage and mapping are recomputed (deterministic, seconds).

    Returns:
        dict: the stats written to ``02_vocab/stats.json`` - ``distinct_tokens``,
        ``masked_tokens``, ``draft_vocab_size``, ``coverage`` (train masked mass inside the draft
        vocab), ``heldout_oov_rate`` (share of held-out masked tokens outside it), coverage at
        8K/16K/32K/64K, per-split tokenization reports (truncation, dropped and rejected samples).

    Raises:
        VocabError: missing/invalid samples.jsonl (file:line:field), a split with samples but no
            supervised token, ``draft_vocab_size`` larger than the target vocab, a token id outside
            the target vocab.
    """
    from eagle3.target import load_tokenizer, resolve_target
    from eagle3.tracking import Tracker
    from eagle3.vocab.explore import CoverageExplorer

    run_dir = Path(run_dir)
    out = stage_dir(run_dir, STAGE)
    samples_path = stage_dir(run_dir, 1, create=False) / "samples.jsonl"
    all_samples = read_samples(samples_path)
    by_split = {s: [x for x in all_samples if x["split"] == s] for s in SPLITS}
    if not by_split["train"]:
        raise VocabError(f"{samples_path}: no sample has split == 'train'; nothing to count")

    target = resolve_target(params.target)
    tok = load_tokenizer(target, params.target.trust_remote_code)
    renderer = ChatRenderer(tok, stop_token_ids(tok, target.path), _template_defaults(params),
                            params.vocab.history_reasoning)
    V = target_vocab_size(target.path, params.target.trust_remote_code)
    if params.vocab.draft_vocab_size is not None and params.vocab.draft_vocab_size > V:
        raise VocabError(
            f"vocab.draft_vocab_size={params.vocab.draft_vocab_size} exceeds the target vocab size {V}; "
            f"use at most {V} (= full size, no mapping)"
        )
    tok_hash = tokenizer_hash(target.path, tok)
    settings = {
        "max_seq_len": params.vocab.max_seq_len,
        "multi_turn_policy": params.vocab.multi_turn_policy,
        "history_reasoning": params.vocab.history_reasoning,
        "template_kwargs": _template_defaults(params),
        "format": 2,  # bump when tokenization or its report changes: earlier splits are redone
    }
    tracker = Tracker(params, run_dir, "02_vocab")
    reports: dict[str, dict] = {}
    hashes: dict[str, str] = {}
    with Progress(out, total=len(all_samples), unit="samples", desc="02_vocab") as prog:
        for split in SPLITS:
            hashes[split] = corpus_hash(by_split[split], settings)
            reports[split] = _tokenize_split(
                params, out, split, by_split[split], renderer, {"corpus": hashes[split], "tokenizer": tok_hash}, prog
            )

        counts = count_masked_tokens(out / "train.parquet", V)
        held = count_masked_tokens(out / "heldout.parquet", V)
        for name, arr in (("token_counts.npy", counts), ("heldout_token_counts.npy", held)):
            with atomic_path(out / name) as tmp:
                with open(tmp, "wb") as f:
                    np.save(f, arr)
        cov = Coverage.from_counts(counts)
        if params.vocab.target_coverage is not None:
            size, size_from = cov.size_for(params.vocab.target_coverage), "target_coverage"
        else:
            size, size_from = int(params.vocab.draft_vocab_size), "draft_vocab_size"
        cache_dir = Path(params.vocab.cache_dir) if params.vocab.cache_dir else default_cache_dir(params.target.cache_dir)
        d2t, t2d, key, hit = cached_vocab_mapping(counts, size, hashes["train"], tok_hash, cache_dir)
        _write_mapping(out, d2t, t2d, key, size, V, cov, hashes["train"], tok_hash, hit)

        kept = t2d.numpy() if t2d is not None else np.ones(V, dtype=bool)
        held_total = int(held.sum())
        stats: dict[str, Any] = {
            "target_vocab_size": V,
            "draft_vocab_size": size,
            "draft_vocab_size_from": size_from,
            "full_size": d2t is None,
            "distinct_tokens": cov.distinct,
            "masked_tokens": cov.total,
            "coverage": cov.at(size),
            "padded_ids": max(size - cov.distinct, 0) if d2t is not None else 0,
            "heldout_masked_tokens": held_total,
            "heldout_oov_rate": (float(held[~kept].sum() / held_total) if held_total else None),
            **{f"coverage_at_{s // 1024}k": cov.at(s) for s in COMMON_SIZES if s <= V},
            "cache_key": key,
            "cache_hit": hit,
            "corpus_hash": hashes["train"],
            "tokenizer_hash": tok_hash,
            "max_seq_len": params.vocab.max_seq_len,
            "multi_turn_policy": params.vocab.multi_turn_policy,
        }
        for split in SPLITS:
            r = reports[split]
            for k in ("samples", "rows", "tokens", "supervised_tokens", "truncated_rows", "truncated_tokens",
                      "truncated_supervised_tokens", "dropped_rows_after_truncation", "no_supervised_samples",
                      "failed_samples", "history_rerendered_samples", "exploded_rows"):
                stats[f"{split}_{k}"] = r[k]
            n = r.get("turns_with_completion_tokens", 0)
            # share of turns whose supervised span has exactly as many tokens as stage 1 recorded generating
            stats[f"{split}_completion_token_agreement"] = r.get("turns_matching_completion_tokens", 0) / n if n else None
        stats["tokenize_reports"] = reports

        explorer = CoverageExplorer.from_run(run_dir, params, tokenizer=tok)
        for name, fig in explorer.figures().items():
            tracker.figure(name, fig)
        tracker.log({k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        tracker.summary(stats)
        tracker.finish()
        prog.extra.update(draft_vocab_size=size, coverage=stats["coverage"])
    return write_stats(out, stats)


def _write_mapping(out, d2t, t2d, key, size, V, cov, c_hash, t_hash, hit) -> None:
    from safetensors.torch import save_file

    mpath = out / "vocab_mapping.safetensors"
    if d2t is None:
        mpath.unlink(missing_ok=True)  # a full-size draft vocab has no mapping file
    else:
        with atomic_path(mpath) as tmp:
            save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(tmp), metadata={"cache_key": key})
    atomic_write_json(out / "mapping.json", {
        "draft_vocab_size": size,
        "target_vocab_size": V,
        "cache_key": key,
        "coverage": cov.at(size),
        "corpus_hash": c_hash,
        "tokenizer_hash": t_hash,
        "cache_hit": hit,
        "full_size": d2t is None,
    })
