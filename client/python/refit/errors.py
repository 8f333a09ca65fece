"""The client's exceptions. Everything a registration can fail with is a RegistrationError (its
subclasses say where: handing memory over, exporting it), so one `except` covers it."""


class RegistrationError(ValueError):
    """The worker's tensors do not match its layout, or the daemon refused the registration."""


class ExportError(RegistrationError):
    """A tensor's memory cannot be handed to the daemon (not shared, not on one device, ...)."""


class HandoverError(RegistrationError):
    """The daemon's handle socket refused or could not take the file descriptors."""

    def __init__(self, message, transient=False):
        super().__init__(message)
        self.transient = transient  # worth retrying: the daemon is busy or (re)starting
