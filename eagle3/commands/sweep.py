"""``eagle3 sweep``: recipe variants of one run (stages 4-5 only), compared in one table.

A recipe study (learning rate, drafter depth, TTT steps, ...) changes only what stages 4 and 5 read
(``train.*``, ``evaluate.*``), so every variant trains on the same samples, vocab mapping and hidden
states as its base run. ``eagle3 sweep PARAMS --vary train.lr=1e-3,2e-3 --vary train.num_layers=1,2``
runs:

1. the base run (``PARAMS``, ``--set``, ``--run-name``) through :func:`eagle3.commands.run.run_pipeline`:
   its stages 1-3 and the selected stages 4-5, each skipped when finished;
2. one variant run per combination of the ``--vary`` values (their cartesian product), named by
   :func:`variant_name`, beside the base in the same output folder. Its stages 1-3 are the base's
   finished stage folders shared by hard links (hidden states are never copied: where a hard link is
   impossible, another file system, the sweep stops with :class:`eagle3.errors.RunnerError`); each
   shared stage's ``inputs.json`` is the base's record plus ``shared_from``
   (:func:`eagle3.stage.record_shared`). Its stages 4-5 then run through ``run_pipeline`` as those of
   any run: a finished stage skipped, a stale one refused, an interrupted one resumed, so the same
   command after a kill resumes every variant where it stopped;
3. the comparison (:func:`comparison_table`): ``<output_dir>/<base>--sweep.md``, printed too, and the
   same runs on one page, ``<output_dir>/<base>--sweep.html`` (:mod:`eagle3.commands.compare`: curves,
   every measurement per set, category and position).

A variant's shared stages are the base's: redo stages 1-3 in the base, never in a variant (a stage
resuming in place would append to files the base holds too). A base stage finished again since a
variant shared it is refused for that variant (:func:`share_stages`), with the folder to remove.

The variants run one after another, or ``--parallel N`` at a time (:func:`run_parallel`): each its own
process, its output in ``<variant>/sweep.log``. A small drafter leaves most of a GPU idle (four variants
of the GPU recipe's 135M-target drafter train side by side on one H100 in about the time of two); on a
CPU the variants share the cores, so one at a time is as fast.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.commands.run import KERNEL, format_stages, params_options, run_pipeline
from eagle3.errors import ParamsError, RunInterrupted, RunnerError
from eagle3.io import atomic_write_text
from eagle3.params_file import load_params, params_fingerprint
from eagle3.rundir import EVALUATE, EXTRACT, STAGES, STATS_FILE, SYNTHESIZE, TRAIN, VOCAB, RunDir, prepare_run_dir
from eagle3.stage import record_shared, shared_from, stage_record

__all__ = ["SWEEP_SECTIONS", "SHARED_STAGES", "Variant", "parse_vary", "variant_name", "plan_variants",
           "parse_variants", "share_stages", "run_parallel", "sweep_rows", "comparison_table", "run_sweep"]

# the params sections that only stages 4 and 5 read: the ones a variant may change
SWEEP_SECTIONS = ("train", "evaluate")
# the stages a variant shares with its base run
SHARED_STAGES = (SYNTHESIZE, VOCAB, EXTRACT)
SWEEP_FILE = "{base}--sweep.md"  # beside the runs, in the base's output folder
SWEEP_LOG = "sweep.log"  # in each run folder of a --parallel sweep: its process's output
_SHARING = ".sharing-"  # a stage folder being linked (renamed into place when complete)


@dataclass(frozen=True)
class Variant:
    """One combination of ``--vary`` values.

    Attributes:
        name: the run name (:func:`variant_name`).
        values: ``{dotted key: value as typed}``, in ``--vary`` order.
    """

    name: str
    values: dict[str, str]

    @property
    def overrides(self) -> list[str]:
        """The ``--set`` items of this variant (``["train.lr=1e-3", ...]``)."""
        return [f"{k}={v}" for k, v in self.values.items()]


def _split_values(raw: str) -> list[str]:
    """``'1e-3,2e-3'`` -> ``['1e-3', '2e-3']``; commas inside ``[]`` / ``{}`` stay (a YAML list is one value)."""
    out, depth, cur = [], 0, ""
    for ch in raw:
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()]


def parse_vary(items: list[str], overrides: list[str] | None = None) -> dict[str, list[str]]:
    """``["train.lr=1e-3,2e-3", ...]`` -> ``{"train.lr": ["1e-3", "2e-3"], ...}`` (values as typed,
    parsed as YAML later, as ``--set`` values are).

    Raises:
        ParamsError: an item without ``=`` or a value; a key outside :data:`SWEEP_SECTIONS` (it is read
            by stages 1-3, which a variant shares with its base: such a change needs a run of its own);
            a key varied twice or also given by ``--set``.
    """
    out: dict[str, list[str]] = {}
    fixed = {o.split("=", 1)[0].strip() for o in overrides or []}
    for item in items:
        key, eq, raw = item.partition("=")
        key = key.strip()
        values = _split_values(raw) if eq else []
        if not key or not values or "" in values:
            raise ParamsError(f"--vary {item!r} must look like section.key=VALUE1,VALUE2 (e.g. train.lr=1e-3,2e-3)")
        _check_key(key, "--vary")
        if key in out or key in fixed:
            raise ParamsError(f"--vary {key}: the key is given twice (another --vary or a --set); list every value "
                              f"in one --vary {key}=A,B")
        out[key] = values
    return out


def _check_key(key: str, flag: str) -> None:
    """Raises ParamsError: ``key`` is outside :data:`SWEEP_SECTIONS` (read by stages 1-3, which a variant
    shares with its base: such a change needs a run of its own)."""
    section = key.split(".", 1)[0]
    if section not in SWEEP_SECTIONS or "." not in key:
        raise ParamsError(
            f"{flag} {key}: {section}.* is read by stages 1-3, which every variant shares with the base run "
            f"(hard links); a variant of it needs stages 1-3 of its own: make it a run of its own "
            f"(`eagle3 run PARAMS --set {key}=VALUE --run-name NAME`). A sweep varies "
            f"{' and '.join(s + '.*' for s in SWEEP_SECTIONS)} (read by stages 4-5 only).")


def parse_variants(base: str, items: list[str], overrides: list[str] | None = None) -> list[Variant]:
    """Named variants, one per ``--variant NAME:KEY=VALUE[,KEY=VALUE...]`` (one setting or several
    changed together beside the base, e.g. ``ttt7:train.ttt_steps=7,train.ttt_step_loss_decay=0.9``),
    run name ``<base>--NAME``; commas inside ``[]`` / ``{}`` stay in their value.

    Raises:
        ParamsError: a NAME other than letters, digits, ``.``, ``_``, ``-``, or given twice; a setting
            without ``=``; a key outside :data:`SWEEP_SECTIONS`, twice in one variant or given by ``--set``.
    """
    fixed = {o.split("=", 1)[0].strip() for o in overrides or []}
    out: list[Variant] = []
    for item in items:
        name, colon, rest = item.partition(":")
        if not colon or not re.fullmatch(r"[A-Za-z0-9._-]+", name) or any(v.name == f"{base}--{name}" for v in out):
            raise ParamsError(f"--variant {item!r} must look like NAME:section.key=VALUE[,section.key=VALUE...] with a "
                              f"NAME of its own of letters, digits, '.', '_' or '-' (e.g. muon:train.optimizer=muon)")
        values: dict[str, str] = {}
        for setting in _split_values(rest):
            key, eq, value = (x.strip() for x in setting.partition("="))
            if not key or not eq or not value or key in values:
                raise ParamsError(f"--variant {name}: {setting!r} must be section.key=VALUE, each key once")
            _check_key(key, f"--variant {name}:")
            if key in fixed:
                raise ParamsError(f"--variant {name}: {key} is also given by --set; leave it out of one of them")
            values[key] = value
        out.append(Variant(f"{base}--{name}", values))
    return out


def _short_keys(keys: list[str]) -> dict[str, str]:
    """Each dotted key's last part (``train.lr`` -> ``lr``), the whole key where two share it."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def variant_name(base: str, values: dict[str, str]) -> str:
    """The run name of a variant: ``<base>--<key>-<value>`` per varied key, in ``--vary`` order, e.g.
    ``ci--lr-1e-3--num_layers-2``. ``<key>`` is the key's last part (``train.lr`` -> ``lr``; the whole
    dotted key where two varied keys end alike); ``<value>`` is the value as typed, every character
    other than a letter, digit, ``.``, ``_`` or ``-`` replaced by ``_`` (a folder name on any system)."""
    short = _short_keys(list(values))
    parts = [f"{short[k]}-{re.sub(r'[^A-Za-z0-9._-]+', '_', v).strip('_') or '_'}" for k, v in values.items()]
    return "--".join([base, *parts])


def plan_variants(base: str, vary: dict[str, list[str]]) -> list[Variant]:
    """One :class:`Variant` per combination of the values (the cartesian product, first key slowest).

    Raises:
        ParamsError: a value given twice for one key; two combinations whose names are the same (values
            that differ only in characters a folder name cannot hold).
    """
    for key, values in vary.items():
        if len(set(values)) < len(values):
            raise ParamsError(f"--vary {key}: a value is given twice ({', '.join(values)}); list each once")
    out = [Variant(variant_name(base, dict(zip(vary, combo))), dict(zip(vary, combo)))
           for combo in itertools.product(*vary.values())]
    names = [v.name for v in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ParamsError(f"--vary: values that differ only in characters a folder name cannot hold give the same "
                          f"run name {dup[0]}; write them so that they differ in letters, digits, '.', '_' or '-'")
    return out


def _link_tree(src: Path, dst: Path) -> None:
    """Recreate ``src``'s folders under ``dst`` and hard-link every file (symlinks copied as links).

    Raises:
        RunnerError: a hard link is impossible (another file system, a file system without them).
    """
    for root, dirs, files in os.walk(src):  # a symlink to a folder is listed in dirs, never entered
        here = dst / Path(root).relative_to(src)
        here.mkdir(parents=True, exist_ok=True)
        for name in [*(d for d in dirs if (Path(root) / d).is_symlink()), *files]:
            s = Path(root) / name
            try:
                if s.is_symlink():
                    os.symlink(os.readlink(s), here / name)
                else:
                    os.link(s, here / name)
            except OSError as exc:
                raise RunnerError(
                    f"cannot hard-link {s} into {here} ({exc.strerror}): a sweep shares the base run's stages "
                    f"1-3 by hard links and never copies them (hidden states can be hundreds of GiB). Put the "
                    f"variants on the base run's file system (the same run.output_dir).") from None


def share_stages(base_dir: str | Path, run_dir: str | Path) -> None:
    """Give the variant ``run_dir`` the base run's finished stages 1-3 (:data:`SHARED_STAGES`) as hard
    links, each stage folder linked under a temporary name and renamed into place (a killed sweep
    leaves no half-linked stage folder: the next one removes the rest), its ``inputs.json`` recorded
    by :func:`eagle3.stage.record_shared`. A stage already there is checked instead: its
    ``stats.json`` must be the base's own file (the same inode; a base stage finished again since
    writes a new one).

    Raises:
        RunnerError: a base stage not complete; a stage of ``run_dir`` that is not (or no longer)
            the base's (the message names the folder to remove); a hard link impossible.
    """
    base, rd = RunDir(base_dir), RunDir(run_dir)
    for trash in rd.root.glob(_SHARING + "*"):
        shutil.rmtree(trash)
    for s in SHARED_STAGES:
        src, dst = base.stage(s), rd.stage(s)
        if not stage_record(base_dir, s).complete:
            raise RunnerError(f"stage {s} ({STAGES[s]}) of the base run {base.root} is not complete: a variant "
                              f"shares only finished stages (run the base's stages 1-3 first)")
        if not dst.exists():
            tmp = rd.root / f"{_SHARING}{dst.name}"
            _link_tree(src, tmp)
            tmp.rename(dst)
        elif not (dst / STATS_FILE).exists() or not os.path.samefile(src / STATS_FILE, dst / STATS_FILE):
            why = (f"holds an earlier state of the base's stage (the base's {STAGES[s]} finished again since the "
                   f"variant shared it), so its stages 4-5 were made from other data" if shared_from(run_dir, s)
                   else "is a stage of its own, not the base's shared one")
            raise RunnerError(f"{dst} {why}. Remove {rd.root} and run the sweep again: the variant then shares "
                              f"the base's stages and runs stages 4-5 on them.")
        if shared_from(run_dir, s) is None:
            record_shared(run_dir, s, src)


def _variant_stages(stages: list[int] | None) -> list[int]:
    """The variants' stages (default 4-5). Raises ParamsError for a stage 1-3 (shared, never run)."""
    sel = sorted(set(stages or (TRAIN, EVALUATE)))
    if set(sel) - {TRAIN, EVALUATE}:
        raise ParamsError(f"eagle3 sweep --stages {format_stages(sel)}: a sweep runs stages 4-5 of its variants "
                          f"(their stages 1-3 are the base run's, shared); use --stages 4, 5 or 4-5")
    return sel


def _prepare_variant(base_dir: Path, variant: Variant, params_file, stages: list[int],
                     overrides: list[str]) -> list[str]:
    """Create the variant's run folder beside the base (its ``params.yaml``; refused when the folder
    holds a run of other params) and share stages 1-3; returns the variant's ``--set`` items."""
    ov = [*overrides, f"run.output_dir={base_dir.parent}", *variant.overrides]
    params = load_params(params_file, [*ov, f"run.name={variant.name}"])
    print(f"eagle3 sweep: variant {variant.name} ({', '.join(variant.overrides)})", flush=True)
    prepare_run_dir(params, base_dir.parent / variant.name, params_file=params_file, stages=stages,
                    options=params_options(variant.name, ov))
    share_stages(base_dir, base_dir.parent / variant.name)
    return ov


def _pipeline_process(job: dict, log: str) -> None:
    """A ``--parallel`` sweep's child process: ``run_pipeline(**job)`` with stdout and stderr in ``log``;
    exit code 0, 130 after Ctrl-C, 1 after an error (its message the log's last line)."""
    from eagle3.errors import Eagle3Error

    with open(log, "a", encoding="utf-8") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)
    sys.stderr = sys.stdout
    try:
        run_pipeline(**job)
    except (RunInterrupted, KeyboardInterrupt) as exc:
        print(f"eagle3 sweep: {exc or 'interrupted (Ctrl-C)'}", flush=True)
        sys.exit(130)
    except Eagle3Error as exc:
        first = (str(exc).splitlines() or [""])[0]
        print(f"{exc}\neagle3 sweep: {type(exc).__name__}: {first}", flush=True)  # the last line: what failed
        sys.exit(1)


def _last_line(path: Path) -> str:
    lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"


def run_parallel(jobs: dict[Path, dict], parallel: int) -> None:
    """Run ``run_pipeline(**job)`` for every ``{run_dir: job}``, at most ``parallel`` processes at once,
    each printing into ``<run_dir>/sweep.log``; a line when each starts and ends.

    Raises:
        RunInterrupted: Ctrl-C (the children stop their stages too: they share the terminal's signal).
        RunnerError: a run failed; the message names each with its log's last line and the log.
    """
    ctx, waiting, active, failed = multiprocessing.get_context("spawn"), list(jobs), {}, []
    try:
        while waiting or active:
            while waiting and len(active) < parallel:
                rd = waiting.pop(0)
                proc = ctx.Process(target=_pipeline_process, args=(jobs[rd], str(rd / SWEEP_LOG)), daemon=False)
                proc.start()
                active[rd] = (proc, time.time())
                print(f"eagle3 sweep: {rd.name} started ({len(active)} running; output: {rd / SWEEP_LOG})", flush=True)
            for rd, (proc, t0) in list(active.items()):
                if proc.exitcode is None:
                    continue
                del active[rd]
                print(f"eagle3 sweep: {rd.name} {'finished' if proc.exitcode == 0 else f'exited {proc.exitcode}'} "
                      f"after {time.time() - t0:.0f} s", flush=True)
                if proc.exitcode:
                    failed.append(f"{rd.name}: {_last_line(rd / SWEEP_LOG)} (log: {rd / SWEEP_LOG})")
            time.sleep(0.2)
    except KeyboardInterrupt:
        for proc, _ in active.values():
            proc.join()
        raise RunInterrupted("the sweep was interrupted (Ctrl-C)", stage=None, run_dir=None) from None
    if failed:
        raise RunnerError(f"{len(failed)} of {len(jobs)} sweep run(s) failed; the others finished: " + "; ".join(failed))


def run_sweep(params_file: str | Path, vary: list[str], stages: list[int] | None = None,
              overrides: list[str] | None = None, run_name: str | None = None, kernel: str = KERNEL,
              notebooks: str | Path | None = None, parallel: int = 1, variants: list[str] | None = None) -> Path:
    """``eagle3 sweep`` (module docstring): the base run, each variant's stages 4-5 (the grid of ``vary``,
    then the named ``variants``: :func:`parse_variants`) (``parallel`` runs at
    a time: :func:`run_parallel`, the base's stages 4-5 among them), the comparison; returns the
    comparison file ``<output_dir>/<base>--sweep.md``.

    Every variant's params are validated before anything runs. A combination equal to the base's
    params (a ``--vary`` value that is the base's own) is the base run: not run twice.

    Raises:
        ParamsError: a ``--vary`` or ``--variant`` refused (:func:`parse_vary`, :func:`parse_variants`),
            neither given, ``--stages`` outside 4-5, invalid params, ``parallel`` below 1.
        RunInterrupted: Ctrl-C (the message says that the same command resumes every run).
        RunnerError, StaleStage, StageFailed: as :func:`eagle3.commands.run.run_pipeline` and
            :func:`share_stages` raise them; with ``parallel`` > 1 a failed run is a RunnerError naming its log.
    """
    overrides = list(overrides or [])
    stages = _variant_stages(stages)
    keys = parse_vary(vary, overrides)
    parse_variants("", variants or [], overrides)  # refused before anything runs
    if not keys and not variants:
        raise ParamsError("eagle3 sweep needs at least one --vary section.key=VALUE1,VALUE2 or --variant "
                          "NAME:section.key=VALUE")
    if parallel < 1:
        raise ParamsError(f"eagle3 sweep --parallel {parallel}: give 1 (one run at a time) or more")
    base_ov = [*overrides, *([f"run.name={run_name}"] if run_name else [])]
    base_print = params_fingerprint(load_params(params_file, base_ov))
    same = [v.values for v in [*(plan_variants("", keys) if keys else []), *parse_variants("", variants or [])]
            if params_fingerprint(load_params(params_file, [*base_ov, *v.overrides])) == base_print]
    job = {"params_file": params_file, "stages": stages, "kernel": kernel, "notebooks": notebooks}
    try:
        base_dir = run_pipeline(params_file, sorted({*SHARED_STAGES, *([] if parallel > 1 else stages)}), run_name,
                                overrides, kernel, notebooks=notebooks)
        jobs, notes = {base_dir: {**job, "run_name": run_name, "overrides": overrides}}, []
        grid = plan_variants(base_dir.name, keys) if keys else []
        for v in [*grid, *parse_variants(base_dir.name, variants or [], overrides)]:
            if v.values in same:
                notes.append(f"{v.name}: the base's own params, its row is the base run's")
                continue
            ov = _prepare_variant(base_dir, v, params_file, stages, overrides)
            if parallel == 1:
                run_pipeline(**job, run_name=v.name, overrides=ov)
            jobs[base_dir.parent / v.name] = {**job, "run_name": v.name, "overrides": ov}
        if parallel > 1:
            try:
                run_parallel(jobs, parallel)
            except RunnerError:  # the runs that finished are compared all the same
                _write_comparison(base_dir, list(jobs), _compared_keys(keys, variants), notes)
                raise
    except RunInterrupted as exc:
        raise RunInterrupted(f"{exc}; the same `eagle3 sweep` command resumes every run where it stopped "
                             f"(finished ones are skipped)", stage=exc.stage, run_dir=exc.run_dir) from None
    table = _write_comparison(base_dir, list(jobs), _compared_keys(keys, variants), notes)
    _comparison_page(base_dir, list(jobs), kernel, notebooks)
    return table


def _comparison_page(base_dir: Path, runs: list[Path], kernel: str, notebooks) -> Path | None:
    """The runs on one page, ``<output_dir>/<base>--sweep.html`` (:func:`eagle3.commands.compare.compare_runs`);
    a page that cannot be made (a failed cell, a machine without nbconvert, a full disk) is one line with
    the reason and the command that makes it again: the table and the runs stand, so the sweep has not
    failed (the rule of :func:`eagle3.commands.report.render_after_run`). Returns the page, or None."""
    import shlex

    from eagle3.commands.compare import compare_runs

    page = base_dir.parent / f"{base_dir.name}--sweep.html"
    try:
        return compare_runs(runs, page, kernel, notebooks)
    except Exception as exc:  # noqa: BLE001 - every run and the table stand whatever broke the page
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        again = shlex.join(["eagle3", "compare", *map(str, runs), "--out", str(page)])
        print(f"eagle3 sweep: the comparison page was not made ({reason}); the table above and the runs stand; "
              f"make it with `{again}`", flush=True)
        return None


def _compared_keys(keys: dict[str, list[str]], variants: list[str] | None) -> list[str]:
    """The comparison's columns: the ``--vary`` keys, then those the named variants set."""
    named = [k for item in variants or [] for k in parse_variants("", [item])[0].values]
    return list(dict.fromkeys([*keys, *named]))


def _write_comparison(base_dir: Path, runs: list[Path], keys: list[str], notes: list[str]) -> Path:
    """Write and print the comparison of ``runs`` (:func:`comparison_table`); returns its file."""
    page = ["the same runs on one page, with their training curves and every measurement per set, category "
            f"and position: `{base_dir.name}--sweep.html` beside this file (`eagle3 sweep` writes it after this "
            "table; `eagle3 compare RUN_DIR ...` compares any runs)"]
    text = comparison_table(base_dir.name, sweep_rows(runs, keys), keys, [*notes, *page])
    out = base_dir.parent / SWEEP_FILE.format(base=base_dir.name)
    atomic_write_text(out, text)
    print(text, flush=True)
    print(f"eagle3 sweep: comparison written to {out}", flush=True)
    return out


def sweep_rows(run_dirs: list[Path], keys: list[str]) -> list[dict]:
    """One row per run: ``run`` (folder name), ``values`` (``{key: value}`` of its ``params.yaml``),
    ``val_tau_hat`` (stage 4's best validation τ̂, the exported drafter's), ``train_time_s`` and ``sets``
    (``{set: {"tau", "tpf_ngram"}}``: vLLM τ of the drafter, tokens per target forward of vLLM's n-gram
    lookup); a number is None where its stage is not complete. Read
    through :func:`eagle3.stage.stage_record` and :func:`eagle3.evaluate.stats.read_stats`."""
    from eagle3.evaluate.methods import VLLM_EAGLE3, VLLM_NGRAM
    from eagle3.evaluate.stats import read_stats, value_at

    rows = []
    for rd in map(Path, run_dirs):
        dump = load_params(RunDir(rd).params_file).model_dump(mode="json")
        train = stage_record(rd, TRAIN)
        st = read_stats(rd) if stage_record(rd, EVALUATE).complete else None
        sets = {name: {"tau": s.get(VLLM_EAGLE3, "tau"), "tpf_ngram": s.get(VLLM_NGRAM, "tokens_per_forward")}
                for name, s in (st.sets if st else {}).items()}
        rows.append({"run": rd.name, "values": {k: value_at(dump, k) for k in keys},
                     "val_tau_hat": train.stats.get("best_val_tau_hat") if train.complete else None,
                     "train_time_s": train.stats.get("train_time_s") if train.complete else None, "sets": sets})
    return rows


def _num(x, fmt: str = "{:.3f}") -> str:
    return "—" if x is None else fmt.format(x)


def comparison_table(base: str, rows: list[dict], keys: list[str], notes: list[str] = ()) -> str:
    """The sweep's Markdown page: a title, a table with one row per run (:func:`sweep_rows`; the
    evaluation sets as the runs name them, in their order) and what the columns mean."""
    sets = list(dict.fromkeys(name for r in rows for name in r["sets"]))
    short = _short_keys(keys)
    head = ["run", *(short[k] for k in keys), "val τ̂", "train time",
            *(f"{s}: drafter τ (n-gram tokens/forward)" for s in sets)]
    lines = [f"# Sweep of {base}", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [f"`{r['run']}`", *(str(r["values"][k]) for k in keys), _num(r["val_tau_hat"]),
                 _num(r["train_time_s"], "{:.0f} s")]
        for s in sets:
            m = r["sets"].get(s, {})
            cells.append(f"{_num(m.get('tau'))} ({_num(m.get('tpf_ngram'))})")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "val τ̂: stage 4's best validation τ̂ (the exported drafter's); train time: stage 4's optimizer "
              "steps, batches included (its validation, checkpoints, start-up and export are not); per evaluation set, "
              "stage 5's vLLM τ of the drafter, which is also its tokens per target forward (it drafts every round, "
              "one target forward each), and in brackets the tokens per target forward of vLLM's n-gram lookup on the "
              "same prompts (its τ counts only the rounds where it found a match); —: the stage has not finished.",
              *(f"- {n}" for n in notes), ""]
    return "\n".join(lines)
