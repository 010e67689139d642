"""Stage 5: acceptance of the drafter on every evaluation set (held-out split, the project's general-chat
set, the user's sets), offline and in vLLM, beside n-gram and no speculation; parity; mismatch warnings.

One module per concern (see ``docs/DESIGN.md``, "Acceptance", for the definitions):

* :mod:`~eagle3.evaluate.metrics`: τ, per-position acceptance, tokens per target forward;
* :mod:`~eagle3.evaluate.drafter`: loads the exported drafter and its offline proposer by the kind its
  ``config.json`` records (:mod:`eagle3.drafters`; the EAGLE-3 proposer with a KV cache, as vLLM runs
  it, is :mod:`eagle3.drafters.eagle3.decoding`; the one drafter check: :func:`eagle3.drafters.check_drafter`);
* :mod:`~eagle3.evaluate.decoding`: offline chain speculation and the acceptance rules;
* :mod:`~eagle3.evaluate.prompts`: the evaluation sets (training prompts excluded by hash), rendered
  as vLLM renders them;
* :mod:`~eagle3.evaluate.mismatch`: the train/serve mismatch warnings and their rules;
* :mod:`~eagle3.evaluate.vllm_jobs` (stage side) and :mod:`~eagle3.evaluate.vllm_worker` (the
  subprocess, one engine each): vLLM with the drafter, n-gram lookup and no speculation;
* :mod:`~eagle3.evaluate.serve`: the command that serves the target with the drafter (here, and on a GPU machine);
* :mod:`~eagle3.evaluate.parity` and :mod:`~eagle3.evaluate.diagnosis`: offline vs vLLM, and why;
* :mod:`~eagle3.evaluate.methods`: the measurements' names (``vllm/eagle3``, ``vllm/ngram``, ``vllm/none``,
  ``offline/eagle3``);
* :mod:`~eagle3.evaluate.stats`: ``stats.json``, the grid ``sets[set].methods[method][metric]``, and its reader;
* :mod:`~eagle3.evaluate.stage`: ``run(params, run_dir) -> EvaluateStats``;
* :mod:`~eagle3.evaluate.report`: tables and figures (``matplotlib.figure.Figure``).
"""

from eagle3.errors import EvaluateError, ParityError
from eagle3.evaluate.decoding import (
    evaluate_offline,
    speculative_accept,
    speculative_generate,
)
from eagle3.evaluate.diagnosis import diagnose, probe_layer_ids
from eagle3.evaluate.drafter import load_drafter, proposer
from eagle3.evaluate.metrics import acceptance_metrics, context_bucket, summarize_rounds
from eagle3.evaluate.mismatch import mismatch_warnings
from eagle3.evaluate.parity import parity_check
from eagle3.evaluate.prompts import EvalSet, evaluation_sets, heldout_prompts
from eagle3.evaluate.report import (
    category_table,
    comparison_table,
    figures,
    formatted,
    parity_table,
    pooled_table,
    read_results,
    set_table,
    warnings_table,
)
from eagle3.evaluate.serve import serve_commands
from eagle3.evaluate.stage import find_drafter, run, training_reference
from eagle3.evaluate.stats import EvaluateStats, read_stats
from eagle3.evaluate.vllm_jobs import run_vllm_job, vllm_records

__all__ = [
    "EvaluateError",
    "ParityError",
    "EvaluateStats",
    "read_stats",
    "acceptance_metrics",
    "summarize_rounds",
    "context_bucket",
    "speculative_accept",
    "load_drafter",
    "proposer",
    "speculative_generate",
    "evaluate_offline",
    "heldout_prompts",
    "evaluation_sets",
    "EvalSet",
    "mismatch_warnings",
    "set_table",
    "category_table",
    "warnings_table",
    "run_vllm_job",
    "vllm_records",
    "parity_check",
    "probe_layer_ids",
    "diagnose",
    "serve_commands",
    "find_drafter",
    "training_reference",
    "comparison_table",
    "parity_table",
    "pooled_table",
    "figures",
    "formatted",
    "read_results",
    "run",
]
