"""File helpers (atomic writes) and the stage records they carry: progress.json, the status table."""

from __future__ import annotations

import time

import pytest

from eagle3.commands.run import parse_stages
from eagle3.commands.status import format_status, status_rows
from eagle3.io import atomic_path, atomic_write_json, read_json
from eagle3.stage import Progress, stage_record, write_stats


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    p = tmp_path / "a.json"
    atomic_write_json(p, {"x": 1})

    with pytest.raises(RuntimeError):
        with atomic_path(p) as tmp:
            tmp.write_text('{"x": 2, "partial')  # killed half-way
            raise RuntimeError("interrupted")
    assert read_json(p) == {"x": 1}
    assert [f.name for f in tmp_path.iterdir()] == ["a.json"]  # no temp file left


def test_atomic_write_gives_the_mode_of_a_plain_open(tmp_path, monkeypatch):
    """stats.json, params.yaml and the figures are not 0600 (mkstemp's mode) beside a 0644 report page:
    an atomically written file gets what open() gives under the umask."""
    import os

    import eagle3.io as eio

    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    p = tmp_path / "a.json"
    atomic_write_json(p, {"x": 1})
    assert os.stat(p).st_mode & 0o777 == os.stat(plain).st_mode & 0o777
    for umask, mode in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664)):
        monkeypatch.setattr(eio, "_UMASK", umask)
        atomic_write_json(p, {"x": umask})
        assert os.stat(p).st_mode & 0o777 == mode and read_json(p) == {"x": umask}


def test_progress_file_and_status(tmp_path):
    run = tmp_path / "run"
    d = run / "03_extract"
    d.mkdir(parents=True)
    (d / "blob.bin").write_bytes(b"x" * 5000)
    prog = Progress(d, total=10, unit="samples", projected_bytes=10_000, interval_s=0.0)
    prog.update(4, tokens=400)
    snap = read_json(d / "progress.json")
    assert snap["status"] == "running" and snap["done"] == 4 and snap["total"] == 10 and snap["tokens"] == 400
    assert snap["bytes_on_disk"] >= 5000 and snap["projected_bytes"] == 10_000
    assert snap["eta_s"] is not None and snap["eta_s"] >= 0
    rows = {r["stage"]: r for r in status_rows(run)}
    assert rows["3 extract"]["state"] == "running"
    assert rows["3 extract"]["done"] == "4/10 samples"
    assert rows["1 synthesize"]["state"] == "not started"
    text = format_status(run)
    assert "4/10 samples" in text and "9.8 KiB" in text
    assert text.splitlines()[-1].startswith("tokens/s: this execution")  # which clock the column reads
    prog.close()
    assert read_json(d / "progress.json")["status"] == "done"
    assert not stage_record(run, 3).complete
    write_stats(d, {"samples": 10})
    assert stage_record(run, 3).complete
    assert status_rows(run)[2]["state"] == "complete"


def test_a_resumed_stage_shows_done_with_its_total_its_whole_time_and_no_eta(tmp_path):
    """A stage 5 interrupted at 3/19 steps after 300 s, resumed: the 16 offline records it finds are
    counted (not in the rate), it ends 19/19, shows no ETA and 300 s + this execution as elapsed."""
    run = tmp_path / "run"
    d = run / "05_evaluate"
    d.mkdir(parents=True)
    atomic_write_json(d / "progress.json", {"status": "interrupted", "unit": "steps", "done": 3, "total": 19,
                                            "tokens": 300, "elapsed_s": 300.0, "eta_s": 1600.0, "updated": time.time()})
    assert status_rows(run)[4]["ETA"] == "-" and status_rows(run)[4]["state"] == "interrupted"
    prog = Progress(d, total=19, unit="steps", interval_s=0.0)
    prog.resumed(16, tokens=1600)  # offline records of the first execution
    snap = read_json(d / "progress.json")
    assert snap["done"] == 16 and snap["tokens"] == 1600 and snap["tokens_per_s"] == 0.0 and snap["eta_s"] is None
    assert snap["elapsed_s"] >= 300.0
    prog.update(3, tokens=90)  # the vLLM jobs, measured now
    prog.close("done")
    write_stats(d, {"num_prompts": 4})
    snap = read_json(d / "progress.json")
    assert (snap["done"], snap["total"], snap["eta_s"], snap["tokens"]) == (19, 19, 0.0, 1690)
    assert 300.0 <= snap["elapsed_s"] < 330.0 and snap["tokens_per_s"] > 90  # 90 tokens in well under 1 s
    row = status_rows(run)[4]
    assert (row["state"], row["done"], row["ETA"], row["elapsed"]) == ("complete", "19/19 steps", "-", "5m00s")


def test_a_new_phase_has_its_own_unit_total_and_eta_and_the_stage_time_runs_on(tmp_path):
    """Stage 5: 16 offline prompts in 60 s, then 3 vLLM measurements of 120 s each. One rate over the
    19 jobs gave an ETA of 14 s after the first measurement; the phase's own rate gives 240 s."""
    d = tmp_path / "05_evaluate"
    d.mkdir()
    prog = Progress(d, total=16, unit="offline prompts", interval_s=0.0)
    prog.t0 -= 60.0
    prog.update(16, tokens=1600)
    prog.next_phase(3, "vLLM measurements")
    snap = read_json(d / "progress.json")
    assert (snap["unit"], snap["done"], snap["total"], snap["eta_s"]) == ("vLLM measurements", 0, 3, None)
    assert snap["tokens"] == 1600 and snap["tokens_per_s"] == 0.0 and 60.0 <= snap["elapsed_s"] < 70.0
    prog.t0 -= 120.0  # the first measurement took 120 s
    prog.update(1, tokens=300)
    snap = read_json(d / "progress.json")
    assert 235.0 <= snap["eta_s"] <= 240.0 and snap["tokens"] == 1900 and 180.0 <= snap["elapsed_s"] < 190.0
    assert 2.4 < snap["tokens_per_s"] <= 2.5  # 300 tokens of this phase over its 120 s
    prog.update(2)
    prog.close("done")
    snap = read_json(d / "progress.json")
    assert (snap["status"], snap["done"], snap["total"], snap["eta_s"]) == ("done", 3, 3, 0.0)


def test_stage_1_elapsed_covers_self_prompting_and_answering(tmp_path):
    """Stage 1 writes progress.json from two Progress objects (self-prompting, closed 'running', then
    answering): the stage's elapsed covers both; a stage redone after a finished run starts at 0."""
    d = tmp_path / "01_synthesize"
    d.mkdir()
    writing = Progress(d, total=4, unit="self prompts", interval_s=0.0)
    writing.t0 -= 150.0  # the target wrote its prompts for 150 s
    writing.update(4, tokens=400)
    writing.close("running")
    answering = Progress(d, total=6, unit="samples", interval_s=0.0)
    answering.update(6, tokens=60)
    answering.close("done")
    snap = read_json(d / "progress.json")
    assert 150.0 <= snap["elapsed_s"] < 180.0 and snap["done"] == 6 and snap["eta_s"] == 0.0
    assert snap["tokens_per_s"] > 60  # the answering phase's own rate, not over 150 s
    write_stats(d, {"samples": 6})
    assert status_rows(tmp_path)[0]["elapsed"] == "2m30s"
    again = Progress(d, total=6, unit="samples", interval_s=0.0)  # --redo 1 after it finished
    again.close("done")
    assert read_json(d / "progress.json")["elapsed_s"] < 30.0


def test_a_finished_progress_has_no_eta_even_short_of_its_total(tmp_path):
    prog = Progress(tmp_path, total=19, unit="steps", interval_s=0.0)
    prog.update(3)
    prog.close("done")
    assert read_json(tmp_path / "progress.json")["eta_s"] == 0.0


def test_stalled_progress_is_flagged(tmp_path):
    d = tmp_path / "01_synthesize"
    d.mkdir()
    atomic_write_json(d / "progress.json", {"status": "running", "done": 1, "total": 2, "updated": time.time() - 3600})
    assert status_rows(tmp_path)[0]["state"] == "stalled?"


def test_parse_stages():
    assert parse_stages("1-5") == [1, 2, 3, 4, 5]
    assert parse_stages("2,4-5") == [2, 4, 5]
    with pytest.raises(ValueError, match="stage 6 does not exist"):
        parse_stages("5-6")


def test_progress_heartbeat_keeps_file_fresh_during_long_work(tmp_path):
    prog = Progress(tmp_path, total=2, interval_s=0.2)
    first = read_json(tmp_path / "progress.json")["updated"]
    time.sleep(3.0)  # one long unit of work (longer than the 2.5 s heartbeat), no update() call
    snap = read_json(tmp_path / "progress.json")
    assert snap["updated"] > first and snap["status"] == "running" and snap["done"] == 0
    prog.close()
    closed = read_json(tmp_path / "progress.json")
    time.sleep(1.0)
    assert read_json(tmp_path / "progress.json") == closed  # nothing writes after close
    assert closed["status"] == "done"


# ------------------------------------------------------------------ read_jsonl, digests, bytes


def test_read_jsonl_drops_only_a_torn_last_line(tmp_path):
    from eagle3.io import read_jsonl

    f = tmp_path / "s.jsonl"
    f.write_bytes(b'{"id": "a"}\n\n{"id": "b"}\n{"id": "c", "te')  # killed mid-write
    assert read_jsonl(f) == [{"id": "a"}, {"id": "b"}]
    f.write_bytes(b'{"id": "a"}\n{"id": "b"}')  # complete record, no final newline: kept
    assert read_jsonl(f) == [{"id": "a"}, {"id": "b"}]
    f.write_bytes(b'{"id": "a"}\n{"id": \n{"id": "c"}\n')  # corruption in the middle
    with pytest.raises(ValueError, match=r"s\.jsonl:2: not valid JSON"):
        read_jsonl(f)


def test_read_jsonl_missing_file_and_error_class(tmp_path):
    from eagle3.errors import VocabError
    from eagle3.io import read_jsonl

    assert read_jsonl(tmp_path / "none.jsonl", missing_ok=True) == []
    with pytest.raises(VocabError, match="none.jsonl: no such file"):
        read_jsonl(tmp_path / "none.jsonl", error=VocabError)


def test_file_sha256_and_format_bytes(tmp_path):
    from eagle3.io import file_sha256, format_bytes

    f = tmp_path / "b.bin"
    f.write_bytes(b"abc")
    assert file_sha256(f) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # FIPS 180-2 "abc"
    assert [format_bytes(n) for n in (None, 0, 1023, 1536, 5 * 2**30)] == ["-", "0 B", "1023 B", "1.5 KiB", "5.0 GiB"]


def test_the_eta_follows_the_recent_rate_not_a_slow_start(tmp_path):
    """A training run on an H200: the first step compiled for 51 s and the first epoch read from
    disk, so the phase's average rate put the ETA at twice the time left. Here: a 60 s first step, then
    5 steps/s for 150 s; 1,249 steps left are 250 s at the recent rate (the average says ~349 s)."""
    prog = Progress(tmp_path, total=2000, unit="steps", interval_s=0.0)
    prog.t0 -= 60.0
    prog.update(1)
    assert 119_900 <= read_json(tmp_path / "progress.json")["eta_s"] <= 120_000  # younger than the window: 1/60 s
    for _ in range(150):
        prog.t0 -= 1.0
        prog.update(5)
    snap = read_json(tmp_path / "progress.json")
    assert snap["done"] == 751 and 245.0 <= snap["eta_s"] <= 252.0
    assert 3.5 < snap["rate_units_per_s"] < 3.6  # the phase's average is still reported as its rate
    assert len(prog.history) <= Progress.ETA_WINDOW_S + 2  # one point a write, none older than needed
    prog.close()


def test_the_eta_of_few_long_units_keeps_the_average(tmp_path):
    """Stage 5's vLLM measurements take minutes each: a window holding one or two of them would swing the
    ETA; with fewer than ETA_MIN_UNITS units in the window the phase's average stays."""
    prog = Progress(tmp_path, total=4, unit="vLLM measurements", interval_s=0.0)
    for _ in range(3):
        prog.t0 -= 100.0
        prog.update(1)
    assert 99.0 <= read_json(tmp_path / "progress.json")["eta_s"] <= 101.0
    prog.close()


def test_the_token_based_eta_of_extraction_follows_the_recent_rate(tmp_path):
    """Stage 3's ETA counts tokens (rows differ in length): the same window, over tokens."""
    from eagle3.extract.progress import ExtractProgress

    prog = ExtractProgress(tmp_path, tmp_path, total=10_000, total_tokens=1_000_000, done=0, tokens=0,
                           projected_bytes=1, done_bytes=0, writer_ref=lambda: 0, other_dirs=[], timeline=None)
    prog.interval_s = 0.0
    prog.t0 -= 30.0  # the model's warm-up: 30 s for 10 rows of 100 tokens
    prog.update(10, tokens=1_000)
    for _ in range(130):
        prog.t0 -= 1.0
        prog.update(20, tokens=2_000)  # then 2,000 tokens/s
    snap = read_json(tmp_path / "progress.json")
    assert snap["tokens"] == 261_000 and 365.0 <= snap["eta_s"] <= 372.0  # 739,000 tokens at 2,000/s
    assert snap["tokens_per_s"] < 1_650  # the execution's average (261,000 over 160 s) stays the reported rate
    prog.close()


def test_a_failed_write_names_the_file(tmp_path, monkeypatch):
    """A write or fsync on a full disk raises ENOSPC naming no file; the atomic writers name the file
    being written (the destination, not the temp file), and the old file stays."""
    import errno
    import json

    import eagle3.io
    from eagle3.io import naming_file

    dst = tmp_path / "stats.json"
    atomic_write_json(dst, {"a": 1})

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(eagle3.io.os, "fsync", full)
    with pytest.raises(OSError) as e:
        atomic_write_json(dst, {"a": 2})
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(dst))
    assert json.loads(dst.read_text()) == {"a": 1} and [p.name for p in tmp_path.iterdir()] == ["stats.json"]
    with pytest.raises(FileNotFoundError) as e, naming_file("elsewhere"):
        open(tmp_path / "nope" / "x")
    assert e.value.filename == str(tmp_path / "nope" / "x")  # a name of its own is kept
