"""Prompt sources of stage 1 (and stage 5's user sets): embedded sets, local JSON/JSONL/Parquet files,
Hugging Face datasets.

Every source becomes a list of :class:`Prompt`: the system and user turns of one conversation,
grouped by the assistant turn that follows each group (the source's own assistant turns are dropped;
stage 1 regenerates them with the target). Formats (``PromptSource.format``; ``auto`` detects the
format of each record on its own, so a file that mixes layouts loses no record):

=========  =====================================================  ==============================
format     record                                                 ``fields`` keys (defaults)
=========  =====================================================  ==============================
sharegpt   ``{"conversations": [{"from": "human", "value": ..}]}`` messages (conversations),
                                                                  role (from), content (value)
openai     ``{"messages": [{"role": "user", "content": ..}]}``    messages (messages),
                                                                  role (role), content (content)
alpaca     ``{"instruction": .., "input": ..}``                   instruction, input, system
prompt     ``{"prompt": ..}`` / ``{"question": ..}`` / ...        prompt (or ``prompt_field``),
                                                                  system
=========  =====================================================  ==============================

Field values are dotted paths: ``instances.0.input`` reads ``record["instances"][0]["input"]``.
ShareGPT roles ``human``/``user``, ``gpt``/``assistant``/``chatgpt``/``bard``/``bing``/``model`` and
``system`` are understood; OpenAI ``developer`` counts as ``system``; content given as a list of
``{"type": "text", "text": ..}`` parts is joined. A field whose value is null counts as absent (a
Parquet file or Hugging Face dataset that mixes layouts has every column in every row). JSON and
JSONL files may start with a UTF-8 byte order mark (BOM; also at the start of any JSONL line, as
left by concatenating such files); a UTF-16 file is refused with the fix.

Bad input never stops the load silently and never passes silently either: each bad record is
counted by kind in the load report (``stats.json`` -> ``prompts.bad_input``) with its file and line
(first few examples kept). Kinds: ``malformed_json``, ``invalid_utf8``, ``not_an_object``,
``unknown_format`` (``format: auto`` found no known layout), ``missing_field``, ``invalid_unicode``
(a lone surrogate escape such as ``\\ud800``), ``unknown_role``,
``empty_prompt``, ``no_user_turn``, ``assistant_only``. :meth:`LoadReport.summary` says it in one line.
``on_bad_line="fail"`` raises :class:`PromptError` at the first one instead. A source that yields
no prompt at all raises.

Selection: per source, exact duplicates (same ``prompt_hash``, also across sources) are removed,
the source is shuffled with the seed and cut to its ``limit``; then all sources are shuffled together
and cut to ``synthesize.limit``. The held-out split is a pure function of the prompt hash
(:func:`split_for`), so a prompt held out in one run is held out in every run with the same
``heldout_fraction``, whatever the limit, order or other sources.

* :mod:`~eagle3.prompts.prompt` - :class:`Prompt`, :class:`LoadReport`, hashes, ids and the split;
* :mod:`~eagle3.prompts.files` - reading the records of a source (embedded, file, Hugging Face);
* :mod:`~eagle3.prompts.schemas` - one record to turn groups (the formats above);
* :mod:`~eagle3.prompts.sources` - :func:`load_source` and :func:`load_prompts` (dedup, shuffle, limits).
"""

from eagle3.prompts.files import EMBEDDED_SETS, HUMAN_EVAL_TEMPLATE, iter_records, source_file
from eagle3.prompts.prompt import (
    BAD_INPUT_KINDS,
    LoadReport,
    Prompt,
    PromptError,
    bad_input_detail,
    prompt_hash,
    sample_id,
    split_for,
)
from eagle3.prompts.schemas import detect_format, record_to_turns
from eagle3.prompts.sources import load_prompts, load_source

__all__ = [
    "PromptError",
    "source_file",
    "Prompt",
    "LoadReport",
    "BAD_INPUT_KINDS",
    "bad_input_detail",
    "EMBEDDED_SETS",
    "HUMAN_EVAL_TEMPLATE",
    "load_prompts",
    "load_source",
    "iter_records",
    "record_to_turns",
    "detect_format",
    "prompt_hash",
    "split_for",
    "sample_id",
]
