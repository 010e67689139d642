"""The one retry policy of stage 1's HTTP calls to an OpenAI-compatible server (``synthesize.server``).

Every request of the ``server`` backend goes through :meth:`RetryPolicy.request`: chat completions
(the answers), ``GET /models`` (the served model's name) and the completions and chat completions
of self-prompting (``kind: self`` sources). Timeouts, connection errors, HTTP 5xx/408/429, bodies that
are not JSON and bodies the caller cannot parse are retried ``server.max_retries`` times, waiting
``backoff_s * 2**attempt`` seconds, capped at :data:`BACKOFF_CAP_S`, between attempts (none after
the last one); other 4xx answers are not retried (the request itself is wrong).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from eagle3.config import ServerParams

__all__ = ["BACKOFF_CAP_S", "RetryPolicy", "SampleFailed", "Rejected", "Stopped"]

log = logging.getLogger(__name__)

BACKOFF_CAP_S = 60.0  # the longest wait between two attempts: a server restart takes about this long


class SampleFailed(Exception):
    """A request still failing after its retries (``kind``: the last failure, see :meth:`RetryPolicy.request`),
    or a non-retryable 4xx that the caller turned into one."""

    def __init__(self, kind: str, message: str, attempts: int) -> None:
        super().__init__(message)
        self.kind, self.message, self.attempts = kind, message, attempts


class Rejected(Exception):
    """The server answered a non-retryable HTTP 4xx (not 408/429); ``text`` is the body's first 500 characters."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status, self.text = status, text
        self.attempts = 1  # set by RetryPolicy.request: the attempt that got this answer


class Stopped(Exception):
    """The stage is stopping (circuit breaker): no further attempt is made."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a request to the server is repeated.

    Attributes:
        max_retries: attempts after the first (``server.max_retries``).
        backoff_s: the first wait in seconds (``server.backoff_s``); doubled per attempt.
        timeout_s: the per-request timeout (``server.timeout_s``), named in timeout messages.
    """

    max_retries: int
    backoff_s: float
    timeout_s: float

    @classmethod
    def of(cls, server: ServerParams) -> RetryPolicy:
        """The policy of ``synthesize.server``."""
        return cls(server.max_retries, server.backoff_s, server.timeout_s)

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (0-based): ``backoff_s * 2**attempt``,
        at most :data:`BACKOFF_CAP_S`."""
        return min(self.backoff_s * 2**attempt, BACKOFF_CAP_S)

    async def wait(self, attempt: int, stop: asyncio.Event | None) -> None:
        """Sleep :meth:`delay` seconds; raise :class:`Stopped` as soon as ``stop`` is set."""
        if stop is None:
            await asyncio.sleep(self.delay(attempt))
            return
        try:
            await asyncio.wait_for(stop.wait(), timeout=self.delay(attempt))
        except TimeoutError:
            return
        raise Stopped()

    async def attempt(self, send: Callable[[], Awaitable[Any]], parse: Callable[[Any], Any]) -> tuple[bool, Any]:
        """One attempt: ``(True, parsed body)``, or ``(False, (kind, message))`` for a retryable failure.

        Raises:
            Rejected: a non-retryable 4xx.
        """
        import httpx

        try:
            r = await send()
        except httpx.TimeoutException as exc:
            return False, ("timeout", f"no response within {self.timeout_s:g} s ({type(exc).__name__})")
        except httpx.TransportError as exc:
            return False, ("connection", f"{type(exc).__name__}: {exc or 'connection closed'}")
        code = r.status_code
        if code >= 500 or code in (408, 429):
            return False, (("http_5xx" if code >= 500 else f"http_{code}"), f"HTTP {code}: {r.text[:200]}")
        if code >= 400:
            raise Rejected(code, r.text[:500])
        try:
            body = r.json()
        except ValueError:
            return False, ("bad_json", f"HTTP {code} body is not JSON: {r.text[:120]!r}")
        try:
            return True, parse(body)
        except ValueError as exc:
            return False, ("bad_response", str(exc))

    async def request(self, send: Callable[[], Awaitable[Any]], parse: Callable[[Any], Any], *, what: str = "request",
                      on_failure: Callable[[str, int], None] | None = None,
                      stop: asyncio.Event | None = None) -> Any:
        """Send until a response parses, at most ``max_retries + 1`` times.

        Args:
            send: makes one attempt (``lambda: client.post(path, json=body)``) -> ``httpx.Response``.
            parse: the parsed JSON body -> the result; a ``ValueError`` counts as a failed attempt
                (``bad_response``).
            what: names the request in the log.
            on_failure: called with ``(kind, attempt)`` after each failed attempt (error counters).
            stop: an event that ends the retries (:class:`Stopped`) when set.

        Returns:
            what ``parse`` returned.

        Raises:
            SampleFailed: still failing after the retries. Rejected: a non-retryable 4xx.
            Stopped: ``stop`` was set.
        """
        kind, msg = "unknown", ""
        for attempt in range(self.max_retries + 1):
            if stop is not None and stop.is_set():
                raise Stopped()
            try:
                ok, out = await self.attempt(send, parse)
            except Rejected as exc:
                exc.attempts = attempt + 1
                raise
            if ok:
                return out
            kind, msg = out
            if on_failure is not None:
                on_failure(kind, attempt)
            log.warning("%s: attempt %d failed (%s: %s)", what, attempt + 1, kind, msg)
            if attempt < self.max_retries:
                await self.wait(attempt, stop)
        raise SampleFailed(kind, msg, self.max_retries + 1)
