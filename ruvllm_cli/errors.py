"""Errors a user can cause, each with a one-line message and an optional hint.

The CLI maps every `RuvllmError` to `Error: <message>` on stderr (plus the hint)
and its `exit_code`; the server maps them to OpenAI-style error bodies.
"""

from __future__ import annotations


class RuvllmError(Exception):
    """Base class: a failure the user can understand and act on."""

    exit_code = 1
    http_status = 500
    error_type = "server_error"

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(RuvllmError):
    exit_code = 2
    http_status = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(RuvllmError):
    """A model name that is no local path, alias or Hugging Face id."""

    http_status = 404
    error_type = "invalid_request_error"


class NotDownloadedError(RuvllmError):
    """A known model that is not (completely) in the cache."""


class DownloadError(RuvllmError):
    """Network, auth, revision or disk trouble while fetching a model."""


class RepoUnavailableError(DownloadError):
    """The hub has no such repo, revision or file for us: missing, private or gated."""


class RevisionNotFoundError(RepoUnavailableError):
    """The repo is there, the branch, tag or commit asked for is not."""


class ModelLoadError(RuvllmError):
    """A directory that is no model, an unsupported architecture, too little memory."""


class CacheError(RuvllmError):
    """The cache directory cannot be used."""


class Terminated(BaseException):
    """SIGTERM, raised in the main thread where a command asks for it (`on_sigterm_raise`)
    so that its cleanup runs and it ends with one line and 143, as Ctrl+C does with 130.
    Not a KeyboardInterrupt: what stops at Ctrl+C and goes on (a chat reply) must not
    take it for one."""


def on_sigterm_raise() -> None:
    """From now on SIGTERM raises Terminated in the main thread (the default action had
    ended the process without a word)."""
    import signal

    def raise_terminated(signum: int, frame: object) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, raise_terminated)
