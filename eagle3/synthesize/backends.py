"""The backend named by ``synthesize.backend``: ``transformers`` / ``vllm`` (in process,
:mod:`eagle3.synthesize.local`) or ``server`` (an OpenAI-compatible endpoint, :mod:`eagle3.synthesize.server`).

Every backend answers assistant turns (``generate`` or the server's ``chat``) and, for ``kind: self``
sources, samples user turns (``sample_user_turns``) and answers them greedily (``answer_user_turns``).
"""

from __future__ import annotations

from eagle3.config import Params
from eagle3.synthesize.local import TransformersBackend, VllmBackend, use_continuous_batching
from eagle3.synthesize.server import ServerBackend
from eagle3.target import load_tokenizer, pick_device, resolve_target

__all__ = ["Backend", "make_backend", "user_turn_backend", "sampling_variant"]

Backend = TransformersBackend | VllmBackend | ServerBackend


def make_backend(params: Params, tokenizer=None) -> Backend:
    """The backend named by ``synthesize.backend`` (``transformers``, ``vllm`` or ``server``).

    Args:
        params: run params.
        tokenizer: for ``server`` only: the target's tokenizer, needed to sample user turns
            (:class:`~eagle3.synthesize.server.ServerBackend`); the in-process backends load their own.

    Raises:
        TargetError: the target cannot be loaded (in-process backends).
    """
    backend = params.synthesize.backend
    if backend == "transformers":
        return TransformersBackend(params)
    if backend == "vllm":
        return VllmBackend(params)
    return ServerBackend(params, tokenizer)


def user_turn_backend(params: Params) -> Backend:
    """The backend of ``synthesize.backend`` ready to sample user turns (``kind: self`` sources): the
    server backend gets the target's tokenizer (the prefixes are rendered here, not by the server).

    Raises:
        TargetError: the target (or its tokenizer) cannot be loaded.
    """
    tok = None
    if params.synthesize.backend == "server":
        tok = load_tokenizer(resolve_target(params.target), params.target.trust_remote_code)
    return make_backend(params, tok)


def sampling_variant(params: Params) -> dict:
    """What about the backend changes the sampled numbers beyond ``synthesize``'s settings:
    ``{"transformers_batching": "continuous"}`` when transformers samples with continuous batching
    (other numbers than the padded ``generate``), else ``{}`` (so padded run dirs keep their
    self-prompt fingerprint)."""
    syn = params.synthesize
    if syn.backend == "transformers" and syn.transformers_batching != "padded":
        if use_continuous_batching(syn.transformers_batching, pick_device(params.target.device)):
            return {"transformers_batching": "continuous"}
    return {}
