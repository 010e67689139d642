"""In-process backends of stage 1: transformers (``generate`` with left padding, or continuous
batching through ``generate_batch``) and vLLM offline.

Both render prompts with :class:`eagle3.chat.ChatRenderer` and stop on the target's stop ids from
:func:`eagle3.chat.stop_token_ids` (the chat template's end of turn, never the tokenizer's eos alone).
For ``kind: self`` sources both also sample user turns after a rendered user-turn header
(``sample_user_turns``) and answer them greedily (``answer_user_turns``), see
:mod:`eagle3.synthesize.self_prompt`; those stop on the template's end of a user turn or the
tokenizer's and generation config's EOS ids (:func:`eagle3.chat.eos_ids`).
"""

from __future__ import annotations

import gc
import hashlib
from typing import Any

from eagle3.chat import ChatRenderer, eos_ids, pad_token_id, stop_token_ids, template_kwargs
from eagle3.config import Params, SelfPromptParams
from eagle3.errors import SynthesisError
from eagle3.synthesize.self_prompt.template import UserTurn, UserTurnRequest, user_turn_finish
from eagle3.synthesize.turns import TurnRequest, TurnResult, text_result

__all__ = ["TransformersBackend", "VllmBackend", "left_pad", "generate_padded", "generate_continuous",
           "use_continuous_batching"]


def left_pad(rows: list[list[int]], pad_id: int):
    """Left-padded ``(input_ids, attention_mask)`` int64 tensors ``[batch, max_len]`` of token id rows.

    Done by hand because a target's tokenizer may have no pad token (a GGUF converted by
    transformers 5.17), where ``tokenizer(..., padding=True)`` raises; the result equals that call's.
    """
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask


def generate_padded(model, rows: list[list[int]], *, pad_id: int, eos_ids: list[int], max_new_tokens: int,
                    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                    seed: int | None = None) -> list[list[int]]:
    """One left-padded ``model.generate`` call over token id rows; the generated ids of each row.

    Args:
        model: a transformers causal LM (the target), on any device.
        rows: prompt token ids, one list per row (any lengths; padded with :func:`left_pad`).
        pad_id, eos_ids: pad id and stop ids (:func:`eagle3.chat.pad_token_id` / ``stop_token_ids``).
        max_new_tokens: tokens generated at most per row (the batch runs to its longest row).
        temperature, top_p, top_k, seed: sampling when ``temperature > 0`` and ``seed`` is not None
            (``torch.manual_seed(seed)`` first; ``top_k`` 0 = off), else greedy.

    Returns:
        ``[len(rows)]`` lists of new ids (after a stop id, ``pad_id`` fills the row to the batch's length).
    """
    import torch

    ids, mask = left_pad(rows, pad_id)
    device = next(model.parameters()).device
    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=list(eos_ids))
    if temperature > 0 and seed is not None:
        kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=int(top_k))
        torch.manual_seed(seed)
    else:
        kw["do_sample"] = False
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kw)
    return out[:, ids.shape[1]:].tolist()


def use_continuous_batching(mode: str, device) -> bool:
    """Whether ``synthesize.transformers_batching`` (``auto`` / ``continuous`` / ``padded``) picks
    continuous batching on ``device`` (a ``torch.device`` or a string).

    ``auto`` is the padded ``generate`` on every device: on an H200 without flash-attn (no
    ``flash_attn`` package, no hub for ``kernels``) transformers 5.17 runs continuous batching through
    ``paged|sdpa`` at 2.9K tokens/s against 6.2K for the padded batches of 1,024 on the same kind of
    prompts (benchmarks/RESULTS.md). ``continuous`` is there for machines with flash
    attention, where transformers' varlen/paged decode path applies (not measured here).
    """
    del device  # kept in the signature: the choice may depend on the device once measured there
    return mode == "continuous"


def _cb_config(rows: list[list[int]], max_new_tokens: int, device, seed: int | None, overrides: dict):
    """A ``transformers.ContinuousBatchingConfig`` for one ``generate_batch`` call.

    On CUDA everything not in ``overrides`` is left to transformers (the paged KV cache takes a
    share of the free GPU memory). On CPU the cache is sized from the workload (every request's
    prompt + ``max_new_tokens`` fits at once) because transformers' automatic sizing there reads the
    host's memory and can take all of it (a 24 GiB machine was killed). The page-size field is
    ``block_size`` in transformers 5.17 and ``page_size`` from 5.19 on; both are handled.
    """
    import dataclasses
    import math

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    kw = dict(overrides)
    if seed is not None:
        kw.setdefault("seed", int(seed))
    if getattr(device, "type", str(device)) != "cuda":
        page = int(kw.get("page_size", kw.get("block_size", 32)))
        kw.pop("block_size", None)
        kw.pop("page_size", None)
        kw["page_size" if "page_size" in names else "block_size"] = page
        per_req = math.ceil((max(len(r) for r in rows) + max_new_tokens) / page)
        kw.setdefault("num_blocks", per_req * len(rows) + 1)
        kw.setdefault("max_batch_tokens", min(2048, sum(len(r) for r in rows) + len(rows)))
        kw.setdefault("max_requests_per_batch", len(rows))
        kw.setdefault("use_cuda_graph", False)
    elif "block_size" in kw and "block_size" not in names:
        kw["page_size"] = kw.pop("block_size")
    unknown = sorted(set(kw) - names)
    if unknown:
        raise SynthesisError(f"synthesize.transformers_kwargs: unknown ContinuousBatchingConfig field(s) {unknown} "
                             f"(this transformers has: {sorted(names)})")
    return ContinuousBatchingConfig(**kw)


def generate_continuous(model, rows: list[list[int]], *, max_new_tokens: int, eos_ids: list[int], pad_id: int,
                        temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                        config_kwargs: dict | None = None) -> list[list[int]]:
    """Generate after each token-id row with transformers' continuous batching (``generate_batch``).

    transformers' paged KV cache refills a finished row's slot with the next request, so no
    position is spent on padding or on turns that already ended (the padded ``generate`` runs every
    batch to its longest turn). Without flash attention it is slower than the padded path
    (:func:`use_continuous_batching`). Greedy outputs equal ``generate``'s (tests/test_synthesize_cb.py).

    Args:
        model: a transformers causal LM (its attention is switched to a ``paged|`` implementation
            by transformers for the call).
        rows: prompt token ids, one list per request (no padding).
        max_new_tokens: limit of every request.
        eos_ids: stop ids (:func:`eagle3.chat.stop_token_ids`); the stop id is included in the output.
        pad_id: the pad id (:func:`eagle3.chat.pad_token_id`).
        temperature, top_p, top_k: sampling (temperature 0 = greedy; top_k 0 = off).
        seed: the manager's seed for sampling (None: transformers picks one).
        config_kwargs: ``ContinuousBatchingConfig`` fields (``synthesize.transformers_kwargs``).

    Returns:
        list of generated token-id lists (int), in the order of ``rows``.

    Raises:
        SynthesisError: a request failed or is missing from transformers' results (its generation
            thread died), or an unknown ``config_kwargs`` field.
    """
    from transformers import GenerationConfig

    if not rows:
        return []
    sample = temperature > 0
    gkw: dict[str, Any] = dict(max_new_tokens=int(max_new_tokens), do_sample=sample, eos_token_id=list(eos_ids),
                               pad_token_id=int(pad_id))
    if sample:
        gkw.update(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k))
    gc_ = GenerationConfig(**gkw)
    cbc = _cb_config(rows, max_new_tokens, model.device, seed if sample else None, config_kwargs or {})
    res = model.generate_batch([list(map(int, r)) for r in rows], generation_config=gc_,
                               continuous_batching_config=cbc, progress_bar=False)
    outs = list(res.values())  # generate_batch returns its results in the order of the inputs
    bad = [o.request_id for o in outs if o.error is not None]
    if len(outs) != len(rows) or bad:
        raise SynthesisError(f"transformers continuous batching returned {len(outs)} of {len(rows)} results "
                             f"(failed: {bad[:5]}); see the transformers log above, or set "
                             f"synthesize.transformers_batching: padded")
    return [list(o.generated_tokens) for o in outs]


class TransformersBackend:
    """transformers, batched: ``generate`` with left padding (the default) or continuous batching
    (``generate_batch``); ``synthesize.transformers_batching`` chooses (:func:`use_continuous_batching`).

    Args:
        params: run params (``target`` for the model, ``synthesize`` for the settings).
        model, tokenizer: an already loaded target (else loaded with :func:`eagle3.target.load_target`).

    Attributes:
        eos_ids: sorted stop ids (:func:`eagle3.chat.stop_token_ids` of the tokenizer, the model's
            generation config and its directory). pad_id: :func:`eagle3.chat.pad_token_id`.
        user_turn_eos: sorted EOS ids of the tokenizer and the model's generation config
            (:func:`eagle3.chat.eos_ids`), where a self-written user turn also stops; user_turn_pad:
            the pad id beside them.
    """

    name = "transformers"

    def __init__(self, params: Params, model=None, tokenizer=None) -> None:
        from eagle3.target import load_target

        if model is None or tokenizer is None:
            model, tokenizer, resolved = load_target(params.target)
            self.model_name = resolved.name
        else:
            self.model_name = str(getattr(model, "name_or_path", "model"))
        self.model, self.tok = model, tokenizer
        self.syn = params.synthesize
        self.renderer = ChatRenderer(tokenizer, template_kwargs(params))
        cfg_max = getattr(model.config, "max_position_embeddings", None) or params.target.max_model_len
        self.context_len = min(params.target.max_model_len, int(cfg_max))
        self.eos_ids = stop_token_ids(tokenizer, None, model.generation_config, kwargs=self.renderer.kwargs)
        self.pad_id = pad_token_id(tokenizer, self.eos_ids)
        self.device = next(model.parameters()).device
        self.continuous = use_continuous_batching(self.syn.transformers_batching, self.device)
        self.user_turn_eos = sorted(set(eos_ids(tokenizer, None, model.generation_config)))
        self.user_turn_pad = pad_token_id(tokenizer, self.user_turn_eos)

    def _seed(self, reqs: list[TurnRequest]) -> int:
        """The batch's sampling seed: ``synthesize.seed`` and the first request's id, so a resumed run
        draws the same numbers for the same batch."""
        digest = hashlib.sha256(reqs[0].key.encode()).digest()
        return (self.syn.seed + int.from_bytes(digest[:4], "little")) % (2**31)

    def generate(self, reqs: list[TurnRequest]) -> list[TurnResult]:
        """Generate one turn for each request: one ``generate_batch`` call (continuous batching) or
        one left-padded ``generate`` batch.

        Each request's tokens are cut at its own ``max_new_tokens`` (the batch runs to the largest);
        ``finish_reason`` is ``"stop"`` when a stop id ends the turn within it, else ``"length"``.
        """
        rows = [self.renderer.encode(self.renderer.render(r.messages)) for r in reqs]
        if self.continuous:
            new = generate_continuous(self.model, rows, max_new_tokens=max(r.max_new_tokens for r in reqs),
                                      eos_ids=self.eos_ids, pad_id=self.pad_id, temperature=self.syn.temperature,
                                      top_p=self.syn.top_p, seed=self._seed(reqs),
                                      config_kwargs=self.syn.transformers_kwargs)
            return [self._result(r, toks, len(row)) for r, toks, row in zip(reqs, new, rows)]
        sample = self.syn.temperature > 0
        kw = dict(pad_id=self.pad_id, eos_ids=self.eos_ids, max_new_tokens=max(r.max_new_tokens for r in reqs),
                  temperature=self.syn.temperature, top_p=self.syn.top_p, seed=self._seed(reqs) if sample else None)
        new = generate_padded(self.model, rows, **kw)
        return [self._result(r, toks, len(row)) for r, toks, row in zip(reqs, new, rows)]

    def _result(self, req: TurnRequest, toks: list[int], plen: int) -> TurnResult:
        toks = toks[: req.max_new_tokens]
        stop = next((i for i, t in enumerate(toks) if t in self.eos_ids), None)
        if stop is not None:
            toks, finish, body = toks[: stop + 1], "stop", toks[:stop]
        else:
            finish, body = "length", toks
        text = self.tok.decode(body, skip_special_tokens=True)
        return text_result(text, finish, int(plen), len(toks), self.syn.reasoning, self.syn.think_tags)

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ self-prompting (kind: self sources)

    def _user_turn_rows(self, rows: list[list[int]], stop_ids: list[int], max_new: int, seed: int | None,
                        settings: SelfPromptParams | None) -> list[list[int]]:
        """New ids per row: sampled with ``settings`` and ``seed``, greedy when ``seed`` is None."""
        temperature = settings.temperature if settings is not None else 0.0
        top_p, top_k = (settings.top_p, settings.top_k) if settings is not None else (1.0, 0)
        if self.continuous:
            return generate_continuous(self.model, rows, max_new_tokens=max_new, eos_ids=stop_ids,
                                       pad_id=self.user_turn_pad, temperature=temperature if seed is not None else 0.0,
                                       top_p=top_p, top_k=top_k, seed=seed, config_kwargs=self.syn.transformers_kwargs)
        return generate_padded(self.model, rows, pad_id=self.user_turn_pad, eos_ids=stop_ids, max_new_tokens=max_new,
                               temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)

    def sample_user_turns(self, reqs: list[UserTurnRequest], settings: SelfPromptParams) -> list[UserTurn]:
        """One sampled user turn per request (stops at the end-of-turn ids or any EOS id).

        The batch is seeded with the first request's seed (``torch.manual_seed``, or the continuous
        batching manager's seed), so a batch's samples depend on its requests and the batch size;
        :func:`eagle3.synthesize.self_prompt.sampling.run_self_prompting` keeps batches fixed.
        """
        stops = sorted(set(reqs[0].stop_ids) | set(self.user_turn_eos))
        outs = self._user_turn_rows([r.prefix_ids for r in reqs], stops, settings.max_new_tokens, reqs[0].seed, settings)
        turns = []
        for r, toks in zip(reqs, outs):
            end = next((i for i, t in enumerate(toks) if t in stops), None)
            if end is None:
                body, finish = toks, "length"
            else:
                body, finish = toks[:end], ("stop" if toks[end] in r.stop_ids else "eos")
                toks = toks[: end + 1]
            turns.append(UserTurn(self.tok.decode(body, skip_special_tokens=True), finish, len(toks), toks))
        return turns

    def answer_user_turns(self, convs: list[list[dict]]) -> list[str]:
        """The target's greedy answers (``synthesize.max_new_tokens`` at most) to conversations ending
        with a user turn (the answer a multi-turn self-prompt's follow-up continues)."""
        ids = [self.tok(self.tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True,
                                                     **self.renderer.kwargs),
                        add_special_tokens=False)["input_ids"] for c in convs]
        outs = self._user_turn_rows(ids, self.user_turn_eos, self.syn.max_new_tokens, None, None)
        res = []
        for toks in outs:
            end = next((i for i, t in enumerate(toks) if t in self.user_turn_eos), len(toks))
            res.append(self.tok.decode(toks[:end], skip_special_tokens=True).strip())
        return res


class VllmBackend:
    """In-process vLLM (``vllm.LLM.chat``); engine settings from :func:`eagle3.vllm_utils.engine_kwargs`
    plus ``synthesize.vllm_kwargs``. Each request is seeded with ``synthesize.seed`` (vLLM's
    per-request generator), so the sampling's random streams do not depend on batch composition (the
    logits' arithmetic may: vLLM's engine-core process starts steps as requests arrive, which is
    its fast mode; stage 5's measurements run the engine core in process instead, see
    :mod:`eagle3.evaluate.vllm_worker`). When the
    template's end of turn is not among the engine's eos ids (a mis-converted tokenizer) it is passed
    as ``stop_token_ids``.

    Args:
        params: run params (``target`` for the engine, ``synthesize`` for the settings).
        llm, tokenizer: an already started ``vllm.LLM`` and its tokenizer (else started here).
    """

    name = "vllm"

    def __init__(self, params: Params, llm=None, tokenizer=None) -> None:
        from eagle3.target import load_tokenizer, resolve_target, target_dtype
        from eagle3.vllm_utils import engine_kwargs

        resolved = resolve_target(params.target)
        self.model_name = resolved.name
        self.syn = params.synthesize
        self.context_len = params.target.max_model_len
        self.tok = tokenizer if tokenizer is not None else load_tokenizer(resolved, params.target.trust_remote_code)
        self.user_turn_eos = sorted(set(eos_ids(self.tok)))
        self.renderer = ChatRenderer(self.tok, template_kwargs(params))
        self.template_kwargs = self.renderer.kwargs or None
        eot = self.renderer.end_of_turn_id()
        # vLLM stops on the eos ids by itself; only a missing end of turn is added (outputs unchanged otherwise)
        self.extra_stop = [eot] if eot is not None and eot not in eos_ids(self.tok, resolved.path) else []
        if llm is not None:
            self.llm = llm
            return
        from vllm import LLM

        kw = engine_kwargs(resolved.path, dtype=target_dtype(params.target), max_model_len=params.target.max_model_len,
                           seed=self.syn.seed, tensor_parallel_size=params.target.tensor_parallel_size,
                           trust_remote_code=params.target.trust_remote_code, **self.syn.vllm_kwargs)
        self.llm = LLM(**kw)

    def generate(self, reqs: list[TurnRequest]) -> list[TurnResult]:
        """One ``LLM.chat`` call for all requests (vLLM batches them itself)."""
        from vllm import SamplingParams

        extra = {"stop_token_ids": self.extra_stop} if self.extra_stop else {}
        sps = [SamplingParams(temperature=self.syn.temperature, top_p=self.syn.top_p, max_tokens=r.max_new_tokens,
                              seed=self.syn.seed, skip_special_tokens=True, **extra) for r in reqs]
        outs = self.llm.chat([r.messages for r in reqs], sampling_params=sps, use_tqdm=False,
                             chat_template_kwargs=self.template_kwargs)
        results = []
        for o in outs:
            c = o.outputs[0]
            results.append(text_result(c.text, str(c.finish_reason or "unknown"), len(o.prompt_token_ids or []),
                                       len(c.token_ids), self.syn.reasoning, self.syn.think_tags))
        return results

    def sample_user_turns(self, reqs: list[UserTurnRequest], settings: SelfPromptParams) -> list[UserTurn]:
        """One sampled user turn per request: ``LLM.generate`` on the prefix token ids (``TokensPrompt``),
        each request seeded with its own seed (vLLM's per-request generator: outputs do not depend on
        batch composition), ``stop_token_ids`` = the end-of-turn ids."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sps = [SamplingParams(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k or 0,
                              max_tokens=settings.max_new_tokens, seed=r.seed, stop_token_ids=list(r.stop_ids),
                              skip_special_tokens=True) for r in reqs]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=r.prefix_ids) for r in reqs], sampling_params=sps,
                                 use_tqdm=False)
        turns = []
        for r, o in zip(reqs, outs):
            c = o.outputs[0]
            ids = [int(t) for t in c.token_ids]
            fin = user_turn_finish(c.finish_reason, ids[-1] if ids else None, getattr(c, "stop_reason", None),
                                   r.stop_ids, self.user_turn_eos)
            turns.append(UserTurn(c.text, fin, len(ids), ids))
        return turns

    def answer_user_turns(self, convs: list[list[dict]]) -> list[str]:
        """The target's greedy answers (``synthesize.max_new_tokens`` at most) through ``LLM.chat``
        (the answer a multi-turn self-prompt's follow-up continues)."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=self.syn.max_new_tokens, skip_special_tokens=True)
        outs = self.llm.chat(convs, sampling_params=sp, use_tqdm=False, chat_template_kwargs=self.template_kwargs)
        return [o.outputs[0].text.strip() for o in outs]

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        self.llm = None
        del llm
        gc.collect()
