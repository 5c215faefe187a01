"""Errors the builder raises. Each message says what is wrong and what to change; the CLI prints it as
one line (``kilnlm build: error: ...``) and exits with status 2."""

from kilnlm.runtime.errors import KilnError


class BuildError(KilnError):
    """A checkpoint or build option the builder refuses: missing path, unsupported architecture,
    corrupt tensors, limits the model cannot honour, an output directory that is in the way."""
