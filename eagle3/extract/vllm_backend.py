"""Stage 3 with vLLM: the ``extract_hidden_states`` speculative method, driven as speculators does.

The path the motivating run took at scale (tensor parallel targets). Three pieces, all upstream:

1. ``vllm serve TARGET`` with ``--speculative-config '{"method": "extract_hidden_states",
   "num_speculative_tokens": 1, "draft_model_config": {"hf_config":
   {"eagle_aux_hidden_state_layer_ids": [aux..., N]}}}'`` and ``--kv-transfer-config
   '{"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
   "kv_connector_extra_config": {"shared_storage_path": STAGING}}'`` (speculators'
   ``scripts/launch_vllm.py``; the connector writes ``hidden_states [seq, n_layers, hidden]`` in
   the model dtype and ``token_ids [seq]`` per request, layers in layer order, id N before the norm);
2. speculators' offline client ``python -m speculators generate-offline-data --endpoint URL
   --preprocessed-data <stage 3>/vllm_input --output <stage 3>/vllm_raw`` (one ``max_tokens=1``
   completion per sample, files renamed to ``hs_<i>.safetensors``, ``i`` = index in the input);
3. adoption (here): each ``hs_<i>.safetensors`` is checked (token ids equal the row's, shape
   ``[seq, n_aux + 1, hidden]``, finite), cast to ``extract.dtype``, given its loss mask and written
   in Stage 3's layout (:mod:`eagle3.contracts.hidden_states`) with a manifest line, exactly as the
   transformers backend writes it; the raw file is then deleted (``extract.vllm_keep_raw`` keeps it).

The connector needs a GPU (CUDA streams, pinned memory), so :func:`run_vllm` refuses on a CPU-only
machine unless ``extract.vllm_endpoint`` points at a server elsewhere that shares this filesystem.
To launch by hand what :func:`run_vllm` does (e.g. the server on its own node), print the two
commands for a params file and run them (Stage 2 must be done: the input rows come from it)::

    python -c "from eagle3.extract.vllm_backend import print_commands; print_commands('params/kimi-k2.5.yaml')"
    # -> vllm serve <target> --host 127.0.0.1 --port 8000 --speculative-config '{...}' --kv-transfer-config '{...}' ...
    # -> python -m speculators generate-offline-data --endpoint http://127.0.0.1:8000/v1 --preprocessed-data ...

then set ``extract.vllm_endpoint: http://127.0.0.1:8000/v1`` and run Stage 3, which writes the input,
runs the client and adopts the files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import eagle3.extract.finalize as _fin
from eagle3.config import Params
from eagle3.contracts.hidden_states import SampleWriter, first_non_finite, sample_relpath, storage_tensors
from eagle3.distributed import DistContext
from eagle3.errors import ExtractError
from eagle3.extract.prepare import Prepared, Setup, build_setup, extract_dir, prepare
from eagle3.extract.progress import make_progress
from eagle3.rundir import EXTRACT
from eagle3.stage import StageRun
from eagle3.target import target_dtype

__all__ = [
    "speculative_config",
    "kv_transfer_config",
    "serve_args",
    "serve_command",
    "generate_command",
    "write_vllm_input",
    "adopt_vllm_outputs",
    "run_vllm",
    "print_commands",
]

INPUT_DIR = "vllm_input"
RAW_DIR = "vllm_raw"
STAGING_DIR = "vllm_staging"
CLIENT_CONCURRENCY = 32


def speculative_config(aux_layer_ids: Sequence[int], num_hidden_layers: int) -> dict:
    """vLLM ``speculative_config`` capturing ``aux + [N]`` (speculators ``launch_vllm.py``)."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [*aux_layer_ids, num_hidden_layers]}},
    }


def kv_transfer_config(staging_dir: str | Path) -> dict:
    """vLLM ``kv_transfer_config`` for the file-based ``ExampleHiddenStatesConnector``."""
    return {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(staging_dir)},
    }


def serve_args(params: Params, aux_layer_ids: Sequence[int], num_hidden_layers: int, staging_dir: str | Path,
               max_len: int) -> list[str]:
    """Arguments after ``vllm serve MODEL`` for hidden-state extraction with this run's settings."""
    args = [
        "--speculative-config", json.dumps(speculative_config(aux_layer_ids, num_hidden_layers)),
        "--kv-transfer-config", json.dumps(kv_transfer_config(staging_dir)),
        "--tensor-parallel-size", str(params.target.tensor_parallel_size),
        "--max-model-len", str(max(params.target.max_model_len, max_len + 1)),
        "--dtype", target_dtype(params.target),
    ]
    if params.target.trust_remote_code:
        args.append("--trust-remote-code")
    return args


def serve_command(params: Params, run_dir: str | Path, port: int = 8000) -> list[str]:
    """The full ``vllm serve`` command (loopback address) for this run's Stage 3."""
    from eagle3.target import resolve_target

    run_dir = Path(run_dir)
    setup = build_setup(params, run_dir)
    sd = extract_dir(run_dir, create=False)
    model = str(resolve_target(params.target).path)
    return ["vllm", "serve", model, "--host", "127.0.0.1", "--port", str(port),
            *serve_args(params, setup.aux, setup.num_layers, sd / STAGING_DIR, int(setup.rows.lengths.max()))]


def generate_command(endpoint: str, input_dir: str | Path, raw_dir: str | Path,
                     concurrency: int = CLIENT_CONCURRENCY) -> list[str]:
    """speculators' offline client: one prefill per input row, files ``hs_<i>.safetensors``."""
    return [sys.executable, "-m", "speculators", "generate-offline-data", "--endpoint", endpoint,
            "--preprocessed-data", str(input_dir), "--output", str(raw_dir), "--concurrency", str(concurrency)]


def print_commands(params_file: str, run_dir: str | None = None, port: int = 8000) -> None:
    """Print the two launch commands (server, client) for a params file, for running them by hand."""
    import shlex

    from eagle3.params_file import load_params
    from eagle3.rundir import resolve_run_dir

    params = load_params(params_file)
    rd = Path(run_dir) if run_dir else resolve_run_dir(params)
    sd = extract_dir(rd, create=False)
    print(shlex.join(serve_command(params, rd, port)))
    print(shlex.join(generate_command(f"http://127.0.0.1:{port}/v1", sd / INPUT_DIR, sd / RAW_DIR)))


def write_vllm_input(rows, row_ids: Sequence[int], out_dir: str | Path) -> Path:
    """Write the rows to extract as a datasets folder that speculators' client reads.

    Columns ``input_ids`` (int64), ``loss_mask`` (int8), ``row`` (our row index; the client's
    ``hs_<i>`` is the ``i``-th line here), torch-formatted (the client calls ``.tolist()``).
    Written to a temp folder and renamed.

    Returns:
        Path: ``out_dir``.
    """
    import datasets

    out = Path(out_dir)
    ds = datasets.Dataset.from_dict({
        "input_ids": [rows.tokens(r).tolist() for r in row_ids],
        "loss_mask": [rows.mask(r).tolist() for r in row_ids],
        "row": [int(r) for r in row_ids],
    })
    ds.set_format("torch")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _row_map(input_dir: Path) -> list[int] | None:
    import datasets

    if not (input_dir / "dataset_info.json").exists():
        return None
    ds = datasets.load_from_disk(str(input_dir))
    return [int(x) for x in ds.with_format(None)["row"]]


def _adopt(sd: Path, setup: Setup, raw_dir: Path, row_map: list[int], writer: SampleWriter, done: set[int],
           final: bool, keep_raw: bool) -> list[dict]:
    """Adopt every complete ``hs_<i>.safetensors`` in ``raw_dir``; returns problems found."""
    from safetensors.torch import load_file

    problems = []
    rows = setup.rows
    slots, hidden = len(setup.stored), setup.hidden
    for f in sorted(raw_dir.glob("hs_*.safetensors")) if raw_dir.exists() else []:
        try:
            i = int(f.stem[3:])
        except ValueError:
            continue
        if i >= len(row_map):
            problems.append({"file": str(f), "problem": f"index {i} not in the input ({len(row_map)} rows)"})
            continue
        r = row_map[i]
        if r in done:
            if not keep_raw:
                f.unlink(missing_ok=True)
            continue
        try:
            data = load_file(str(f))
        except Exception as exc:  # noqa: BLE001 - incomplete (still moving) or corrupt
            if final:
                problems.append({"row": r, "file": str(f), "problem": f"unreadable: {exc}"})
                f.unlink(missing_ok=True)
            continue
        tok, hs = data.get("token_ids"), data.get("hidden_states")
        bad = None
        if tok is None or hs is None:
            bad = f"missing tensors (has {sorted(data)})"
        elif tok.tolist() != rows.tokens(r).tolist():
            bad = f"token_ids differ from row {r} (id {rows.ids[r]})"
        elif list(hs.shape) != [len(tok), slots, hidden]:
            bad = f"hidden_states shape {list(hs.shape)} != {[len(tok), slots, hidden]} (layers {setup.stored})"
        elif not bool(torch.isfinite(hs).all()):
            bad = f"non-finite hidden states in sample id {rows.ids[r]}: {first_non_finite(hs, setup.stored)}"
        if bad:
            problems.append({"row": r, "file": str(f), "problem": bad})
            f.unlink(missing_ok=True)
            continue
        done.add(r)
        tensors = {"token_ids": tok.to(torch.int64), "loss_mask": torch.from_numpy(rows.mask(r).copy()),
                   **storage_tensors(hs, setup.sdtype)}
        after = None if keep_raw else (lambda p=f: p.unlink(missing_ok=True))
        writer.submit({"row": r, "id": rows.ids[r], "file": sample_relpath(r, setup.meta["shard_size"])}, tensors,
                      after=after)
    return problems


def adopt_vllm_outputs(params: Params, run_dir: str | Path, raw_dir: str | Path | None = None,
                       row_map: Sequence[int] | None = None, finalize: bool = True) -> dict:
    """Adopt vLLM/speculators ``hs_<i>.safetensors`` files into Stage 3's layout.

    Args:
        params: the run's params. run_dir: the run directory.
        raw_dir: the client's output (default ``<stage 3>/vllm_raw``).
        row_map: row index of each ``i`` (default: the ``row`` column of ``<stage 3>/vllm_input``,
            else the identity).
        finalize: when every row has its file, write the manifest and ``stats.json``.

    Returns:
        dict: ``adopted`` (files written), ``problems`` (rejected raw files, each with a reason),
        ``missing`` (rows still without a file), ``stats`` (when finalized).

    Raises:
        ExtractError: as :func:`eagle3.extract.run` before extraction (bad inputs, refusals).
    """
    run_dir = Path(run_dir)
    sd = extract_dir(run_dir)
    raw = Path(raw_dir) if raw_dir else sd / RAW_DIR
    prep = prepare(params, run_dir, sd, DistContext())
    rm = list(row_map) if row_map is not None else (_row_map(sd / INPUT_DIR) or list(range(len(prep.setup.rows))))
    writer = SampleWriter(sd, prep.journal, prep.setup.stored, threads=params.extract.writer_threads)
    done = set(prep.valid)
    t0 = time.perf_counter()
    try:
        problems = _adopt(sd, prep.setup, raw, rm, writer, done, final=True, keep_raw=params.extract.vllm_keep_raw)
    finally:
        writer.close()
    secs = time.perf_counter() - t0
    missing = [r for r in range(len(prep.setup.rows)) if r not in done]
    out = {"adopted": writer.files_written, "problems": problems, "missing": missing, "stats": None}
    if finalize and not missing:
        loops = _loop_stats(writer, secs, 0)
        out["stats"] = _fin.finalize(params, run_dir, sd, prep.setup, prep.pf, loops, prep.redone, 1, None)
    return out


def _new_writer(sd: Path, prep: Prepared, ep) -> SampleWriter:
    return SampleWriter(sd, prep.journal, prep.setup.stored, threads=ep.writer_threads,
                        max_pending_bytes=ep.max_pending_mb << 20)


def _loop_stats(writer: SampleWriter, seconds: float, computed_tokens: int) -> list[dict]:
    """The one "rank" of an adoption, in the form :func:`eagle3.extract.finalize.finalize` takes."""
    return [{"samples": writer.files_written, "tokens": sum(e["num_tokens"] for e in writer.entries),
             "computed_tokens": computed_tokens, "seconds": seconds, "bytes_written": writer.bytes_written,
             "writer_busy_s": writer.busy_s, "calibration": None}]


def _serve_and_collect(params: Params, sd: Path, setup: Setup, row_map: list[int], writer: SampleWriter,
                       done: set[int], problems: list[dict], on_adopted) -> int:
    """Write the client's input for ``row_map`` and run speculators' client against
    ``extract.vllm_endpoint`` or a ``vllm serve`` started here, adopting files every 2 s while it
    runs (``on_adopted()`` after each pass); returns the client's exit code."""
    from eagle3.target import resolve_target
    from eagle3.vllm_utils import VllmServer

    ep = params.extract
    raw = sd / RAW_DIR
    write_vllm_input(setup.rows, row_map, sd / INPUT_DIR)
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(2.0):
            problems.extend(_adopt(sd, setup, raw, row_map, writer, done, final=False, keep_raw=ep.vllm_keep_raw))
            on_adopted()

    def client(endpoint: str) -> int:
        th = threading.Thread(target=poll, daemon=True)
        th.start()
        try:
            return subprocess.run(generate_command(endpoint, sd / INPUT_DIR, raw), check=False).returncode
        finally:
            stop.set()
            th.join()

    if ep.vllm_endpoint:
        return client(ep.vllm_endpoint)
    model = str(resolve_target(params.target).path)
    args = serve_args(params, setup.aux, setup.num_layers, sd / STAGING_DIR, int(setup.rows.lengths.max()))
    with VllmServer(model, args=args, log_file=sd / "vllm_serve.log") as server:
        return client(server.base_url)


def _refuse_missing(setup: Setup, done: set[int], problems: list[dict], rc: int) -> None:
    """Print the rejected raw files; raise when a row still has no file after the client finished."""
    for p in problems:
        print(f"eagle3 extract (vllm): rejected {p['file']}: {p['problem']}", flush=True)
    missing = [r for r in range(len(setup.rows)) if r not in done]
    if missing:
        raise ExtractError(
            f"{len(missing)} row(s) have no hidden states after the vLLM client finished (exit code {rc}); "
            f"first: row {missing[0]} (id {setup.rows.ids[missing[0]]}). {len(problems)} file(s) were "
            f"rejected (printed above). Re-run to retry only the missing rows."
        )


def _close_quietly(writer: SampleWriter) -> None:
    try:
        writer.close()
    except BaseException:  # noqa: BLE001 - the first error is the one raised
        pass


def _require_gpu(ep) -> None:
    """Refuse before any work when no GPU serves the extraction (here, or behind ``extract.vllm_endpoint``)."""
    if ep.vllm_endpoint is None and not torch.cuda.is_available():
        raise ExtractError(
            "extract.backend = vllm needs a GPU: vLLM's ExampleHiddenStatesConnector copies hidden states "
            "through CUDA streams and pinned memory. Use extract.backend: transformers on CPU, or set "
            "extract.vllm_endpoint to a GPU server that shares this filesystem."
        )


def run_vllm(params: Params, run_dir: str | Path) -> dict:
    """Stage 3 through vLLM (see the module docstring); returns the stats.

    Starts ``vllm serve`` on 127.0.0.1 with the extraction configs (unless ``extract.vllm_endpoint``
    names a running one), runs speculators' client for the rows still missing, adopts files while
    they arrive, then writes the manifest and stats like the transformers backend.

    Raises:
        ExtractError: no GPU and no ``vllm_endpoint``; rows still missing after the client finished
            (re-running retries only those); plus everything :func:`eagle3.extract.run` raises.
    """
    run_dir = Path(run_dir)
    ep = params.extract
    sd = extract_dir(run_dir)
    _require_gpu(ep)
    dist = DistContext()
    prep = prepare(params, run_dir, sd, dist)
    setup = prep.setup
    raw = sd / RAW_DIR
    raw.mkdir(exist_ok=True)
    writer = _new_writer(sd, prep, ep)
    done = set(prep.valid)
    problems: list[dict] = []
    old_map = _row_map(sd / INPUT_DIR)
    if old_map:  # files of an interrupted attempt, indexed by that attempt's input
        problems += _adopt(sd, setup, raw, old_map, writer, done, final=True, keep_raw=ep.vllm_keep_raw)
        writer.close()
        writer = _new_writer(sd, prep, ep)
    for f in raw.glob("hs_*.safetensors"):
        f.unlink()
    todo = [r for r in range(len(setup.rows)) if r not in done]
    st = StageRun(params, run_dir, EXTRACT, progress=lambda _: make_progress(sd, dist, prep, lambda: writer.bytes_written))
    with st:
        _ = st.tracker  # the W&B run opens now, as the stage starts
        t0 = time.perf_counter()
        counted = {"n": 0}

        def tick() -> None:
            n = len(done) - len(prep.valid) - counted["n"]
            if n > 0:
                st.progress.update(n)
                counted["n"] += n

        try:
            if todo:
                rc = _serve_and_collect(params, sd, setup, todo, writer, done, problems, tick)
                problems += _adopt(sd, setup, raw, todo, writer, done, final=True, keep_raw=ep.vllm_keep_raw)
                writer.close()
                tick()
                _refuse_missing(setup, done, problems, rc)
            else:
                writer.close()
        except BaseException:
            _close_quietly(writer)
            raise
        shutil.rmtree(sd / STAGING_DIR, ignore_errors=True)
        loops = _loop_stats(writer, time.perf_counter() - t0, sum(e["num_tokens"] for e in writer.entries))
        return _fin.finalize(params, run_dir, sd, setup, prep.pf, loops, prep.redone, 1, st)
