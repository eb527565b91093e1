"""Exception types. Every error fnzero raises for something a user did subclasses `FnzeroError`.

`ValueError`/`TypeError` are mixed in so callers that catch the builtin kinds keep working;
`assert` is reserved for fnzero's own invariants.
"""

from __future__ import annotations

__all__ = ["FnzeroError", "ConfigError", "ShardingError", "CheckpointError", "DistributedError"]


class FnzeroError(Exception):
    """Base class of every error fnzero raises on bad input or a failed run."""


class ConfigError(FnzeroError, ValueError):
    """A configuration is malformed, inconsistent or asks for something fnzero does not do."""


class ShardingError(FnzeroError, ValueError):
    """A model, state or batch does not fit the sharding plan it was given."""


class CheckpointError(FnzeroError, ValueError):
    """A checkpoint is missing, truncated, corrupt, from the future, or of another model."""


class DistributedError(FnzeroError, RuntimeError):
    """A collective failed, timed out, or ranks disagreed about what to do.

    `ranks`: the ranks at fault where fnzero knows them (a rank the collective watchdog judged
    stuck, a peer that died or raised first), else empty. A rank whose error names other ranks
    failed because of them, and ends after them (`specs/collectives.md` §Blame).
    """

    ranks: tuple[int, ...] = ()  # also for subclasses whose other base's __init__ runs instead

    def __init__(self, *args: object, ranks: tuple[int, ...] | list[int] = ()):
        super().__init__(*args)
        self.ranks = tuple(int(r) for r in ranks)
