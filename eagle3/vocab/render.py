"""Serving-exact tokenization of conversations and loss masks from renders of turn prefixes.

A conversation is rendered with the target's own chat template through
``tokenizer.apply_chat_template(..., tokenize=True)`` - the call vLLM's chat endpoint makes
(``vllm/renderers/hf.py::safe_apply_chat_template``), with assistant reasoning passed as both
``reasoning`` and ``reasoning_content`` as vLLM does (``vllm/renderers/chat_utils.py``).

Loss mask of assistant turn ``j`` (message index), from three renders and no pattern matching:

* ``P_j`` = render(``messages[:j]``, ``add_generation_prompt=True``): what the server feeds the
  model before it generates turn ``j`` (role header and anything the template injects, e.g. an
  empty ``<think></think>`` block, are in here and therefore never supervised). Earlier assistant
  turns are sent without their reasoning, as stage 1 sent them (``history_reasoning="drop"``);
* ``F_j`` = render(``messages[:j+1]``): the same history with turn ``j`` (and its reasoning) written in;
* supervised = ``F_j[len(P_j):end]`` where ``end`` is one past the first stop token (the
  tokenizer's / ``generation_config.json``'s eos ids, where generation stops) - what the target
  generated: reasoning as the template renders it, the answer and the end-of-turn token. Template
  text after the stop token (ChatML's trailing ``\\n``) is not supervised. A turn whose
  ``finish_reason`` is ``length`` was cut by the token limit, so its closing stop token is not
  supervised either.

When ``F_j`` does not start with ``P_j`` (a generation prompt that the recorded turn renders
differently, or a BPE merge across the boundary), the boundary falls back to their common prefix,
valid only when the history render ``messages[:j]`` is itself a prefix of ``F_j`` (the same rule as
speculators' ``_render_boundary_rows``); otherwise the sample is rejected and reported.

A conversation is *history-stable* when every earlier turn's tokens, up to its stop token, appear
unchanged in the render of the whole conversation: it becomes one row with every assistant turn
supervised. Templates that re-render history (Qwen3-style templates drop earlier turns' reasoning;
reasoning that is rendered for its own turn but not sent back in later contexts) break this; then
``multi_turn_policy`` decides: ``last`` keeps one row (the whole conversation,
only the last assistant turn supervised) and ``explode`` makes one row per assistant turn, each
rendered as the server saw it when generating that turn (``F_j``), ids ``<id>#<k>`` (k = 0-based
assistant-turn index).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from eagle3.chat import ChatRenderer, stop_token_ids
from eagle3.contracts.tokenized import TokenizedRow
from eagle3.errors import VocabError

__all__ = [
    "LossMaskRenderer",
    "TokenizeReport",
    "tokenize_samples",
]


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class _Unstable(Exception):
    pass


class LossMaskRenderer(ChatRenderer):
    """Render conversations with the target's chat template and derive per-turn supervised spans.

    Args:
        tokenizer: the target's tokenizer (``transformers``), carrying the chat template the server uses.
        stop_ids: token ids where generation stops (see :func:`eagle3.chat.stop_token_ids`); default:
            those of the tokenizer and its chat template.
        chat_template_kwargs: extra template variables for every render (e.g. ``enable_thinking``),
            as the server received them; per-sample settings can override them.
        history_reasoning: ``"drop"`` (default) - earlier assistant turns go into the context
            without their reasoning, as stage 1 and OpenAI-style clients send history (content
            only); ``"keep"`` - their reasoning is sent back too (interleaved thinking).

    Raises:
        VocabError: the tokenizer has no chat template; an unknown ``history_reasoning``.
    """

    def __init__(
        self,
        tokenizer,
        stop_ids: Iterable[int] | None = None,
        chat_template_kwargs: dict | None = None,
        history_reasoning: str = "drop",
    ):
        if history_reasoning not in ("drop", "keep"):
            raise VocabError(f"vocab.history_reasoning must be 'drop' or 'keep' (got {history_reasoning!r})")
        if not getattr(tokenizer, "chat_template", None):
            raise VocabError(
                f"the target's tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template; "
                "stage 2 renders conversations exactly as the server does and needs one"
            )
        super().__init__(tokenizer, chat_template_kwargs)
        self.history_reasoning = history_reasoning
        self.stop_ids = set(stop_ids) if stop_ids is not None else set(stop_token_ids(tokenizer, kwargs=self.kwargs))

    def prompt(self, messages: list[dict], j: int) -> list[dict]:
        """The context the server received before generating message ``j``: ``messages[:j]``, earlier
        assistant turns without reasoning unless ``history_reasoning == "keep"``."""
        if self.history_reasoning == "keep":
            return list(messages[:j])
        return [{k: v for k, v in m.items() if k != "reasoning"} for m in messages[:j]]

    def turn(self, messages: list[dict], j: int) -> list[dict]:
        """:meth:`prompt` followed by message ``j`` itself (with its reasoning)."""
        return self.prompt(messages, j) + [messages[j]]

    def template_kwargs(self, sample: dict) -> dict:
        """Template variables for one sample: defaults, then ``settings.chat_template_kwargs`` and
        ``settings.enable_thinking`` recorded by stage 1."""
        kw = dict(self.kwargs)
        settings = sample.get("settings") or {}
        if isinstance(settings.get("chat_template_kwargs"), dict):
            kw.update(settings["chat_template_kwargs"])
        if settings.get("enable_thinking") is not None:
            kw["enable_thinking"] = settings["enable_thinking"]
        return kw

    def turn_span(
        self,
        P: list[int],
        F: list[int],
        texts: Callable[[], tuple[str, str]],
        history: Callable[[], list[int]],
        finish_reason: str | None,
    ) -> tuple[list[int], int, int, set[str]]:
        """The row of one assistant turn as served and its supervised ``[start, end)`` (module docstring).

        Args:
            P: ids of the generation-prompt render of the history.
            F: ids of the render with the turn written in.
            texts: returns ``(P_text, F_text)``, the same renders as text (called only when ``F``
                does not start with ``P``).
            history: returns the ids of the history render without generation prompt (called
                only for the common-prefix fallback).
            finish_reason: the turn's finish reason (``"length"`` = cut by the token limit).

        Returns:
            tuple: ``(row_ids, start, end, flags)``. ``row_ids`` is ``F``, or - when the texts agree
            but the tokenizer merged tokens across the boundary - ``P`` followed by the tokens of
            the rest of ``F_text`` (what the server fed plus what the model generated). flags among
            ``boundary_retokenized``, ``boundary_fallback``, ``no_stop_token``, ``length_cut``.

        Raises:
            _Unstable: the renders diverge inside the history.
        """
        flags: set[str] = set()
        row = F
        if len(F) >= len(P) and F[: len(P)] == P:
            start = len(P)
        else:
            p_text, f_text = texts()
            if f_text.startswith(p_text):
                row = P + self.encode(f_text[len(p_text) :])
                start = len(P)
                flags.add("boundary_retokenized")
            else:
                cp = _common_prefix_len(P, F)
                H = history()
                if F[: len(H)] != H or cp < len(H):
                    raise _Unstable("the generation-prompt render and the turn render diverge inside the history")
                start = cp
                flags.add("boundary_fallback")
        end = len(row)
        for i in range(start, len(row)):
            if row[i] in self.stop_ids:
                end = i + 1
                break
        else:
            flags.add("no_stop_token")
        if finish_reason == "length" and end > start and row[end - 1] in self.stop_ids:
            end -= 1
            flags.add("length_cut")
        return row, start, end, flags


# --------------------------------------------------------------------------- tokenization


@dataclass
class TokenizeReport:
    """Counts from :func:`tokenize_samples` (one split). Ids lists are capped at ``max_ids`` entries."""

    samples: int = 0
    rows: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    assistant_turns: int = 0
    history_rerendered_samples: int = 0
    exploded_rows: int = 0
    boundary_retokenized_turns: int = 0
    boundary_fallback_turns: int = 0
    no_stop_token_turns: int = 0
    length_cut_turns: int = 0
    leading_assistant_turns: int = 0
    reasoning_not_rendered_turns: int = 0
    turns_with_completion_tokens: int = 0
    turns_matching_completion_tokens: int = 0
    truncated_rows: int = 0
    truncated_tokens: int = 0
    truncated_supervised_tokens: int = 0
    dropped_rows_after_truncation: int = 0
    no_supervised_samples: int = 0
    failed_samples: int = 0
    no_supervised_ids: list = field(default_factory=list)
    truncated_ids: list = field(default_factory=list)
    failed: list = field(default_factory=list)
    max_ids: int = 50

    def note(self, kind: str, value) -> None:
        lst = getattr(self, kind)
        if len(lst) < self.max_ids:
            lst.append(value)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.pop("max_ids")
        return d


def _reasoning_rendered(tok, ids: list[int], reasoning: str) -> bool:
    """Whether the first characters of ``reasoning`` appear in the decoded tokens (whitespace ignored)."""
    probe = "".join(reasoning.split())[:32]
    if not probe:
        return True
    return probe in "".join(tok.decode(ids).split())


def _sample_rows(
    r: LossMaskRenderer,
    sample: dict,
    P: dict[int, list[int]],
    F: dict[int, list[int]],
    kwargs: dict,
    policy: str,
    rep: TokenizeReport,
) -> list[tuple[str, list[int], np.ndarray]]:
    msgs = sample["messages"]
    assistant = [j for j, m in enumerate(msgs) if m["role"] == "assistant"]
    finish = sample.get("finish_reasons") or [None] * len(assistant)
    usage = sample.get("turn_usage")
    usage = usage if isinstance(usage, list) and len(usage) == len(assistant) else [None] * len(assistant)
    rep.assistant_turns += len(assistant)
    spans: dict[int, tuple[int, int]] = {}
    R: dict[int, list[int]] = {}
    for k, j in enumerate(assistant):
        if j == 0:
            rep.leading_assistant_turns += 1  # nothing before it to bound against: context only
            continue
        R[j], s, e, flags = r.turn_span(
            P[j],
            F[j],
            lambda j=j: (r.text(r.prompt(msgs, j), True, kwargs), r.text(r.turn(msgs, j), False, kwargs)),
            lambda j=j: r.render_ids([r.prompt(msgs, j)], False, kwargs)[0],
            finish[k],
        )
        for fl in flags:
            setattr(rep, f"{fl}_turns", getattr(rep, f"{fl}_turns") + 1)
        spans[j] = (s, e)
        done = usage[k].get("completion_tokens") if isinstance(usage[k], dict) else None
        if isinstance(done, int) and done > 0:  # cross-check: supervised span vs tokens the target generated
            rep.turns_with_completion_tokens += 1
            rep.turns_matching_completion_tokens += int(e - s == done)
        reasoning = msgs[j].get("reasoning")
        if reasoning and not _reasoning_rendered(r.tok, R[j][s:e], reasoning):
            rep.reasoning_not_rendered_turns += 1
    if not spans:
        return []
    turns = sorted(spans)
    last = turns[-1]
    full = R[last]
    stable = all(R[j][: spans[j][1]] == full[: spans[j][1]] for j in turns[:-1])

    def masked(ids: list[int], js: list[int]) -> np.ndarray:
        m = np.zeros(len(ids), dtype=np.int8)
        for j in js:
            m[spans[j][0] : spans[j][1]] = 1
        return m

    if stable:
        return [(sample["id"], full, masked(full, turns))]
    rep.history_rerendered_samples += 1
    if policy == "last":
        return [(sample["id"], full, masked(full, [last]))]
    rep.exploded_rows += len(turns)
    k_of = {j: k for k, j in enumerate(assistant)}
    return [(f"{sample['id']}#{k_of[j]}", R[j], masked(R[j], [j])) for j in turns]


def tokenize_samples(
    samples: list[dict],
    renderer: LossMaskRenderer,
    max_seq_len: int,
    policy: str = "explode",
    chunk_size: int = 64,
    on_chunk: Callable[[int, int], None] | None = None,
) -> tuple[Iterator[list[TokenizedRow]], TokenizeReport]:
    """Tokenize conversations into training rows with loss masks (module docstring for the rules).

    Rows are produced chunk by chunk (lists of :class:`TokenizedRow`), so that a caller can stream
    them to disk; the returned report is complete once the iterator is exhausted. Rows longer than
    ``max_seq_len`` are cut on the right; rows left without a supervised token are dropped.

    Args:
        samples: validated stage-1 samples (:func:`eagle3.contracts.samples.read_samples`).
        renderer: the target's :class:`LossMaskRenderer`.
        max_seq_len: maximum row length in tokens.
        policy: ``"last"`` or ``"explode"`` for conversations whose history the template re-renders.
        chunk_size: samples rendered per batched ``apply_chat_template`` call.
        on_chunk: called with ``(samples_done_in_chunk, tokens_in_chunk)`` after each chunk.

    Returns:
        tuple: ``(iterator of row lists, TokenizeReport)``.

    Raises:
        VocabError: (while iterating, at the end) ``samples`` is non-empty and no row has a
            supervised token - the message gives the reasons counted; an unknown ``policy``.
    """
    if policy not in ("last", "explode"):
        raise VocabError(f"vocab.multi_turn_policy must be 'last' or 'explode' (got {policy!r})")
    rep = TokenizeReport()

    def gen() -> Iterator[list[TokenizedRow]]:
        for c0 in range(0, len(samples), chunk_size):
            chunk = samples[c0 : c0 + chunk_size]
            P, F, kw_of, failed = _render_chunk(renderer, chunk)
            out = _chunk_rows(renderer, chunk, P, F, kw_of, failed, policy, max_seq_len, rep)
            if on_chunk is not None:
                on_chunk(len(chunk), sum(len(r.input_ids) for r in out))
            yield out
        if samples and rep.rows == 0:
            raise _nothing_supervised(len(samples), max_seq_len, rep)

    return gen(), rep


def _render_chunk(renderer: LossMaskRenderer, chunk: list[dict]):
    """Batched renders of a chunk, grouped by template kwargs: ``P_j`` (generation prompt) and ``F_j``
    per assistant turn. Returns ``(P, F, kw_of, failed)``: per sample ``{j: ids}`` dicts, its template
    kwargs, and ``{sample index: reason}`` for samples the template rejects (the rest are kept)."""
    groups: dict[str, list[int]] = {}
    kw_of: list[dict] = []
    for i, s in enumerate(chunk):
        kw = renderer.template_kwargs(s)
        kw_of.append(kw)
        groups.setdefault(json.dumps(kw, sort_keys=True), []).append(i)
    P: list[dict[int, list[int]]] = [{} for _ in chunk]
    F: list[dict[int, list[int]]] = [{} for _ in chunk]
    failed: dict[int, str] = {}
    for idx in groups.values():
        kw = kw_of[idx[0]]
        reqs = [(i, j) for i in idx for j, m in enumerate(chunk[i]["messages"]) if m["role"] == "assistant" and j > 0]
        try:
            ps = renderer.render_ids([renderer.prompt(chunk[i]["messages"], j) for i, j in reqs], True, kw)
            fs = renderer.render_ids([renderer.turn(chunk[i]["messages"], j) for i, j in reqs], False, kw)
        except Exception:  # noqa: BLE001 - find the sample(s) the template rejects, keep the rest
            ps, fs = [], []
            for i, j in reqs:
                try:
                    ps.append(renderer.render_ids([renderer.prompt(chunk[i]["messages"], j)], True, kw)[0])
                    fs.append(renderer.render_ids([renderer.turn(chunk[i]["messages"], j)], False, kw)[0])
                except Exception as exc:  # noqa: BLE001 - templates raise anything
                    failed.setdefault(i, f"chat template error: {type(exc).__name__}: {exc}")
                    ps.append([])
                    fs.append([])
        for (i, j), p, f in zip(reqs, ps, fs):
            P[i][j], F[i][j] = p, f
    return P, F, kw_of, failed


def _chunk_rows(renderer, chunk, P, F, kw_of, failed, policy, max_seq_len, rep) -> list[TokenizedRow]:
    """The rows of one rendered chunk, truncated to ``max_seq_len``; counts go into ``rep``."""
    out: list[TokenizedRow] = []
    for i, s in enumerate(chunk):
        rep.samples += 1
        rows: list[tuple[str, list[int], np.ndarray]] = []
        if i not in failed:
            try:
                rows = _sample_rows(renderer, s, P[i], F[i], kw_of[i], policy, rep)
            except _Unstable as exc:
                failed[i] = f"boundary unstable: {exc}"
        if i in failed:
            rep.failed_samples += 1
            rep.note("failed", {"id": s["id"], "reason": failed[i]})
            continue
        if not rows or all(int(m.sum()) == 0 for _, _, m in rows):
            rep.no_supervised_samples += 1
            rep.note("no_supervised_ids", s["id"])
            continue
        for rid, ids, mask in rows:
            n = len(ids)
            if n > max_seq_len:
                rep.truncated_rows += 1
                rep.truncated_tokens += n - max_seq_len
                rep.truncated_supervised_tokens += int(mask[max_seq_len:].sum())
                rep.note("truncated_ids", rid)
                ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            if int(mask.sum()) == 0:
                rep.dropped_rows_after_truncation += 1
                continue
            rep.rows += 1
            rep.tokens += len(ids)
            rep.supervised_tokens += int(mask.sum())
            out.append(TokenizedRow(rid, s["source"], np.asarray(ids, dtype=np.int64), mask, n))
    return out


def _nothing_supervised(n_samples: int, max_seq_len: int, rep: TokenizeReport) -> VocabError:
    reasons = Counter()
    reasons["no supervised token (no assistant turn, or empty turns)"] = rep.no_supervised_samples
    reasons["rejected (template error / unstable boundary)"] = rep.failed_samples
    reasons[f"all supervised tokens beyond max_seq_len={max_seq_len}"] = rep.dropped_rows_after_truncation
    detail = "; ".join(f"{k}: {v}" for k, v in reasons.items() if v)
    first = rep.failed[:1] or rep.no_supervised_ids[:3]
    return VocabError(
        f"none of the {n_samples} samples yields a supervised token ({detail}); first: {first}. "
        "Check the samples' assistant turns, the chat template and vocab.max_seq_len."
    )
