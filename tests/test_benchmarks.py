"""The benchmarks' own bookkeeping: what they attribute time to must exist in the code they measure."""

from __future__ import annotations

import importlib.util
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
