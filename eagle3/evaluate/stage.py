"""Stage 5: acceptance of the drafter on held-out prompts, offline and in vLLM, plus the parity check.

* **Offline** (transformers, :mod:`eagle3.evaluate.decoding`): EAGLE-3 chain speculation exactly as
  vLLM runs it, with the settings the drafter was trained with (:func:`training_reference`).
* **vLLM** (:mod:`eagle3.evaluate.vllm_jobs`, one engine per subprocess): the same prompts through
  ``vllm.LLM.chat`` with the exported config, the n-gram (prompt lookup) baseline and no speculation.
* **Parity** (:mod:`eagle3.evaluate.parity`): at temperature 0 offline τ and vLLM τ must agree within
  ``evaluate.parity_tolerance`` (relative); otherwise :class:`ParityError` with a diagnosis list
  (:mod:`eagle3.evaluate.diagnosis`).

Resumable: offline records are appended per prompt (``offline_records.jsonl``) and each vLLM
measurement is kept (``vllm_<method>.json``) with a key of its inputs; a re-run reuses them. A run
whose stage 5 is complete with the same inputs is returned as it is, without rewriting a file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3.chat import stop_token_ids, template_kwargs
from eagle3.contracts.drafter import DrafterSettings, read_config, settings_from_config
from eagle3.drafters import check_drafter
from eagle3.errors import EvaluateError, ParityError
from eagle3.evaluate.decoding import backend_summary, evaluate_offline, offline_prompt_key
from eagle3.evaluate.diagnosis import diagnose
from eagle3.evaluate.drafter import load_drafter
from eagle3.evaluate.layer_ids import aux_layer_id_warnings
from eagle3.evaluate.methods import OFFLINE_EAGLE3, VLLM_EAGLE3, VLLM_NONE, vllm_method
from eagle3.evaluate.metrics import group_metrics, speed_stats, summarize_rounds
from eagle3.evaluate.mismatch import default_demonstration, mismatch_warnings
from eagle3.evaluate.parity import parity_result
from eagle3.evaluate.prompts import EvalSet, evaluation_sets, out_of_domain_first, spread
from eagle3.evaluate.report import figures
from eagle3.evaluate.serve import serve_commands
from eagle3.evaluate.stats import EvaluateStats, Parity, PooledStats, Settings, grid, set_stats
from eagle3.evaluate.vllm_jobs import (
    build_job,
    run_speed,
    run_vllm_job,
    speed_by_set,
    speed_lengths_differ,
    vllm_records,
    vllm_summary,
)
from eagle3.io import atomic_write_json, file_sha256, json_digest, read_json, read_jsonl
from eagle3.rundir import ENGINE_LOGS_DIR, EVALUATE, EXTRACT, TRAIN, RunDir
from eagle3.stage import Progress, StageRun, stage_record

__all__ = ["find_drafter", "training_reference", "speed_together", "forget_speed", "run"]


def find_drafter(params, run_dir: str | Path) -> Path:
    """The drafter to measure (:meth:`eagle3.rundir.RunDir.evaluated_drafter`: ``evaluate.drafter_dir``
    when set, else this run's own Stage 4 export), checked to hold a config.json; absolute.

    Raises:
        EvaluateError: no drafter (Stage 4 not complete) or the directory lacks config.json.
    """
    d = RunDir(run_dir).evaluated_drafter(params)
    if not (d / "config.json").is_file():
        raise EvaluateError(f"no drafter at {d} (config.json missing): run stage 4 (train) first, "
                            f"or set evaluate.drafter_dir to a speculators-format directory")
    return d.resolve()


def training_reference(params, run_dir: str | Path, drafter_dir: str | Path) -> DrafterSettings:
    """What the drafter learned with: aux ids from stage 3's ``meta.json``, norm flags from
    ``params.train`` and the draft vocab mapping from stage 2's ``vocab_mapping.safetensors`` when the
    drafter is this run's Stage 4 export; otherwise the config and weights as written.

    The offline evaluator uses these values, vLLM uses the exported config: a difference is a
    train/serve mismatch that the parity check catches.
    """
    cfg = settings_from_config(drafter_dir, vllm_view=False, error=EvaluateError)
    from eagle3.contracts.hidden_states import read_meta  # torch at import: only where needed

    rd = RunDir(run_dir)
    meta = read_meta(rd.stage(EXTRACT))
    own = Path(drafter_dir).resolve().is_relative_to(rd.stage(TRAIN).resolve()) and not params.evaluate.drafter_dir
    srcs = []
    ids = cfg.aux_layer_ids
    if own and meta and meta.get("aux_layer_ids"):
        ids = [int(i) for i in meta["aux_layer_ids"]]
        srcs.append(f"aux ids: {rd.extract_meta.relative_to(rd.root)}")
    if own:
        t = params.train
        flags = dict(norm_before_residual=t.norm_before_residual, norm_before_fc=t.norm_before_fc,
                     fc_norm=t.fc_norm, norm_output=t.norm_output)
        srcs.append("norm flags: params.train")
    else:
        flags = dict(norm_before_residual=cfg.norm_before_residual, norm_before_fc=cfg.norm_before_fc,
                     fc_norm=cfg.fc_norm, norm_output=cfg.norm_output)
    vm = rd.vocab_mapping
    mapping = None
    if own and vm.is_file():
        mapping = str(vm.resolve())  # absolute, as find_drafter's drafter_dir: results.json names the file
        srcs.append(f"vocab mapping: {vm.relative_to(rd.root)}")
    return DrafterSettings(aux_layer_ids=ids, **flags, source="; ".join(srcs) or "config.json", vocab_mapping=mapping)


@dataclass
class _Inputs:
    """Everything the measurements share: target, tokenizer, drafter, prompts, settings, resume keys."""

    resolved: Any  # eagle3.target.ResolvedTarget
    model: Any  # the transformers target (None for a vLLM-only evaluation)
    tok: Any
    drafter_dir: Path
    sets: list[EvalSet]
    training: dict
    prompts: list[dict]  # every set's prompts, in set order
    offline_prompts: list[dict]  # evaluate.offline_prompts of each set
    speed_ids: list[str]  # evaluate.speed_prompts of each set
    ref: DrafterSettings
    served: DrafterSettings
    drafter_key: str
    t_dtype: str


def _load_inputs(params, run_dir: Path) -> _Inputs:
    from eagle3.target import load_target, load_tokenizer, resolve_target, target_dtype, torch_dtype

    ev = params.evaluate
    resolved = resolve_target(params.target)
    drafter_dir = find_drafter(params, run_dir)
    if "offline" in ev.backends:
        model, tok, _ = load_target(params.target)
    else:  # vLLM only (e.g. a target too large for one device): the tokenizer is enough
        model, tok = None, load_tokenizer(resolved, params.target.trust_remote_code)
    sets, training = evaluation_sets(params, run_dir, tok)
    prompts = [p for s in sets for p in s.prompts]
    t_dtype = model.dtype if model is not None else torch_dtype(target_dtype(params.target), resolved.path)
    return _Inputs(
        resolved=resolved, model=model, tok=tok, drafter_dir=drafter_dir, sets=sets, training=training,
        prompts=prompts, offline_prompts=[p for s in sets for p in spread(s.prompts, ev.offline_prompts)],
        speed_ids=[p["id"] for s in sets for p in spread(s.prompts, ev.speed_prompts)],
        ref=training_reference(params, run_dir, drafter_dir),
        served=settings_from_config(drafter_dir, vllm_view=True, error=EvaluateError),
        drafter_key=json_digest([file_sha256(drafter_dir / "model.safetensors")[:16],
                                 read_config(drafter_dir, EvaluateError)]),
        t_dtype=str(t_dtype).replace("torch.", ""))


def _offline_key(params, inp: _Inputs) -> str:
    """The resume key the offline records share: drafter, trained settings, decoding settings, dtype.
    The prompts are not in it: each record carries its own prompt's key
    (:func:`eagle3.evaluate.decoding.offline_prompt_key`), so a changed prompt list (an evaluation
    source added or removed) measures only the prompts it did not measure before.

    The draft vocab mapping enters by content, not by path: a run opened as ``outputs/<run>`` by
    ``eagle3 run`` and as ``/abs/.../outputs/<run>`` (or ``../outputs/<run>``) by a notebook is the
    same run, and its finished records must be reused, not measured again."""
    ev = params.evaluate
    vm = inp.ref.vocab_mapping
    ref = asdict(inp.ref) | {"vocab_mapping": file_sha256(vm)[:16] if vm else None}
    return json_digest([inp.drafter_key, ref, ev.num_speculative_tokens, ev.temperature, ev.max_new_tokens,
                        params.run.seed, inp.t_dtype])


def speed_together(params) -> bool:
    """Whether the vLLM methods are timed together (one engine each, alive at once, prompt by prompt in
    turn: :func:`eagle3.evaluate.vllm_jobs.run_speed`) rather than each in its own job
    (``evaluate.speed_engines``; ``auto``: together on a CPU, where the engines fit beside each other)."""
    from eagle3.vllm_utils import on_cpu

    mode = params.evaluate.speed_engines
    return mode == "together" or (mode == "auto" and on_cpu())


def _acceptance_methods(params) -> list[str]:
    """The vLLM methods that run a job of their own: every one, but no speculation when the speed is
    timed together (its job would have nothing else to measure)."""
    return [m for m in params.evaluate.vllm_methods if not (m == "none" and speed_together(params))]


def _job(params, inp: _Inputs, method: str, speed: bool | None = None) -> tuple[dict, str]:
    """The vLLM job of ``method`` and its resume key (the job, plus the drafter's weights for eagle3).
    ``speed``: the job times the speed prompts itself (default: unless they are timed together).

    The drafter enters the key by content (``drafter_key``), not by its path: a run directory that was
    moved, or opened by another path, holds the same measurement and must not be measured again."""
    ev = params.evaluate
    own_speed = not speed_together(params) if speed is None else speed
    job = build_job(params, method, inp.resolved.path, inp.drafter_dir, inp.prompts,
                    template_kwargs(params) or None,  # None: the template's defaults
                    # without its own speed pass, a job (and its key) does not depend on the speed settings
                    speed_ids=inp.speed_ids if own_speed else [], speed_rounds=ev.speed_rounds if own_speed else 1)
    return job, json_digest([job | {"drafter": None}, inp.drafter_key if method == "eagle3" else None])


def _speed_key(params, inp: _Inputs) -> str:
    """The resume key of the measurement of every method's speed together (``vllm_speed.json``)."""
    keys = [_job(params, inp, m, speed=False)[1] for m in params.evaluate.vllm_methods]
    return json_digest([keys, inp.speed_ids, params.evaluate.speed_rounds])


def forget_speed(run_dir: str | Path, params) -> list[Path]:
    """Remove the kept speed measurement of a run's stage 5 (``eagle3 run --remeasure-speed``): the
    methods' timing together (``vllm_speed.json``), or, where each method times itself in its own job
    (``evaluate.speed_engines``), every vLLM measurement. Acceptance measured together with nothing
    else is kept. Returns the files removed."""
    rd = RunDir(run_dir)
    names = ["speed"] if speed_together(params) else list(params.evaluate.vllm_methods)
    gone = [rd.vllm_result(m) for m in names if rd.vllm_result(m).exists()]
    for f in gone:
        f.unlink()
    return gone


def _finished(params, inp: _Inputs, rd: RunDir) -> EvaluateStats | None:
    """The stats of a complete stage 5 whose every measurement still has the same inputs, else None.

    Then nothing needs to run and nothing is rewritten: opening a finished run's notebook leaves its
    ``stats.json`` and ``progress.json`` as they were.
    """
    ev = params.evaluate
    rec = stage_record(rd.root, EVALUATE)
    if not rec.complete or not rd.evaluate_results.exists():
        return None
    if "offline" in ev.backends:
        key = _offline_key(params, inp)
        recs = {r.get("id"): r for r in read_jsonl(rd.offline_records, error=EvaluateError, missing_ok=True)
                if r.get("key") == key}
        if any(recs.get(p["id"], {}).get("prompt_key") != offline_prompt_key(p, i, params.run.seed, ev.temperature)
               for i, p in enumerate(inp.offline_prompts)):
            return None
    for method in _acceptance_methods(params) if "vllm" in ev.backends else ():
        res = read_json(rd.vllm_result(method), None)
        if not res or res.get("job_key") != _job(params, inp, method)[1]:
            return None
    if "vllm" in ev.backends and speed_together(params):
        res = read_json(rd.vllm_result("speed"), None)
        if not res or res.get("job_key") != _speed_key(params, inp):
            return None
    try:
        return EvaluateStats.from_dict(rec.stats)
    except (TypeError, ValueError):  # a stats.json of an earlier layout: measure again (kept measurements reused)
        return None


def _offline(params, inp: _Inputs, rd: RunDir, prog: Progress):
    """``(drafter model, records)`` of the offline EAGLE-3 measurement (resumed per prompt); each
    record gains its prompt's ``set`` and ``category``."""
    ev = params.evaluate
    k, temp, model = ev.num_speculative_tokens, ev.temperature, inp.model
    dm = load_drafter(inp.drafter_dir, model, inp.ref, device=str(model.device))
    key = _offline_key(params, inp)
    stops = stop_token_ids(inp.tok, inp.resolved.path, getattr(model, "generation_config", None), model.config,
                           kwargs=template_kwargs(params))
    recs = evaluate_offline(model, inp.tok, dm, inp.offline_prompts, k, ev.max_new_tokens, inp.ref.aux_layer_ids,
                            temperature=temp, seed=params.run.seed,
                            out_file=rd.offline_records, key=key, progress=prog, stop_ids=stops)
    meta = {p["id"]: p for p in inp.offline_prompts}
    return dm, [r | {"set": meta[r["id"]]["set"], "category": meta[r["id"]]["category"]} for r in recs]


def _offline_summary(inp: _Inputs, recs: list[dict], k: int, temp: float) -> dict:
    return backend_summary(recs, k, temp, "transformers", "eagle3") | {
        "dtype": inp.t_dtype, "device": str(inp.model.device), "aux_layer_ids": inp.ref.aux_layer_ids,
        "settings_source": inp.ref.source}


def _vllm(params, inp: _Inputs, rd: RunDir, prog: Progress) -> dict[str, dict]:
    """``{method: raw result}``; a kept result with the same key is reused. Engine logs go to
    ``logs/vllm_<method>.log`` in the stage folder (never to the notebook). Where the methods are
    timed together (:func:`speed_together`), their speed comes from :func:`_speed` (a phase of its
    own) and no speculation has no job of its own."""
    ev = params.evaluate
    logs = rd.stage(EVALUATE) / ENGINE_LOGS_DIR
    logs.mkdir(exist_ok=True)
    results = {}
    for method in _acceptance_methods(params):
        job, jkey = _job(params, inp, method)
        out = rd.vllm_result(method)
        res = read_json(out, None)
        count = prog.resumed  # a kept result: measured by an earlier execution, not in the rate
        if not res or res.get("job_key") != jkey:
            res = run_vllm_job(job, out, logs / f"vllm_{method}.log", timeout_s=ev.vllm_timeout_s)
            res["job_key"] = jkey
            atomic_write_json(out, res)
            count = prog.update
        results[method] = res
        count(1, tokens=(res.get("output_tokens") or 0) + (res.get("speed_output_tokens") or 0))
    if speed_together(params):
        for method, sp in _speed(params, inp, rd, prog).items():
            results[method] = _with_speed(results.get(method), sp)
    return {m: results[m] for m in ev.vllm_methods if m in results}


def _speed(params, inp: _Inputs, rd: RunDir, prog: Progress) -> dict[str, dict]:
    """Every vLLM method's speed, timed together (:func:`eagle3.evaluate.vllm_jobs.run_speed`), or the
    kept ``vllm_speed.json`` of the same key: ``{method: engine info + {"speed": rows}}``. The
    stage's progress shows it as a phase of timed requests."""
    ev = params.evaluate
    out, key = rd.vllm_result("speed"), _speed_key(params, inp)
    kept = read_json(out, None)
    if kept and kept.get("job_key") == key:
        return kept["methods"]
    from eagle3.vllm_utils import on_cpu

    # on a GPU the engines share its memory (vLLM's default takes 90% of it for one)
    share = {} if on_cpu() else {"gpu_memory_utilization": round(0.85 / len(ev.vllm_methods), 3)}
    jobs = {m: _job(params, inp, m, speed=False)[0] | share for m in ev.vllm_methods}
    prog.next_phase(len(jobs) * len(inp.speed_ids) * ev.speed_rounds, "timed requests",
                    desc=f"{rd.stage(EVALUATE).name} vLLM speed")
    methods = run_speed(jobs, inp.speed_ids, ev.speed_rounds, rd.stage(EVALUATE) / ENGINE_LOGS_DIR,
                        timeout_s=ev.vllm_timeout_s, on_row=lambda m, row: prog.update(1, tokens=row["output_tokens"]),
                        load=prog.other_load)
    atomic_write_json(out, {"job_key": key, "methods": methods})
    return methods


def _with_speed(res: dict | None, sp: dict) -> dict:
    """A method's vLLM result with the speed rows timed together (``sp``: :func:`_speed`'s entry); no
    speculation, which has no job of its own, is ``sp`` itself with an empty acceptance pass."""
    rows = sp["speed"]
    n, t = sum(r["output_tokens"] for r in rows), sum(r["time_s"] for r in rows)
    speed = {"speed": rows, "speed_output_tokens": n, "speed_s": round(t, 3),
             "tokens_per_s": speed_stats(rows)["tokens_per_s"], "speed_startup_s": sp.get("startup_s"),
             "machine_busy_cpus": sp.get("machine_busy_cpus"), "machine_other_cpus": sp.get("machine_other_cpus")}
    if res is None:
        return sp | {"per_prompt": [], "counters": None, "generate_s": None, "output_tokens": 0} | speed
    return res | speed


def _per_set(inp: _Inputs, offline_recs: list[dict] | None, vllm_results: dict, k: int,
             tolerance: float | None = None) -> dict:
    """results.json ``sets``: per set its info, per method the metrics, per category per method;
    ``tolerance``: ``evaluate.speed_spread_tolerance`` (the speed's flag)."""
    methods: dict[str, list[dict]] = {}
    if offline_recs is not None:
        methods[OFFLINE_EAGLE3] = offline_recs
    for m in ("eagle3", "ngram"):  # the engine methods with acceptance (no speculation has none)
        if m in vllm_results:
            methods[vllm_method(m)] = vllm_records(vllm_results[m], inp.prompts)
    grouped = {m: group_metrics(recs, k, "set") for m, recs in methods.items()}
    by_cat = {m: group_metrics(recs, k, "set", "category") for m, recs in methods.items()}
    speed = {m: speed_by_set(r, inp.prompts, tolerance) for m, r in vllm_results.items()}
    out = {}
    for s in inp.sets:
        entry: dict = {"domain": s.domain, "domain_reason": s.domain_reason, "info": s.info, "methods": {},
                       "by_category": {}}
        for m in methods:
            if s.name in grouped[m]:
                entry["methods"][m] = grouped[m][s.name]
                for cat, met in by_cat[m][s.name].items():
                    entry["by_category"].setdefault(cat, {})[m] = met
        for m, sp in speed.items():
            if s.name in sp:
                entry["methods"].setdefault(vllm_method(m), {}).update(
                    {"tokens_per_s": sp[s.name]["tokens_per_s"], "speed_prompts": sp[s.name]["prompts"],
                     "speed_tokens_per_forward": sp[s.name].get("tokens_per_forward"),
                     **{key: sp[s.name].get(key) for key in ("tokens_per_s_rounds", "speed_spread", "speed_steady",
                                                              "speed_busy_cpus", "speed_other_cpus")}})
        # timed prompts whose answers have other lengths under other methods: tokens/s of different texts
        entry["speed_lengths_differ"] = speed_lengths_differ(vllm_results, [p["id"] for p in s.prompts])
        if VLLM_NONE in entry["methods"]:
            entry["methods"][VLLM_NONE] |= {"tau": None, "tokens_per_forward": 1.0}
        out[s.name] = entry
    return out


def _parity_vllm(inp: _Inputs, vllm_results: dict, k: int) -> dict | None:
    """vLLM's EAGLE-3 acceptance on exactly the offline prompts (the parity check's other side)."""
    if "eagle3" not in vllm_results:
        return None
    ids = {p["id"] for p in inp.offline_prompts}
    recs = [r for r in vllm_records(vllm_results["eagle3"], inp.prompts) if r["id"] in ids]
    return summarize_rounds(recs, k)["overall"] if recs else None


def _measured(params, inp: _Inputs, offline_n: int) -> dict:
    """What was measured on which prompts (stats.json ``measured``): the report states it."""
    ev = params.evaluate
    n = len(inp.prompts)
    out = {"prompts": {s.name: s.info["count"] for s in sorted(inp.sets, key=lambda s: out_of_domain_first(s.domain))}}
    if "vllm" in ev.backends:
        acc = [m for m in ev.vllm_methods if m != "none"]
        out["vllm_acceptance"] = (f"{', '.join(acc) or 'no method'}: all {n} prompts, one batched pass per engine "
                                  f"(max_num_seqs={ev.vllm_max_num_seqs}); no speculation: 1 token per forward")
        how = ("the methods in turn, prompt by prompt (one engine each, all started)" if speed_together(params)
               else "each method in its own engine, one after another")
        out["vllm_tokens_per_s"] = (f"{len(inp.speed_ids)} of {n} prompts (at most {ev.speed_prompts} per set, "
                                    f"spread over categories), one request at a time, {ev.speed_rounds} round"
                                    f"{'s' * (ev.speed_rounds != 1)}, {how}; the median of the per-round rates")
    if "offline" in ev.backends:
        out["offline"] = (f"{offline_n} of {n} prompts (at most {ev.offline_prompts} per set, spread over categories); "
                          f"parity compares vLLM on the same prompts")
    return out


def _stats(params, inp: _Inputs, backends: dict, sets: dict, parity: dict, diagnosis: list[str],
           cmd: tuple[str, str]) -> EvaluateStats:
    """stats.json from the backends' summaries (pooled), results.json's ``sets`` and the parity result;
    ``warnings`` are added by the caller (they read these numbers)."""
    ev = params.evaluate
    first = backends.get(OFFLINE_EAGLE3) or backends.get(VLLM_EAGLE3) or {}
    checked = parity["checked"]
    return EvaluateStats(
        settings=Settings(k=ev.num_speculative_tokens, temperature=ev.temperature,
                          acceptance_rule=first.get("acceptance_rule") or ""),
        pooled=PooledStats(prompts=len(inp.prompts), excluded_training=sum(s.info["excluded_training"] for s in inp.sets),
                           speed_prompts=max([b.get("speed_prompts") or 0 for b in backends.values()] + [0]),
                           methods=grid(backends)),
        sets=set_stats(sets),
        parity=Parity(ok=parity.get("ok") if checked else None, gap=parity.get("relative_gap"),
                      tolerance=ev.parity_tolerance, prompts=len(inp.offline_prompts) if checked else 0,
                      tau_offline=parity.get("tau_offline"), tau_vllm=parity.get("tau_vllm")),
        training_data=inp.training, measured=_measured(params, inp, (backends.get(OFFLINE_EAGLE3) or {}).get("prompts") or 0),
        diagnosis=diagnosis, vllm_serve_command=cmd[0], vllm_serve_where=cmd[1])


def _results(params, inp: _Inputs, backends: dict, sets: dict, parity: dict, diagnosis: list[str],
             drafter_check: list[str] | None, warnings: list[dict], cmd: tuple[str, str]) -> dict:
    """The ``results.json`` document: settings, prompts, pooled and per-set summaries, parity,
    diagnosis, warnings."""
    ev = params.evaluate
    first = backends.get(OFFLINE_EAGLE3) or backends.get(VLLM_EAGLE3) or {}
    return {
        "settings": {"temperature": ev.temperature, "k": ev.num_speculative_tokens, "max_new_tokens": ev.max_new_tokens,
                     "acceptance_rule": first.get("acceptance_rule"),
                     "drafter_dir": str(inp.drafter_dir), "target": str(inp.resolved.path),
                     "verifier_name": inp.resolved.name,
                     "trained_settings": asdict(inp.ref), "served_settings": asdict(inp.served),
                     "ngram": ev.ngram.model_dump(),
                     "vllm_engine": f"LLM.chat; acceptance: max_num_seqs={ev.vllm_max_num_seqs}; tokens/s: one "
                                    f"request at a time, {ev.speed_rounds} rounds"
                                    + (", the methods in turn" if speed_together(params) else ""),
                     "measured": _measured(params, inp, (backends.get(OFFLINE_EAGLE3) or {}).get("prompts") or 0)},
        "prompts": {"count": len(inp.prompts), "excluded_training": sum(s.info["excluded_training"] for s in inp.sets),
                    "sets": {s.name: s.info for s in inp.sets}},
        "training_data": inp.training,
        "sets": sets,
        "backends": backends,
        "parity": parity,
        "diagnosis": diagnosis,
        "drafter_check": drafter_check,
        "warnings": warnings,
        "vllm_serve_command": cmd[0],
        "vllm_serve_where": cmd[1],
        "logs": {m: f"{ENGINE_LOGS_DIR}/vllm_{m}.log" for m in (_acceptance_methods(params) if "vllm" in ev.backends else ())}
        | ({f"{m} speed": f"{ENGINE_LOGS_DIR}/speed_{m}.log" for m in ev.vllm_methods}
           if "vllm" in ev.backends and speed_together(params) else {}),
    }


@dataclass
class _Measured:
    """The measurements of one execution: the summaries (results.json ``backends``), the offline
    records and drafter model, the raw vLLM results (``{engine method: result}``)."""

    backends: dict[str, dict]
    vllm_results: dict[str, dict]
    dm: Any = None  # the drafter model of the offline measurement (None without one)
    offline_recs: list[dict] | None = None


def _measure(params, inp: _Inputs, rd: RunDir, st: StageRun) -> _Measured:
    """Offline, then vLLM, each a phase of the stage's progress with its own unit and rate: the offline
    prompts (seconds each), then the vLLM measurements (minutes each), so the ETA is the current phase's."""
    ev = params.evaluate
    k, temp = ev.num_speculative_tokens, ev.temperature
    out = _Measured(backends={}, vllm_results={})
    if "offline" in ev.backends:
        out.dm, out.offline_recs = _offline(params, inp, rd, st.progress)
        out.backends[OFFLINE_EAGLE3] = _offline_summary(inp, out.offline_recs, k, temp)
    if "vllm" in ev.backends:
        if "offline" in ev.backends:
            st.progress.next_phase(len(_acceptance_methods(params)), "vLLM measurements", desc=f"{st.dir.name} vLLM")
        out.vllm_results = _vllm(params, inp, rd, st.progress)
        for m, res in out.vllm_results.items():
            out.backends[vllm_method(m)] = vllm_summary(res, inp.prompts, k, ev.speed_spread_tolerance)
    return out


def _first_phase(params, inp: _Inputs) -> tuple[int, str]:
    """(total, unit) of the stage's first progress phase (:func:`_measure`)."""
    ev = params.evaluate
    if "offline" in ev.backends:
        return len(inp.offline_prompts), "offline prompts"
    return (len(_acceptance_methods(params)), "vLLM measurements") if "vllm" in ev.backends else (0, "jobs")


def _check(params, inp: _Inputs, rd: RunDir, m: _Measured) -> tuple[dict, list[str] | None, list[str], list[dict]]:
    """``(parity, drafter_check, diagnosis, layer_warnings)``: offline vs vLLM τ on the same prompts, the
    drafter's checkpoint problems, what explains a gap (:func:`eagle3.evaluate.diagnosis.diagnose`),
    and an external drafter's aux layer id warnings (:func:`eagle3.evaluate.layer_ids.aux_layer_id_warnings`;
    a measurement that could not decide is a diagnosis line)."""
    ev = params.evaluate
    off, vl = m.backends.get(OFFLINE_EAGLE3), _parity_vllm(inp, m.vllm_results, ev.num_speculative_tokens)
    parity = parity_result(off, vl, ev.temperature, ev.parity_tolerance)
    drafter_check = check_drafter(inp.drafter_dir, inp.resolved.path, reference=inp.ref)
    vllm_eagle3 = m.vllm_results.get("eagle3") and {**m.vllm_results["eagle3"], **(m.backends.get(VLLM_EAGLE3) or {}),
                                                   "per_position_conditional": (vl or {}).get("per_position_conditional")}
    diagnosis = diagnose(inp.drafter_dir, inp.resolved.path, reference=inp.ref, run_dir=rd.root, target=inp.model,
                         drafter_model=m.dm, offline=off, vllm=vllm_eagle3, prompts=inp.prompts,
                         offline_records=m.offline_recs, drafter_problems=drafter_check, offline_dtype=inp.t_dtype)
    layer_warnings = aux_layer_id_warnings(params, rd.root, inp.drafter_dir, inp.model, m.dm, inp.offline_prompts,
                                           m.offline_recs, notes=diagnosis)
    return parity, drafter_check, diagnosis, layer_warnings


def _serve_command(params, inp: _Inputs, rd: RunDir) -> tuple[str, str]:
    """``(command, notes)``: the command that serves the target with the drafter here, with the
    measured engine settings, and the GPU-machine form (:func:`eagle3.evaluate.serve.serve_commands`)."""
    return serve_commands(params, rd.root, inp.resolved, inp.drafter_dir)


def _write_prompts(rd: RunDir, inp: _Inputs) -> None:
    """``prompts.json``: each set's info, and per prompt its id, set, source, category, hash and length."""
    keys = ("id", "set", "source", "category", "prompt_hash")
    atomic_write_json(rd.stage(EVALUATE) / "prompts.json", {
        "info": {s.name: s.info for s in inp.sets},
        "prompts": [{kk: p[kk] for kk in keys} | {"prompt_tokens": len(p["prompt_ids"])} for p in inp.prompts]})


def run(params, run_dir: str | Path) -> EvaluateStats:
    """Stage 5: acceptance on every evaluation set (held-out split, general-chat, the user's sources),
    offline and in vLLM, beside n-gram and no speculation; parity check; mismatch warnings. Writes
    ``results.json``, ``prompts.json``, figures and ``stats.json`` in its folder.

    Returns:
        EvaluateStats: what ``stats.json`` holds (:mod:`eagle3.evaluate.stats`).

    Raises:
        EvaluateError: missing inputs or a failed vLLM job.
        ParityError: at temperature 0, offline and vLLM τ (same prompts) differ by more than
            ``evaluate.parity_tolerance`` (relative); results.json holds the diagnosis.
    """
    rd = RunDir(run_dir)
    rd.stage(EVALUATE, create=True)
    ev = params.evaluate
    inp = _load_inputs(params, rd.root)
    done = _finished(params, inp, rd)
    if done is not None:
        return done
    _write_prompts(rd, inp)
    total, unit = _first_phase(params, inp)
    with StageRun(params, rd.root, EVALUATE, total=total, unit=unit) as st:
        m = _measure(params, inp, rd, st)
        sets = _per_set(inp, m.offline_recs, m.vllm_results, ev.num_speculative_tokens, ev.speed_spread_tolerance)
        parity, drafter_check, diagnosis, layer_warnings = _check(params, inp, rd, m)
        cmd = _serve_command(params, inp, rd)
        stats = _stats(params, inp, m.backends, sets, parity, diagnosis, cmd)
        stats.warnings = (mismatch_warnings(stats.sets, inp.training, ev, pooled=stats.pooled,
                                            demonstration=default_demonstration(params))
                          + layer_warnings)
        results = _results(params, inp, m.backends, sets, parity, diagnosis, drafter_check, stats.warnings, cmd)
        atomic_write_json(rd.evaluate_results, results)
        # The W&B run opens only now, once the results exist (StageRun.tracker is lazy).
        for name, fig in figures(results).items():
            st.figure(name, fig)
        # W&B: the grid's numbers by their stats.json paths (finish logs only top-level numbers)
        numbers = stats.numbers()
        st.tracker.log(numbers)
        st.tracker.summary(numbers)
        if parity["checked"] and not parity["ok"]:
            st.progress.extra["parity"] = "failed"
            st.finish(stats, complete=False)
            raise ParityError(
                f"parity check failed: offline tau {parity['tau_offline']:.3f} vs vLLM tau {parity['tau_vllm']:.3f} on "
                f"the same {len(inp.offline_prompts)} prompts (relative gap {parity['relative_gap']:.3f} > tolerance "
                f"{ev.parity_tolerance}); see {rd.evaluate_results}", diagnosis)
        return EvaluateStats.from_dict(st.finish(stats))
