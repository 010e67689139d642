"""Self-prompting (Magpie-style): the target writes the user turns of ``kind: self`` prompt sources.

The target's chat template is cut at a new user message, the target samples the user message at a
high temperature until the template's end of turn, and the candidates are filtered and
de-duplicated; stage 1 then answers the kept prompts like those of any other source.

* :mod:`~eagle3.synthesize.self_prompt.template` - the user-turn prefix and the requests;
* :mod:`~eagle3.synthesize.self_prompt.filters` - acceptance filters, near duplicates, distinct-n;
* :mod:`~eagle3.synthesize.self_prompt.sampling` - the loop over a backend's
  ``sample_user_turns`` (:mod:`eagle3.synthesize.local`, :mod:`eagle3.synthesize.server`);
* :mod:`~eagle3.synthesize.self_prompt.run` - stage 1's driver, writes ``01_synthesize/self_prompts/``;
* :mod:`~eagle3.synthesize.self_prompt.report` - the prompts and figures notebook 01 shows.
"""

from eagle3.errors import SelfPromptError
from eagle3.synthesize.self_prompt.filters import FILTER_REASONS, NearDuplicateIndex, PromptFilter, distinct_n
from eagle3.synthesize.self_prompt.report import read_self_prompts, self_prompt_figures
from eagle3.synthesize.self_prompt.run import prepare_self_sources, self_prompts_dir, self_sources_pending
from eagle3.synthesize.self_prompt.sampling import SelfPromptResult, max_attempts, run_self_prompting, settings_record
from eagle3.synthesize.self_prompt.template import (
    SENTINEL,
    SelfPrompt,
    UserTurnFormat,
    followup_request,
    plan_requests,
    user_turn_format,
)

__all__ = [
    "SelfPromptError",
    "SENTINEL",
    "FILTER_REASONS",
    "UserTurnFormat",
    "user_turn_format",
    "SelfPrompt",
    "SelfPromptResult",
    "NearDuplicateIndex",
    "PromptFilter",
    "plan_requests",
    "followup_request",
    "run_self_prompting",
    "max_attempts",
    "settings_record",
    "distinct_n",
    "prepare_self_sources",
    "self_prompts_dir",
    "self_sources_pending",
    "read_self_prompts",
    "self_prompt_figures",
]
