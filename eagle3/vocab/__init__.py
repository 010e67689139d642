"""Stage 2 - vocab coverage: serving-exact tokenization, loss masks, token counts, draft vocab mapping.

* :mod:`eagle3.vocab.render` - render conversations with the target's chat template as the server
  does and derive loss masks from renders of turn prefixes;
* :mod:`eagle3.vocab.mapping` - masked-token counting, coverage curve, d2t/t2d mapping and its cache;
* :mod:`eagle3.vocab.stage` - ``run(params, run_dir)`` and the loaders later stages use;
* :mod:`eagle3.vocab.explore` - the notebook's coverage explorer (tables, plots, slider).
"""

from eagle3.vocab.mapping import (
    Coverage,
    VocabMappingError,
    build_vocab_mapping,
    cached_vocab_mapping,
    count_masked_tokens,
    mapping_cache_key,
    validate_vocab_mapping,
)
from eagle3.vocab.render import ChatRenderer, TokenizeReport, VocabError, read_samples, stop_token_ids, tokenize_samples
from eagle3.vocab.stage import load_mapping, load_tokenized, run

__all__ = [
    "run",
    "load_tokenized",
    "load_mapping",
    "build_vocab_mapping",
    "validate_vocab_mapping",
    "cached_vocab_mapping",
    "mapping_cache_key",
    "count_masked_tokens",
    "Coverage",
    "ChatRenderer",
    "tokenize_samples",
    "TokenizeReport",
    "read_samples",
    "stop_token_ids",
    "VocabError",
    "VocabMappingError",
    "CoverageExplorer",
    "report_table",
    "show_masked_rows",
]


def __getattr__(name):  # the explorer pulls in pandas/matplotlib: import it on first use
    if name in ("CoverageExplorer", "report_table", "show_masked_rows"):
        from eagle3.vocab import explore

        return getattr(explore, name)
    raise AttributeError(name)
