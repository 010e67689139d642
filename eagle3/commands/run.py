"""``eagle3 run``: execute the stage notebooks headless with papermill, stage after stage.

A complete stage is skipped, a stale one refused (or redone with ``--redo``), a stage in ``--redo``
re-opened; each notebook runs in the project's Jupyter kernel with a Ctrl-C forwarded to it, while
:class:`eagle3.commands.status.ProgressEcho` shows its ``progress.json`` in the terminal.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from eagle3.commands.status import ProgressEcho
from eagle3.errors import ParamsError, RunInterrupted, RunnerError, StageFailed, StaleStage
from eagle3.io import naming_file, read_json
from eagle3.machine import machine_line, openmp_for_start
from eagle3.params_file import load_params
from eagle3.rundir import (
    NOTEBOOKS,
    PARAMS_FILE,
    PROGRESS_FILE,
    STAGES,
    START_OVER_KEEPS,
    RunDir,
    check_run_location,
    notebooks_dir,
    prepare_run_dir,
    resolve_run_dir,
)
from eagle3.stage import RunLock, shared_from, stage_record, stale_inputs, stale_message, this_command
from eagle3.tracking import check_tracking

__all__ = ["KERNEL", "check_machine", "parse_stages", "format_stages", "resume_stages", "params_options", "run_dir_for",
           "check_prompt_files", "reopen_stage", "run_pipeline", "stages_read", "require_earlier_complete",
           "stage_notebooks", "require_kernel"]

# the Jupyter kernel `make venv` registers for the project's virtual environment
KERNEL = "eagle3"


def parse_stages(spec: str | None, flag: str = "--stages") -> list[int]:
    """'1-5', '2', '1,3-4', '3-' (3 to 5), '-2' (1 to 2) -> sorted stage numbers (None or '' -> all);
    ``flag`` names the option in messages (``--stages``, ``--redo``).

    Raises:
        ParamsError: a part that is not a number or a range ``A-B`` (either end may be left open) with
            A <= B, or a stage outside 1..5.
    """
    if not spec:
        return list(STAGES)
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        a, dash, b = (x.strip() for x in part.partition("-"))
        if dash:  # an open end is the first or the last stage: '2-' is 2-5, '-3' is 1-3
            a, b = a or str(min(STAGES)), b or str(max(STAGES))
        if not (a.isdigit() and (not dash or b.isdigit())) or part == "-":
            raise ParamsError(f"{flag} {spec!r}: {part!r} is not a stage number or a range like 2-4, 3- or -2 "
                              "(stages are 1-5)")
        lo, hi = int(a), int(b) if dash else int(a)
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
    results and ``params.yaml`` recorded the broken params. Stage 1 reads
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


class InterruptForwarder:
    """SIGINT (Ctrl-C) while a stage notebook runs: the first one is sent on to the kernel, whose
    cell then stops as an interrupted Python program does (``StageRun`` marks ``progress.json``
    'interrupted', the stage's ``finally`` blocks stop its engines) and papermill saves the executed
    notebook, instead of a KeyboardInterrupt tearing the kernel's sockets down under it (80 lines of
    papermill/ZMQ traceback); a second one raises KeyboardInterrupt here at once.

    The kernel runs in its own process session (jupyter_client starts it so), so a terminal's Ctrl-C does not
    reach it by itself; its process group is found through the kernel manager papermill builds from
    :meth:`manager_class`. Installed only in the main thread (``signal.signal`` works nowhere else).
    """

    def __init__(self) -> None:
        self.managers: list = []
        self.count = 0
        self._old = None
        # the kernel's Unix sockets: jupyter_client makes them relative to the kernel's cwd (the
        # project's notebooks/ folder) unless told where, and a killed kernel leaves them behind;
        # a private temp folder (a socket path must stay under ~107 bytes), removed on exit
        self.socket_dir: Path | None = None

    def manager_class(self, env: dict[str, str] | None = None):
        """An ``AsyncKernelManager`` subclass that records its instances here (nbclient's default class)
        and starts the kernel with the environment ``env`` (default: this process's)."""
        from jupyter_client.manager import AsyncKernelManager

        self.socket_dir = self.socket_dir or Path(tempfile.mkdtemp(prefix="eagle3-kernel-"))
        managers, sockets = self.managers, str(self.socket_dir / "kernel-ipc")

        class _RecordedKernelManager(AsyncKernelManager):
            def __init__(self, *args, **kwargs):
                # the kernel talks to this process only: Unix sockets instead of TCP on localhost (over TCP
                # ipykernel warns "running over TCP without encryption" at every stage's start)
                kwargs.setdefault("transport", "ipc")
                kwargs.setdefault("ip", sockets)  # the sockets' path prefix (kernel-ipc-<port>)
                super().__init__(*args, **kwargs)
                managers.append(self)

            async def _async_pre_start_kernel(self, **kw):
                if env is not None:
                    kw.setdefault("env", env)
                return await super()._async_pre_start_kernel(**kw)

            async def _async_interrupt_kernel(self) -> None:
                # jupyter_client's shutdown_kernel sends SIGINT before its shutdown request; papermill
                # shuts the kernel down once the notebook has run, so the kernel is idle and the SIGINT
                # only makes ipykernel print "ERROR | KeyboardInterrupt caught in kernel" after a stage
                # that finished normally. A user's Ctrl-C does not come through here: _on_sigint
                # signals the kernel's process group itself.
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

    def __enter__(self) -> InterruptForwarder:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


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
    old folder (resolved by its params, it would name a fresh run and start stage 1 there).
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


def require_kernel(name: str) -> None:
    """Raises RunnerError: the Jupyter kernel ``name`` is not registered (with how to register it)."""
    from jupyter_client.kernelspec import KernelSpecManager

    if name not in KernelSpecManager().find_kernel_specs():
        raise RunnerError(f"Jupyter kernel {name!r} is not registered. Run `make venv` (it registers the kernel "
                          f"of the project's virtual environment) or pass --kernel NAME.")


def run_pipeline(
    params_file: str | Path,
    stages: list[int] | None = None,
    run_name: str | None = None,
    overrides: list[str] | None = None,
    kernel: str = KERNEL,
    force: bool = False,
    notebooks: str | Path | None = None,
    redo: list[int] | None = None,
    remeasure_speed: bool = False,
) -> Path:
    """Execute the stage notebooks into ``<run_dir>/notebooks/`` and return the run directory.

    Stages whose ``stats.json`` says complete are skipped (a re-run resumes from the first unfinished stage);
    each stage also resumes its own unfinished work. Stops at the first failing stage. It starts with the
    machine line (:func:`eagle3.machine.machine_line`); ``remeasure_speed``: stage 5 times its methods again.

    A complete stage whose inputs changed since it ran (an earlier stage re-run, a file replaced:
    :func:`eagle3.stage.stale_inputs`) is never skipped: the run stops with the reason and the
    command, unless ``redo`` names it or an earlier stage of this call. Stages in ``redo`` are
    re-opened (:func:`reopen_stage`) before they run; after them, a later selected stage whose inputs
    changed is re-opened too (it starts over on the new inputs).

    Raises:
        StaleStage: a complete stage with changed inputs, not covered by ``redo``.
        PromptError: a local prompt file of a stage to run has no usable prompt, or a field mapping
            that matches none of its records (:func:`check_prompt_files`; nothing written yet).
        ParamsError: a run directory in the source tree (:func:`eagle3.rundir.check_run_location`); stages
            after 1 only on a folder without ``params.yaml`` (nothing is created); invalid params or a run
            made with others (:func:`eagle3.rundir.prepare_run_dir`); a ``redo`` stage not selected.
        StageFailed: a notebook cell raised (message: stage, cell index, exception).
        RunInterrupted: Ctrl-C while a stage ran (the stage keeps what it wrote).
        RunnerError: the kernel ``eagle3`` is not registered (run ``make venv``); a selected stage's
            notebook is missing (:func:`stage_notebooks`); a stage reads an unfinished earlier stage
            (:func:`require_earlier_complete`).
        RunLocked: another process writes the run directory (:class:`eagle3.stage.RunLock`; the
            stage notebooks this call executes run under its lock).
    """
    ov = [*(overrides or []), *([f"run.name={run_name}"] if run_name else [])]
    selected = list(stages or STAGES)
    params = _print_machine_line(load_params(params_file, ov), params_file, overrides, selected)
    redo_set = set(redo or []) | ({5} if remeasure_speed else set())
    if redo_set - set(selected):
        raise ParamsError(f"--redo {','.join(map(str, sorted(redo_set)))}: stage(s) {sorted(redo_set - set(selected))} "
                          f"not among the stages to run ({selected}); add them to --stages")
    target_dir = run_dir_for(params, params_file, ov)
    if min(selected) > 1 and not (target_dir / PARAMS_FILE).exists():
        raise ParamsError(_not_a_run_yet(target_dir, selected, params_file, run_name, overrides))
    to_run = [s for s in selected if s in redo_set or force or not stage_record(target_dir, s).complete]
    again = shlex.join([str(params_file), *params_options(run_name, overrides)])
    _refuse_before_writing(target_dir, to_run, params, again, selected)
    nbs = stage_notebooks(Path(notebooks) if notebooks else None, selected)
    check_prompt_files(params, to_run)
    check_run_location(target_dir)
    with RunLock(target_dir, this_command()):  # one writer per run folder, from here to the last stage
        run_dir = prepare_run_dir(params, target_dir, redo=redo_set, params_file=params_file, stages=selected,
                                  options=params_options(run_name, overrides))
        _forget_speed(run_dir, params) if remeasure_speed else None
        _run_stages(run_dir, params, params_file, nbs, (redo_set, force), kernel, again)
    return run_dir


def _print_machine_line(params, params_file, overrides: list[str] | None, stages: list[int]):
    """Print the machine line of a run of ``params`` (:func:`eagle3.machine.machine_line`); returns ``params``."""
    print(machine_line(params, params_file, overridden=bool(overrides), stages=stages), flush=True)
    return params


def _forget_speed(run_dir: Path, params) -> None:
    """``--remeasure-speed``: drop stage 5's kept speed measurement, saying which files went."""
    from eagle3.evaluate.stage import forget_speed

    gone = forget_speed(run_dir, params)
    what = ", ".join(f.name for f in gone) or "no kept speed measurement"
    print(f"eagle3: --remeasure-speed: removed {what}; stage 5 times every method again", flush=True)


def check_machine(params_file: str | Path, run_name: str | None = None, overrides: list[str] | None = None) -> str:
    """``eagle3 run PARAMS --check-machine``: the line :func:`run_pipeline` prints first (the CPU's
    features, the target's dtype and why, the expected duration: :func:`eagle3.machine.machine_line`),
    without running or writing anything.

    Raises:
        ParamsError: invalid params (as :func:`run_pipeline`).
    """
    ov = [*(overrides or []), *([f"run.name={run_name}"] if run_name else [])]
    return machine_line(load_params(params_file, ov), params_file, overridden=bool(overrides))


def _refuse_before_writing(run_dir: Path, to_run: list[int], params, again: str, selected: list[int]) -> None:
    """Refuse, before anything is written, a stage to run whose earlier stage is unfinished
    (:func:`require_earlier_complete`), or whose folder is another run's, shared by hard links
    (:func:`eagle3.stage.shared_from`, an ``eagle3 sweep`` variant): writing there would change the
    files of the run it shares them with.

    Raises:
        RunnerError: naming the stage and what to run instead.
        ParamsError: ``tracking.mode`` online/offline without the wandb package (a stage would fail
            when it logs, after its work: :func:`eagle3.tracking.check_tracking`).
    """
    check_tracking(params)
    for s in to_run:
        base = shared_from(run_dir, s)
        if base is not None:
            raise RunnerError(f"stage {s} of {run_dir} is {base}'s, shared by hard links (eagle3 sweep): run it in "
                              f"that run, then the sweep again; a variant runs only stages 4-5")
        require_earlier_complete(run_dir, s, params, again, selected)


def stage_notebooks(folder: Path | None, stages: list[int]) -> dict[int, Path]:
    """``{stage: notebook}`` of the stages to run, from ``folder`` (default: the project's ``notebooks/``).

    Raises:
        RunnerError: a stage's notebook is missing (a run that skipped it would end rc 0 without the stage).
    """
    root = folder or notebooks_dir()
    nbs = {s: root / NOTEBOOKS[s] for s in stages}
    missing = [s for s, nb in nbs.items() if not nb.is_file()]
    if missing:
        fix = (f"restore it: `git checkout -- {' '.join(f'notebooks/{NOTEBOOKS[s]}' for s in missing)}`"
               if folder is None else "add it or pass another notebooks folder")
        raise RunnerError("; ".join(f"stage {s} ({STAGES[s]}): notebook {nbs[s]} does not exist" for s in missing)
                          + f". Nothing was run; {fix}.")
    return nbs


def stages_read(stage: int, params) -> list[int]:
    """The earlier stages whose outputs stage ``stage`` reads (docs/DESIGN.md "Stage contracts"): 2 reads
    1; 3 reads 2; 4 reads 2 and 3 (not 3 with ``train.online``: the target runs beside training); 5
    reads 1 and 2, and 4 unless ``evaluate.drafter_dir`` names another drafter."""
    return {1: [], 2: [1], 3: [2], 4: [2] if params.train.online else [2, 3],
            5: [1, 2] if params.evaluate.drafter_dir else [1, 2, 4]}[stage]


def require_earlier_complete(run_dir: Path, stage: int, params, again: str, selected=()) -> None:
    """Refuse to run ``stage`` on an earlier stage it reads that is not complete (stopped part-way, or
    never run): it would run on part of the data and end "complete" (stage 2 on 7 of 960 samples).
    ``selected``: the stages of this call, which run first and are checked again when their turn
    comes; ``again``: the params file and options, for the command in the message.

    Raises:
        RunnerError: names the unfinished stage, its state and the ``eagle3 run`` command that finishes it.
    """
    missing = [e for e in stages_read(stage, params) if e not in selected and not stage_record(run_dir, e).complete]
    if not missing:
        return
    states = []
    for e in missing:
        prog = read_json(RunDir(run_dir).stage(e) / PROGRESS_FILE, None)
        prog = prog if isinstance(prog, dict) else {}
        done = f" at {prog.get('done')}/{prog.get('total')} {prog.get('unit', '')}".rstrip() if prog.get("total") else ""
        states.append(f"stage {e} ({STAGES[e]}) {prog.get('status', 'not started') if prog else 'not started'}{done}")
    stages = format_stages(range(min(missing), stage + 1))
    raise RunnerError(f"stage {stage} ({STAGES[stage]}) reads the outputs of stage {format_stages(missing)}, which "
                      f"is not complete: {'; '.join(states)}. Finish it first: `eagle3 run {again} --stages {stages}`.")


def _run_stages(run_dir: Path, params, params_file, nbs: dict[int, Path], redo_force: tuple[set[int], bool],
                kernel: str, again: str) -> None:
    """:func:`run_pipeline`'s stages, in order, under its lock (the run directory is prepared);
    ``again``: the params file and options, for the commands in messages.

    Raises:
        RunnerError: a stage's earlier stage did not end complete (:func:`require_earlier_complete`).
    """
    redo, force = redo_force
    for trash in run_dir.glob(".redo-*"):  # a stage folder a killed --redo was removing
        shutil.rmtree(trash, ignore_errors=True)
    require_kernel(kernel)
    print(f"eagle3: run directory {run_dir}", flush=True)
    for s, nb_in in nbs.items():
        if _to_run(run_dir, s, params, params_file, redo, force):
            require_earlier_complete(run_dir, s, params, again)
            _execute_stage(run_dir, s, nb_in, kernel, next_stage=s + 1 if s + 1 in nbs else None)


def _not_a_run_yet(target_dir: Path, selected: list[int], params_file, run_name, overrides) -> str:
    """The refusal of stages after 1 on a folder without ``params.yaml``, checked before anything is
    written (a mistyped run name would otherwise get a folder, then fail inside the stage's notebook
    on the missing samples)."""
    options = shlex.join([str(params_file), *params_options(run_name, overrides)])
    first = min(selected)
    return (f"{target_dir} is not a run yet (no {PARAMS_FILE}): stage {first} reads what stages "
            f"1-{first - 1} write there. Run them too: `eagle3 run {options} --stages "
            f"{format_stages(range(1, max(selected) + 1))}`, or name the run that has them (--run-name, or "
            f"its own params: `eagle3 run <run dir>/{PARAMS_FILE}`). Nothing was written.")


def _to_run(run_dir: Path, s: int, params, params_file, redo: set[int], force: bool) -> bool:
    """Whether stage ``s`` runs in this call, after re-opening it where :func:`run_pipeline`'s rule says so.

    Raises:
        StaleStage: ``s`` is complete, its inputs changed, and no earlier stage of ``redo`` covers it.
    """
    if s in redo:
        print(f"eagle3: {reopen_stage(run_dir, s, params)}", flush=True)
    elif stage_record(run_dir, s).complete and not force:
        reasons = stale_inputs(run_dir, s, params)
        if not reasons:
            print(f"eagle3: stage {s} ({STAGES[s]}) already complete, skipped", flush=True)
            return False
        if not (redo and s > min(redo)):
            raise StaleStage(stale_message(s, reasons, params_file))
        print(f"eagle3: {reopen_stage(run_dir, s, params)}", flush=True)
    return True


def _execute_stage(run_dir: Path, s: int, nb_in: Path, kernel: str, next_stage: int | None) -> None:
    """Run stage ``s``'s notebook ``nb_in`` into ``<run_dir>/notebooks/`` with papermill; ``next_stage``:
    the selected stage after it, if it is ``s + 1`` (where a run stopped after ``s`` resumes).

    Raises:
        StageFailed: a cell raised (the stage, the cell as the executed notebook labels it, the error).
        RunInterrupted: Ctrl-C during the stage (``stage``: the one to resume from).
        OSError: without a file name of its own (a write on a full disk), named ``out_nb``.
    """
    import papermill as pm

    out_nb = RunDir(run_dir).executed_dir / NOTEBOOKS[s]
    out_nb.parent.mkdir(exist_ok=True)
    print(f"eagle3: stage {s} ({STAGES[s]}) running {nb_in.name} (watch: eagle3 status {run_dir})", flush=True)
    # the kernel reads its OpenMP settings when it starts: chosen from the load of this moment
    kernel_env, openmp_note = openmp_for_start()
    if openmp_note:
        print(f"eagle3: stage {s} ({STAGES[s]}): {openmp_note}", flush=True)
    t0 = time.time()
    stopped = RunInterrupted(f"stage {s} ({STAGES[s]}) was interrupted (Ctrl-C)", stage=s, run_dir=run_dir)
    fwd = InterruptForwarder()
    try:
        # papermill saves the executed notebook after every cell and once more when the kernel died: on
        # a full disk that write fails with an OSError that names no file (naming_file names it)
        with fwd, ProgressEcho(run_dir / STAGES[s] / PROGRESS_FILE, f"stage {s} ({STAGES[s][3:]})"), \
                naming_file(out_nb):
            pm.execute_notebook(
                str(nb_in),
                str(out_nb),
                parameters={"params_file": str(run_dir / PARAMS_FILE), "run_dir": str(run_dir)},
                kernel_name=kernel,
                kernel_manager_class=fwd.manager_class(kernel_env),
                cwd=str(nb_in.parent),
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
            f"Executed notebook: {out_nb}"
        ) from None
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the kernel was up
        raise stopped from None
    print(f"eagle3: stage {s} ({STAGES[s]}) finished in {time.time() - t0:.0f} s", flush=True)
    if fwd.count:  # the stage ended before the interrupt reached its code: stop before the next one
        raise RunInterrupted(f"stopped after stage {s} ({STAGES[s]}) finished (Ctrl-C)",
                             stage=next_stage, run_dir=run_dir)
