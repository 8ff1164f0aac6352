"""Named errors of a shard group (several processes serving one model). Messages name the ranks and sizes."""

from shard_svc.errors import ConfigError, KimiServeError


class ParallelConfigError(ConfigError):
    """--tp / --ep do not fit together or do not divide the model's sizes (heads, vocab, widths, experts)."""


class GroupError(KimiServeError):
    """The shard group cannot go on: a rank died, a collective failed or timed out, or a rank failed to load.

    Never contained to one request: every rank's state would disagree afterwards, so the whole group stops."""


class GroupDiverged(GroupError):
    """Two ranks computed different step plans or sequence states; continuing would deadlock or give wrong output."""
