"""Stage 1 - synthesize: regenerate the assistant turns of a prompt set with the target itself.

Reads the prompt sources of ``params.synthesize`` (:mod:`eagle3.prompts`); writes ``samples.jsonl``
(:mod:`eagle3.contracts.samples`, the only reader/writer), ``stats.json``, ``progress.json``,
``throughput.jsonl`` (:mod:`eagle3.synthesize.summary`), ``errors.json`` (only when samples failed)
and the figures.

* :mod:`~eagle3.synthesize.stage` - ``run(params, run_dir) -> SynthesizeStats``;
* :mod:`~eagle3.synthesize.local` - in-process backends: ``transformers`` (CPU default, batched with
  left padding, prompts sorted by length) and ``vllm`` (``vllm.LLM.chat``);
* :mod:`~eagle3.synthesize.server` - ``server``: any OpenAI-compatible endpoint (``vllm serve``) and a
  circuit breaker;
* :mod:`~eagle3.synthesize.retry` - the one retry policy of every HTTP request to that server;
* :mod:`~eagle3.synthesize.backends` - the backend named by ``synthesize.backend``;
* :mod:`~eagle3.synthesize.self_prompt` - ``kind: self`` sources: the target writes the user turns;
* :mod:`~eagle3.synthesize.conversation` - multi-turn conversations and the batched driver;
* :mod:`~eagle3.synthesize.turns` - one turn's request/result and reasoning capture;
* :mod:`~eagle3.synthesize.summary` - stats numbers and throughput over time;
* :mod:`~eagle3.synthesize.report` - figures and notebook tables.

Backends import transformers / vLLM / httpx where used (only the chosen one's load).
"""

from eagle3.errors import SynthesisError
from eagle3.synthesize.backends import make_backend
from eagle3.synthesize.report import make_figures, preview_rows, saved_figures, summary_table
from eagle3.synthesize.stage import SynthesizeStats, prepare_self_sources, run
from eagle3.synthesize.summary import overall_rate, summarize_samples, throughput_series
from eagle3.synthesize.turns import TurnRequest, TurnResult, parse_chat_completion, split_reasoning

__all__ = [
    "run",
    "SynthesizeStats",
    "SynthesisError",
    "make_backend",
    "prepare_self_sources",
    "TurnRequest",
    "TurnResult",
    "split_reasoning",
    "parse_chat_completion",
    "summarize_samples",
    "throughput_series",
    "overall_rate",
    "make_figures",
    "saved_figures",
    "summary_table",
    "preview_rows",
]
