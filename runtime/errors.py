"""Errors the runtime raises. Messages say what is wrong and what to change."""


class KilnError(Exception):
    """Base class of every error kilnlm raises on bad input; the CLI prints it as one line."""


class EngineError(KilnError):
    """An engine directory that cannot be used: missing, corrupt, of an unsupported version or for
    another target. Raised before anything in it is loaded."""


class RequestError(KilnError):
    """A request the executor refuses (bad sampling parameters, a prompt longer than max_seq_len, ...)."""


class CacheError(KilnError):
    """An engine cache that cannot be used: an unparsable cache URL or reference, a name or key that is not
    in the cache, an unreachable endpoint or refused credentials, or a cached object whose size or SHA-256
    does not match its manifest (the message names the object)."""


class QueueFullError(RequestError):
    """The executor's queue holds ``max_queue_size`` requests already: retry later (HTTP 503 / 429)."""
