"""The benchmarks' own bookkeeping: what they attribute time to must exist in the code they measure."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench_train():
    spec = importlib.util.spec_from_file_location("bench_train_under_test", BENCH / "bench_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _defines(path_suffix: str, func: str) -> bool:
    """Whether a loaded module's file ending in ``path_suffix`` defines ``func`` (a def at any depth)."""
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None) or ""
        if f.replace("\\", "/").endswith(path_suffix):
            return f"def {func}(" in Path(f).read_text(encoding="utf-8")
    return False


def test_host_profile_parts_name_functions_that_exist():
    """A pattern of ``bench_train.py --host-profile`` that names a function the code no longer has
    printed 0% as if the part cost nothing (AdamW's ``step``, inherited from ``adam.py`` in torch
    2.13, and the loop's former ``__next__``): every part must name at least one function that exists."""
    import speculators.models.eagle3.core  # noqa: F401 - the modules the patterns point into
    import torch.nn.utils.clip_grad
    import torch.optim.adam
    import torch.optim.adamw  # noqa: F401

    import eagle3.stage.progress
    import eagle3.train.data
    import eagle3.train.loop
    import eagle3.train.metrics  # noqa: F401

    bt = _bench_train()
    missing = []
    for label, pattern in bt.HOST_PARTS.items():
        if pattern == "MicroBatches":  # matched by line: profiled below
            continue
        pats = (pattern,) if isinstance(pattern, str) else pattern
        if not any(_defines(*p.rsplit(":", 1)) for p in pats):
            missing.append(f"{label}: {pats}")
    assert not missing, missing


def test_host_profile_finds_the_loaders_generators():
    """The "next batch" part is found by line in a real profile of MicroBatches, with 0 loader threads
    (a generator expression of ``__iter__``) and 1 (``_threaded``), and takes the batches' time."""
    import cProfile
    import pstats
    import time

    from eagle3.train.data import MicroBatches

    bt = _bench_train()

    def slow_collate(items):
        time.sleep(0.02)  # the read + pack the part stands for
        return {"n": len(items)}

    for workers in (0, 1):
        pr = cProfile.Profile()
        pr.enable()
        got = [b["n"] for b in MicroBatches([[0, 1], [2], [3, 4, 5]], slow_collate, dataset=list(range(6)),
                                            num_workers=workers)]
        pr.disable()
        assert got == [2, 1, 3]
        stats = pstats.Stats(pr).stats
        found = sum(v[3] for k, v in stats.items() if bt.part_matches("MicroBatches", k))
        assert found >= 0.02 * (3 if workers == 0 else 1), (workers, found)
        # no other function of the package is taken for the loader
        assert not any(bt.part_matches("MicroBatches", k) for k in stats if not k[0].endswith("data.py"))


ROOT = BENCH.parent
DOCS = ("README.md", "CHANGELOG.md", "docs/USAGE.md", "docs/GPU.md", "benchmarks/RESULTS.md")


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_recipe_scripts_read_params_that_load():
    """benchmarks/gpu_recipe/pipeline.py runs the GPU recipe by default, and default_sweep/sweep.sh runs
    it on its own params file: both files exist and load, and every script sweep.sh calls exists."""
    from eagle3.params_file import load_params

    pipeline = _load(BENCH / "gpu_recipe" / "pipeline.py", "gpu_recipe_pipeline_under_test")
    assert pipeline.RUN_YAML == ROOT / "params" / "smollm2-135m-h200.yaml"
    recipe = load_params(pipeline.RUN_YAML)
    assert recipe.train.num_layers == 3 and recipe.train.optimizer == "muon" and recipe.extract.dtype == "float8_e4m3fn"
    sweep = (BENCH / "default_sweep" / "sweep.sh").read_text(encoding="utf-8")
    called = set(re.findall(r"\$W/(benchmarks/[\w/.-]+)", sweep))
    assert called == {"benchmarks/default_sweep/default-gpu.yaml", "benchmarks/gpu_recipe/pipeline.py",
                      "benchmarks/gpu_recipe", "benchmarks/default_sweep/sweep_eval.py"}, called
    assert all((ROOT / c).exists() for c in called), called
    default_gpu = load_params(BENCH / "default_sweep" / "default-gpu.yaml")
    assert default_gpu.target.dtype == "float32" and default_gpu.train.compile == "none"
    # the base its RESULTS table was measured with
    assert (default_gpu.train.optimizer, default_gpu.train.epochs) == ("adamw", 6)


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_documents_relative_links_and_anchors_resolve():
    """Every relative link and image of the user documents points at a file that exists, and a
    `#anchor` into a Markdown file at one of its headings."""
    bad = []
    for doc in DOCS:
        path = ROOT / doc
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append(f"{doc}: {target}")
            elif anchor and dest.suffix == ".md":
                heads = [_slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(encoding="utf-8"), re.M)]
                if anchor not in heads:
                    bad.append(f"{doc}: {target} (no such heading)")
    assert not bad, bad


def test_documents_name_files_and_make_targets_that_exist():
    """The params files, scripts and make targets the documents tell a user to run exist as spelled."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    bad = []
    for doc in DOCS:
        text = (ROOT / doc).read_text(encoding="utf-8")
        for rel in set(re.findall(r"(?<![\w/.-])((?:params|benchmarks|scripts|notebooks)/[\w./-]+\.(?:yaml|py|sh|png))", text)):
            if not (ROOT / rel).is_file() and not (ROOT / "benchmarks" / rel).is_file():
                bad.append(f"{doc}: {rel}")
        for target in set(re.findall(r"`make ([\w-]+)", text)):
            if target not in targets:
                bad.append(f"{doc}: make {target}")
    assert not bad, bad
