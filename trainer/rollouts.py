"""The rollout file format moved to `protocol.rollout_files` (validators write it, trainers read it)."""

from protocol.rollout_files import (  # noqa: F401 - re-exported for the trainer's modules
    ROLLOUT_SCHEMA,
    SCHEMA_KEY,
    SCHEMA_VERSION,
    RolloutError,
    Sample,
    read_rollouts,
    write_rollouts,
)
