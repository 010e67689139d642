"""The backend named by ``synthesize.backend``: ``transformers`` / ``vllm`` (in process,
:mod:`eagle3.synthesize.local`) or ``server`` (an OpenAI-compatible endpoint, :mod:`eagle3.synthesize.server`).

Every backend answers assistant turns (``generate`` or the server's ``chat``) and, for ``kind: self``
sources, samples user turns (``sample_user_turns``) and answers them greedily (``answer_user_turns``).
"""

from __future__ import annotations

from eagle3.config import Params
from eagle3.synthesize.local import TransformersBackend, VllmBackend
from eagle3.synthesize.server import ServerBackend

__all__ = ["Backend", "make_backend"]

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
