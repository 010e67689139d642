"""The commands (run, status, report) and the CLI on small notebooks made by the test."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from eagle3.cli import main
from eagle3.commands.run import parse_stages, run_pipeline
from eagle3.errors import ParamsError, StageFailed
from eagle3.io import read_json
from eagle3.params_file import load_params
from eagle3.rundir import NOTEBOOKS

ROOT = Path(__file__).resolve().parent.parent

PARAMS_CELL = 'params_file = None\nrun_dir = None\noverrides = []'


def _nb(path: Path, body: str) -> None:
    p = new_code_cell(PARAMS_CELL)
    p.metadata["tags"] = ["parameters"]
    setup = new_code_cell("from eagle3.notebook import setup\nparams, run_dir = setup(params_file, run_dir, overrides)")
    kernel = {"name": "eagle3", "display_name": "eagle3", "language": "python"}
    nb = new_notebook(cells=[p, setup, new_code_cell(body)], metadata={"kernelspec": kernel})
    nbformat.write(nb, path)


WRITE_STAGE = """
from eagle3.rundir import stage_dir
from eagle3.stage import Progress, write_stats
d = stage_dir(run_dir, {s})
with Progress(d, total=3, unit="items") as p:
    p.update(3, tokens=30)
write_stats(d, {{"items": 3, "lr": params.train.lr, "samples": 3, "target_vocab_size": 49152}})
(d / "runs.txt").open("a").write("x")
"""


@pytest.fixture
def nbdir(tmp_path):
    d = tmp_path / "nbs"
    d.mkdir()
    for s in (1, 2):
        _nb(d / NOTEBOOKS[s], WRITE_STAGE.format(s=s))
    return d


def test_run_resume_and_status(tmp_params, nbdir, capsys):
    pf = tmp_params("train:\n  lr: 0.003\n")
    rd = run_pipeline(pf, [1, 2], notebooks=nbdir)
    assert read_json(rd / "01_synthesize" / "stats.json")["lr"] == 0.003
    assert (rd / "notebooks" / "01_synthesize.ipynb").exists()
    assert read_json(rd / "02_vocab" / "progress.json")["done"] == 3
    # a re-run skips complete stages
    run_pipeline(pf, [1, 2], notebooks=nbdir)
    assert (rd / "01_synthesize" / "runs.txt").read_text() == "x"
    assert main(["status", str(rd)]) == 0
    out = capsys.readouterr().out
    assert "complete" in out and "3/3 items" in out


def test_later_stages_on_a_new_run_name_stop_before_the_folder_exists(tmp_params, nbdir, capsys):
    """`eagle3 run P --stages 5 --run-name <typo>` must not create the run folder and then fail inside
    notebook 05 on the missing samples: it stops first, names the command that runs the earlier stages
    too, and writes nothing; the same call on the real run goes on."""
    pf = tmp_params()
    new = Path(load_params(pf).run.output_dir) / "typo"
    with pytest.raises(ParamsError) as e:
        run_pipeline(pf, [5], run_name="typo", notebooks=nbdir)
    assert f"{new} is not a run yet (no params.yaml): stage 5 reads what stages 1-4 write there" in str(e.value)
    assert f"`eagle3 run {pf} --run-name typo --stages 1-5`" in str(e.value)
    assert not new.exists()
    assert main(["run", str(pf), "--run-name", "typo", "--stages", "3-4"]) == 2  # the CLI: a clean line, exit 2
    assert "stage 3 reads what stages 1-2 write there" in capsys.readouterr().err and not new.exists()
    rd = run_pipeline(pf, [1], run_name="typo", notebooks=nbdir)  # the run exists now: stage 2 alone goes on
    assert run_pipeline(pf, [2], run_name="typo", notebooks=nbdir) == rd == new
    assert read_json(rd / "02_vocab" / "progress.json")["done"] == 3


# stage 5 measures a drafter made elsewhere: it reads stages 1-2 only (eagle3.commands.run.stages_read)
EXTERNAL_DRAFTER = "evaluate:\n  drafter_dir: elsewhere/drafter\n"


def test_evaluate_only_params_on_an_existing_run_redo_stage_5_only(tmp_params, nbdir, capsys):
    """Own prompts on a finished run: `--set evaluate.*` is refused with the --redo 5 command, then
    accepted with it; stages 1-2 are neither rerun nor changed, stage 5 runs on the new params."""
    _nb(nbdir / NOTEBOOKS[5], WRITE_STAGE.replace('"lr": params.train.lr', '"num_prompts": params.evaluate.num_prompts')
        .format(s=5))
    pf = tmp_params(EXTERNAL_DRAFTER)  # stage 5 without stages 3-4
    rd = run_pipeline(pf, [1, 2, 5], notebooks=nbdir)
    assert read_json(rd / "05_evaluate" / "stats.json")["num_prompts"] is None
    s1 = (rd / "01_synthesize" / "stats.json").read_bytes()
    with pytest.raises(ParamsError, match=r"evaluate\.num_prompts: None -> 5\n.*--stages 5 --redo 5") as refused:
        run_pipeline(pf, [5], overrides=["evaluate.num_prompts=5"], notebooks=nbdir)
    # the command it names keeps the override (without it, a copy-paste would redo stage 5 on the file's params)
    assert f"`eagle3 run {pf} --set evaluate.num_prompts=5 --stages 5 --redo 5`" in str(refused.value)
    # and the way that keeps the run's other evaluate.* settings (a user's own evaluation sets)
    assert (f"keep the run's other evaluate.* settings, start from its own params: `eagle3 run {rd / 'params.yaml'} "
            f"--set evaluate.num_prompts=5 --stages 5 --redo 5`") in str(refused.value)
    run_pipeline(pf, [1, 2, 5], overrides=["evaluate.num_prompts=5"], notebooks=nbdir, redo=[5])
    out = capsys.readouterr().out
    assert "params changed since this run was made (the stage that reads them is redone): evaluate.num_prompts: None -> 5" in out
    assert "stage 1 (01_synthesize) already complete, skipped" in out and "stage 5 (05_evaluate) re-opened" in out
    assert read_json(rd / "05_evaluate" / "stats.json")["num_prompts"] == 5
    assert (rd / "05_evaluate" / "runs.txt").read_text() == "xx"
    assert (rd / "01_synthesize" / "runs.txt").read_text() == "x" and (rd / "01_synthesize" / "stats.json").read_bytes() == s1
    assert "num_prompts: 5" in (rd / "params.yaml").read_text()


def test_a_run_with_its_own_evaluate_params_opens_for_stages_1_4_and_by_its_own_params_yaml(tmp_params, nbdir, capsys,
                                                                                            tmp_path):
    """After `--stages 5 --redo 5` with the user's own evaluation params, `make run` and every notebook
    open the run with the default params: stages 1-4 open it (they do not read evaluate.*) and keep
    its params.yaml; all five are refused with the way back, the run's own
    params.yaml, which opens that run, also when the folder was copied (its params name the old one)."""
    import shutil

    _nb(nbdir / NOTEBOOKS[5], WRITE_STAGE.replace('"lr": params.train.lr', '"num_prompts": params.evaluate.num_prompts')
        .format(s=5))
    pf = tmp_params(EXTERNAL_DRAFTER)  # stage 5 without stages 3-4
    rd = run_pipeline(pf, [1, 2, 5], overrides=["evaluate.num_prompts=5"], notebooks=nbdir)
    record = (rd / "params.yaml").read_text()
    assert "num_prompts: 5" in record
    assert run_pipeline(pf, [1, 2], notebooks=nbdir) == rd  # the default params: evaluate.num_prompts None
    out = capsys.readouterr().out
    assert "differ from the run's only in evaluate.* (read by stage 5 alone, which this call does not run)" in out
    assert "stage 1 (01_synthesize) already complete, skipped" in out
    assert (rd / "params.yaml").read_text() == record and (rd / "01_synthesize" / "runs.txt").read_text() == "x"
    with pytest.raises(ParamsError) as e:
        run_pipeline(pf, [1, 2, 5], notebooks=nbdir)
    assert f"use its own params: `eagle3 run {rd / 'params.yaml'}`" in str(e.value)
    assert run_pipeline(rd / "params.yaml", [1, 2, 5], notebooks=nbdir) == rd
    copy = tmp_path / "elsewhere" / "copied"
    shutil.copytree(rd, copy)
    capsys.readouterr()
    assert run_pipeline(copy / "params.yaml", [1, 2, 5], notebooks=nbdir) == copy
    out = capsys.readouterr().out
    assert f"is the params.yaml of the run directory {copy}: opening that run" in out
    assert out.count("already complete, skipped") == 3 and not (rd.parent / "copied").exists()
    # a run.* override names another run: the params file's own folder is not taken
    other = run_pipeline(copy / "params.yaml", [1], run_name="fresh", notebooks=nbdir)
    assert other.name == "fresh" and other != copy


SLOW_STAGE = """
import time
from pathlib import Path
from eagle3.stage import StageRun
with StageRun(params, run_dir, {s}, total=3, unit="items") as st:
    st.progress.update(1, tokens=10)
    if not Path(run_dir, "started").exists():  # the first execution waits for its Ctrl-C
        Path(run_dir, "started").write_text("x")
        time.sleep(120)
    st.progress.update(2, tokens=20)
    st.finish({{"items": 3}})
"""

DRIVE = """
import sys
from pathlib import Path
import eagle3.commands.run
eagle3.commands.run.notebooks_dir = lambda: Path(sys.argv[1])  # the test's notebooks instead of notebooks/
from eagle3.cli import main
from eagle3.params_file import load_params
sys.exit(main(sys.argv[2:]))
"""


def test_a_stage_s_stderr_line_reaches_the_terminal_once(tmp_params, tmp_path):
    """A stage's stderr line (vLLM's import-time warning "Triton is installed, but doesn't include CPU
    backend") shows once in `eagle3 run`'s terminal: with log_output papermill writes the notebook's
    stderr to our stream and also logs it as a warning, which Python's last-resort handler prints.
    A real `eagle3 run` process (in-process, pytest's own log capture would hide the second copy)."""
    d = tmp_path / "nbs"
    d.mkdir()
    _nb(d / NOTEBOOKS[1], "import sys\nprint('probe-stderr-line', file=sys.stderr)\nprint('probe-stdout-line')\n"
        + WRITE_STAGE.format(s=1))
    r = subprocess.run([sys.executable, "-c", DRIVE, str(d), "run", str(tmp_params()), "--stages", "1", "--no-report"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("probe-stderr-line") == 1, r.stderr
    assert r.stdout.count("probe-stdout-line") == 1 and "probe-stdout-line" not in r.stderr, (r.stdout, r.stderr)


def test_ctrl_c_in_eagle3_run_says_how_to_resume_and_exits_130(tmp_params, nbdir, tmp_path):
    """A terminal's Ctrl-C (SIGINT to the process group) while stage 1 runs: a few lines, no
    traceback, the stage marked interrupted by its own code, the kernel gone, exit 130, and the
    printed command resumes the run."""
    import shlex
    import signal
    import time

    _nb(nbdir / NOTEBOOKS[1], SLOW_STAGE.format(s=1))
    pf = tmp_params()
    rd = Path(pf).parent / "outputs" / "t"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", DRIVE, str(nbdir), "run", str(pf), "--stages", "1-2", "--redo", "1",
                             "--set", "train.lr=0.004", "--no-report"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for _ in range(240):
        if (rd / "started").exists() or proc.poll() is not None:
            break
        time.sleep(0.25)
    assert (rd / "started").exists()
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "ZMQError" not in out and len(out.splitlines()) <= 12, out
    assert "without encryption" not in out  # the kernel is reached over Unix sockets, not TCP
    assert "eagle3: stage 1 (01_synthesize) was interrupted (Ctrl-C). What was written is kept" in out
    cmd = out.split("eagle3: resume with: ")[1].strip()
    assert cmd == f"eagle3 run {shlex.quote(str(pf))} --stages 1-2 --redo 1 --set train.lr=0.004 --no-report"
    prog = read_json(rd / "01_synthesize" / "progress.json")
    assert prog["status"] == "interrupted" and prog["done"] == 1 and "KeyboardInterrupt" in prog["extra"]["error"]
    time.sleep(1.0)
    with pytest.raises(ProcessLookupError):  # the kernel that ran the stage is not left behind
        os.kill(prog["pid"], 0)
    # the printed command resumes: stage 1 ends, stage 2 runs
    args = shlex.split(cmd)[1:]
    assert main_with_notebooks(args, nbdir) == 0
    assert read_json(rd / "01_synthesize" / "stats.json")["complete"] and read_json(rd / "02_vocab" / "stats.json")["lr"] == 0.004


def main_with_notebooks(args: list[str], nbdir: Path) -> int:
    import eagle3.commands.run

    old = eagle3.commands.run.notebooks_dir
    eagle3.commands.run.notebooks_dir = lambda: nbdir
    try:
        return main(args)
    finally:
        eagle3.commands.run.notebooks_dir = old


def test_ctrl_c_ends_status_watch_quietly(tmp_path, monkeypatch, capsys):
    import eagle3.cli

    (tmp_path / "run").mkdir()
    calls = []

    def sleep(s):
        calls.append(s)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(eagle3.cli.time, "sleep", sleep)
    assert main(["status", str(tmp_path / "run"), "--watch", "5"]) == 0
    cap = capsys.readouterr()
    assert calls == [5.0, 5.0] and cap.out.count("1 synthesize") == 2 and cap.err == ""


def test_resume_stages_after_an_interrupt():
    from eagle3.commands.run import format_stages, resume_stages

    assert format_stages([1, 2, 3, 5]) == "1-3,5" and format_stages([4]) == "4" and format_stages([2, 4, 5]) == "2,4-5"
    assert resume_stages(3, [1, 2, 3, 4, 5], None) == ([3, 4, 5], [])
    assert resume_stages(3, [1, 2, 3, 4, 5], [1]) == ([3, 4, 5], [3])  # stale 4-5 still re-opened after 3
    assert resume_stages(3, [1, 2, 3, 4, 5], [4]) == ([3, 4, 5], [4])
    assert resume_stages(5, [2, 5], [2, 5]) == ([5], [5])


def test_failing_stage_shows_cell_error(tmp_params, nbdir):
    _nb(nbdir / NOTEBOOKS[2], "raise ValueError('planted failure in stage 2')")
    _nb(nbdir / NOTEBOOKS[3], WRITE_STAGE.format(s=3))
    pf = tmp_params()
    with pytest.raises(StageFailed) as e:
        run_pipeline(pf, [1, 2, 3], notebooks=nbdir)
    msg = str(e.value)
    # named as the executed notebook labels the failing cell (papermill injects a parameters cell)
    executed = nbformat.read(Path(pf).parent / "outputs" / "t" / "notebooks" / NOTEBOOKS[2], as_version=4)
    failed = [c for c in executed.cells if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    assert len(failed) == 1 and failed[0].execution_count == 4
    assert ("Stage 2 (02_vocab) failed at In [4] of 02_vocab_coverage.ipynb (raise ValueError('planted failure "
            "in stage 2')): ValueError: planted failure in stage 2") in msg
    # stage 1 finished and stays finished; stage 3 never ran
    assert read_json(Path(pf).parent / "outputs" / "t" / "01_synthesize" / "stats.json")["complete"]
    assert not (Path(pf).parent / "outputs" / "t" / "03_extract").exists()


def test_cli_errors_are_one_paragraph(tmp_path, capsys):
    assert main(["run", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert "Params file not found" in err and "Traceback" not in err
    assert main(["status", str(tmp_path / "nope")]) == 2


def test_python_dash_m_and_console_script(tmp_path):
    out = subprocess.run([sys.executable, "-m", "eagle3", "params", str(ROOT / "params" / "ci.yaml"), "--set", "train.lr=0.5"],
                         capture_output=True, text=True, check=True).stdout
    assert "lr: 0.5" in out
    exe = Path(sys.executable).parent / "eagle3"
    assert exe.exists()
    r = subprocess.run([str(exe), "params", str(tmp_path / "x.yaml")], capture_output=True, text=True)
    assert r.returncode == 2 and "Params file not found" in r.stderr


def test_report_renders_index(tmp_params, nbdir):
    from eagle3.commands.report import render_report

    rd = run_pipeline(tmp_params(), [1, 2], notebooks=nbdir)
    index = render_report(rd)
    html = index.read_text()
    assert "01_synthesize.html" in html and "<th>samples</th><td>3</td>" in html
    assert "<th>target_vocab_size</th><td>49152</td>" in html and "<th>items</th>" not in html
    assert (index.parent / "02_vocab_coverage.html").exists()
    assert "<title>Stage 2: vocab (t)</title>" in (index.parent / "02_vocab_coverage.html").read_text()


def test_cli_without_command_prints_help(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "usage: eagle3" in out and "status" in out and "params" in out


def test_cli_help_explains_set_and_run_dir(capsys):
    for argv in (["params", "-h"], ["status", "-h"]):
        with pytest.raises(SystemExit):
            main(argv)
    out = capsys.readouterr().out
    assert "override one params key" in out and "<run.output_dir>/<run.name>" in out


@pytest.mark.parametrize("spec, msg", [
    ("3-1", "the range '3-1' is empty"),
    ("x", "'x' is not a stage number"),
    ("2,", "'' is not a stage number"),
    ("0-2", "stage 0 does not exist"),
    ("-", "'-' is not a stage number"),
    ("1-2-3", "'1-2-3' is not a stage number"),
])
def test_bad_stage_selection_is_a_clear_error(spec, msg, capsys):
    from eagle3.errors import ParamsError

    with pytest.raises(ParamsError, match=msg):
        parse_stages(spec)
    assert main(["run", str(ROOT / "params" / "ci.yaml"), "--stages", spec]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_cli_eagle3_errors_are_clean_and_bugs_keep_their_traceback(monkeypatch, capsys):
    import eagle3.commands.report
    from eagle3.errors import TrainError

    def planted(*a, **k):
        raise TrainError("02_vocab/mapping.json missing: run stage 2")

    monkeypatch.setattr(eagle3.commands.report, "render_report", planted)
    assert main(["report", "somewhere"]) == 2
    assert capsys.readouterr().err == "eagle3: 02_vocab/mapping.json missing: run stage 2\n"

    def bug(*a, **k):
        raise KeyError("a real bug")

    monkeypatch.setattr(eagle3.commands.report, "render_report", bug)
    with pytest.raises(KeyError, match="a real bug"):
        main(["report", "somewhere"])


def test_a_report_that_cannot_be_rendered_after_finished_stages_is_a_warning(monkeypatch, tmp_path, capsys):
    """Four finished stages, then nbconvert without its 'lab' template: one line with the reason and the
    command that renders the report again; the stages' results stand, so the run exits 0."""
    import eagle3.commands.report
    import eagle3.commands.run

    monkeypatch.setattr(eagle3.commands.run, "run_pipeline", lambda *a, **k: tmp_path / "run")

    def no_lab(run_dir):
        raise ValueError("No template sub-directory with name 'lab' found in the following paths:\n\t/x/share")

    monkeypatch.setattr(eagle3.commands.report, "render_report", no_lab)
    assert main(["run", "p.yaml", "--stages", "1-4"]) == 0
    out, err = capsys.readouterr()
    assert err == (f"eagle3: warning: the report could not be rendered (ValueError: No template sub-directory with "
                   f"name 'lab' found in the following paths:); the stages' results stand in {tmp_path / 'run'}; "
                   f"render it again with `eagle3 report {tmp_path / 'run'}`\n")
    assert "Traceback" not in out + err
    # rendered: the index is printed, as before
    monkeypatch.setattr(eagle3.commands.report, "render_report", lambda d: Path(d) / "report" / "index.html")
    assert main(["run", "p.yaml"]) == 0
    assert capsys.readouterr().out == f"eagle3: report {tmp_path / 'run' / 'report' / 'index.html'}\n"
    # `eagle3 report` alone keeps the full error (test_cli_eagle3_errors_are_clean_and_bugs_keep_their_traceback)


def test_status_into_a_closed_pipe_is_quiet(tmp_path):
    rd = tmp_path / "run"
    (rd / "01_synthesize").mkdir(parents=True)
    code = ("import sys, eagle3.commands.status as r\n"
            "r.format_status = lambda d: 'line\\n' * 200000\n"
            "from eagle3.cli import main\n"
            f"sys.exit(main(['status', {str(rd)!r}]))\n")
    r = subprocess.run(f"{sys.executable} -c \"$CODE\" | head -1", shell=True, capture_output=True, text=True,
                       env={**os.environ, "CODE": code})
    assert r.stdout == "line\n"
    assert "BrokenPipeError" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_report_of_a_run_without_notebooks_is_a_clean_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no executed notebooks" in err and "Traceback" not in err


def test_a_read_only_run_directory_is_a_clean_error(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    try:
        assert main(["run", str(ROOT / "params" / "ci.yaml"), "--set", f"run.output_dir={out}"]) == 2
    finally:
        out.chmod(0o700)
    err = capsys.readouterr().err
    assert "Permission denied" in err and "run.output_dir" in err and "Traceback" not in err


def test_a_full_disk_is_a_clean_error(monkeypatch, capsys):
    import errno

    import eagle3.commands.report

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/run/params.yaml")

    monkeypatch.setattr(eagle3.commands.report, "render_report", full)
    assert main(["report", "x"]) == 2
    assert capsys.readouterr().err == ("eagle3: No space left on device: /data/run/params.yaml (the disk is full: "
                                       "free space or set run.output_dir to a larger disk)\n")


def test_a_full_disk_while_a_stage_runs_names_the_notebook_being_written(tmp_params, nbdir, monkeypatch, capsys):
    """The stage's kernel died on a full disk, then papermill's save of the executed notebook failed
    with an ENOSPC that names no file: the one line names the notebook, never 'device:  (the disk'."""
    import errno

    import papermill

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(papermill, "execute_notebook", full)
    pf = tmp_params()
    assert main_with_notebooks(["run", str(pf), "--stages", "1", "--no-report"], nbdir) == 2
    err = capsys.readouterr().err
    rd = load_params(pf).run
    out_nb = Path(rd.output_dir) / rd.name / "notebooks" / NOTEBOOKS[1]
    assert err.endswith(f"eagle3: No space left on device: {out_nb} (the disk is full: free space or set "
                        f"run.output_dir to a larger disk)\n"), err
    assert "device:  (" not in err and "Traceback" not in err


def test_the_resume_hint_names_the_command_as_it_was_started(monkeypatch, tmp_path):
    """After `make run`, which starts `.venv/bin/python -m eagle3` (the venv's bin need not be on PATH),
    `eagle3 run ...` would not run: the hint repeats how eagle3 was started."""
    import eagle3.cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    monkeypatch.setattr(sys, "argv", [str(ROOT / "eagle3" / "__main__.py"), "run", "p.yaml"])
    assert eagle3.cli.invocation() == [".venv/bin/python", "-m", "eagle3"]
    monkeypatch.setattr(sys, "argv", [".venv/bin/eagle3", "run", "p.yaml"])
    assert eagle3.cli.invocation() == [".venv/bin/eagle3"]
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/eagle3", "run", "p.yaml"])
    assert eagle3.cli.invocation() == ["/usr/local/bin/eagle3"]
    monkeypatch.setattr(sys, "executable", "/opt/py/bin/python")  # outside the current directory: kept absolute
    monkeypatch.setattr(sys, "argv", [str(ROOT / "eagle3" / "__main__.py"), "run", "p.yaml"])
    assert eagle3.cli.invocation() == ["/opt/py/bin/python", "-m", "eagle3"]
    args = eagle3.cli._build_parser().parse_args(["run", "p.yaml", "--stages", "2-5"])
    exc = eagle3.errors.RunInterrupted("stage 3 (03_extract) was interrupted (Ctrl-C)", stage=3, run_dir=tmp_path / "r")
    msg = eagle3.cli._interrupted_message(args, exc)
    assert msg.endswith("eagle3: resume with: /opt/py/bin/python -m eagle3 run p.yaml --stages 3-5")
    assert f"(`/opt/py/bin/python -m eagle3 status {tmp_path / 'r'}` shows it)" in msg


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_terminal_shows_a_running_stage_s_progress(tmp_path):
    """`eagle3 run` echoes the running stage's progress.json (not only a start and an end line per
    stage): a line per interval in a log, a tqdm bar on a terminal; a file left by an
    earlier execution is not shown; a new unit (the stage's next phase) starts a new bar."""
    import time

    from eagle3.commands.status import ProgressEcho
    from eagle3.stage import Progress

    sd = tmp_path / "03_extract"
    old = Progress(sd, total=9, unit="samples")
    old.update(4, tokens=400)
    old.close("interrupted")  # an earlier execution's file
    log = io.StringIO()
    with ProgressEcho(sd / "progress.json", "stage 3 (extract)", file=log, interval_s=0.02, log_every_s=0.0) as echo:
        time.sleep(0.1)
        assert log.getvalue() == ""  # the old file is not this execution's
        prog = Progress(sd, total=20, unit="samples", interval_s=0.0)
        prog.update(5, tokens=1000)
        deadline = time.time() + 5
        while "5/20 samples" not in log.getvalue() and time.time() < deadline:
            time.sleep(0.02)
        prog.update(15, tokens=3000)
        prog.close("done")
        echo.poll()
    lines = log.getvalue().splitlines()
    five = [x for x in lines if x.startswith("eagle3: stage 3 (extract): 5/20 samples, ")]
    assert five and "tokens/s" in five[0] and "ETA" in five[0]  # running: the stage's own rate and ETA
    assert all(x.startswith("eagle3: stage 3 (extract): ") and "/9 " not in x for x in lines)
    assert lines[-1].startswith("eagle3: stage 3 (extract): 20/20 samples, ") and "ETA" not in lines[-1]
    assert len(lines) == len(set(lines))  # a line only when something changed
    clock = time.strftime("%H:%M:%S", time.gmtime(read_json(sd / "progress.json")["updated"]))
    assert lines[-1].endswith(f" ({clock} UTC)")  # the file's time: a log's ETAs can be checked afterwards
    assert all(re.search(r" \(\d\d:\d\d:\d\d UTC\)$", x) for x in lines)

    tty = _Tty()
    assert not ProgressEcho(sd / "progress.json", "x", file=tty).tty  # a "terminal" that reports no width
    echo = ProgressEcho(sd / "progress.json", "stage 3 (extract)", file=tty, tty=True)
    echo.t0 = 0.0  # show the file as it is
    echo.poll()
    assert "stage 3 (extract): 100%|" in tty.getvalue() and "| 20/20 samples, " in tty.getvalue()
    Progress(sd, total=None, unit="answers", interval_s=0.0).update(7, tokens=70)
    echo.poll()
    echo._bar.close()
    assert echo._key == ("answers", None) and "stage 3 (extract): 7 answers, " in tty.getvalue()


def test_a_log_shows_each_phase_s_end_and_start_at_once(tmp_path):
    """At one line a minute a log must not go from "673/960 self prompts" straight to answering, or
    from "0/20 offline prompts" to the vLLM phase: each phase's end is shown, then the next one's start."""
    from eagle3.commands.status import ProgressEcho
    from eagle3.stage import Progress

    sd = tmp_path / "05_evaluate"
    log = io.StringIO()
    echo = ProgressEcho(sd / "progress.json", "stage 5 (evaluate)", file=log, log_every_s=3600.0, tty=False)
    echo.t0 = 0.0
    prog = Progress(sd, total=20, unit="offline prompts", interval_s=0.0)
    prog.update(3, tokens=30)
    echo.poll()  # the first line is due at once
    for _ in range(17):
        prog.update(1, tokens=10)
        echo.poll()  # not due for an hour: nothing written
    Progress(sd, total=3, unit="vLLM measurements", interval_s=0.0).update(0)
    echo.poll()
    lines = [x.split(", ")[0] for x in log.getvalue().splitlines()]
    assert lines == ["eagle3: stage 5 (evaluate): 3/20 offline prompts", "eagle3: stage 5 (evaluate): 20/20 offline prompts",
                     "eagle3: stage 5 (evaluate): 0/3 vLLM measurements"]


def test_the_kernel_is_not_sent_sigint_when_papermill_shuts_it_down(monkeypatch):
    """jupyter_client's shutdown_kernel interrupts the kernel before asking it to shut down; after a
    stage that finished normally ipykernel then prints 'ERROR | KeyboardInterrupt caught in kernel'.
    `eagle3 run`'s kernel manager skips that SIGINT; other interrupts pass."""
    import asyncio

    from jupyter_client.manager import AsyncKernelManager

    from eagle3.commands.run import InterruptForwarder

    calls = []

    async def interrupt(self):
        calls.append(self.shutting_down)

    monkeypatch.setattr(AsyncKernelManager, "_async_interrupt_kernel", interrupt)
    with InterruptForwarder() as fwd:  # its exit removes the kernel's socket folder
        km = fwd.manager_class()()
        km.shutting_down = True
        asyncio.run(km._async_interrupt_kernel())
        assert calls == []
        km.shutting_down = False
        asyncio.run(km._async_interrupt_kernel())
        assert calls == [False]
    assert not fwd.socket_dir.exists()


HOLD = """
import sys, time
from eagle3.stage import RunLock
RunLock(sys.argv[1], "eagle3 run params/other.yaml --stages 3").acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holder(run_dir: Path) -> subprocess.Popen:
    """Another process that holds ``run_dir``'s writer lock (as a second `eagle3 run` would)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout.readline().strip() == "held"
    return proc


def _snapshot(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_second_writer_of_a_run_folder_is_refused_naming_the_holder(tmp_params, nbdir, capsys):
    """Two writers on one run folder destroy each other's files: while another process holds the run's
    lock, `eagle3 run` and a stage notebook's setup are refused at once (exit 2, the holder's pid, host,
    command and start named), nothing in the folder changes; status, verify and report neither take it
    nor wait."""
    import socket

    from eagle3.errors import RunLocked
    from eagle3.notebook import setup

    pf = tmp_params()
    rd = run_pipeline(pf, [1], notebooks=nbdir)
    (rd / "01_synthesize" / "stats.json").unlink()  # stage 1 unfinished: its notebook would write
    before = _snapshot(rd)
    proc = _holder(rd)
    try:
        capsys.readouterr()
        assert main_with_notebooks(["run", str(pf), "--stages", "1", "--no-report"], nbdir) == 2
        err = capsys.readouterr().err
        assert f"{rd} is being written by pid {proc.pid} on {socket.gethostname()} " in err
        assert "(`eagle3 run params/other.yaml --stages 3`, since 20" in err and f"kill {proc.pid}" in err
        assert len(err.strip().splitlines()) == 1
        with pytest.raises(RunLocked, match=f"pid {proc.pid}"):
            setup(str(pf), str(rd), stage=1)
        assert main(["status", str(rd)]) == 0
        assert main(["verify", str(rd)]) in (0, 1)
        main(["report", str(rd)])
        lock_record = (rd / "run.lock").read_bytes()
        after = _snapshot(rd)
        after.pop("run.lock"), before.pop("run.lock")
        assert [k for k in after if not k.startswith("report/")] == list(before) and all(after[k] == v for k, v in before.items())
        assert str(proc.pid).encode() in lock_record
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_writer_s_lock_is_taken_over_and_the_stage_notebook_runs_under_its_parent_s(tmp_params, nbdir, capsys):
    """The kernel frees a killed writer's lock: the next `eagle3 run` takes the run over with one line
    naming the gone writer. The stage notebook it executes (a child kernel) is not refused by its
    parent's lock: it finds the lock held by its parent, with the token it inherited. Released at the end."""
    from eagle3.stage import LOCK_ENV

    _nb(nbdir / NOTEBOOKS[1], "import json, os\nrec = json.loads((run_dir / 'run.lock').read_text())\n"
        "assert rec['pid'] == os.getppid() and rec['token'] == os.environ['EAGLE3_RUN_LOCK'], rec\n"
        + WRITE_STAGE.format(s=1))
    pf = tmp_params()
    rd = Path(load_params(pf).run.output_dir) / "t"
    proc = _holder(rd)
    proc.kill()
    proc.wait()
    capsys.readouterr()
    assert run_pipeline(pf, [1, 2], notebooks=nbdir) == rd
    out = capsys.readouterr().out
    assert f"named pid {proc.pid} on " in out and "which is gone: taking the run over" in out
    assert read_json(rd / "01_synthesize" / "stats.json")["complete"] and read_json(rd / "02_vocab" / "stats.json")["complete"]
    assert (rd / "run.lock").read_text() == "" and LOCK_ENV not in os.environ


def test_a_stage_on_an_unfinished_earlier_stage_is_refused_with_the_command_that_finishes_it(tmp_params, nbdir,
                                                                                              capsys):
    """`--stages 2` after stage 1 stopped part-way ran stage 2 on the 7 samples there and ended complete:
    refused (exit 2) before anything is written, naming the unfinished stage, its progress and the
    command; a stage of the same call that ends incomplete stops the next one too."""
    from eagle3.commands.run import stages_read
    from eagle3.errors import RunnerError

    pf = tmp_params()
    rd = run_pipeline(pf, [1], notebooks=nbdir)
    s1 = rd / "01_synthesize"
    (s1 / "stats.json").unlink()
    (s1 / "progress.json").write_text('{"status": "interrupted", "done": 7, "total": 20, "unit": "samples"}')
    before = _snapshot(rd)
    capsys.readouterr()
    assert main_with_notebooks(["run", str(pf), "--stages", "2", "--set", "train.lr=0.003", "--no-report"], nbdir) == 2
    err = capsys.readouterr().err
    assert ("stage 2 (02_vocab) reads the outputs of stage 1, which is not complete: stage 1 (01_synthesize) "
            f"interrupted at 7/20 samples. Finish it first: `eagle3 run {pf} --set train.lr=0.003 --stages 1-2`.") in err
    assert _snapshot(rd) == before and not (rd / "02_vocab").exists()
    # stage 1 of the same call ends incomplete (stats.json complete: false): stage 2 is not run on it
    _nb(nbdir / NOTEBOOKS[1], WRITE_STAGE.format(s=1).replace("write_stats(d, {", "write_stats(d, complete=False, "
                                                                "stats={"))
    with pytest.raises(RunnerError, match=r"stage 1 \(01_synthesize\) done at 3/3 items"):
        run_pipeline(pf, [1, 2], notebooks=nbdir)
    assert not (rd / "02_vocab").exists()
    # which stages each stage reads: online training reads no stage 3, an external drafter no stage 4
    p = load_params(pf)
    assert [stages_read(s, p) for s in (1, 2, 3, 4, 5)] == [[], [1], [2], [2, 3], [1, 2, 4]]
    p = load_params(pf, ["train.online=true", "evaluate.drafter_dir=/d"])
    assert (stages_read(4, p), stages_read(5, p)) == ([2], [1, 2])


def test_open_stage_ranges_run_to_the_last_stage_or_from_the_first():
    """`--stages 2-` was read as stage 2 alone."""
    assert parse_stages("2-") == [2, 3, 4, 5] and parse_stages("-3") == [1, 2, 3]
    assert parse_stages(" 4 - ") == [4, 5] and parse_stages("-1,4-") == [1, 4, 5]
    assert parse_stages("3-", "--redo") == [3, 4, 5]


def test_a_missing_stage_notebook_is_an_error_before_anything_runs(tmp_params, nbdir, capsys):
    """A selected stage whose notebook was removed was skipped and the run ended rc 0."""
    from eagle3.errors import RunnerError

    pf = tmp_params()
    rd = Path(load_params(pf).run.output_dir) / "t"
    with pytest.raises(RunnerError, match=r"stage 3 \(03_extract\): notebook .*03_extract_hidden_states.ipynb does "
                                          r"not exist\. Nothing was run; add it or pass another notebooks folder"):
        run_pipeline(pf, [1, 2, 3], notebooks=nbdir)
    assert not rd.exists()
    assert main_with_notebooks(["run", str(pf), "--stages", "1-", "--no-report"], nbdir) == 2
    err = capsys.readouterr().err
    assert "stage 4 (04_train): notebook" in err and "stage 5 (05_evaluate): notebook" in err
    assert ("restore it: `git checkout -- notebooks/03_extract_hidden_states.ipynb notebooks/04_train_drafter.ipynb "
            "notebooks/05_evaluate_acceptance.ipynb`") in err and not rd.exists()


def test_a_run_directory_inside_the_source_tree_is_refused(tmp_params, capsys):
    """`run.output_dir: eagle3` put a run's files inside the package; only the git-ignored outputs/ may
    hold runs inside the repository."""
    from eagle3.notebook import setup
    from eagle3.rundir import check_run_location

    pf = tmp_params()
    for out in ("eagle3", ".", "notebooks"):
        assert main(["run", str(pf), "--set", f"run.output_dir={out}", "--run-name", "in-tree", "--stages", "1"]) == 2
        err = capsys.readouterr().err
        assert f"run directory {(ROOT / out / 'in-tree').resolve()} lies inside the project's source tree ({ROOT})" in err
        assert "Set run.output_dir to outputs (git-ignored)" in err and not (ROOT / out / "in-tree").exists()
    with pytest.raises(ParamsError, match="lies inside the project's source tree"):
        setup(str(pf), str(ROOT / "eagle3" / "in-tree"), stage=1)
    assert not (ROOT / "eagle3" / "in-tree").exists()
    check_run_location(ROOT / "outputs" / "in-tree")  # the ignored outputs/ and any folder outside are fine
    check_run_location(Path(load_params(pf).run.output_dir) / "t")


SOCKETS = """
import json, os
from pathlib import Path
from ipykernel.connect import get_connection_file
ip = json.loads(Path(get_connection_file()).read_text())["ip"]
here = sorted(p.name for p in Path.cwd().iterdir() if p.name.startswith("kernel-ipc"))
Path(run_dir, "sockets.json").write_text(json.dumps({"ip": ip, "cwd": str(Path.cwd()), "here": here,
                                                     "there": sorted(os.listdir(Path(ip).parent))}))
"""


def test_the_kernel_s_sockets_stay_out_of_the_notebooks_folder(tmp_params, nbdir):
    """The stage kernel's Unix sockets (kernel-ipc-<port>) were made in its cwd, the project's notebooks/
    folder, and a killed kernel left them there: they live in a private temp folder, removed after the stage."""
    _nb(nbdir / NOTEBOOKS[1], SOCKETS + WRITE_STAGE.format(s=1))
    rd = run_pipeline(tmp_params(), [1], notebooks=nbdir)
    seen = read_json(rd / "sockets.json")
    assert seen["cwd"] == str(nbdir) and seen["here"] == []
    ip = Path(seen["ip"])
    assert ip.is_absolute() and ip.name == "kernel-ipc" and ip.parent.name.startswith("eagle3-kernel-")
    assert len([n for n in seen["there"] if n.startswith("kernel-ipc-")]) >= 5  # shell, iopub, stdin, control, hb
    assert not ip.parent.exists() and not list(nbdir.glob("kernel-ipc*"))


def test_each_stage_kernel_starts_with_the_openmp_setting_chosen_for_that_moment(tmp_params, tmp_path, monkeypatch,
                                                                               capsys):
    """The kernel reads OpenMP's settings when it starts: `eagle3 run` chooses them per stage from the load
    of that moment (eagle3.machine.openmp_for_start) and starts the stage's kernel with them; the choice
    is printed. Stage 1 here starts on a busy machine, stage 2 on a quiet one."""
    import eagle3.commands.run as run_mod
    from eagle3.machine import OPENMP_AUTO

    d = tmp_path / "nbs"
    d.mkdir()
    body = WRITE_STAGE + "(d / 'openmp.txt').write_text(os.environ.get('OMP_WAIT_POLICY', 'default'))\n"
    for s in (1, 2):
        _nb(d / NOTEBOOKS[s], "import os\n" + body.format(s=s))
    # read at the call: the run sets its own variables (its writer lock's holder) before the stage starts
    choices = iter([lambda: (dict(os.environ, OMP_WAIT_POLICY="PASSIVE", **{OPENMP_AUTO: "1"}),
                             "other processes took 1.0 of 2 CPUs: ..."),
                    lambda: (dict(os.environ), None)])
    monkeypatch.setattr(run_mod, "openmp_for_start", lambda: next(choices)())
    rd = run_pipeline(tmp_params(), [1, 2], notebooks=d)
    assert (rd / "01_synthesize" / "openmp.txt").read_text() == "PASSIVE"
    assert (rd / "02_vocab" / "openmp.txt").read_text() == "default"
    assert OPENMP_AUTO not in os.environ  # this process's own environment is unchanged
    out = capsys.readouterr().out
    assert "eagle3: stage 1 (01_synthesize): other processes took 1.0 of 2 CPUs: ..." in out
    assert "stage 2 (02_vocab): other" not in out
