"""Errors that moec reports to users as one clear line (the CLI exits with code 2)."""


class MoecError(Exception):
    """A user-facing error: bad input, unsupported model or corrupt artifact."""


class ImportFailure(MoecError):
    """The model file could not be read or converted to Relax."""


class UnsupportedModel(MoecError):
    """The model imported but is not an MoE decoder moec can compile."""


class ArtifactError(MoecError):
    """An artifact directory is missing files, corrupt, stale or built for another target."""


class ContextTooLong(MoecError):
    """A sequence would grow past the tokens the compiled model may attend over (its smallest sliding window)."""
