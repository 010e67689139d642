"""Every path of a run, in one place.

A run directory (``<run.output_dir>/<run.name>``) holds ``params.yaml``, the executed notebooks, one
folder per stage and ``report/``::

    params.yaml
    run.lock        the writer now (pid, host, command; empty when none: eagle3.stage.lock)
    notebooks/      the executed stage notebooks (eagle3 run)
    01_synthesize/  samples.jsonl, progress.json, stats.json, inputs.json (every stage)
    02_vocab/       train.parquet, heldout.parquet, vocab_mapping.safetensors, mapping.json, ...
    03_extract/     meta.json, manifest.jsonl, preflight.json, rows_*/NNNNNN.safetensors
    04_train/       metrics.jsonl, checkpoints/step_NNNNNN/, drafter/ (config.json, model.safetensors)
    05_evaluate/    results.json
    report/         index.html, one HTML page per executed notebook, figures/

Stage folder names live here and nowhere else (``tests/test_hygiene.py`` checks it). A module that
reads a file another stage wrote asks :class:`RunDir` for its path::

    rd = RunDir(run_dir)
    rd.samples                 # 01_synthesize/samples.jsonl
    rd.tokenized("heldout")    # 02_vocab/heldout.parquet
    rd.stage(3)                # 03_extract/ (created by rd.stage(3, create=True))

The file names of each stage (``samples.jsonl``, ...) are module constants too, for code that
already holds a stage folder. See docs/DESIGN.md "Stage contracts" for what each file contains.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from eagle3.errors import ParamsError

__all__ = [
    "STAGES",
    "NOTEBOOKS",
    "SYNTHESIZE",
    "VOCAB",
    "EXTRACT",
    "TRAIN",
    "EVALUATE",
    "PARAMS_FILE",
    "PROGRESS_FILE",
    "STATS_FILE",
    "INPUTS_FILE",
    "RunDir",
    "project_root",
    "source_root",
    "check_run_location",
    "notebooks_dir",
    "notebook_path",
    "resolve_run_dir",
    "stage_dir",
    "prepare_run_dir",
    "read_run_params",
]

# Stage numbers, for readable call sites: ``rd.stage(EXTRACT)``.
SYNTHESIZE, VOCAB, EXTRACT, TRAIN, EVALUATE = 1, 2, 3, 4, 5

# Stage number -> folder name inside the run directory (DESIGN.md "Stage contracts").
STAGES: dict[int, str] = {
    SYNTHESIZE: "01_synthesize",
    VOCAB: "02_vocab",
    EXTRACT: "03_extract",
    TRAIN: "04_train",
    EVALUATE: "05_evaluate",
}
# Stage number -> notebook file under notebooks/.
NOTEBOOKS: dict[int, str] = {
    SYNTHESIZE: "01_synthesize.ipynb",
    VOCAB: "02_vocab_coverage.ipynb",
    EXTRACT: "03_extract_hidden_states.ipynb",
    TRAIN: "04_train_drafter.ipynb",
    EVALUATE: "05_evaluate_acceptance.ipynb",
}

# Files every stage folder has / the run directory has.
PARAMS_FILE = "params.yaml"
PROGRESS_FILE = "progress.json"
STATS_FILE = "stats.json"
INPUTS_FILE = "inputs.json"  # digests of the upstream files a finished stage consumed (eagle3.stage)
REPORT_DIR = "report"
EXECUTED_DIR = "notebooks"  # the stage notebooks as `eagle3 run` executed them
LOCK_FILE = "run.lock"  # the one writer's lock (eagle3.stage.lock.RunLock)

# Stage 1
SAMPLES_FILE = "samples.jsonl"
SELF_PROMPTS_DIR = "self_prompts"  # the target's self-written prompts (eagle3.synthesize.self_prompt)
# Stage 2
TOKENIZED_FILE = "{split}.parquet"  # split: "train" | "heldout"
VOCAB_MAPPING_FILE = "vocab_mapping.safetensors"
MAPPING_JSON_FILE = "mapping.json"
TOKEN_COUNTS_FILE = "token_counts.npy"
HELDOUT_TOKEN_COUNTS_FILE = "heldout_token_counts.npy"
# Stage 3
EXTRACT_META_FILE = "meta.json"
MANIFEST_FILE = "manifest.jsonl"
PREFLIGHT_FILE = "preflight.json"
# Stage 4
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
DRAFTER_DIR = "drafter"
# Stage 5
RESULTS_FILE = "results.json"
OFFLINE_RECORDS_FILE = "offline_records.jsonl"
ENGINE_LOGS_DIR = "logs"  # vllm_<method>.log of each measurement
VLLM_RESULT_FILE = "vllm_{method}.json"  # method: eagle3 | ngram | none; the job beside it as .job.json

# What a stage starting over on changed inputs keeps (eagle3.commands.run.reopen_stage; globs in the stage
# folder): files whose reuse the stage's own resume decides by content, so that a start-over, or one
# interrupted and run again on the earlier params, redoes none of the work they hold. Stage 1: the
# self-written prompts (they depend on the target and the self-prompting settings, never on the prompt
# files); stage 5: the offline records and each vLLM measurement, reused only where their resume key
# (drafter weights, prompts, settings) matches.
START_OVER_KEEPS = {1: (SELF_PROMPTS_DIR,),
                    # + .job.json; the engine logs of the measurements kept (the report links them)
                    5: (OFFLINE_RECORDS_FILE, VLLM_RESULT_FILE.format(method="*"), ENGINE_LOGS_DIR)}


def source_root() -> Path | None:
    """The repository this package runs from (the folder holding pyproject.toml above it); None for an
    installed package."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / "pyproject.toml").exists() else None


def project_root() -> Path:
    """The repository root (:func:`source_root`), else the cwd."""
    return source_root() or Path.cwd()


def check_run_location(run_dir: str | Path) -> None:
    """Refuse a run directory inside the source tree other than its git-ignored ``outputs/``
    (``run.output_dir: eagle3``): the run's files, gigabytes of them, would show as changes to commit,
    and stage folders inside ``eagle3/`` would be packaged with the code.

    Also refuse a run directory that cannot be a folder: it, or the nearest existing path above it
    (``run.output_dir`` itself), is a file, a device or a pipe.

    Raises:
        ParamsError: names the folder (or the path in its way) and the way out.
    """
    from eagle3.io import path_kind

    src = source_root()
    rd = Path(run_dir).expanduser().resolve()
    if src is not None and rd.is_relative_to(src) and not rd.is_relative_to(src / "outputs"):
        raise ParamsError(f"run directory {rd} lies inside the project's source tree ({src}): its files would be "
                          f"committed (or packaged) with the code. Set run.output_dir to outputs (git-ignored) or to "
                          f"a folder outside {src}.")
    for p in (rd, *rd.parents):
        kind, words = path_kind(p)
        if kind == "folder":
            break
        if kind != "missing":
            raise ParamsError(f"run directory {rd} cannot be made: {p} is {words}, not a folder. Set "
                              f"run.output_dir (or --run-name) to a folder.")


def notebooks_dir() -> Path:
    """``<project_root>/notebooks``."""
    return project_root() / "notebooks"


def notebook_path(stage: int) -> Path:
    """``<project_root>/notebooks/<NN_name>.ipynb`` of stage 1..5."""
    return notebooks_dir() / NOTEBOOKS[stage]


def resolve_run_dir(params) -> Path:
    """``<run.output_dir>/<run.name>``, a relative output_dir taken from the project root (absolute)."""
    out = Path(params.run.output_dir).expanduser()
    if not out.is_absolute():
        out = project_root() / out
    return (out / params.run.name).resolve()


def stage_dir(run_dir: str | Path, stage: int, create: bool = True) -> Path:
    """``<run_dir>/<NN_name>`` for stage 1..5; created when ``create``."""
    d = Path(run_dir) / STAGES[stage]
    if create:
        d.mkdir(parents=True, exist_ok=True)
    return d


def prepare_run_dir(params, run_dir: str | Path | None = None, redo=(), params_file: str | Path | None = None,
                    stages=None, options=()) -> Path:
    """Create (or re-open) the run directory and write the resolved ``params.yaml`` into it.

    A run directory belongs to one set of params: re-opening it with params whose results would
    differ is refused, so that no stage ever mixes outputs of two configurations. Tracking settings
    and names may change between calls. Params that only one stage reads
    (:data:`eagle3.params_file.STAGE_OWN_SECTIONS`: ``evaluate.*``, stage 5) may change when that stage is
    in ``redo`` (it is measured again on the new params; the earlier stages' outputs stay), and are
    ignored when that stage is not among ``stages``: a stage-1 notebook or ``eagle3 run --stages 1-4``
    with the default params, on a run whose stage 5 measured the user's own sets, runs its stages
    (which never read ``evaluate.*``) and keeps the run's ``params.yaml``, the record of what stage 5
    measured. The written ``params.yaml`` names the folder it lies in (``run.name`` = the folder's
    name, where that is a valid run name), so that it resolves to this run whoever opens it.

    Args:
        params: the resolved :class:`eagle3.config.Params`.
        run_dir: the folder; default ``resolve_run_dir(params)``.
        redo: the stages this call redoes (``eagle3 run --redo``).
        params_file: the params file the user gave, named in the command of the refusal.
        stages: the stages this call runs or shows (``eagle3 run --stages``, a notebook's own stage);
            None = every stage.
        options: the command-line options the refusal's suggested command repeats (``--set``,
            ``--run-name``), so that the command it names runs the params that were refused.

    Returns:
        Path: the run directory.

    Raises:
        ParamsError: the folder lies in the source tree (:func:`check_run_location`) or cannot be made
            (a path on a file system without folders, ``/proc``); ``params.yaml``
            exists with a different fingerprint (the message lists the keys
            and what to do: the ``--redo`` command for a one-stage change, else a new run name).
    """
    # params_file imports config and errors; imported here so that `rundir` stays importable
    # from config-free code (the report).
    from eagle3.io import atomic_write_text
    from eagle3.params_file import dump_params

    rd = Path(run_dir) if run_dir is not None else resolve_run_dir(params)
    check_run_location(rd)
    try:
        rd.mkdir(parents=True, exist_ok=True)
    except (FileNotFoundError, NotADirectoryError) as exc:  # a file system that holds no folders (/proc)
        raise ParamsError(f"run directory {rd} cannot be made ({exc.strerror}: {exc.filename}). Set "
                          f"run.output_dir (or --run-name) to a folder on a disk.") from None
    pfile = rd / PARAMS_FILE
    if pfile.exists() and not _replaces_recorded(read_run_params(rd), params, rd, redo, stages, params_file, options):
        return rd
    text = dump_params(_named_after(params, rd.resolve().name))
    if not (pfile.is_file() and pfile.read_text(encoding="utf-8") == text):  # a finished run opened: left as it is
        atomic_write_text(pfile, text)
    return rd


def read_run_params(run_dir: str | Path):
    """The params a run was made with, from its ``params.yaml``.

    An empty file is not the default params (which an empty params file of the user's means): the
    run's record was cut (a full disk, a truncated copy), and reading it as the defaults would refuse
    the run's own params or, worse, accept the defaults on its outputs.

    Raises:
        ParamsError: the file is empty, missing or unreadable, or not valid params (the loader's message).
    """
    from eagle3.params_file import load_params

    pfile = Path(run_dir) / PARAMS_FILE
    way_out = "restore it from a copy or the executed notebooks' parameters, or delete the run folder to start over"
    try:
        empty = pfile.is_file() and not pfile.read_bytes().strip()
    except OSError as exc:
        raise ParamsError(f"the run's {PARAMS_FILE} ({pfile}) cannot be read: {exc.strerror}") from None
    if empty:
        raise ParamsError(f"the run's {PARAMS_FILE} ({pfile}) is empty, so what the run was made with is unknown: "
                          f"{way_out}.")
    try:
        return load_params(pfile)
    except ParamsError as exc:
        raise ParamsError(f"the run's {PARAMS_FILE} cannot be used ({way_out}): {exc}") from None


def _replaces_recorded(old, params, rd: Path, redo, stages, params_file, options) -> bool:
    """:func:`prepare_run_dir`'s rule for a run whose ``params.yaml`` holds ``old``: True when
    ``params`` are written over it (the same fingerprint, or only the own params of a stage in
    ``redo`` differ); False when only the own params of a stage outside ``stages`` differ (the run's
    file is kept). Raises ParamsError (:func:`_params_refusal`) for any other difference."""
    from eagle3.params_file import STAGE_OWN_SECTIONS, changed_stage, diff_params, params_fingerprint

    if params_fingerprint(old) == params_fingerprint(params):
        return True
    s, diffs = changed_stage(old, params), diff_params(old, params)
    if s is not None and stages is not None and s not in set(stages):
        # only params of a stage this call does not run differ: the stages run here do not read
        # them, and the run's params.yaml stays the record that stage's outputs were made with
        print(f"eagle3: these params differ from the run's only in {_own_section(s)}.* (read by stage {s} alone, "
              f"which this call does not run); the run's {PARAMS_FILE} is kept: " + "; ".join(diffs), flush=True)
        return False
    if s is None or s not in set(redo or ()):
        raise ParamsError(_params_refusal(rd, diffs, s, STAGE_OWN_SECTIONS, params_file, options))
    # accepted: one stage's own params, that stage redone; say what changed
    print("eagle3: params changed since this run was made (the stage that reads them is redone): "
          + "; ".join(diffs), flush=True)
    return True


def _named_after(params, folder: str):
    """``params`` with ``run.name`` = ``folder``: the run's ``params.yaml`` names the folder it lies in,
    whichever params file opened it, so that it resolves to this run and not to the run its params
    file named. A folder name that is no valid run name keeps the params' own."""
    if params.run.name == folder:
        return params
    try:
        return params.model_copy(update={"run": type(params.run)(**(params.run.model_dump() | {"name": folder}))})
    except ValueError:  # pydantic's ValidationError
        return params


def _own_section(stage: int) -> str:
    """The params section that ``stage`` alone reads (:data:`eagle3.params_file.STAGE_OWN_SECTIONS`)."""
    from eagle3.params_file import STAGE_OWN_SECTIONS

    return next(k for k, v in STAGE_OWN_SECTIONS.items() if v == stage)


def _params_refusal(rd: Path, diffs: list[str], stage: int | None, own: dict[str, int], params_file,
                    options=()) -> str:
    pf = str(params_file) if params_file else "PARAMS"
    # the user's --set/--run-name: without them the suggested command would redo the stage on the file's params
    again = (" " + shlex.join(options)) if options else ""
    msg = (f"Run directory {rd} was created with different params ({rd / PARAMS_FILE}); refusing to mix "
           f"outputs of two configurations. Differences:\n  " + "\n  ".join(diffs) + "\n")
    # the way back to the run as it was made (after stage 5 was redone on the user's own sets, the
    # default params again would otherwise leave only ways that drop those sets)
    reopen = (f" To re-open this run as it was made, use its own params: `eagle3 run {rd / PARAMS_FILE}` "
              f"(in a notebook's parameters cell: params_file = \"{rd / PARAMS_FILE}\", run_dir = \"{rd}\").")
    if stage is not None:
        # the file's other settings of that section replace the run's (a user's own evaluation sets would
        # go missing that way): the run's own params with the same options change only what they name
        keep = (f" To change only what your options name and keep the run's other {_own_section(stage)}.* settings, "
                f"start from its own params: `eagle3 run {rd / PARAMS_FILE}{again} --stages {stage} --redo {stage}`."
                if again else "")
        return msg + (f"They are {_own_section(stage)}.* only, which stage {stage} ({STAGES[stage]}) alone reads: redo that "
                      f"stage on this run with `eagle3 run {pf}{again} --stages {stage} --redo {stage}` (the earlier "
                      f"stages' outputs are kept), or start a new run with --run-name NEW_NAME." + keep + reopen)
    allowed = ", ".join(f"{k}.* (with --redo {v})" for k, v in own.items())
    return msg + (f"Only {allowed} may change on an existing run. Start a new run with --run-name NEW_NAME "
                  f"(or run.name=...), or delete {rd}." + reopen)


class RunDir:
    """The paths of one run directory. Pure path arithmetic: nothing is read, and nothing is created
    except by :meth:`stage` with ``create=True`` (whether a stage is complete: :func:`eagle3.stage.stage_record`).

    Args:
        root: the run directory (``resolve_run_dir(params)``).
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    def __fspath__(self) -> str:
        return str(self.root)

    # ------------------------------------------------------------------ every stage
    def stage(self, stage: int, create: bool = False) -> Path:
        """``<root>/<NN_name>`` of stage 1..5 (created when ``create``)."""
        return stage_dir(self.root, stage, create=create)

    def progress(self, stage: int) -> Path:
        """``<NN_name>/progress.json``: the live state of a stage (:class:`eagle3.stage.Progress`)."""
        return self.stage(stage) / PROGRESS_FILE

    def stats(self, stage: int) -> Path:
        """``<NN_name>/stats.json``: a finished stage's numbers (``complete: true``; :func:`eagle3.stage.stage_record`)."""
        return self.stage(stage) / STATS_FILE

    def inputs(self, stage: int) -> Path:
        """``<NN_name>/inputs.json``: sha256 of every earlier stage's file the finished stage consumed."""
        return self.stage(stage) / INPUTS_FILE

    @property
    def params_file(self) -> Path:
        """``params.yaml``: the resolved params the run was made with."""
        return self.root / PARAMS_FILE

    @property
    def lock_file(self) -> Path:
        """``run.lock``: who writes the run now (:class:`eagle3.stage.lock.RunLock`)."""
        return self.root / LOCK_FILE

    @property
    def executed_dir(self) -> Path:
        """``notebooks/``: the stage notebooks as ``eagle3 run`` executed them (with their outputs)."""
        return self.root / EXECUTED_DIR

    @property
    def report_dir(self) -> Path:
        """``report/``: index.html and the HTML pages of the executed notebooks."""
        return self.root / REPORT_DIR

    # ------------------------------------------------------------------ stage 1
    @property
    def samples(self) -> Path:
        """``01_synthesize/samples.jsonl``: one conversation per line."""
        return self.stage(SYNTHESIZE) / SAMPLES_FILE

    # ------------------------------------------------------------------ stage 2
    def tokenized(self, split: str) -> Path:
        """``02_vocab/{split}.parquet`` for split "train" or "heldout": token ids and loss masks."""
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        return self.stage(VOCAB) / TOKENIZED_FILE.format(split=split)

    @property
    def vocab_mapping(self) -> Path:
        """``02_vocab/vocab_mapping.safetensors``: d2t / t2d tensors."""
        return self.stage(VOCAB) / VOCAB_MAPPING_FILE

    @property
    def mapping_json(self) -> Path:
        """``02_vocab/mapping.json``: vocab sizes, cache key and coverage of the mapping."""
        return self.stage(VOCAB) / MAPPING_JSON_FILE

    @property
    def token_counts(self) -> Path:
        """``02_vocab/token_counts.npy``: loss-masked token counts of the train split (int64, [V])."""
        return self.stage(VOCAB) / TOKEN_COUNTS_FILE

    @property
    def heldout_token_counts(self) -> Path:
        """``02_vocab/heldout_token_counts.npy``: the same for the held-out split."""
        return self.stage(VOCAB) / HELDOUT_TOKEN_COUNTS_FILE

    # ------------------------------------------------------------------ stage 3
    @property
    def extract_meta(self) -> Path:
        """``03_extract/meta.json``: aux hidden state layer ids, hidden size, dtype, data fingerprint."""
        return self.stage(EXTRACT) / EXTRACT_META_FILE

    @property
    def manifest(self) -> Path:
        """``03_extract/manifest.jsonl``: one line per hidden-state file (row, id, file, bytes, sha256)."""
        return self.stage(EXTRACT) / MANIFEST_FILE

    @property
    def preflight(self) -> Path:
        """``03_extract/preflight.json``: projected bytes and free disk before extraction."""
        return self.stage(EXTRACT) / PREFLIGHT_FILE

    # ------------------------------------------------------------------ stage 4
    @property
    def train_metrics(self) -> Path:
        """``04_train/metrics.jsonl``: one record per logged train step / validation."""
        return self.stage(TRAIN) / METRICS_FILE

    @property
    def checkpoints_dir(self) -> Path:
        """``04_train/checkpoints/``: ``step_NNNNNN/`` folders (weights, optimizer, rng, state)."""
        return self.stage(TRAIN) / CHECKPOINTS_DIR

    @property
    def drafter_dir(self) -> Path:
        """``04_train/drafter/``: the exported speculators-format drafter (config.json, model.safetensors)."""
        return self.stage(TRAIN) / DRAFTER_DIR

    def evaluated_drafter(self, params) -> Path:
        """The drafter stage 5 measures: ``evaluate.drafter_dir`` when set, else this run's own export
        (:attr:`drafter_dir`).

        Never the path stage 4's ``stats.json`` recorded: that one is absolute, so in a moved or copied
        run directory it names the old folder (or the original run's drafter, measured as this one's).
        """
        ext = getattr(getattr(params, "evaluate", None), "drafter_dir", None)
        return Path(ext).expanduser() if ext else self.drafter_dir

    # ------------------------------------------------------------------ stage 5
    @property
    def evaluate_results(self) -> Path:
        """``05_evaluate/results.json``: τ offline / vLLM / n-gram and the parity check."""
        return self.stage(EVALUATE) / RESULTS_FILE

    @property
    def offline_records(self) -> Path:
        """``05_evaluate/offline_records.jsonl``: one offline EAGLE-3 decoding record per prompt, each
        with the resume key of its inputs."""
        return self.stage(EVALUATE) / OFFLINE_RECORDS_FILE

    def vllm_result(self, method: str) -> Path:
        """``05_evaluate/vllm_<method>.json``: one vLLM measurement, ``job_key`` its inputs' resume key."""
        return self.stage(EVALUATE) / VLLM_RESULT_FILE.format(method=method)
