"""``eagle3 verify RUN``: every integrity check of a run directory, as a list of problems."""

from __future__ import annotations

from pathlib import Path

from eagle3.errors import DamagedFile, RunnerError
from eagle3.rundir import EXTRACT, STAGES, SYNTHESIZE, TRAIN, VOCAB, RunDir, read_run_params
from eagle3.stage import stage_record, stale_inputs

__all__ = ["verify_run"]


def verify_run(run_dir: str | Path, check_values: bool = True, checked: list[str] | None = None) -> list[str]:
    """``eagle3 verify RUN``: every integrity check of a run directory; returns the problems found.
    ``checked``: a list that gets one line per check made (what, how many), which ``eagle3 verify``
    prints after the verdict.

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
    rd = RunDir(run_dir)
    if not rd.params_file.exists():
        raise RunnerError(f"{rd.root}: no {rd.params_file.name}; not a run directory")
    params = read_run_params(rd.root)
    checked = [] if checked is None else checked
    problems = []
    complete = [s for s in STAGES if stage_record(rd.root, s).complete]
    for s in complete:
        problems += [f"stage {s} ({STAGES[s]}) is stale: {r}" for r in stale_inputs(rd.root, s, params)]
    checked.append(f"inputs of the complete stages ({', '.join(map(str, complete)) or 'none'}) against the files "
                   f"and params now (sha256 of every recorded file)")
    if rd.extract_meta.exists() and rd.manifest.exists() and rd.tokenized("train").exists():
        from eagle3.contracts import hidden_states as hsc
        from eagle3.extract.prepare import load_rows

        sd = rd.stage(EXTRACT)
        rows = load_rows(rd.root)
        problems += hsc.check_manifest(hsc.read_manifest(sd), hsc.read_meta(sd), rows.ids, where=rd.manifest)
        rep = hsc.verify_folder(sd, rows, check_hashes=True, check_values=check_values)
        problems += [f"{p['file']}: row {p['row']} (id {p['id']}): {p['problem']}" for p in rep["problems"]]
        checked.append(f"stage 3: the manifest against meta.json and stage 2's {len(rows.ids):,} training rows; "
                       f"{rep['files']:,} hidden-state files, {rep['bytes'] / 2**20:,.1f} MiB (size, sha256, header, "
                       f"shapes, token ids, loss mask{', finite values' if check_values else ''})")
    problems += _verify_outputs(rd, checked)
    problems += _verify_train(rd, checked)
    return problems


def _verify_outputs(rd: RunDir, checked: list[str]) -> list[str]:
    """Stage 1's samples and Stage 2's splits of a complete stage whose next stage is not complete,
    read as that stage will read them: until it records them as its inputs, no staleness check does;
    what it checked goes to ``checked``."""
    from eagle3.contracts import tokenized
    from eagle3.contracts.samples import SamplesError, read_samples

    problems = []
    done = {s: stage_record(rd.root, s).complete for s in (SYNTHESIZE, VOCAB, EXTRACT)}
    if done[SYNTHESIZE] and not done[VOCAB]:
        try:
            read_samples(rd.root)
        except SamplesError as exc:
            problems.append(f"stage 1's samples: {exc}")
        checked.append("stage 1's samples (read as stage 2 reads them)")
    if done[VOCAB] and not done[EXTRACT]:
        problems += [f"{tokenized.split_path(rd.root, s)}: missing, unreadable or its row lengths disagree; redo stage "
                     f"2 (`--stages 2 --redo 2`)" for s in tokenized.SPLITS if not tokenized.split_complete(rd.root, s)]
        checked.append("stage 2's splits (footer, row counts)")
    return problems


def _verify_train(rd: RunDir, checked: list[str]) -> list[str]:
    """Stage 2's draft vocab mapping (readable, its sizes agreeing) and Stage 4's part of
    :func:`verify_run`: its checkpoints and its exported drafter, each against that mapping as it is
    now; what it checked goes to ``checked``."""
    from eagle3.contracts.drafter import verify_export
    from eagle3.contracts.vocab_mapping import VocabMappingError, mapping_digest, read_mapping
    from eagle3.train.checkpoint import verify_checkpoints

    problems, mapping = [], None
    if rd.mapping_json.exists():
        try:
            mapping = read_mapping(rd.root)
        except (VocabMappingError, DamagedFile) as exc:
            problems.append(f"stage 2's draft vocab mapping: {exc}")
    if not rd.stage(TRAIN).is_dir():
        return problems
    problems += verify_checkpoints(rd.checkpoints_dir, mapping_digest(mapping.d2t, mapping.t2d) if mapping else None)
    n = len(list(rd.checkpoints_dir.glob("step_*"))) if rd.checkpoints_dir.is_dir() else 0
    checked.append(f"stage 4: {n} checkpoint{'s' * (n != 1)} (every file loads, finite weights, the draft vocab "
                   f"mapping{' against stage 2' if mapping else ''})")
    # the export's own place; stats.json's path is absolute: in a moved or copied run it names another folder
    drafter = rd.drafter_dir
    if stage_record(rd.root, TRAIN).complete and not drafter.is_dir():
        problems.append(f"{drafter}: stage 4 is complete but its exported drafter is missing")
    elif (drafter / "config.json").is_file():
        problems += verify_export(drafter, mapping)
        where = drafter.relative_to(rd.root) if drafter.is_relative_to(rd.root) else drafter
        against = " against stage 2's" if mapping else ""
        checked.append(f"the exported drafter {where} (loads, finite values, its d2t/t2d{against})")
    return problems
