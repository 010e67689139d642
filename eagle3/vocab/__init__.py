"""Stage 2 - vocab coverage: serving-exact tokenization, loss masks, token counts, draft vocab mapping.

* :mod:`eagle3.vocab.render` - render conversations with the target's chat template as the server
  does and derive loss masks from renders of turn prefixes;
* :mod:`eagle3.vocab.mapping` - masked-token counting, the coverage computation, the mapping cache;
* :mod:`eagle3.vocab.stage` - ``run(params, run_dir)``;
* :mod:`eagle3.vocab.report` - the notebook's coverage explorer (tables, figures, slider).

The files stage 2 writes are read and written only through :mod:`eagle3.contracts.tokenized` and
:mod:`eagle3.contracts.vocab_mapping`.
"""

from eagle3.contracts.vocab_mapping import VocabMapping, VocabMappingError
from eagle3.errors import VocabError
from eagle3.vocab.mapping import Coverage, cached_vocab_mapping, count_masked_tokens, mapping_cache_key
from eagle3.vocab.render import LossMaskRenderer, TokenizeReport, tokenize_samples
from eagle3.vocab.report import CoverageExplorer, report_table, show_masked_rows
from eagle3.vocab.stage import VocabStats, run

__all__ = [
    "run",
    "VocabStats",
    "VocabMapping",
    "VocabMappingError",
    "VocabError",
    "cached_vocab_mapping",
    "mapping_cache_key",
    "count_masked_tokens",
    "Coverage",
    "LossMaskRenderer",
    "tokenize_samples",
    "TokenizeReport",
    "CoverageExplorer",
    "report_table",
    "show_masked_rows",
]
