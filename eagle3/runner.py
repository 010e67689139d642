"""Run the stage notebooks headless with papermill, show where a run is, render its report."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from eagle3.errors import ParamsError, RunInterrupted, RunnerError, StageFailed, StaleStage
from eagle3.io import format_bytes, read_json
from eagle3.params_file import load_params
from eagle3.rundir import (
    NOTEBOOKS,
    PARAMS_FILE,
    PROGRESS_FILE,
    STAGES,
    START_OVER_KEEPS,
    TRAIN,
    RunDir,
    notebooks_dir,
    prepare_run_dir,
    resolve_run_dir,
    stage_complete,
)
from eagle3.stage import stale_inputs, stale_message

__all__ = ["parse_stages", "format_stages", "resume_stages", "run_pipeline", "run_dir_for", "params_options", "reopen_stage", "verify_run",
           "StageFailed", "ProgressEcho", "StaleStage", "status_rows", "format_status", "render_report", "static_widgets"]

KERNEL = "eagle3"


def parse_stages(spec: str | None, flag: str = "--stages") -> list[int]:
    """'1-5', '2', '1,3-4' -> sorted stage numbers (None or '' -> all); ``flag`` names the option in
    messages (``--stages``, ``--redo``).

    Raises:
        ParamsError: a part that is not a number or a range ``A-B`` with A <= B, or a stage outside 1..5.
    """
    if not spec:
        return list(STAGES)
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        a, _, b = part.partition("-")
        if not (a.strip().isdigit() and (not b or b.strip().isdigit())):
            raise ParamsError(f"{flag} {spec!r}: {part!r} is not a stage number or a range like 2-4 (stages are 1-5)")
        lo, hi = int(a), int(b) if b else int(a)
        if lo > hi:
            raise ParamsError(f"{flag} {spec!r}: the range {part!r} is empty; write it low-high, e.g. {hi}-{lo}")
        for s in range(lo, hi + 1):
            if s not in STAGES:
                raise ParamsError(f"{flag} {spec!r}: stage {s} does not exist (stages are 1-5)")
            out.add(s)
    return sorted(out)


def format_stages(stages) -> str:
    """Stage numbers -> the shortest ``--stages`` text (``[1, 2, 3, 5]`` -> ``'1-3,5'``); the inverse
    of :func:`parse_stages`."""
    out, run = [], []
    for s in sorted(set(stages)):
        if run and s != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(s)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def resume_stages(stage: int, stages: list[int], redo: list[int] | None) -> tuple[list[int], list[int]]:
    """``(--stages, --redo)`` of the command that resumes a run interrupted in ``stage``: the selected
    stages from it on; the ``--redo`` stages from it on, plus ``stage`` itself when an earlier one
    was redone (its re-opening is a no-op on its own partial outputs, and a later stale stage is still
    re-opened after it, as the first command would have done)."""
    redo = sorted(set(redo or ()))
    again = [r for r in redo if r >= stage]
    if redo and redo[0] < stage and stage not in again:
        again.insert(0, stage)
    return [s for s in stages if s >= stage], again


def check_prompt_files(params, stages: list[int]) -> None:
    """Read the local prompt files (``kind: file`` sources) of the stages about to run, through the
    loader the stages use, before the run directory is touched: a wrong path or field mapping, or a
    file without a usable prompt, stops the run here, not after ``--redo`` removed the stage's
    results and ``params.yaml`` recorded the broken params (a new user's finding). Stage 1 reads
    ``synthesize.sources`` (with ``synthesize.on_bad_line``), stage 5 ``evaluate.sources``.

    Raises:
        PromptError: the loader's message, naming the params list, the source and the file/line.
    """
    from eagle3.prompts import load_source

    lists = {1: ("synthesize.sources", params.synthesize.sources, params.synthesize.on_bad_line),
             5: ("evaluate.sources", params.evaluate.sources, "skip")}
    for stage in sorted(set(stages) & set(lists)):
        field, sources, on_bad_line = lists[stage]
        for src in sources:
            if src.kind == "file":
                load_source(src, on_bad_line=on_bad_line, dedup=False, field=field)


def reopen_stage(run_dir: str | Path, stage: int, params=None) -> str:
    """Make stage ``stage`` run again (``eagle3 run --redo N``); returns what was done, for the console.

    The rule: when the stage's recorded inputs (``inputs.json``) differ from the files now, its
    outputs were made from other data and the stage starts over (its folder is removed); otherwise
    only its completion is dropped (``stats.json``, ``inputs.json``'s mark) and the stage's own resume
    re-checks its files against their records and redoes the broken ones (stage 3 re-hashes every
    file against the manifest; stage 4 re-exports from its checkpoints; stage 1 keeps its samples).
    Stage 1 starting over keeps its self-written prompts (``self_prompts/``): they depend on the
    target and the self-prompting settings, never on the prompt files, and resume on their own checks.
    """
    rd = RunDir(run_dir)
    sd = rd.stage(stage)
    reasons = stale_inputs(run_dir, stage, params)
    if reasons:
        kept: list[str] = []
        if sd.exists():
            trash = rd.root / f".redo-{sd.name}-{int(time.time())}"
            sd.rename(trash)  # one rename, then the slow removal: a kill leaves no half-removed folder
            for pattern in START_OVER_KEEPS.get(stage, ()):
                for f in sorted(trash.glob(pattern)):
                    sd.mkdir(exist_ok=True)
                    f.rename(sd / f.name)
                    kept.append(f.name + ("/" if (sd / f.name).is_dir() else ""))
            shutil.rmtree(trash, ignore_errors=True)
        keeps = (f"; kept, reused where their inputs match: {', '.join(kept)}" if kept else "")
        return (f"stage {stage} ({STAGES[stage]}) starts over: its inputs changed since it ran ("
                + "; ".join(reasons) + ")" + keeps)
    # progress.json goes too: a stage that then fails before it starts (bad params) is shown as not
    # run, not as "done" without its stats
    rd.stats(stage).unlink(missing_ok=True)
    (sd / PROGRESS_FILE).unlink(missing_ok=True)
    return f"stage {stage} ({STAGES[stage]}) re-opened: it re-checks its files and redoes what is broken or missing"


class _InterruptForwarder:
    """SIGINT (Ctrl-C) while a stage notebook runs: the first one is sent on to the kernel, whose
    cell then stops as an interrupted Python program does (``StageRun`` marks ``progress.json``
    'interrupted', the stage's ``finally`` blocks stop its engines) and papermill saves the executed
    notebook, instead of a KeyboardInterrupt tearing the kernel's sockets down under it (80 lines of
    papermill/ZMQ traceback); a second one raises KeyboardInterrupt here at once.

    The kernel runs in its own session (jupyter_client starts it so), so a terminal's Ctrl-C does not
    reach it by itself; its process group is found through the kernel manager papermill builds from
    :meth:`manager_class`. Installed only in the main thread (``signal.signal`` works nowhere else).
    """

    def __init__(self) -> None:
        self.managers: list = []
        self.count = 0
        self._old = None

    def manager_class(self):
        """An ``AsyncKernelManager`` subclass that records its instances here (nbclient's default class)."""
        from jupyter_client.manager import AsyncKernelManager

        managers = self.managers

        class _RecordedKernelManager(AsyncKernelManager):
            def __init__(self, *args, **kwargs):
                # the kernel talks to this process only: Unix sockets instead of TCP on localhost (ipykernel
                # warned "running over TCP without encryption" at every stage's start)
                kwargs.setdefault("transport", "ipc")
                super().__init__(*args, **kwargs)
                managers.append(self)

            async def _async_interrupt_kernel(self) -> None:
                # jupyter_client's shutdown_kernel sends SIGINT before its shutdown request; papermill
                # shuts the kernel down once the notebook has run, so the kernel is idle and the SIGINT
                # only made ipykernel print "ERROR | KeyboardInterrupt caught in kernel" after a stage
                # that had finished normally (seen by two new users). A user's Ctrl-C does not come
                # through here: _on_sigint signals the kernel's process group itself.
                if self.shutting_down:
                    return
                await super()._async_interrupt_kernel()

        return _RecordedKernelManager

    def _kernel_pgid(self) -> int | None:
        prov = getattr(self.managers[-1], "provisioner", None) if self.managers else None
        pid = getattr(prov, "pgid", None) or getattr(prov, "pid", None)
        return int(pid) if pid else None

    def _on_sigint(self, signum, frame) -> None:
        self.count += 1
        pgid = self._kernel_pgid()
        if self.count > 1 or pgid is None:
            raise KeyboardInterrupt
        try:
            os.killpg(pgid, signal.SIGINT)
        except OSError:  # the kernel is gone already
            raise KeyboardInterrupt from None
        print("\neagle3: Ctrl-C: stopping the stage (it keeps what it wrote); Ctrl-C again to stop at once",
              file=sys.stderr, flush=True)

    def __enter__(self) -> _InterruptForwarder:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def params_options(run_name: str | None, overrides: list[str] | None) -> list[str]:
    """``eagle3 run``'s options that change the params (``--run-name``, each ``--set``), as a command
    that repeats them writes them: the resume command after Ctrl-C, a refusal's suggested command."""
    return [*(["--run-name", run_name] if run_name else []), *(x for o in overrides or [] for x in ("--set", o))]


def run_dir_for(params, params_file: str | Path | None, overrides: list[str] | None = None) -> Path:
    """The run directory ``eagle3 run`` opens: the folder of ``params_file`` when that file is a run
    directory's own ``params.yaml`` (the folder holds a stage folder) and no ``run.*`` override names
    another run, else ``<run.output_dir>/<run.name>`` (:func:`eagle3.rundir.resolve_run_dir`).

    ``eagle3 run outputs/<run>/params.yaml`` re-opens that run as it was made (what a refusal of other
    params suggests), also when the folder was copied or moved and its ``params.yaml`` still names the
    old folder (a copied run's params once resolved to a fresh run and started stage 1 there).
    """
    default = resolve_run_dir(params)
    if params_file is None or any(o.split("=", 1)[0].strip().startswith("run.") for o in overrides or []):
        return default
    pf = Path(params_file).expanduser().resolve()
    if pf.name != PARAMS_FILE or not any((pf.parent / name).is_dir() for name in STAGES.values()):
        return default
    if pf.parent != default:
        print(f"eagle3: {params_file} is the params.yaml of the run directory {pf.parent}: opening that run "
              f"(its params name {default})", flush=True)
    return pf.parent


def _kernel_available(name: str) -> bool:
    from jupyter_client.kernelspec import KernelSpecManager

    return name in KernelSpecManager().find_kernel_specs()


def run_pipeline(
    params_file: str | Path,
    stages: list[int] | None = None,
    run_name: str | None = None,
    overrides: list[str] | None = None,
    kernel: str = KERNEL,
    force: bool = False,
    notebooks: str | Path | None = None,
    redo: list[int] | None = None,
) -> Path:
    """Execute the stage notebooks into ``<run_dir>/notebooks/`` and return the run directory.

    Stages whose ``stats.json`` says complete are skipped (a re-run resumes from the first
    unfinished stage); each stage also resumes its own unfinished work. Stops at the first
    failing stage.

    A complete stage whose inputs changed since it ran (an earlier stage re-run, a file replaced:
    :func:`eagle3.stage.stale_inputs`) is never skipped: the run stops with the reason and the
    command, unless ``redo`` names it or an earlier stage of this call. Stages in ``redo`` are
    re-opened (:func:`reopen_stage`) before they run; after them, a later selected stage whose inputs
    changed is re-opened too (it starts over on the new inputs).

    Raises:
        StaleStage: a complete stage with changed inputs, not covered by ``redo``.
        PromptError: a local prompt file of a stage to run has no usable prompt, or a field mapping
            that matches none of its records (:func:`check_prompt_files`; nothing written yet).
        ParamsError: stages after 1 only on a run folder that has no ``params.yaml`` yet (nothing
            is created); invalid params or a run directory created with other params (but for
            ``evaluate.*`` with 5 in ``redo``: :func:`eagle3.rundir.prepare_run_dir`); a ``redo`` stage
            that is not selected.
        StageFailed: a notebook cell raised (message: stage, cell index, exception).
        RunnerError: the Jupyter kernel ``eagle3`` is not registered (run ``make venv``).
    """
    import papermill as pm

    ov = list(overrides or [])
    if run_name:
        ov.append(f"run.name={run_name}")
    params = load_params(params_file, ov)
    selected = list(stages or STAGES)
    redo_set = set(redo or [])
    if redo_set - set(selected):
        raise ParamsError(f"--redo {','.join(map(str, sorted(redo_set)))}: stage(s) {sorted(redo_set - set(selected))} "
                          f"not among the stages to run ({selected}); add them to --stages")
    target_dir = run_dir_for(params, params_file, ov)
    if min(selected) > 1 and not (target_dir / PARAMS_FILE).exists():
        # checked before anything is written: a stage-5-only call on a mistyped run name once
        # created the folder, then failed inside notebook 05 on the missing samples
        import shlex

        options = shlex.join([str(params_file), *params_options(run_name, overrides)])
        raise ParamsError(
            f"{target_dir} is not a run yet (no {PARAMS_FILE}): stage {min(selected)} reads what stages "
            f"1-{min(selected) - 1} write there. Run them too: `eagle3 run {options} --stages "
            f"{format_stages(range(1, max(selected) + 1))}`, or name the run that has them (--run-name, or "
            f"its own params: `eagle3 run <run dir>/{PARAMS_FILE}`). Nothing was written.")
    check_prompt_files(params, [s for s in selected if s in redo_set or force
                                or not stage_complete(target_dir, s)])
    run_dir = prepare_run_dir(params, target_dir, redo=redo_set, params_file=params_file, stages=selected,
                              options=params_options(run_name, overrides))
    for trash in run_dir.glob(".redo-*"):  # a stage folder a killed --redo was removing
        shutil.rmtree(trash, ignore_errors=True)
    if not _kernel_available(kernel):
        raise RunnerError(
            f"Jupyter kernel {kernel!r} is not registered. Run `make venv` (it registers the kernel "
            f"of the project's virtual environment) or pass --kernel NAME."
        )
    out_dir = run_dir / "notebooks"
    out_dir.mkdir(exist_ok=True)
    nb_root = Path(notebooks) if notebooks else notebooks_dir()
    print(f"eagle3: run directory {run_dir}", flush=True)
    for s in selected:
        nb_in = nb_root / NOTEBOOKS[s]
        if not nb_in.exists():
            print(f"eagle3: stage {s} ({STAGES[s]}): notebook {nb_in.name} does not exist, skipped", flush=True)
            continue
        if s in redo_set:
            print(f"eagle3: {reopen_stage(run_dir, s, params)}", flush=True)
        elif stage_complete(run_dir, s) and not force:
            reasons = stale_inputs(run_dir, s, params)
            if not reasons:
                print(f"eagle3: stage {s} ({STAGES[s]}) already complete, skipped", flush=True)
                continue
            if not (redo_set and s > min(redo_set)):
                raise StaleStage(stale_message(s, reasons, params_file))
            print(f"eagle3: {reopen_stage(run_dir, s, params)}", flush=True)
        print(f"eagle3: stage {s} ({STAGES[s]}) running {nb_in.name} (watch: eagle3 status {run_dir})", flush=True)
        t0 = time.time()
        stopped = RunInterrupted(f"stage {s} ({STAGES[s]}) was interrupted (Ctrl-C)", stage=s, run_dir=run_dir)
        fwd = _InterruptForwarder()
        try:
            with fwd, ProgressEcho(run_dir / STAGES[s] / "progress.json", f"stage {s} ({STAGES[s][3:]})"):
                pm.execute_notebook(
                    str(nb_in),
                    str(out_dir / NOTEBOOKS[s]),
                    parameters={"params_file": str(run_dir / "params.yaml"), "run_dir": str(run_dir)},
                    kernel_name=kernel,
                    kernel_manager_class=fwd.manager_class(),
                    cwd=str(nb_root),
                    log_output=False,  # True would print its stderr twice: stderr_file and a logged warning
                    progress_bar=False,
                    stdout_file=sys.stdout,
                    stderr_file=sys.stderr,
                )
        except pm.PapermillExecutionError as exc:
            if fwd.count or exc.ename == "KeyboardInterrupt":
                raise stopped from None
            # the executed notebook labels its cells "In [n]" (papermill's own message says the same);
            # exc.cell_index counts from 0 and includes markdown and the injected parameters cell
            first = next((ln.strip() for ln in (exc.source or "").splitlines() if ln.strip()), "")
            raise StageFailed(
                f"Stage {s} ({STAGES[s]}) failed at In [{exc.exec_count}] of {nb_in.name}"
                f"{f' ({first[:80]})' if first else ''}: {exc.ename}: {exc.evalue}\n"
                f"Executed notebook: {out_dir / NOTEBOOKS[s]}"
            ) from None
        except KeyboardInterrupt:  # a second Ctrl-C, or one before the kernel was up
            raise stopped from None
        if fwd.count:  # the stage ended before the interrupt reached its code: stop before the next one
            print(f"eagle3: stage {s} ({STAGES[s]}) finished in {time.time() - t0:.0f} s", flush=True)
            raise RunInterrupted(f"stopped after stage {s} ({STAGES[s]}) finished (Ctrl-C)",
                                 stage=s + 1 if s + 1 in selected else None, run_dir=run_dir)
        print(f"eagle3: stage {s} ({STAGES[s]}) finished in {time.time() - t0:.0f} s", flush=True)
    return run_dir


def verify_run(run_dir: str | Path, check_values: bool = True) -> list[str]:
    """``eagle3 verify RUN``: every integrity check of a run directory; returns the problems found.

    Checks: each complete stage's recorded inputs against the files now (stale stages); Stage 3's
    manifest against ``meta.json``'s count and Stage 2's train split, and every hidden-state file
    against its manifest line (size, sha256, header, shapes, token ids, loss mask, finite values:
    :func:`eagle3.contracts.hidden_states.verify_folder`); Stage 4's checkpoints (every file loads,
    finite weights, their ``mapping_digest`` vs Stage 2's d2t/t2d:
    :func:`eagle3.train.checkpoint.verify_checkpoints`) and its exported drafter (loads, finite, its
    d2t/t2d are Stage 2's: :func:`eagle3.contracts.drafter.verify_export`). Cost: one read and one
    sha256 pass over the hidden states (~450 MiB/s per core measured on the CI machine), one read of
    each checkpoint.

    Raises:
        RunnerError: ``run_dir`` is not a run directory (no ``params.yaml``).
    """
    from eagle3.params_file import load_params
    from eagle3.rundir import EXTRACT

    rd = RunDir(run_dir)
    if not rd.params_file.exists():
        raise RunnerError(f"{rd.root}: no {rd.params_file.name}; not a run directory")
    params = load_params(rd.params_file)
    problems = []
    for s in STAGES:
        if stage_complete(rd.root, s):
            problems += [f"stage {s} ({STAGES[s]}) is stale: {r}" for r in stale_inputs(rd.root, s, params)]
    if rd.extract_meta.exists() and rd.manifest.exists() and rd.tokenized("train").exists():
        from eagle3.contracts import hidden_states as hsc
        from eagle3.extract.prepare import load_rows

        sd = rd.stage(EXTRACT)
        rows = load_rows(rd.root)
        problems += hsc.check_manifest(hsc.read_manifest(sd), hsc.read_meta(sd), rows.ids, where=rd.manifest)
        rep = hsc.verify_folder(sd, rows, check_hashes=True, check_values=check_values)
        problems += [f"{p['file']}: row {p['row']} (id {p['id']}): {p['problem']}" for p in rep["problems"]]
    problems += _verify_train(rd)
    return problems


def _verify_train(rd: RunDir) -> list[str]:
    """Stage 4's part of :func:`verify_run`: its checkpoints and its exported drafter, each against
    Stage 2's draft vocab mapping as it is now."""
    if not rd.stage(TRAIN).is_dir():
        return []
    from eagle3.contracts.drafter import verify_export
    from eagle3.contracts.vocab_mapping import VocabMappingError, mapping_digest, read_mapping
    from eagle3.train.checkpoint import verify_checkpoints

    problems, mapping = [], None
    if rd.mapping_json.exists():
        try:
            mapping = read_mapping(rd.root)
        except VocabMappingError as exc:
            problems.append(f"stage 2's draft vocab mapping: {exc}")
    problems += verify_checkpoints(rd.checkpoints_dir, mapping_digest(mapping.d2t, mapping.t2d) if mapping else None)
    st = read_json(rd.stats(TRAIN), {}) or {}
    # the export's own place; stats.json's path is absolute: in a moved or copied run it names another folder
    drafter = rd.drafter_dir
    if st.get("complete") and not drafter.is_dir():
        problems.append(f"{drafter}: stage 4 is complete but its exported drafter is missing")
    elif (drafter / "config.json").is_file():
        problems += verify_export(drafter, mapping)
    return problems


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class ProgressEcho:
    """Shows a running stage's ``progress.json`` in the terminal of ``eagle3 run`` while papermill runs
    its notebook (whose own tqdm bars are notebook widgets, invisible there).

    A thread reads the file every ``interval_s``. On a terminal it drives a tqdm bar on ``file``
    (done/total, the stage's own tokens/s and ETA, bytes on disk); elsewhere (a log file, CI) it writes
    one line per ``log_every_s`` when something changed, and at once when a phase ends (the last
    state seen of the phase that ended, then the next phase's first), each ending with the file's
    time (``(HH:MM:SS UTC)``). A file left by an earlier execution (older
    than this echo) is not shown until the stage rewrites it. The numbers are the ones ``eagle3
    status`` shows (:class:`eagle3.io.Progress` writes them); a new unit or total (a stage's next
    phase) starts a new bar.

    Args:
        path: the stage's ``progress.json``. desc: the bar's label (``stage 3 (extract)``).
        file: where to write (default ``sys.stderr``). interval_s: poll period, seconds.
        log_every_s: seconds between lines when ``file`` is not a terminal.
        tty: draw a bar (True) or write lines (False); None: a bar where ``file`` is a terminal that
            reports a width (a pseudo-terminal of width 0, e.g. ``script`` run without a terminal, would
            make tqdm draw empty lines).
    """

    def __init__(self, path: str | Path, desc: str, file=None, interval_s: float = 2.0,
                 log_every_s: float = 60.0, tty: bool | None = None) -> None:
        self.path, self.desc = Path(path), desc
        self.file = file if file is not None else sys.stderr
        self.interval_s, self.log_every_s = interval_s, log_every_s
        if tty is None:
            try:
                tty = self.file.isatty() and os.get_terminal_size(self.file.fileno()).columns > 0
            except (AttributeError, OSError, ValueError):
                tty = False
        self.tty = tty
        self.t0 = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eagle3-progress-echo", daemon=True)
        self._bar = None
        self._key = None
        self._last_line = (0.0, None)
        self._phase = self._seen = None  # log mode: the (unit, total) and the line of the last poll

    def __enter__(self) -> ProgressEcho:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll(final=True)
        if self._bar is not None:
            self._bar.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the echo must never stop a stage
                pass

    def poll(self, final: bool = False) -> None:
        """Read the file once and show it (``final``: write the last line even if not due)."""
        prog = read_json(self.path, None)
        if not isinstance(prog, dict) or float(prog.get("updated") or 0) < self.t0:
            return
        extras = [f"{prog.get('tokens_per_s') or 0:.0f} tokens/s"]
        if prog.get("status") == "running" and prog.get("eta_s") is not None:
            extras.append(f"ETA {_fmt_s(prog['eta_s'])}")
        if prog.get("bytes_on_disk"):
            extras.append(f"{format_bytes(prog['bytes_on_disk'])} on disk")
        if self.tty:
            self._show_bar(int(prog.get("done") or 0), prog.get("total"), str(prog.get("unit") or ""), ", ".join(extras))
            return
        line = f"eagle3: {self.desc}: {_done_text(prog)}, {', '.join(extras)}"
        # the file's own time on each printed line (not in `line`, which says whether anything changed):
        # a new user could not check the ETAs of a log afterwards
        stamped = f"{line} ({time.strftime('%H:%M:%S', time.gmtime(float(prog['updated'])))} UTC)"
        # a new unit or total is the stage's next phase: the last state seen of the one that ended and
        # the new one's first are written at once (at one line a minute a log skipped whole phases)
        phase = (prog.get("unit"), prog.get("total"))
        new_phase = self._phase is not None and phase != self._phase
        if new_phase and self._seen is not None and self._seen[0] != self._last_line[1]:
            print(self._seen[1], file=self.file, flush=True)
        self._phase, self._seen = phase, (line, stamped)
        due = time.time() - self._last_line[0] >= self.log_every_s
        if line != self._last_line[1] and (due or final or new_phase):
            print(stamped, file=self.file, flush=True)
            self._last_line = (time.time(), line)

    def _show_bar(self, done: int, total, unit: str, postfix: str) -> None:
        from tqdm import tqdm

        if self._key != (unit, total):
            if self._bar is not None:
                self._bar.close()
            head = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} " if total else "{desc}: {n_fmt} "
            fmt = head + unit + "{postfix}"  # tqdm puts ", " before a postfix
            self._bar = tqdm(total=total, initial=done, desc=self.desc, file=self.file, bar_format=fmt,
                             dynamic_ncols=True, leave=True)
            self._key = (unit, total)
        self._bar.n = done
        self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.refresh()


def _done_text(prog: dict) -> str:
    """``done/total unit`` of a ``progress.json`` (``?`` for an unknown total): status table and terminal echo."""
    total = prog.get("total")
    return f"{prog.get('done', 0)}/{total if total is not None else '?'} {prog.get('unit', '')}".strip()


def _run_params(run_dir: str | Path):
    """The run's resolved params (which files a stage consumes depends on a few), None if unreadable."""
    from eagle3.params_file import load_params

    try:
        return load_params(Path(run_dir) / "params.yaml")
    except Exception:  # noqa: BLE001 - status must show what it can of a damaged run directory
        return None


def status_rows(run_dir: str | Path) -> list[dict]:
    """One dict per stage from its ``progress.json`` and ``stats.json`` (missing -> 'not started').

    A 'running' stage whose progress file is older than 60 s is reported as 'stalled?' (its
    process may have died; re-running resumes it). A complete stage whose inputs changed size since
    it ran is 'stale' (sizes only, nothing is read: ``eagle3 verify`` hashes them). Only a running
    stage has an ETA; ``elapsed`` is the stage's time over all its executions (:class:`eagle3.io.Progress`).
    """
    rows = []
    params = _run_params(run_dir)
    for s, name in STAGES.items():
        d = Path(run_dir) / name
        prog = read_json(d / "progress.json", None)
        stats = read_json(d / "stats.json", {}) or {}
        if stats.get("complete"):
            state = "stale" if stale_inputs(run_dir, s, params, quick=True) else "complete"
        elif prog is None:
            state = "not started"
        else:
            state = prog.get("status", "?")
            if state == "running" and time.time() - prog.get("updated", 0) > 60:
                state = "stalled?"
        p = prog or {}
        rows.append(
            {
                "stage": f"{s} {name[3:]}",
                "state": state,
                "done": _done_text(p) if prog else "-",
                "tokens/s": f"{p.get('tokens_per_s', 0):.0f}" if prog else "-",
                "elapsed": _fmt_s(p.get("elapsed_s")) if prog else "-",
                "ETA": _fmt_s(p.get("eta_s")) if prog and state == "running" else "-",  # none once it stopped
                "on disk": format_bytes(p.get("bytes_on_disk")) if prog else "-",
                "projected": format_bytes(p.get("projected_bytes")) if prog else "-",
                "updated": time.strftime("%H:%M:%S", time.localtime(p["updated"])) if p.get("updated") else "-",
            }
        )
    return rows


def format_status(run_dir: str | Path) -> str:
    """``eagle3 status`` as a fixed-width text table."""
    rows = status_rows(run_dir)
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    line = "  ".join(c.ljust(widths[c]) for c in cols)
    out = [f"run: {Path(run_dir).resolve()}", line, "  ".join("-" * widths[c] for c in cols)]
    out += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    # The two clocks differ on a resumed stage: say which one each column reads.
    out.append("tokens/s: this execution over its wall time (the report's tokens_per_s, where a stage has one, "
               "is its stats.json figure); ETA: at the phase's last 2 minutes' rate; elapsed: the stage's time over "
               "every execution")
    return "\n".join(out)


_REMOTE_SCRIPT = re.compile(r"<script[^>]*\bsrc=[\"']https?://[^>]*>\s*</script>", re.I)


def offline_html(body: str) -> str:
    """Remove ``<script src="https://...">`` tags (require.js, MathJax from a CDN) from nbconvert
    output, so that the report renders with no network and no failed requests."""
    return _REMOTE_SCRIPT.sub("", body)


_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _final_bar_html(model_id: str, state: dict) -> str | None:
    """The last state of a tqdm notebook bar (HBox of HTML, FloatProgress, HTML) as static HTML."""
    box = state.get(model_id, {})
    kids = [state.get(str(c).removeprefix("IPY_MODEL_"), {}) for c in box.get("state", {}).get("children", [])]
    if box.get("model_name") != "HBoxModel" or [k.get("model_name") for k in kids] != [
            "HTMLModel", "FloatProgressModel", "HTMLModel"]:
        return None
    pre, bar, post = (k.get("state", {}) for k in kids)
    value, top = bar.get("value") or 0, bar.get("max") or 0
    return (f"<div class='eagle3-progress'><code>{pre.get('value', '')}</code> "
            f"<progress value='{value}' max='{top}'></progress> <code>{post.get('value', '')}</code></div>")


def static_widgets(nb) -> int:
    """Replace each widget output of an executed notebook by static HTML, in place; returns how many.

    The report renders without a widget manager, where nbconvert would fall back to the widget's
    ``text/plain`` repr (a tqdm bar's *first* state, "0%"; ``VBox(children=...)``). A progress bar
    becomes its last state (from the notebook's saved widget state); an output that carries its own
    ``text/html`` (the vocab explorer's static block) keeps that; any other widget says where it runs.
    """
    state = (nb.metadata.get("widgets") or {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    n = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data") or {}
            if _WIDGET_VIEW not in data:
                continue
            html_text = data.get("text/html") or _final_bar_html(data[_WIDGET_VIEW].get("model_id", ""), state) or (
                "<p><em>(interactive widget: open this notebook in JupyterLab)</em></p>")
            out["data"] = {"text/html": html_text}
            n += 1
    return n


def render_report(run_dir: str | Path) -> Path:
    """Render the executed notebooks to HTML plus ``report/index.html`` (key numbers, figures, links).

    Returns:
        Path: ``<run_dir>/report/index.html``.

    Raises:
        RunnerError: the run directory has no executed notebooks.
    """
    import nbformat
    from nbconvert import HTMLExporter

    from eagle3.report import index_html

    run_dir = Path(run_dir)
    nb_dir = run_dir / "notebooks"
    executed = sorted(nb_dir.glob("*.ipynb")) if nb_dir.exists() else []
    if not executed:
        raise RunnerError(f"{run_dir}: no executed notebooks in {nb_dir}; run `eagle3 run` first")
    rep = run_dir / "report"
    (rep / "figures").mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter()
    pages = []
    for nb_path in executed:
        nb = nbformat.read(nb_path, as_version=4)
        # Widget state (tqdm bars, the vocab slider) would make nbconvert load the widget manager
        # from a CDN; the report must render offline, so widgets become static HTML first.
        static_widgets(nb)
        nb.metadata.pop("widgets", None)
        # Each page gets its stage's title (nbconvert's default is "Notebook" for every page).
        stage = next((n for n, f in NOTEBOOKS.items() if f == nb_path.name), None)
        title = f"Stage {stage}: {STAGES[stage][3:]} ({run_dir.name})" if stage else f"{nb_path.stem} ({run_dir.name})"
        nb.metadata["title"] = title
        body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title}})
        out = rep / (nb_path.stem + ".html")
        out.write_text(offline_html(body), encoding="utf-8")
        pages.append(out.name)
    figures: dict[str, list[str]] = {}
    for name in STAGES.values():
        for png in sorted((run_dir / name).glob("*.png")):
            dst = rep / "figures" / f"{name}__{png.name}"
            shutil.copy2(png, dst)
            figures.setdefault(name, []).append(f"figures/{dst.name}")
    index = rep / "index.html"
    index.write_text(index_html(run_dir, pages, figures), encoding="utf-8")
    return index
