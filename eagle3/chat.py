"""The target's chat template, rendered once for every stage: prompt text and ids, stop ids, template kwargs.

Every stage renders conversations the way vLLM's chat endpoint does
(``vllm/renderers/hf.py::safe_apply_chat_template``): ``apply_chat_template`` with the template
variables the server was started with, assistant reasoning passed as both ``reasoning`` and
``reasoning_content`` (``vllm/renderers/chat_utils.py``), and - for prompt ids - the rendered text
tokenized with ``add_special_tokens=False`` (the template already holds any BOS).

Stop ids (:func:`stop_token_ids`) never trust the tokenizer's ``eos_token`` alone: a GGUF converted by
transformers 5.17 gives SmolLM2's tokenizer ``eos_token = <|im_start|>`` and no pad token, where 5.19
gives ``<|im_end|>`` for both. The end-of-turn token is read from the chat template itself
(:func:`end_of_turn_id`: the first token after an assistant message), checked against the
tokenizer's special tokens, and always stops generation; ids that the template uses to *open* a
turn are never stop ids.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eagle3.errors import TargetError

__all__ = ["ChatRenderer", "chat_message", "template_kwargs", "end_of_turn_id", "eos_ids", "stop_token_ids", "pad_token_id"]

log = logging.getLogger(__name__)

_PROBE = "eagle3 end-of-turn probe"


def template_kwargs(params) -> dict:
    """Chat-template variables the target is served with: ``{"enable_thinking": bool}`` when
    ``synthesize.enable_thinking`` is set, else ``{}`` (the template's default)."""
    et = params.synthesize.enable_thinking
    return {} if et is None else {"enable_thinking": bool(et)}


def chat_message(m: dict) -> dict:
    """A stored message as the server passes it to the template (vLLM's ``_parse_chat_message_content``):
    role and content, plus ``reasoning`` and ``reasoning_content`` on assistant messages that have one."""
    out = {"role": m["role"], "content": m["content"]}
    if m["role"] == "assistant" and m.get("reasoning") is not None:
        out["reasoning"] = m["reasoning"]
        out["reasoning_content"] = m["reasoning"]
    return out


class ChatRenderer:
    """Renders conversations with the target's own chat template, as the serving engine does.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        template_kwargs: template variables for every render (``{"enable_thinking": bool}`` or ``{}``).

    Raises:
        TargetError: the tokenizer has no chat template.
    """

    def __init__(self, tokenizer, template_kwargs: dict | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TargetError(
                f"the target's tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template; "
                "conversations are rendered exactly as the server does and need one"
            )
        self.tok = tokenizer
        self.kwargs = dict(template_kwargs or {})

    def _kw(self, kwargs: dict | None) -> dict:
        return self.kwargs if kwargs is None else kwargs

    def text(self, messages: list[dict], add_generation_prompt: bool = True, kwargs: dict | None = None) -> str:
        """The rendered text of one conversation (``apply_chat_template(tokenize=False)``); ``kwargs``
        replaces the renderer's template variables when given."""
        return self.tok.apply_chat_template([chat_message(m) for m in messages], tokenize=False,
                                            add_generation_prompt=add_generation_prompt, **self._kw(kwargs))

    def render(self, messages: list[dict]) -> str:
        """The prompt text vLLM and transformers both feed to the model (generation prompt added)."""
        return self.text(messages, True)

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text, no special tokens added (the template holds them)."""
        return list(map(int, self.tok(text, add_special_tokens=False)["input_ids"]))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a prompt exactly as vLLM's chat endpoint renders it: text with the generation
        prompt, then :meth:`encode`."""
        return self.encode(self.render(messages))

    def count(self, messages: list[dict]) -> int:
        """Prompt length in tokens (:meth:`prompt_ids`)."""
        return len(self.prompt_ids(messages))

    def render_ids(self, convs: list[list[dict]], add_generation_prompt: bool, kwargs: dict | None = None) -> list[list[int]]:
        """Token ids of each conversation through one batched ``apply_chat_template(tokenize=True)``.

        Returns:
            list[list[int]]: one id list per conversation (``[]`` for no conversations).
        """
        if not convs:
            return []
        batch = [[chat_message(m) for m in c] for c in convs]
        out = self.tok.apply_chat_template(batch, tokenize=True, return_dict=False,
                                           add_generation_prompt=add_generation_prompt, **self._kw(kwargs))
        return [list(map(int, x)) for x in out]

    def end_of_turn_id(self) -> int | None:
        """See :func:`end_of_turn_id`."""
        return end_of_turn_id(self.tok, self.kwargs)


def _special_ids(tokenizer) -> set[int]:
    ids = set(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []))
    for tid, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", True):
            ids.add(int(tid))
    return ids


def _opener_ids(tokenizer, kwargs: dict) -> set[int]:
    """Special ids in the generation prompt of a one-message chat (role headers such as ``<|im_start|>``)."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], tokenize=False,
                                             add_generation_prompt=True, **kwargs)
    except Exception:  # noqa: BLE001 - templates raise anything; then nothing is excluded
        return set()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return set(map(int, ids)) & _special_ids(tokenizer)


def end_of_turn_id(tokenizer, kwargs: dict | None = None) -> int | None:
    """The token the chat template writes right after an assistant message (``<|im_end|>`` for ChatML).

    Renders ``[user, assistant=<probe>]`` without a generation prompt and tokenizes what follows the
    probe text; its first token is the end of turn when it is one of the tokenizer's special tokens.
    Returns None when the template writes no special token there (then the eos ids decide).
    """
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, **(kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - templates raise anything
        log.warning("chat template cannot render a probe conversation (%s); end of turn from eos ids only", exc)
        return None
    at = text.rfind(_PROBE)
    if at < 0:
        return None
    tail = tokenizer(text[at + len(_PROBE):], add_special_tokens=False)["input_ids"]
    if tail and int(tail[0]) in _special_ids(tokenizer):
        return int(tail[0])
    return None


def _eos_values(src: Any) -> list[int]:
    e = src.get("eos_token_id") if isinstance(src, dict) else getattr(src, "eos_token_id", None)
    if e is None:
        return []
    return [int(x) for x in (e if isinstance(e, (list, tuple)) else [e])]


def eos_ids(tokenizer, model_dir: str | Path | None = None, *configs: Any) -> list[int]:
    """The eos ids as the tokenizer and generation configs name them (what vLLM stops on by itself), in
    source order, unchecked: the tokenizer's ``eos_token_id``, ``<model_dir>/generation_config.json``'s
    ``eos_token_id``, then each of ``configs`` (a ``GenerationConfig``, a model config or a dict)."""
    cands: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        cands.append(int(tokenizer.eos_token_id))
    if model_dir is not None:
        gc = Path(model_dir) / "generation_config.json"
        if gc.is_file():
            cands += _eos_values(json.loads(gc.read_text()))
    for c in configs:
        if c is not None:
            cands += _eos_values(c)
    return cands


def stop_token_ids(tokenizer, model_dir: str | Path | None = None, *configs: Any,
                   kwargs: dict | None = None) -> list[int]:
    """Token ids at which the target's generation stops, sorted.

    Sources: the template's end of turn (:func:`end_of_turn_id`, always a stop id), the tokenizer's
    ``eos_token_id``, ``<model_dir>/generation_config.json``'s ``eos_token_id`` and that of every
    object in ``configs`` (a ``GenerationConfig``, a model config, a dict) - vLLM stops on the
    tokenizer's eos and every generation-config eos (``SamplingParams.update_from_generation_config``).
    A candidate that the template uses to open a turn (in its generation prompt, e.g. ``<|im_start|>``
    named eos by a mis-converted GGUF) is dropped with a warning.

    Raises:
        TargetError: no source names a stop token (turn ends could not be found).
    """
    kw = dict(kwargs or {})
    cands = eos_ids(tokenizer, model_dir, *configs)
    eot = end_of_turn_id(tokenizer, kw)
    openers = _opener_ids(tokenizer, kw) - ({eot} if eot is not None else set())
    dropped = sorted(set(cands) & openers)
    if dropped:
        log.warning("eos id(s) %s open a turn in the chat template (a mis-converted tokenizer?); not used as stop ids; "
                    "end of turn from the template: %s", dropped, eot)
    ids = (set(cands) - openers) | ({eot} if eot is not None else set())
    if not ids:
        raise TargetError(
            "the target's chat template, tokenizer and generation config name no end-of-turn/eos token; "
            "generation and the loss mask need the end-of-turn token id"
        )
    return sorted(ids)


def pad_token_id(tokenizer, stop_ids: Iterable[int]) -> int:
    """The tokenizer's pad id, else the first stop id (padding is masked out; any id works). Never
    assumes the tokenizer has a pad token."""
    pid = getattr(tokenizer, "pad_token_id", None)
    return int(pid) if pid is not None else int(sorted(stop_ids)[0])
