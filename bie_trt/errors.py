"""User-facing errors: each names the problem and the fix, and the CLI prints them without a traceback."""


class BieError(Exception):
    """Base for errors a user can act on."""


class CheckpointError(BieError):
    """A checkpoint directory is missing something or holds something malformed."""


class EngineError(BieError):
    """An engine directory is corrupt, incompatible, or built for another machine."""


class PlanError(BieError):
    """A configuration does not fit the memory plan or is inconsistent."""


class RequestError(BieError, ValueError):
    """A generation request is invalid (prompt too long, bad sampling parameters); a ValueError, as
    other inference libraries raise for bad input."""
