"""Self-prompting (Magpie-style): the target writes the user turns of ``kind: self`` prompt sources.

The target's chat template is cut at a new user message, the target samples the user message at a
high temperature until the template's end of turn, and the candidates are filtered and
de-duplicated; stage 1 then answers the kept prompts like those of any other source. Nothing here
imports the rest of :mod:`eagle3.synthesize`: the backends are handed in (``sample_user_turns``).

* :mod:`~eagle3.synthesize.self_prompt.template` - the user-turn prefix, the requests and what comes back;
* :mod:`~eagle3.synthesize.self_prompt.filters` - acceptance filters, near duplicates, distinct-n;
* :mod:`~eagle3.synthesize.self_prompt.sampling` - the loop over a backend's
  ``sample_user_turns`` (:mod:`eagle3.synthesize.local`, :mod:`eagle3.synthesize.server`);
* :mod:`~eagle3.synthesize.self_prompt.run` - writes ``01_synthesize/self_prompts/`` with the backend
  stage 1 gives it (:func:`eagle3.synthesize.stage.prepare_self_sources`);
* :mod:`~eagle3.synthesize.self_prompt.report` - the prompts and figures notebook 01 shows.
"""

from eagle3.errors import SelfPromptError
from eagle3.synthesize.self_prompt.filters import FILTER_REASONS, NearDuplicateIndex, PromptFilter, distinct_n
from eagle3.synthesize.self_prompt.report import read_self_prompts, self_prompt_figures
from eagle3.synthesize.self_prompt.run import self_prompts_dir, self_sources_pending, write_self_prompts
from eagle3.synthesize.self_prompt.sampling import SelfPromptResult, max_attempts, run_self_prompting, settings_record
from eagle3.synthesize.self_prompt.template import (
    SENTINEL,
    SelfPrompt,
    UserTurn,
    UserTurnFormat,
    UserTurnRequest,
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
    "UserTurnRequest",
    "UserTurn",
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
    "write_self_prompts",
    "self_prompts_dir",
    "self_sources_pending",
    "read_self_prompts",
    "self_prompt_figures",
]
