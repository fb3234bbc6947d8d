"""The one error base every stage raises for bad input.

The CLI turns any of these into a single line `KIND: message` and exit status 1,
so messages must name the file, the field and the offending value themselves.
"""


class CmfdeployError(Exception):
    """Bad input or a failed check. Never a bug: bugs are ordinary exceptions."""

    @property
    def kind(self) -> str:
        return type(self).__name__


class IdentityError(CmfdeployError):
    """An artifact's identity (hashes, status, chain to its source) does not check out."""


class OutputExists(CmfdeployError):
    """A stage would overwrite an existing output and the user did not say --force."""


class UnsupportedModel(CmfdeployError):
    """The model uses an architecture, layer type, tensor or dtype a stage cannot run."""


class CmfdeployWarning(UserWarning):
    """A caveat the project itself raises; the quiet CLI keeps these while it hides third-party warnings."""


class OutputBusy(CmfdeployError):
    """Another run is writing the same output right now."""


class OutputWriteFailed(CmfdeployError):
    """The output could not be written (disk full, quota, I/O error); nothing was replaced."""


class NotEnoughDisk(CmfdeployError):
    """A stage's filesystem lacks the disk its peak needs (`manifests.disk`); refused before it writes."""
