"""Stage 2 end to end on the embedded SmolLM2 tokenizer: files, stats, resume, mapping cache, loaders."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eagle3.contracts import tokenized
from eagle3.contracts.samples import SamplesError, write_samples
from eagle3.contracts.vocab_mapping import VocabMapping, VocabMappingError, read_mapping
from eagle3.io import read_json
from eagle3.params_file import load_params
from eagle3.rundir import VOCAB, RunDir
from eagle3.vocab import Coverage, CoverageExplorer, VocabError, VocabStats
from eagle3.vocab import run as run_stage


def run(params, rd) -> dict:
    """Stage 2, checking that the returned stats are what stats.json holds (plus complete/finished_at)."""
    st = run_stage(params, rd)
    on_disk = read_json(RunDir(rd).stats(VOCAB))
    assert isinstance(st, VocabStats) and on_disk["complete"] is True
    assert st.to_dict() == {k: v for k, v in on_disk.items() if k not in ("complete", "finished_at")}
    assert list(st.to_dict()) == [k for k in on_disk if k not in ("complete", "finished_at")]
    return on_disk


def load_tokenized(rd, split, as_table=False):
    return tokenized.read_table(rd, split) if as_table else tokenized.read_dataset(rd, split)


def load_mapping(rd):
    m = read_mapping(rd)
    return m.d2t, m.t2d


def _samples() -> list[dict]:
    out = []
    for i in range(12):
        msgs = [{"role": "user", "content": f"Write function number {i}."},
                {"role": "assistant", "content": f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 3)}]
        if i == 3:  # multi-turn
            msgs += [{"role": "user", "content": "Shorter?"}, {"role": "assistant", "content": "lambda x: x"}]
        out.append({"id": f"s{i}", "source": "code" if i % 2 else "chat", "split": "heldout" if i % 4 == 0 else "train",
                    "prompt_hash": f"h{i}", "messages": msgs, "finish_reasons": ["stop"] * ((len(msgs)) // 2),
                    "prompt_tokens": 0, "completion_tokens": 0, "settings": {"enable_thinking": None}})
    out.append({"id": "q", "source": "chat", "split": "train", "prompt_hash": "hq",
                "messages": [{"role": "user", "content": "unanswered"}], "finish_reasons": [],
                "prompt_tokens": 0, "completion_tokens": 0, "settings": {}})
    return out


def _run_dir(tmp_path, name="r", samples=None):
    rd = tmp_path / name
    write_samples(rd, samples or _samples())
    return rd


def _params(tmp_path, *sets):
    return load_params(None, ["tracking.mode=disabled", "vocab.max_seq_len=60",
                              f"vocab.cache_dir={tmp_path / 'cache'}", *sets])


def test_run_end_to_end_and_resume(tmp_path):
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    rd = _run_dir(tmp_path)
    st = run(_params(tmp_path, "vocab.draft_vocab_size=16"), rd)
    d = RunDir(rd).stage(VOCAB)
    train = load_tokenized(rd, "train")
    held = load_tokenized(rd, "heldout", as_table=True)
    assert train.column_names == ["id", "source", "input_ids", "loss_mask"]
    assert str(held.schema.field("input_ids").type) == "list<element: int64>"
    assert str(held.schema.field("loss_mask").type) == "list<element: int8>"
    assert train["id"] == ["s1", "s2", "s3", "s5", "s6", "s7", "s9", "s10", "s11"]  # q: no supervised token
    assert held.column("id").to_pylist() == ["s0", "s4", "s8"]
    assert st["train_no_supervised_samples"] == 1 and st["tokenize_reports"]["train"]["no_supervised_ids"] == ["q"]
    assert all(len(x) <= 60 for x in train["input_ids"]) and st["train_truncated_rows"] > 0
    lengths = tokenized.read_row_lengths(rd, "train")
    assert int((lengths > 60).sum()) == st["train_truncated_rows"]
    assert int(np.minimum(lengths, 60).sum()) == st["train_tokens"] == sum(len(x) for x in train["input_ids"])
    assert int((lengths - np.minimum(lengths, 60)).sum()) == st["train_truncated_tokens"]

    # counts: masked tokens of the train split only, the same as speculators' own counting
    counts = np.load(d / "token_counts.npy")
    assert counts.shape == (49152,) and counts.dtype == np.int64
    save_token_frequency_distribution(train.with_format("torch"), tmp_path / "freq.pt")
    ref = torch.load(tmp_path / "freq.pt")
    assert {i: int(c) for i, c in enumerate(counts) if c} == ref
    assert st["masked_tokens"] == sum(sum(m) for m in train["loss_mask"]) == st["train_supervised_tokens"]
    assert st["distinct_tokens"] == len(ref)

    # mapping: the top-16 by (-count, id), as the pure function builds it, and the stats derived from it
    d2t, t2d = load_mapping(rd)
    expected = VocabMapping.build(counts, 16)
    e2t, e2d = expected.d2t, expected.t2d
    assert torch.equal(d2t, e2t) and torch.equal(t2d, e2d) and d2t.shape == (16,) and t2d.shape == (49152,)
    meta = json.loads((d / "mapping.json").read_text())
    assert meta["draft_vocab_size"] == 16 and meta["target_vocab_size"] == 49152 and meta["cache_key"] == st["cache_key"]
    assert st["coverage"] == pytest.approx(Coverage.from_counts(counts).at(16)) == pytest.approx(meta["coverage"])
    hid = np.concatenate([np.asarray(x)[np.asarray(m, bool)] for x, m in
                          zip(held.column("input_ids").to_pylist(), held.column("loss_mask").to_pylist())])
    assert st["heldout_masked_tokens"] == hid.size
    assert st["heldout_oov_rate"] == pytest.approx(float((~t2d.numpy()[hid]).mean()))
    assert 0 < st["heldout_oov_rate"] < 1 and st["cache_hit"] is False
    for png in ("coverage_curve", "rank_frequency", "sequence_lengths"):
        assert (d / f"{png}.png").stat().st_size > 1000
    # the explorer computes the same held-out OOV as the stage, and none at the full vocab
    ex = CoverageExplorer.from_run(rd)
    assert ex.chosen_size == 16 and ex.summary(16)["heldout_oov_rate"] == st["heldout_oov_rate"]
    assert ex.summary(49152)["heldout_oov_rate"] == 0.0 and ex.summary(49152)["heldout_coverage"] == 1.0

    # a finished stage with the same inputs is returned as it is: no file rewritten
    files = {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in sorted(d.iterdir()) if f.is_file()}
    assert run(_params(tmp_path, "vocab.draft_vocab_size=16"), rd) == st
    assert {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in sorted(d.iterdir()) if f.is_file()} == files
    # ... but another size rule on the same files is a new computation
    assert run(_params(tmp_path, "vocab.draft_vocab_size=24"), rd)["draft_vocab_size"] == 24

    # resume of an unfinished stage: nothing re-tokenized, same outputs, the mapping comes from the cache
    run(_params(tmp_path, "vocab.draft_vocab_size=16"), rd)
    (d / "stats.json").unlink()
    mtime = (d / "train.parquet").stat().st_mtime_ns
    blob = (d / "vocab_mapping.safetensors").read_bytes()
    st2 = run(_params(tmp_path, "vocab.draft_vocab_size=16"), rd)
    assert (d / "train.parquet").stat().st_mtime_ns == mtime
    assert st2["cache_hit"] is True and (d / "vocab_mapping.safetensors").read_bytes() == blob
    assert {k: v for k, v in st2.items() if k not in ("finished_at", "cache_hit")} == \
        {k: v for k, v in st.items() if k not in ("finished_at", "cache_hit")}

    # another corpus (one answer changed) with the same size does not pick up that cache entry
    other = _samples()
    other[1]["messages"][1]["content"] = "return 42 " * 30
    st3 = run(_params(tmp_path, "vocab.draft_vocab_size=16"), _run_dir(tmp_path, "r2", other))
    assert st3["cache_key"] != st["cache_key"] and st3["cache_hit"] is False
    assert st3["corpus_hash"] != st["corpus_hash"] and st3["tokenizer_hash"] == st["tokenizer_hash"]


def test_run_size_from_coverage_and_full_size(tmp_path):
    rd = _run_dir(tmp_path)
    st = run(_params(tmp_path, "vocab.target_coverage=0.9"), rd)
    counts = np.load(RunDir(rd).token_counts)
    cov = Coverage.from_counts(counts)
    assert st["draft_vocab_size_from"] == "target_coverage"
    assert st["draft_vocab_size"] == cov.size_for(0.9) and st["coverage"] >= 0.9 > cov.at(st["draft_vocab_size"] - 1)

    only_train = [dict(x, split="train") for x in _samples()]  # no held-out split at all
    rd2 = _run_dir(tmp_path, "full", only_train)
    st = run(_params(tmp_path, "vocab.draft_vocab_size=49152"), rd2)
    assert st["full_size"] is True and st["coverage"] == 1.0 and st["padded_ids"] == 0
    assert st["heldout_samples"] == 0 and st["heldout_oov_rate"] is None
    assert load_tokenized(rd2, "heldout").num_rows == 0 and load_tokenized(rd2, "train").num_rows == 12
    assert not RunDir(rd2).vocab_mapping.exists()
    assert load_mapping(rd2) == (None, None)


def test_run_errors(tmp_path):
    with pytest.raises(SamplesError, match=r"synthesize/samples.jsonl does not exist: run stage 1"):
        run(_params(tmp_path), tmp_path / "empty")
    with pytest.raises(VocabError, match="exceeds the target vocab size 49152"):
        run(_params(tmp_path, "vocab.draft_vocab_size=50000"), _run_dir(tmp_path))
    with pytest.raises(VocabMappingError, match="run stage 2"):
        load_mapping(tmp_path / "empty")
    with pytest.raises(tokenized.TokenizedError, match="run stage 2"):
        tokenized.read_rows(tmp_path / "empty", "train")


def test_headlines_are_the_report_index_keys():
    from eagle3.report import headline_keys, stats_classes
    from eagle3.rundir import SYNTHESIZE
    from eagle3.synthesize import SynthesizeStats

    assert stats_classes()[SYNTHESIZE] is SynthesizeStats and stats_classes()[VOCAB] is VocabStats
    assert headline_keys()[SYNTHESIZE] == SynthesizeStats.HEADLINE and headline_keys()[VOCAB] == VocabStats.HEADLINE
