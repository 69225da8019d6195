"""Engine error hierarchy.

Every error raised inside the engine derives from `EngineError`, carries a `category` ("user" when
the caller's input was at fault, "server" otherwise) and is picklable (no custom ``__init__``),
because errors cross Ray process boundaries. The gateway maps them to HTTP / failed futures in
one place.
"""


class EngineError(Exception):
    """Root of engine errors. ``str(err)`` is the message shown to the client."""

    category = "server"


class UserInputError(EngineError, ValueError):
    """The request is malformed; the message names the field and the rule."""

    category = "user"


class AdapterNotFoundError(EngineError, KeyError):
    """No adapter with that id is loaded on this replica."""

    category = "user"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "adapter not found"


class CheckpointError(EngineError, OSError):
    """A checkpoint could not be read or is inconsistent with the target adapter."""

    category = "user"


class BackendError(EngineError, RuntimeError):
    """The compute backend failed for a reason that is not the caller's fault."""

    category = "server"


class ConfigError(EngineError, ValueError):
    """The server configuration is invalid."""

    category = "server"


class ReplicaLostError(EngineError, RuntimeError):
    """The engine replica running a call died (killed, crashed, out of memory) before answering.
    Serve starts a new one; whatever that replica held in memory (unsaved adapter state) is gone,
    so the message tells the client to resume from its last saved checkpoint."""

    category = "server"
    #: the dead actor's id ("" when Ray named none); None when the replica was only unreachable
    died: str | None = None


class StorageFullError(EngineError, OSError):
    """A checkpoint could not be written because its disk (or quota) is full. Nothing was saved
    (the partial directory is removed); the server keeps serving."""

    category = "server"


class StorageUnreachableError(EngineError, OSError):
    """This replica's node does not reach the checkpoint storage the server wrote (a multi-node
    cluster whose data dir is not the same shared directory on every node)."""

    category = "server"
