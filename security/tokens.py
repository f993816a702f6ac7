"""Bearer tokens from a file: one per line, re-read when the file changes. Torch-free.

Runs in the router process (the gRPC interceptor and the HTTP front share one `TokenFile`).
The file is read at start (an unreadable one is an error then); afterwards `reload_if_changed`
re-reads it and takes its tokens when they changed, so a token can be rotated by rewriting or
replacing the file, and a removed token stops working at the next reload. A
reload that fails (file gone, unreadable) keeps the tokens in force and is logged once.
`watch` runs `reload_if_changed` every `interval_s` off the event loop (the stat and read run
in a thread).

`check` compares a presented token against every token in constant time per token (SHA-256
digests compared with `hmac.compare_digest`, no early exit), so timing does not tell which
prefix matched. Any presented text is digested, bytes that are not UTF-8 included (an HTTP
header decoded with surrogate escapes: it never matches, it never raises). Tokens are never
logged; only their count is.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from pathlib import Path

log = logging.getLogger(__name__)

BEARER = "bearer "


def parse_tokens(text: str) -> list[str]:
    """Tokens in a token file's text: one per line, blank lines and '#' comments skipped,
    surrounding whitespace stripped."""
    out = []
    for line in text.splitlines():
        token = line.strip()
        if token and not token.startswith("#"):
            out.append(token)
    return out


def bearer_token(value: str | bytes | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` value; None for anything else."""
    if value is None:
        return None
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    if len(text) <= len(BEARER) or text[: len(BEARER)].lower() != BEARER:
        return None
    return text[len(BEARER) :].strip() or None


def _digest(token: str) -> bytes:
    """SHA-256 of the token's bytes; a str holding surrogate escapes (a header's bytes that
    are not UTF-8) gives back those bytes instead of raising."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class TokenFile:
    """The tokens of `path`, kept current. Checks may run on any thread."""

    def __init__(self, path: Path, field: str = "security.auth_token_file") -> None:
        self.path = path
        self._field = field
        self._digests: tuple[bytes, ...] = ()
        self._failing = False
        if not self.reload_if_changed():
            raise ValueError(f"{field}: cannot read {str(path)!r}")

    @property
    def count(self) -> int:
        """How many tokens are in force."""
        return len(self._digests)

    def check(self, presented: str | None) -> bool:
        """True when `presented` is one of the tokens (constant time per token)."""
        if presented is None:
            return False
        want = _digest(presented)
        ok = False
        for d in self._digests:  # every digest is compared: no early exit
            ok |= hmac.compare_digest(want, d)
        return ok

    def reload_if_changed(self) -> bool:
        """Re-read the file and take its tokens if they changed; False when it cannot be read
        (the tokens in force stay). The file is small: it is read whole every time, so a
        rewrite that keeps size and modification time is still seen."""
        try:
            tokens = parse_tokens(self.path.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            if not self._failing:
                log.error("%s: cannot read %s (%s); tokens in force stay", self._field,
                          self.path, exc)  # fmt: skip
            self._failing = True
            return False
        self._failing = False
        digests = tuple(sorted(_digest(t) for t in tokens))
        if digests == self._digests:
            return True
        self._digests = digests  # one reference swap: a concurrent check sees old or new
        if not tokens:
            log.warning("%s: %s holds no token; every authenticated call is refused",
                        self._field, self.path)  # fmt: skip
        else:
            log.info("%s: %d token(s) in force from %s", self._field, len(tokens), self.path)
        return True

    async def watch(self, interval_s: float) -> None:
        """Reload when the file changes, every `interval_s`, until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.to_thread(self.reload_if_changed)
