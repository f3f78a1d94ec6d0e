"""Who this process is in a distributed job: RANK, LOCAL_RANK, WORLD_SIZE as torchrun sets them, else Slurm's
SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS (what `srun` sets per task); None outside one. The same rule as the
extension's hello to the recorder (`events.rs`), so the Monitor and the profile agree."""

from __future__ import annotations

import os


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def identity() -> tuple[int | None, int | None, int | None]:
    """(rank, local_rank, world_size) of this process, each None where the environment does not say."""
    return (
        _env_int("RANK", "SLURM_PROCID"),
        _env_int("LOCAL_RANK", "SLURM_LOCALID"),
        _env_int("WORLD_SIZE", "SLURM_NTASKS"),
    )
