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


class SettingsError(PlanError, ValueError):
    """A runtime setting asks for more than the engine was built for (its memory plan is sized for the
    built value); a ValueError, as for any bad argument. `setting` is the EngineConfig field."""

    def __init__(self, setting: str, detail: str):
        super().__init__(f"{setting} {detail}")
        self.setting, self.detail = setting, detail
