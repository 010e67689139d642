"""The ``eagle3`` command line: ``run``, ``sweep``, ``status``, ``verify``, ``report``, ``compare``, ``params``.

Exit codes: 0 success; 2 a usage error or an :class:`eagle3.errors.Eagle3Error` (bad params, a
missing target, a failed stage, a stale stage, ...: one clean message on stderr, no traceback);
1 from ``verify`` when it found problems; 130 after Ctrl-C (``run`` prints the command that
resumes); anything else is a bug and propagates with its full traceback (exit 1).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
import time
from pathlib import Path

__all__ = ["main"]

# OSErrors that describe the machine, with the fix; any other OSError keeps its traceback.
_ENVIRONMENT_ERRNOS = {
    errno.ENOSPC: "the disk is full: free space or set run.output_dir to a larger disk",
    errno.EDQUOT: "the disk quota is used up: free space or set run.output_dir elsewhere",
    errno.EROFS: "the file system is read-only: set run.output_dir to a writable folder",
    errno.EACCES: "no permission: set run.output_dir to a folder you can write, or fix its owner",
}

_SET_HELP = ("override one params key, e.g. --set train.lr=0.003 --set synthesize.limit=64 (repeatable; VALUE "
             "is parsed as YAML); an integer part indexes a list, e.g. --set synthesize.sources.1.self_prompt.count=2000 "
             "(the default's second source)")

# the default run's folder (`make run`), the one a reader has
_RUN_DIR_HELP = "the run directory, <run.output_dir>/<run.name>, e.g. outputs/smollm2-135m (the default run)"


def _seconds(text: str) -> float:
    """``--watch``'s value: a finite number of seconds, 0 or more (argparse names the option on error)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def _build_parser() -> argparse.ArgumentParser:
    from eagle3.commands.run import KERNEL

    p = argparse.ArgumentParser(prog="eagle3", description="Train EAGLE-3 drafters and measure their acceptance in vLLM.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    r = sub.add_parser("run", help="execute the stage notebooks with papermill")
    r.add_argument("params", help="params YAML file, e.g. params/smollm2-135m.yaml")
    r.add_argument("--stages", default="1-5", help="stages to run, e.g. 1-5, 3, 2,4-5, 3- (3 to 5) (default 1-5)")
    r.add_argument("--run-name", default=None, help="run name (default: run.name from params)")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help=_SET_HELP)
    r.add_argument("--kernel", default=KERNEL, help=f"Jupyter kernel (default: {KERNEL})")
    r.add_argument("--no-report", action="store_true", help="do not render the HTML report at the end")
    r.add_argument("--redo", default=None, metavar="STAGES",
                   help="re-open these stages even if complete, e.g. --redo 3: a stage whose inputs changed starts "
                        "over, else it re-checks its files and redoes the broken ones; later selected stages whose "
                        "inputs change with it are redone too")
    r.add_argument("--remeasure-speed", action="store_true",
                   help="measure stage 5's tokens/s again (the kept timing is dropped; acceptance is reused): "
                        "implies --redo 5")
    r.add_argument("--check-machine", action="store_true",
                   help="print the machine line (CPU features, the target's dtype and why, the expected duration) "
                        "and run nothing")

    v = sub.add_parser("verify", help="check a run directory's files: stale stages, manifest, hidden-state sha256s")
    v.add_argument("run_dir", help=_RUN_DIR_HELP)
    v.add_argument("--no-values", action="store_true", help="skip the finite-values check (hashes only)")

    s = sub.add_parser("status", help="show each stage's progress for a run directory")
    s.add_argument("run_dir", help=_RUN_DIR_HELP)
    s.add_argument("--watch", type=_seconds, default=None, metavar="SECONDS", help="refresh every SECONDS")

    rep = sub.add_parser("report", help="render the executed notebooks and an index page to HTML")
    rep.add_argument("run_dir", help=_RUN_DIR_HELP)

    sw = sub.add_parser("sweep", help="recipe variants of a run (train.*, evaluate.*): stages 4-5 each, one comparison")
    sw.add_argument("params", help="params YAML file of the base run, e.g. params/ci.yaml")
    sw.add_argument("--vary", action="append", default=[], metavar="SECTION.KEY=V1,V2",
                    help="values of one train.* or evaluate.* key (repeatable: one variant per combination)")
    sw.add_argument("--stages", default="4-5", help="the variants' stages: 4, 5 or 4-5 (default 4-5)")
    sw.add_argument("--run-name", default=None, help="the base run's name (default: run.name from params)")
    sw.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help=_SET_HELP)
    sw.add_argument("--kernel", default=KERNEL, help=f"Jupyter kernel (default: {KERNEL})")
    sw.add_argument("--variant", dest="variants", action="append", default=[], metavar="NAME:SECTION.KEY=V[,...]",
                    help="a named variant beside the grid: one setting or several changed together, run <base>--NAME "
                    "(e.g. ttt7:train.ttt_steps=7,train.ttt_step_loss_decay=0.9); repeatable")
    sw.add_argument("--parallel", type=int, default=1, metavar="N",
                    help="runs at a time (stages 4-5 of the base and the variants; default 1): on one GPU a small "
                    "drafter leaves room for several, e.g. 4; each run's output goes to <run folder>/sweep.log")

    c = sub.add_parser("compare", help="several runs side by side on one self-contained HTML page")
    c.add_argument("run_dirs", nargs="+", metavar="RUN", help="run directories, e.g. outputs/ci outputs/ci--lr-0.002")
    c.add_argument("--out", default=None, metavar="FILE.html",
                   help="the page (default: beside the first run, <run>--vs--<run>.html)")
    c.add_argument("--kernel", default=KERNEL, help=f"Jupyter kernel (default: {KERNEL})")

    pp = sub.add_parser("params", help="validate a params file and print the resolved params")
    pp.add_argument("params", help="params YAML file, e.g. params/ci.yaml")
    pp.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help=_SET_HELP)
    return p


def _run(args: argparse.Namespace) -> int:
    """The stages, then the report; a report that cannot be rendered is a warning, exit 0 (the stages'
    results stand: :func:`eagle3.commands.report.render_after_run`)."""
    from eagle3.commands.report import print_result, render_after_run
    from eagle3.commands.run import check_machine, parse_stages, run_pipeline

    if args.check_machine:
        print(check_machine(args.params, args.run_name, args.overrides), flush=True)
        return 0
    redo = parse_stages(args.redo, "--redo") if args.redo else None
    run_dir = run_pipeline(args.params, parse_stages(args.stages), args.run_name, args.overrides, args.kernel,
                           redo=redo, remeasure_speed=args.remeasure_speed)
    if not args.no_report:
        render_after_run(run_dir)
    print_result(run_dir)  # the answer last: the result table, parity, warnings, the serve command
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from eagle3.commands.run import parse_stages
    from eagle3.commands.sweep import run_sweep

    run_sweep(args.params, args.vary, parse_stages(args.stages), args.overrides, args.run_name, args.kernel,
              parallel=args.parallel, variants=args.variants)
    return 0


def _status(args: argparse.Namespace) -> int:
    from eagle3.commands.status import format_status

    if not Path(args.run_dir).is_dir():
        print(f"eagle3 status: {args.run_dir} is not a run directory", file=sys.stderr)
        return 2
    try:
        while True:
            print(format_status(args.run_dir), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.watch)
            print()
    except KeyboardInterrupt:  # Ctrl-C is how --watch ends: nothing went wrong
        print()
        return 0


def _verify(args: argparse.Namespace) -> int:
    from eagle3.commands.verify import verify_run

    checked: list[str] = []
    problems = verify_run(args.run_dir, check_values=not args.no_values, checked=checked)
    for line in problems:
        print(line)
    print(f"eagle3 verify: {len(problems)} problem(s) in {args.run_dir}" if problems
          else f"eagle3 verify: {args.run_dir}: no problem found", flush=True)
    print("checked: " + "; ".join(checked), flush=True)
    return 1 if problems else 0


def _report(args: argparse.Namespace) -> int:
    from eagle3.commands.report import render_report, single_file_line

    print(render_report(args.run_dir))
    print(single_file_line(args.run_dir))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from eagle3.commands.compare import compare_runs

    compare_runs(args.run_dirs, args.out, args.kernel)
    return 0


def _params(args: argparse.Namespace) -> int:
    from eagle3.params_file import dump_params, load_params

    print(dump_params(load_params(args.params, args.overrides)), end="")
    return 0


_COMMANDS = {"run": _run, "status": _status, "verify": _verify, "report": _report, "params": _params,
             "sweep": _sweep, "compare": _compare}


def invocation() -> list[str]:
    """This process's own command, as it works from the current directory: the console script as it
    was typed (``.venv/bin/eagle3``, ``eagle3``), ``<venv python> -m eagle3`` when started so (``make
    run`` does: the venv's ``bin`` need not be on PATH), else ``eagle3``."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "eagle3":
        return [sys.argv[0]]
    if argv0.name == "__main__.py" and argv0.parent.name == "eagle3":
        rel = os.path.relpath(sys.executable)
        return [sys.executable if rel.startswith("..") else rel, "-m", "eagle3"]
    return ["eagle3"]


def _interrupted_message(args: argparse.Namespace, exc) -> str:  # exc: a RunInterrupted or None
    """What ``eagle3 run`` says after a Ctrl-C: what stopped, that its files are kept, the exact
    command that resumes (the same options, the stages from the interrupted one on)."""
    import shlex

    from eagle3.commands.run import KERNEL, format_stages, params_options, parse_stages, resume_stages

    prog = invocation()
    cmd = [*prog, "run", args.params]
    if exc is not None and exc.stage is not None:
        stages, redo = resume_stages(exc.stage, parse_stages(args.stages),
                                     parse_stages(args.redo, "--redo") if args.redo else None)
        cmd += ["--stages", format_stages(stages)] + (["--redo", format_stages(redo)] if redo else [])
    else:
        cmd += ["--stages", args.stages] + (["--redo", args.redo] if args.redo else [])
    cmd += params_options(args.run_name, args.overrides)
    cmd += (["--kernel", args.kernel] if args.kernel != KERNEL else []) + (["--no-report"] if args.no_report else [])
    what = str(exc) if exc is not None else "interrupted (Ctrl-C)"
    where = f" (`{shlex.join([*prog, 'status', str(exc.run_dir)])}` shows it)" if exc is not None and exc.run_dir else ""
    return (f"\neagle3: {what}. What was written is kept{where}; each stage resumes its own work.\n"
            f"eagle3: resume with: {shlex.join(cmd)}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``eagle3`` console script; returns the process exit code.

    Raises:
        Exception: anything that is not an :class:`eagle3.errors.Eagle3Error` (a bug: full traceback).
    """
    from eagle3.errors import Eagle3Error, RunInterrupted

    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 2
    try:
        return _COMMANDS[args.cmd](args)
    except RunInterrupted as exc:
        print(_interrupted_message(args, exc) if args.cmd == "run" else f"\neagle3: {exc}", file=sys.stderr, flush=True)
        return 130  # 128 + SIGINT, as a shell reports a Ctrl-C'd program
    except KeyboardInterrupt:  # outside a stage (run: before the first one, the report), status --watch, ...
        print(_interrupted_message(args, None) if args.cmd == "run" else "\neagle3: interrupted (Ctrl-C)",
              file=sys.stderr, flush=True)
        return 130
    except Eagle3Error as exc:
        print(f"eagle3: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # before OSError, its base class
        # `eagle3 status RUN | head`: the reader closed the pipe. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again, and exit like a piped Unix tool.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE
    except OSError as exc:
        # A full disk or a read-only / foreign run directory is the machine's state, not a bug.
        if exc.errno not in _ENVIRONMENT_ERRNOS:
            raise
        where = f": {exc.filename}" if exc.filename else ""  # a failed write() names no file
        print(f"eagle3: {exc.strerror}{where} ({_ENVIRONMENT_ERRNOS[exc.errno]})", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
