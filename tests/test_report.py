"""The report index shows every headline number of every stage, and the stages write those keys."""

from __future__ import annotations

import dataclasses
import html
from pathlib import Path

import pytest

from eagle3.evaluate.methods import OFFLINE_EAGLE3, VLLM_EAGLE3, VLLM_NGRAM, VLLM_NONE
from eagle3.evaluate.stats import grid
from eagle3.report import MISSING, headline_keys, index_html, key_numbers, stats_classes
from eagle3.rundir import STAGES, stage_dir
from eagle3.stage import Stats, write_stats

ROOT = Path(__file__).resolve().parent.parent

HEADLINE = headline_keys()


def _put(d: dict, path: str, value) -> dict:
    """``d`` with ``value`` at the dot-joined ``path`` (nested dicts made on the way)."""
    *parents, last = path.split(".")
    at = d
    for key in parents:
        at = at.setdefault(key, {})
    at[last] = value
    return d


def _methods(eagle3=None, ngram=None, none=None, offline=None) -> dict:
    """The grid of one group from results.json-style entries (speed-ups computed as the stage does);
    no speculation, where timed, gives one token per forward as the stage records it."""
    entries = {VLLM_EAGLE3: eagle3, VLLM_NGRAM: ngram, VLLM_NONE: none and {"tau": None, "tokens_per_forward": 1.0} | none,
               OFFLINE_EAGLE3: offline}
    return grid({m: e for m, e in entries.items() if e is not None})


def _evaluate(prompts: int, methods: dict | None = None, sets: dict | None = None, **parts) -> dict:
    """A stage 5 stats.json: k=3 at T=0, ``prompts`` pooled with ``methods``, the ``sets`` as given."""
    return {"settings": {"k": 3, "temperature": 0.0, **parts.pop("settings", {})},
            "pooled": {"prompts": prompts, **parts.pop("pooled", {}), "methods": methods or {}},
            "sets": sets or {}, **parts}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_headline_key_is_written_by_its_stage(stage):
    # A stage writes its Stats (field names = stats.json keys); tests/test_pipeline_ci.py checks the
    # same against the stats.json files of a real run.
    cls = stats_classes()[stage]
    assert issubclass(cls, Stats) and dataclasses.is_dataclass(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    missing = [k for k in cls.HEADLINE if k.split(".")[0] not in fields]  # a path starts at a field
    assert HEADLINE[stage] and not missing, f"stage {stage} never writes headline keys {missing}"


def test_index_shows_every_headline_number(tmp_path):
    for s in STAGES:
        stats: dict = {}
        for i, k in enumerate(HEADLINE[s]):
            _put(stats, k, f"v{s}-{i}")
        if s == 4:
            del stats["final_train_loss"]  # a key the stage stopped writing: shown, not skipped
        write_stats(stage_dir(tmp_path, s), {**stats, "not_a_headline": 1})
    nums = key_numbers(tmp_path)
    assert list(nums) == list(STAGES.values())
    for s, name in STAGES.items():
        assert list(nums[name]) == list(HEADLINE[s])
    assert nums[STAGES[4]]["final_train_loss"] == MISSING
    page = index_html(tmp_path, [], {})
    for s in STAGES:
        for i, k in enumerate(HEADLINE[s]):
            assert f"<th>{k}</th>" in page
            if not (s == 4 and k == "final_train_loss"):
                assert f"<td>v{s}-{i}</td>" in page
    assert "not_a_headline" not in page and MISSING in page


def test_a_copied_run_shows_its_own_drafter_not_the_one_of_the_run_it_was_copied_from(tmp_path):
    """A run copied to try other stage-5 settings names its own drafter, not the first run's."""
    write_stats(stage_dir(tmp_path, 4), {"drafter_dir": "/home/me/outputs/first/04_train/drafter", "best_step": 5})
    nums = key_numbers(tmp_path)[STAGES[4]]
    assert nums["drafter_dir"] == "04_train/drafter" and nums["best_step"] == 5
    assert "<td>04_train/drafter</td>" in index_html(tmp_path, [], {}) and "/home/me" not in index_html(tmp_path, [], {})


def test_the_index_says_what_stage_1_left_out(tmp_path):
    """A training file with a malformed line: the report says so, as the terminal does."""
    write_stats(stage_dir(tmp_path, 1), {"samples": 5, "turns": 5, "finish_reasons": {"length": 2},
                                         "prompts": {"records": 7, "kept": 5, "bad_input": {"malformed_json": 1},
                                                     "bad_input_examples": [{"where": "mine.jsonl:4:1",
                                                                             "message": "malformed JSON: x"}]}})
    page = index_html(tmp_path, [], {})
    assert ("<p>Stage 1: 5 samples from 5 prompts selected of 7 records; 1 bad prompt record(s) (malformed_json 1; "
            "first mine.jsonl:4:1 malformed JSON: x); 2 of 5 answer(s) cut at max_new_tokens (finish_reason length).</p>"
            ) in page


def test_a_half_done_stage_says_how_far_it_got(tmp_path):
    from eagle3.stage import Progress

    write_stats(stage_dir(tmp_path, 1), {"samples": 3})
    with pytest.raises(KeyError):
        with Progress(stage_dir(tmp_path, 3), total=18, unit="samples") as prog:
            prog.update(7)
            raise KeyError("killed")
    page = index_html(tmp_path, [], {})
    assert "not finished: failed at 7/18 samples" in page
    assert page.count("not run") == 3  # stages 2, 4 and 5: nothing on disk


def test_the_index_opens_with_the_vllm_comparison(tmp_path):
    stats = _evaluate(21, _methods(eagle3={"tau": 1.696, "tokens_per_forward": 1.696, "tokens_per_s": 45.4},
                                   ngram={"tau": 2.532, "tokens_per_forward": 1.49, "tokens_per_s": 46.2},
                                   none={"tokens_per_s": 37.0}, offline={"tau": 1.7}),
                      parity={"ok": True, "gap": 0.0, "tolerance": 0.15}, diagnosis=["aux ids differ"])
    write_stats(stage_dir(tmp_path, 1), {"samples": 3})
    write_stats(stage_dir(tmp_path, 5), stats)
    page = index_html(tmp_path, [], {"05_evaluate": ["figures/05_evaluate__tau.png"]})
    assert page.index("<h2>Result</h2>") < page.index("<h2>1. synthesize</h2>")
    # a stats.json without per-set numbers: the pooled ones, in one group
    # every column with its own fixed decimals (1.000 beside 1.490, 37.0 beside 46.2)
    assert ("<th>EAGLE-3 drafter</th><td>1.696</td><td>1.696</td><td>45.4</td><td>1.23x</td></tr>"
            "<tr><th>n-gram lookup</th><td>1.490</td><td>2.532</td><td>46.2</td><td>1.25x</td></tr>"
            "<tr><th>no speculation</th><td>1.000</td><td>-</td><td>37.0</td><td>1.00x</td></tr>") in page
    assert ("In vLLM on all prompts n-gram lookup was faster (46.2 vs 45.4 tokens/s); a speed on so few prompts, "
            "one request at a time, is indicative only.") in page
    assert "The drafter's tokens per target forward: 1.14x n-gram's on all prompts." in page  # 1.696 / 1.49
    assert "parity agrees (relative gap 0, tolerance 0.15)" in page and "<li>aux ids differ</li>" in page
    assert "mismatch-warning" not in page and "<p>No mismatch warning.</p>" in page
    assert "Checked and not fired: drafter_below_ngram" in page and "narrow_training_data (one training source" in page
    assert "<a href='figures/05_evaluate__tau.png'><img src='figures/05_evaluate__tau.png'" in page
    assert "<h2>Result</h2>" not in index_html(tmp_path / "empty", [], {})


def test_the_headline_states_every_set_out_of_domain_first_and_the_warnings_on_top(tmp_path):
    def one(tpf, tau, ngram, tps):
        return _methods(eagle3={"tokens_per_forward": tpf, "tau": tau, "tokens_per_s": tps},
                        ngram={"tokens_per_forward": ngram, "tau": 2.5, "tokens_per_s": 20.0}, none={"tokens_per_s": 16.0})

    stats = _evaluate(
        114, parity={"ok": True, "gap": 0.01, "tolerance": 0.15, "prompts": 16}, pooled={"excluded_training": 2},
        settings={"acceptance_rule": "exact match with the target argmax"},
        sets={"heldout": {"domain": "in-distribution", "prompts": 18, "methods": one(1.7, 1.7, 1.49, 24.0)},
              "general-chat": {"domain": "out-of-domain", "prompts": 96, "speed_prompts": 2,
                               "methods": one(1.08, 1.08, 1.19, 15.0)}},
        warnings=[{"rule": "drafter_below_ngram", "message": "on general-chat the drafter gives 1.080",
                   "numbers": {}, "fix": "train on more data"}],
        measured={"vllm_tokens_per_s": "8 of 114 prompts, one request at a time"})
    write_stats(stage_dir(tmp_path, 5), stats | {"vllm_serve_where": "Run it from the run directory (x/)."})
    (stage_dir(tmp_path, 5) / "logs").mkdir()
    (stage_dir(tmp_path, 5) / "logs" / "vllm_eagle3.log").write_text("INFO engine\n")
    page = index_html(tmp_path, [], {})
    # engine logs are linked (relative to report/), never inlined
    assert "Engine logs: <a href='../05_evaluate/logs/vllm_eagle3.log'>vllm_eagle3.log</a>" in page
    assert "INFO engine" not in page and "<p>Run it from the run directory (x/).</p>" in page
    top = page.index("mismatch-warning")
    assert top < page.index("<h2>Result</h2>") < page.index("general-chat<br>") < page.index("heldout<br>")
    assert page.index("<h2>Result</h2>") < page.index("<h2>1. synthesize</h2>")
    assert "1 mismatch warning: this drafter may not help" in page
    assert "tokens/s, 2 prompts)" in page and "0.91x n-gram's on general-chat; 1.14x n-gram's on heldout" in page
    # the speed columns say on how many prompts they rest (a set without the count says nothing)
    assert ("<th rowspan='3'>general-chat<br><small>out-of-domain, 96 prompts; tokens/s on 2 of them</small></th>"
            "<th>EAGLE-3 drafter</th><td>1.080</td><td>1.080</td><td>15.0</td><td>0.94x</td></tr>") in page
    assert "<th rowspan='3'>heldout<br><small>in-distribution, 18 prompts</small></th>" in page
    # why n-gram's τ (2.5 here) can top the drafter's while its tokens per forward are lower, on the page itself
    assert page.index("<h2>Result</h2>") < page.index("can show a higher τ than the drafter") < page.index("<h3 id='warnings'>")
    # stage 5's own table is labelled as pooled, so it is not read as the out-of-domain number
    stage5 = page.index("<h2>5. evaluate</h2>")
    assert stage5 < page.index("Pooled over every evaluation set") < page.index("<table>", stage5)
    assert "<strong>drafter_below_ngram</strong>: on general-chat the drafter gives 1.080.<br><em>Fix:</em> train on" in page
    assert "prompts: heldout 18, general-chat 96 (2 excluded as training prompts, by prompt hash)" in page
    assert "acceptance rule: exact match with the target argmax" in page and "16 prompts)" in page
    assert "vllm_tokens_per_s: 8 of 114 prompts, one request at a time" in page


def test_the_parity_line_shows_the_parity_prompts_vllm_tau_not_the_pooled_one(tmp_path):
    """The parity line must not read "Offline τ 1.596 vs vLLM τ 1.477: parity agrees (relative gap
    0.023)", 1.477 being vLLM over all 129 prompts while the gap is computed on the 16 parity ones."""
    parity = {"ok": True, "gap": 0.0232, "tolerance": 0.15, "prompts": 16, "tau_offline": 1.596, "tau_vllm": 1.559}
    stats = _evaluate(129, _methods(offline={"tau": 1.596}, eagle3={"tau": 1.477}), parity=parity)
    write_stats(stage_dir(tmp_path, 5), stats)
    page = index_html(tmp_path, [], {})
    assert "Offline τ 1.596 vs vLLM τ 1.559 on the same 16 prompts: parity agrees (relative gap 0.023" in page
    assert "vs vLLM τ 1.477" not in page
    # both sides with three decimals (not "Offline τ 1.66 vs vLLM τ 1.742"; the console says 1.660)
    write_stats(stage_dir(tmp_path, 5), stats | {"parity": parity | {"tau_offline": 1.66, "tau_vllm": 1.742}})
    assert "Offline τ 1.660 vs vLLM τ 1.742 on the same 16 prompts" in index_html(tmp_path, [], {})


def test_a_data_size_warning_alone_does_not_say_the_drafter_may_not_help(tmp_path):
    """"this drafter may not help on the traffic you will serve (small_training_data)" must not stand
    above a table where the drafter beat n-gram and no speculation on both sets."""
    sets = {"general-chat": {"domain": "out-of-domain", "prompts": 96, "methods": _methods(
        eagle3={"tokens_per_forward": 1.669}, ngram={"tokens_per_forward": 1.304})}}
    warn = {"rule": "small_training_data", "message": "m", "numbers": {}, "fix": "f"}
    write_stats(stage_dir(tmp_path, 5), _evaluate(96, sets=sets, warnings=[warn]))
    page = index_html(tmp_path, [], {})
    assert "1 mismatch warning: the training data is small or narrow" in page and "may not help" not in page
    # and the rules that did not fire are named (not left to be inferred from the ratios)
    assert ("Checked and not fired: drafter_below_ngram (the drafter's tokens per target forward below n-gram's "
            "on a set); ood_far_below_id (out-of-domain τ far below in-distribution τ); narrow_training_data") in html.unescape(page)


def test_a_disturbed_timing_alone_is_not_called_a_drafter_mismatch(tmp_path):
    """unsteady_speed alone opened the page with "1 mismatch warning: this drafter may not help on the
    traffic you will serve": the machine's load, not the drafter; the banner says so and how to re-measure."""
    sets = {"general-chat": {"domain": "out-of-domain", "prompts": 96, "methods": _methods(
        eagle3={"tokens_per_forward": 1.535}, ngram={"tokens_per_forward": 1.303})}}
    warn = {"rule": "unsteady_speed", "message": "m", "numbers": {}, "fix": "f"}
    write_stats(stage_dir(tmp_path, 5), _evaluate(96, sets=sets, warnings=[warn]))
    page = html.unescape(index_html(tmp_path, [], {}))
    assert ("⚠ 1 speed warning: other load on the machine disturbed the speed timing: re-measure before reading "
            "the tokens/s or speed-ups (<code>eagle3 run PARAMS --stages 5 --remeasure-speed</code>)") in page
    assert "may not help" not in page and "mismatch warning:" not in page
    loss = {"rule": "drafter_below_ngram", "message": "m", "numbers": {}, "fix": "f"}
    write_stats(stage_dir(tmp_path, 5), _evaluate(96, sets=sets, warnings=[loss, warn]))
    assert "2 mismatch warnings: this drafter may not help" in html.unescape(index_html(tmp_path, [], {}))


def test_an_expected_warning_is_a_note_not_an_alarm(tmp_path):
    """The default demonstration's small_training_data (expected: true) opens the page as a note
    without the red box; a real warning beside it is still the red banner."""
    sets = {"general-chat": {"domain": "out-of-domain", "prompts": 96, "methods": _methods(
        eagle3={"tokens_per_forward": 1.535}, ngram={"tokens_per_forward": 1.303})}}
    warn = {"rule": "small_training_data", "expected": True, "numbers": {}, "fix": "train on more: params/smollm2-135m-2x.yaml",
            "message": "expected of the default demonstration, small by design to finish in about 35 minutes on 2 "
                       "CPU cores: the drafter was trained on 958 conversations"}
    write_stats(stage_dir(tmp_path, 5), _evaluate(96, sets=sets, warnings=[warn]))
    page = html.unescape(index_html(tmp_path, [], {}))
    assert ("<div class='note' id='mismatch-warning'>\u24d8 1 expected warning (small_training_data): expected of the "
            "default demonstration, small by design to finish in about 35 minutes on 2 CPU cores.") in page
    assert "class='warn'" not in page and "mismatch warning:" not in page
    assert "<ul class='note'><li><strong>small_training_data</strong>" in page
    loss = {"rule": "drafter_below_ngram", "message": "m", "numbers": {}, "fix": "f"}
    write_stats(stage_dir(tmp_path, 5), _evaluate(96, sets=sets, warnings=[loss, warn]))
    page = html.unescape(index_html(tmp_path, [], {}))
    assert "<div class='warn' id='mismatch-warning'><strong>\u26a0 1 mismatch warning: this drafter may not help" in page
    assert "<ul class='warn'><li><strong>drafter_below_ngram</strong>" in page and "<ul class='note'>" in page


def test_a_set_label_says_why_it_has_fewer_prompts_than_its_source(tmp_path):
    """A 12-prompt file shown as '8 prompts' says why (the cap is evaluate.num_prompts, otherwise in
    results.json only), and that a malformed line of it was skipped."""
    one = {"methods": _methods(eagle3={"tokens_per_forward": 1.1, "tau": 1.1}, ngram={"tokens_per_forward": 1.2, "tau": 2.0})}
    sets = {"selfinstruct-seed": {"domain": "out-of-domain", "prompts": 8, "candidates": 12, "capped": 4,
                                  "excluded_training": 0, "duplicates": 0, "skipped_too_long": 0, "bad_records": 1,
                                  "speed_prompts": 2} | one,
            "heldout": {"domain": "in-distribution", "prompts": 6, "candidates": 9, "excluded_training": 2,
                        "duplicates": 0, "skipped_too_long": 1, "capped": 0, "bad_records": 0} | one,
            "general-chat": {"domain": "out-of-domain", "prompts": 8, "candidates": 8, "bad_records": 0} | one}
    write_stats(stage_dir(tmp_path, 5), _evaluate(22, sets=sets))
    page = index_html(tmp_path, [], {})
    assert ("selfinstruct-seed<br><small>out-of-domain, 8 prompts of 12 (4 over evaluate.num_prompts / "
            "prompts_per_category); 1 bad record skipped; tokens/s on 2 of them</small>") in page
    assert "heldout<br><small>in-distribution, 6 prompts of 9 (2 training prompts, 1 too long)</small>" in page
    assert "general-chat<br><small>out-of-domain, 8 prompts</small>" in page


def test_a_speed_up_above_the_tokens_per_forward_is_flagged_as_a_disturbed_timing(tmp_path):
    """A run beside a CI job: no speculation timed at 1.2 tokens/s, so n-gram shows a 23x speed-up
    with 1.198 tokens per target forward. Above 1.25x the tokens per forward the
    report now marks the cell and says the timing was disturbed."""
    def stats(none_tps: float) -> dict:
        return _evaluate(8, _methods(eagle3={"tokens_per_forward": 1.042, "tokens_per_s": 1.3},
                                     ngram={"tokens_per_forward": 1.198, "tokens_per_s": 27.6},
                                     none={"tokens_per_s": none_tps}))

    write_stats(stage_dir(tmp_path, 5), stats(1.2))
    page = index_html(tmp_path, [], {})
    assert "<th>n-gram lookup</th><td>1.198</td><td>-</td><td>27.6</td><td>23.00x &#9888;</td></tr>" in page
    assert "<th>EAGLE-3 drafter</th><td>1.042</td><td>-</td><td>1.3</td><td>1.08x</td></tr>" in page  # within 1.25x
    assert ("Disturbed speed measurements (n-gram lookup on all prompts: 23.00x with 1.198 tokens per target "
            "forward)") in page
    # the fix is one command, not a file to find and delete
    assert "Measure the speed again on a quiet machine: <code>eagle3 run PARAMS --stages 5 --remeasure-speed</code>" in page
    write_stats(stage_dir(tmp_path, 5), stats(25.0))
    assert "disturbed-speed" not in index_html(tmp_path, [], {})


def test_a_row_whose_timing_rounds_disagree_is_flagged_with_the_speed_ups_on_it(tmp_path):
    """No speculation timed while another job held the machine in one of three rounds: its tokens/s
    cell shows the rounds and a mark, the speed-ups resting on it are marked, and the note names the
    set, the method and the one command that measures again."""
    rounds = {"tokens_per_s": 35.0, "tokens_per_s_rounds": [35.0, 1.2, 34.6], "speed_spread": 0.97,
              "speed_steady": False}
    steady = {"speed_spread": 0.0, "speed_steady": True}
    sets = {"heldout": {"domain": "in-distribution", "prompts": 8, "speed_prompts": 2, "methods": _methods(
        eagle3={"tokens_per_forward": 1.5, "tokens_per_s": 50.0, "tokens_per_s_rounds": [50.0] * 3} | steady,
        ngram={"tokens_per_forward": 1.2, "tokens_per_s": 40.0, "tokens_per_s_rounds": [40.0] * 3} | steady,
        none=rounds)}}
    write_stats(stage_dir(tmp_path, 5), _evaluate(8, sets=sets))
    page = index_html(tmp_path, [], {})
    assert "<td>35.0 &#9888;<br><small>rounds 35.0, 1.2, 34.6</small></td>" in page
    # the speed-up pairs each round with no speculation's same round: the median of 1.43, 41.7 and 1.45
    assert "<th>EAGLE-3 drafter</th><td>1.500</td><td>-</td><td>50.0</td><td>1.45x &#9888;</td></tr>" in page
    assert "Disturbed speed measurements (no speculation on heldout: tokens/s 35.0, rounds 35.0, 1.2, 34.6)" in page
    assert "eagle3 run PARAMS --stages 5 --remeasure-speed" in page


def test_a_speed_up_is_bounded_by_the_timed_answers_own_tokens_per_forward(tmp_path):
    """n-gram's 1.56x over no speculation on a user's set, against the acceptance pass's 1.084 tokens
    per forward, is not a disturbed timing when a quiet re-measurement gives the same: the timed answers
    were other texts (128 tokens where the acceptance pass stopped at 29)."""
    def mine(timed: bool, none_tps: float = 40.5) -> dict:
        speed = lambda tpf: {"speed_tokens_per_forward": tpf} if timed else {}  # noqa: E731
        return {"mine": {"domain": "out-of-domain", "prompts": 16, "speed_prompts": 2, "speed_lengths_differ": int(timed),
                         "methods": _methods(eagle3={"tokens_per_forward": 1.20, "tau": 1.5, "tokens_per_s": 40.0} | speed(1.9),
                                             ngram={"tokens_per_forward": 1.084, "tau": 1.708, "tokens_per_s": 63.2}
                                             | speed(1.72), none={"tokens_per_s": none_tps})}}

    write_stats(stage_dir(tmp_path, 5), _evaluate(16, sets=mine(timed=False)))
    page = index_html(tmp_path, [], {})  # no timed answers' own rate: the acceptance pass's tokens per forward bound it
    assert "<th>n-gram lookup</th><td>1.084</td><td>1.708</td><td>63.2</td><td>1.56x &#9888;</td></tr>" in page
    assert "n-gram lookup on mine: 1.56x with 1.084 tokens per target forward" in page and "speed-lengths-differ" not in page
    write_stats(stage_dir(tmp_path, 5), _evaluate(16, sets=mine(timed=True)))
    page = index_html(tmp_path, [], {})
    # the bound the check used stands in the cell (1.320 beside 2.47x would be unexplained)
    assert ("<th>n-gram lookup</th><td>1.084</td><td>1.708</td><td>63.2</td><td>1.56x<br><small>timed answers: "
            "1.720 tokens per forward</small></td></tr>") in page
    assert "disturbed-speed" not in page
    assert "The methods' answers to some timed prompts have different lengths (1 of 2 on mine)" in page
    # the timed answers' own bound still flags a timing no answer explains
    write_stats(stage_dir(tmp_path, 5), _evaluate(16, sets=mine(timed=True, none_tps=20.0)))
    page = index_html(tmp_path, [], {})
    assert ("<th>EAGLE-3 drafter</th><td>1.200</td><td>1.500</td><td>40.0</td><td>2.00x<br><small>timed answers: "
            "1.900 tokens per forward</small></td></tr>") in page  # < 1.25 x 1.9
    assert ("<td>63.2</td><td>3.16x &#9888;<br><small>timed answers: 1.720 tokens per forward</small></td>") in page
    assert "(n-gram lookup on mine: 3.16x with 1.720 tokens per target forward)" in page


def test_the_speed_line_says_when_no_speculation_beat_the_drafter(tmp_path):
    def stats(none_tps: float) -> dict:
        return _evaluate(4, _methods(eagle3={"tokens_per_forward": 1.55, "tokens_per_s": 30.7},
                                     ngram={"tokens_per_forward": 1.3, "tokens_per_s": 32.5}, none={"tokens_per_s": none_tps}))

    write_stats(stage_dir(tmp_path, 5), stats(33.0))
    page = index_html(tmp_path, [], {})
    assert ("In vLLM on all prompts n-gram lookup was faster (32.5 vs 30.7 tokens/s), and no speculation faster "
            "than the drafter (33.0 tokens/s); a speed on so few prompts") in page
    write_stats(stage_dir(tmp_path, 5), stats(30.0))
    assert "no speculation faster" not in index_html(tmp_path, [], {})


def test_the_banner_names_the_rules_in_the_lists_order_with_their_counts(tmp_path):
    """Not "5 mismatch warnings … (drafter_below_ngram, narrow_training_data, ood_far_below_id,
    small_training_data)", 4 rules sorted above a list of 5 in another order."""
    def warn(rule: str) -> dict:
        return {"rule": rule, "message": f"m {rule}", "numbers": {}, "fix": "f"}

    warnings = [warn("drafter_below_ngram"), warn("drafter_below_ngram"), warn("ood_far_below_id"),
                warn("small_training_data"), warn("narrow_training_data")]
    write_stats(stage_dir(tmp_path, 5), _evaluate(14, warnings=warnings))
    page = index_html(tmp_path, [], {})
    assert ("5 mismatch warnings: this drafter may not help on the traffic you will serve (drafter_below_ngram x2, "
            "ood_far_below_id, small_training_data, narrow_training_data)") in page
    listed = [page.index(f"<strong>{w['rule']}</strong>: m ") for w in warnings[1:]]
    assert listed == sorted(listed)


def test_a_stats_json_of_the_flat_layout_is_named_with_the_command_that_rewrites_it(tmp_path):
    write_stats(stage_dir(tmp_path, 5), {"num_prompts": 4, "k": 3, "temperature": 0.0, "tau_vllm": 1.5})
    page = index_html(tmp_path, [], {})
    assert "stats.json of an earlier layout" in page and "--stages 5 --redo 5" in page
    assert "<th>EAGLE-3 drafter</th>" not in page  # its numbers are not read as the grid's


def test_a_grid_cell_not_measured_is_empty_on_the_index_not_missing(tmp_path):
    """No n-gram run: its headline cells are empty (-); a part of stats.json that is gone is MISSING."""
    write_stats(stage_dir(tmp_path, 5), _evaluate(4, _methods(eagle3={"tau": 1.5}), parity={"ok": True}))
    nums = key_numbers(tmp_path)[STAGES[5]]
    assert nums["pooled.methods.vllm/eagle3.tau"] == 1.5 and nums["parity.ok"] is True
    assert nums["pooled.methods.vllm/ngram.tau"] is None and nums["vllm_serve_command"] == MISSING


def _finished_run(tmp_path) -> Path:
    """A run folder whose stage 5 finished: two sets, the three vLLM methods, parity, the default's
    expected warning and the serve command."""
    sets = {"heldout": {"domain": "in-distribution", "prompts": 44, "methods": _methods(
                eagle3={"tokens_per_forward": 1.787, "tau": 1.95, "tokens_per_s": 48.4, "speed_steady": True},
                ngram={"tokens_per_forward": 1.322, "tau": 2.1, "tokens_per_s": 57.5, "speed_steady": False},
                none={"tokens_per_s": 37.8, "speed_steady": True})},
            "general-chat": {"domain": "out-of-domain", "prompts": 96, "methods": _methods(
                eagle3={"tokens_per_forward": 1.535, "tau": 1.61}, ngram={"tokens_per_forward": 1.303, "tau": 2.2})}}
    warn = {"rule": "small_training_data", "expected": True, "numbers": {}, "fix": "params/smollm2-135m-2x.yaml",
            "message": "expected of the default demonstration"}
    write_stats(stage_dir(tmp_path, 5), _evaluate(140, sets=sets, warnings=[warn], vllm_serve_command="SERVE HERE",
                                                  parity={"ok": True, "gap": 0.02, "tolerance": 0.15, "prompts": 16,
                                                          "tau_offline": 1.596, "tau_vllm": 1.559}))
    return tmp_path


def test_summary_text_is_the_result_table_in_plain_text(tmp_path):
    """The terminal's last lines: per set (out-of-domain first) the drafter, n-gram and no speculation
    with tokens per target forward, τ, tokens/s and speed-up ("—" where not measured, "(unsteady)" where
    the timing rounds disagree), parity and the warnings."""
    from eagle3.report import summary_text

    lines = summary_text(_finished_run(tmp_path)).splitlines()
    assert lines[0] == "Result (vLLM, k = 3 draft tokens, temperature 0):"
    table = [ln.split("  ") for ln in lines[1:8]]
    cells = [[c.strip() for c in row if c.strip()] for row in table]
    assert cells == [
        ["set", "vLLM", "tokens per target forward", "τ", "drafter / n-gram", "tokens/s", "speed-up"],
        ["general-chat (out-of-domain, 96 prompts)", "EAGLE-3 drafter", "1.535", "1.610", "1.18x", "—", "—"],
        ["n-gram lookup", "1.303", "2.200", "—", "—"],
        ["no speculation", "—", "—", "—"],
        ["heldout (in-distribution, 44 prompts)", "EAGLE-3 drafter", "1.787", "1.950", "1.35x", "48.4", "1.28x"],
        ["n-gram lookup", "1.322", "2.100", "57.5 (unsteady)", "1.52x (unsteady)"],
        ["no speculation", "1.000", "—", "37.8"]]
    # the columns line up: every row's τ starts where the header's does
    assert len({ln.index("τ") for ln in lines[1:2]}) == 1 and lines[2].index("1.610") == lines[1].index("τ")
    assert lines[8].startswith("(tokens per target forward compare the methods; τ counts only rounds with drafts")
    assert lines[9] == "Parity: offline τ 1.596 vs vLLM τ 1.559 on the same 16 prompts: agrees."
    assert lines[10] == ("note (expected) small_training_data: expected of the default demonstration. "
                        "Fix: params/smollm2-135m-2x.yaml")
    assert summary_text(tmp_path / "nothing") == ""


def test_the_index_labels_the_serve_command_for_this_machine(tmp_path):
    """The report's stage-5 block: the command that runs here as printed, labelled, then the notes
    (the GPU-machine form among them)."""
    import json

    run = _finished_run(tmp_path)
    st = run / "05_evaluate" / "stats.json"
    d = json.loads(st.read_text())
    d["vllm_serve_where"] = "On a GPU machine with vLLM installed, from the run directory: vllm serve X."
    st.write_text(json.dumps(d))
    page = index_html(run, [], {})
    assert "<p id='serve'>Serve it on this machine, as printed: <code>SERVE HERE</code></p>" in page
    assert page.index("id='serve'") < page.index("On a GPU machine with vLLM installed")


def test_eagle3_run_ends_with_the_result_table(tmp_path, monkeypatch, capsys):
    """`eagle3 run` prints the result table, the warnings and the serve command after the report
    line, on stdout (so a log of the run holds them too); nothing more follows."""
    import eagle3.commands.report as cr
    import eagle3.commands.run as crun
    from eagle3.cli import main

    run = _finished_run(tmp_path)
    monkeypatch.setattr(crun, "run_pipeline", lambda *a, **k: run)
    monkeypatch.setattr(cr, "render_report", lambda rd: Path(rd) / "report" / "index.html")
    assert main(["run", "params/smollm2-135m.yaml"]) == 0
    out = capsys.readouterr().out.splitlines()
    at = out.index("Result (vLLM, k = 3 draft tokens, temperature 0):")
    assert out[at - 2] == f"eagle3: report {run / 'report' / 'index.html'}"
    assert out[at + 1].startswith("set") and "general-chat (out-of-domain, 96 prompts)" in out[at + 2]
    assert out[-2].startswith("note (expected) small_training_data")
    assert out[-1] == "Serve it on this machine (as printed): SERVE HERE"
    # --no-report: the table all the same
    assert main(["run", "params/smollm2-135m.yaml", "--no-report"]) == 0
    out = capsys.readouterr().out
    assert "eagle3: report" not in out and "heldout (in-distribution, 44 prompts)" in out


def test_summary_text_says_when_other_processes_ran_beside_the_speed_pass(tmp_path):
    """A speed pass timed while other processes took CPUs (without competing with the timed engines: not
    unsteady) says so under the table, so the terminal and the log show what the numbers were timed beside."""
    import json

    from eagle3.report import summary_text

    run = _finished_run(tmp_path)
    st = run / "05_evaluate" / "stats.json"
    d = json.loads(st.read_text())
    d["pooled"].setdefault("methods", {}).setdefault("vllm/none", {})["speed_other_cpus"] = 1.02
    st.write_text(json.dumps(d))
    lines = summary_text(run).splitlines()
    assert lines[9] == ("(tokens/s timed while other processes took up to 1.0 CPUs; the timed engines leave the CPUs "
                        "taken at their start to them, and a load that competed with them marks the numbers unsteady)")
    assert lines[10].startswith("Parity: ")
    d["pooled"]["methods"]["vllm/none"]["speed_other_cpus"] = 0.2  # the machine's own background: no line
    st.write_text(json.dumps(d))
    assert summary_text(run).splitlines()[9].startswith("Parity: ")
