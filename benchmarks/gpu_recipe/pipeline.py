"""The GPU recipe's stages 1-4 called directly, without papermill or Jupyter, resumable step by step;
also the run directories of the data-scaling curve and of variants of stage-2/3 settings (draft vocab
size, hidden-state dtype; variants of what stages 4-5 read: `eagle3 sweep`).

usage (from the repository root, with the package importable):
  pipeline.py synth                  stage 1 of run `full` (self prompts, then the answers)
  pipeline.py restore DIR            stage 1 of run `full` from an earlier run's files in DIR
                                     (samples.jsonl, source_0.meta.json, source_0.stats.json): the
                                     self-written prompts are rebuilt from the samples (their `origin`
                                     line), so `synth` only finalizes, with no generation
  pipeline.py subsets 1000,4000      run dirs n<N>: synthesize.limit N (the first N of the same
                                     shuffled prompts), the full run's samples and self-prompt files
                                     copied, so stage 1 only finalizes them (the data-scaling curve)
  pipeline.py vocab full,n1000,...   stage 2 of each run dir, in parallel processes
  pipeline.py extract full,n1000,... stage 3 of each, one after the other (one process each)
  pipeline.py train full,n1000,...   stage 4 (+ export) of each, one after the other
  pipeline.py share full e6,...      run dirs of RECIPE_VARIANTS (JSON: name -> overrides, e.g.
                                     '{"e6": {"train": {"epochs": 6}}}') whose stages 1-3 are the base
                                     run's folders (symlinks): only stage 4 differs
                                     (SHARE_STAGES=1,2: only stages 1-2 shared, stage 3 its own)
  pipeline.py summary                one JSON line per run dir with the headline numbers
Environment: RECIPE_PARAMS (default params/smollm2-135m-h200.yaml), RECIPE_ROOT (the run directories'
parent, default outputs/gpu_recipe), RECIPE_SET (JSON overrides for every run dir), RECIPE_VARIANTS,
TRAIN_PARALLEL=1 (`train` runs its run dirs side by side: a small drafter leaves most of a GPU idle).
Epochs are held fixed across data sizes, so the steps grow with the data. Logs: RECIPE_ROOT/<name>.<stage>.log.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN_YAML = Path(os.environ.get("RECIPE_PARAMS", HERE.parents[1] / "params" / "smollm2-135m-h200.yaml"))
ROOT = Path(os.environ.get("RECIPE_ROOT", "outputs/gpu_recipe"))


def params_for(name: str):
    from eagle3.params_file import apply_overrides, load_params

    # RECIPE_SET: JSON overrides for every run dir (e.g. '{"synthesize": {"batch_size": 2048}}')
    extra = json.loads(os.environ.get("RECIPE_SET", "{}"))
    over = {"run": {"name": name, "output_dir": str(ROOT)}}
    variants = json.loads(os.environ.get("RECIPE_VARIANTS", "{}"))
    if name in variants:
        extra = apply_overrides(extra, variants[name])
    elif name != "full":
        over["synthesize"] = {"limit": int(name[1:])}
    return load_params(RUN_YAML, apply_overrides(extra, over))


def share(base: str, names: list[str]) -> None:
    """Run dirs that differ from `base` in stage 4 only: stages 1-3 are symlinks to base's folders."""
    from eagle3.rundir import EXTRACT, SYNTHESIZE, VOCAB, RunDir, prepare_run_dir

    for name in names:
        rd = prepare_run_dir(params_for(name), ROOT / name)
        # SHARE_STAGES=1,2: stage 3 differs too (e.g. extract.dtype), so only stages 1-2 are linked
        shared = [int(x) for x in os.environ.get("SHARE_STAGES", "1,2,3").split(",")]
        for stage in [s for s in (SYNTHESIZE, VOCAB, EXTRACT) if s in shared]:
            link = RunDir(rd).stage(stage)
            if not link.exists():
                link.symlink_to(RunDir(ROOT / base).stage(stage), target_is_directory=True)
        print("SHARE", name, "->", base, sorted(x.name for x in rd.iterdir()), flush=True)


def synth() -> None:
    from eagle3.rundir import prepare_run_dir
    from eagle3.synthesize import run

    p = params_for("full")
    rd = prepare_run_dir(p, ROOT / "full")
    t = time.time()
    st = run(p, rd)
    print("SYNTH", json.dumps({k: getattr(st, k) for k in st.HEADLINE} | {"wall_s": round(time.time() - t, 1),
                                                                            "load_s": st.load_s, "generation_s": st.generation_s}))


def restore(src: Path) -> None:
    """Stage 1 files of run dir `full` from an earlier run's samples (same params), without the target."""
    import shutil

    from eagle3.rundir import SELF_PROMPTS_DIR, SYNTHESIZE, RunDir, prepare_run_dir

    rd = prepare_run_dir(params_for("full"), ROOT / "full")
    d = RunDir(rd).stage(SYNTHESIZE, create=True)
    sp = d / SELF_PROMPTS_DIR
    sp.mkdir(parents=True, exist_ok=True)
    samples = (src / "samples.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    lines: dict[int, dict] = {}
    for line in samples:
        r = json.loads(line)
        if r["source"] == "self":  # origin ".../source_0.jsonl:<line>": the kept prompt's line, 1-based
            lines[int(r["origin"].rsplit(":", 1)[1])] = {"messages": r["messages"][:-1], "self_prompt": {}}
    if sorted(lines) != list(range(1, len(lines) + 1)):
        raise SystemExit(f"{src}: the self samples do not cover source_0.jsonl's lines 1..{len(lines)}")
    (sp / "source_0.jsonl").write_text("".join(json.dumps(lines[i], ensure_ascii=False) + "\n" for i in sorted(lines)),
                                       encoding="utf-8")
    for f in ("source_0.meta.json", "source_0.stats.json"):
        shutil.copy(src / f, sp / f)
    (d / "samples.jsonl").write_text("".join(samples), encoding="utf-8")
    print("RESTORE", len(samples), "samples,", len(lines), "self prompts", flush=True)


def subsets(sizes: list[int]) -> None:
    import shutil

    from eagle3.rundir import SYNTHESIZE, RunDir, prepare_run_dir
    from eagle3.synthesize import run

    full = RunDir(ROOT / "full")
    lines = (full.stage(SYNTHESIZE) / "samples.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    for n in sizes:
        p = params_for(f"n{n}")
        rd = prepare_run_dir(p, ROOT / f"n{n}")
        d = RunDir(rd).stage(SYNTHESIZE, create=True)
        src = full.stage(SYNTHESIZE) / "self_prompts"
        if src.is_dir() and not (d / "self_prompts").exists():
            shutil.copytree(src, d / "self_prompts")
        if not (d / "samples.jsonl").exists():  # every sample: stage 1 keeps those of its N prompts
            (d / "samples.jsonl").write_text("".join(lines), encoding="utf-8")
        st = run(p, rd)
        if st.extra_samples_not_in_prompts:
            # stage 1 keeps samples that are not among its prompts (after its own, in prompt order):
            # cut them, then let stage 1 finalize again so its stats describe the subset alone
            keep = (d / "samples.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
            keep = keep[: st.samples - st.extra_samples_not_in_prompts]
            (d / "samples.jsonl").write_text("".join(keep), encoding="utf-8")
            (d / "stats.json").unlink()
            st = run(p, rd)
        print("SUBSET", n, json.dumps({"samples": st.samples, "train": st.samples_train, "heldout": st.samples_heldout,
                                       "generated_this_session": st.generated_this_session,
                                       "extra": st.extra_samples_not_in_prompts}), flush=True)


def _launch(names: list[str], stage: str, parallel: bool = True) -> None:
    ROOT.mkdir(parents=True, exist_ok=True)
    procs = {}
    t0, bad = time.time(), []
    for name in names:
        log = open(ROOT / f"{name}.{stage}.log", "a")
        procs[name] = subprocess.Popen([sys.executable, __file__, f"_{stage}", name], stdout=log, stderr=subprocess.STDOUT)
        if not parallel:
            procs[name].wait()
    for name, pr in procs.items():
        rc = pr.wait()
        print(f"{stage} {name}: rc {rc} after {time.time() - t0:.1f} s", flush=True)
        if rc:
            bad.append(name)
            print((ROOT / f"{name}.{stage}.log").read_text()[-3000:], flush=True)
    if bad:
        raise SystemExit(f"{stage} failed: {bad}")


def _vocab(name: str) -> None:
    from eagle3.vocab import run

    t = time.time()
    st = run(params_for(name), ROOT / name)
    d = st.to_dict()
    flat = {k: v for k, v in d.items() if not isinstance(v, (list, dict))}
    print("VOCAB", name, json.dumps(flat | {"wall_s": round(time.time() - t, 1)}, default=str))


def _extract(name: str) -> None:
    from eagle3.extract import run

    t = time.time()
    st = run(params_for(name), ROOT / name)
    d = st.to_dict() if st is not None else {}
    flat = {k: v for k, v in d.items() if not isinstance(v, (list, dict))}
    print("EXTRACT", name, json.dumps(flat | {"wall_s": round(time.time() - t, 1)}, default=str))


def _train(name: str) -> None:
    from eagle3.train import run

    t = time.time()
    st = run(params_for(name), ROOT / name)
    d = st.to_dict()
    flat = {k: v for k, v in d.items() if not isinstance(v, (list, dict))}
    print("TRAIN", name, json.dumps(flat | {"wall_s": round(time.time() - t, 1)}, default=str))


def summary() -> None:
    from eagle3.io import read_json

    for rd in sorted(ROOT.iterdir()):
        if not rd.is_dir():
            continue
        out = {"run": rd.name}
        for stage in ("01_synthesize", "02_vocab", "03_extract", "04_train"):
            s = read_json(rd / stage / "stats.json")
            if s:
                out[stage] = {k: v for k, v in s.items() if not isinstance(v, (list, dict))}
        print("SUMMARY", json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "synth":
        synth()
    elif cmd == "restore":
        restore(Path(sys.argv[2]))
    elif cmd == "subsets":
        subsets([int(x) for x in sys.argv[2].split(",")])
    elif cmd == "vocab":
        _launch(sys.argv[2].split(","), cmd)
    elif cmd == "share":
        share(sys.argv[2], sys.argv[3].split(","))
    elif cmd == "extract":  # one at a time: each has the GPU to itself
        _launch(sys.argv[2].split(","), cmd, parallel=False)
    elif cmd == "train":
        _launch(sys.argv[2].split(","), cmd, parallel=os.environ.get("TRAIN_PARALLEL") == "1")
    elif cmd == "_vocab":
        _vocab(sys.argv[2])
    elif cmd == "_extract":
        _extract(sys.argv[2])
    elif cmd == "_train":
        _train(sys.argv[2])
    elif cmd == "summary":
        summary()
    else:
        raise SystemExit(__doc__)
    sys.stdout.flush()
