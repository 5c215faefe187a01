"""Errors the runtime raises. Messages say what is wrong and what to change."""


class KilnError(Exception):
    """Base class of every error kilnlm raises on bad input; the CLI prints it as one line."""


class EngineError(KilnError):
    """An engine directory that cannot be used: missing, corrupt, of an unsupported version or for
    another target. Raised before anything in it is loaded."""


class RequestError(KilnError):
    """A request the executor refuses (bad sampling parameters, a prompt longer than max_seq_len, ...)."""
