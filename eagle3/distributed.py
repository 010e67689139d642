"""The one distributed context and the one ``torchrun`` launcher (Stages 3 and 4).

Topology comes from the environment ``torchrun`` sets (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``),
read here and nowhere else (speculators' ``train/distributed.py`` rule: a single source of truth
that every other module asks). One process (no ``torchrun``) is world size 1 and every collective
is a no-op, so the stages run the same code with and without data parallelism.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DistContext", "in_torchrun", "launch_torchrun"]


def in_torchrun() -> bool:
    """True in a process started by ``torchrun`` (``WORLD_SIZE`` and ``RANK`` are set)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@dataclass
class DistContext:
    """This process's place in the job and the collectives the stages use.

    Attributes:
        rank, world, local_rank: from torchrun's environment (0, 1, 0 without it).
        device: the torch device this rank computes on (None when the stage picks it itself).
        owns_group: True when :meth:`from_env` created the process group (:meth:`close` destroys it).
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: Any = None
    owns_group: bool = False

    @classmethod
    def from_env(cls, device: str | None = None, backend: str | None = None,
                 timeout: datetime.timedelta | None = None) -> DistContext:
        """Join the job torchrun started (or a world of one).

        Args:
            device: ``"cpu"``, ``"cuda"`` or ``"cuda:i"``; under torchrun ``cuda`` becomes
                ``cuda:LOCAL_RANK`` (and is made current); None leaves ``device`` unset.
            backend: process-group backend; default NCCL for a CUDA device, gloo otherwise.
            timeout: collective timeout (default torch's).

        Returns:
            DistContext: joined; call :meth:`close` when done.
        """
        import torch

        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        dev = device
        owns = False
        if world > 1:
            import torch.distributed as dist

            if dev is not None and dev.startswith("cuda"):
                dev = f"cuda:{local}"
                torch.cuda.set_device(local)
            if not dist.is_initialized():
                be = backend or ("nccl" if dev is not None and dev.startswith("cuda") else "gloo")
                kw = {"timeout": timeout} if timeout is not None else {}
                dist.init_process_group(backend=be, **kw)
                owns = True
        elif dev == "cuda":
            dev = "cuda:0"
        return cls(rank=rank, world=world, local_rank=local,
                   device=torch.device(dev) if dev is not None else None, owns_group=owns)

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes shared files."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (no-op in a world of one)."""
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def all_sum(self, t):
        """Sum ``t`` over ranks in place (a tensor on this rank's device); returns ``t``."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def gather(self, obj: Any) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        """Destroy the process group when this context created it."""
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.owns_group = False


def launch_torchrun(module: str, params_file: str | Path, run_dir: str | Path, nproc: int,
                    extra_args: Sequence[str] = (), omp_threads: bool = False) -> tuple[int, list[str]]:
    """Run ``python -m module PARAMS --run-dir RUN_DIR`` under ``torchrun --standalone`` and wait.

    Args:
        module: the stage's entry module (``eagle3.extract``, ``eagle3.train``).
        params_file: the resolved params written for the ranks to read.
        nproc: processes (``--nproc-per-node``).
        extra_args: more arguments for the module.
        omp_threads: set ``OMP_NUM_THREADS`` to ``cpus // nproc`` unless already set (CPU ranks
            would otherwise oversubscribe the cores).

    Returns:
        tuple: ``(exit code, command)``.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, str(params_file), "--run-dir", str(run_dir), *extra_args]
    env = dict(os.environ)
    if omp_threads:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    print(f"eagle3: data parallel: {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, env=env, check=False).returncode, cmd
