"""Who this process is in a distributed job: RANK, LOCAL_RANK, WORLD_SIZE as torchrun sets them, else Slurm's
SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS (what `srun` sets per task); its node and attempt, GROUP_RANK and
TORCHELASTIC_RESTART_COUNT, else SLURM_NODEID and SLURM_RESTART_COUNT; None outside one. The same rule as the
extension's hello to the recorder (`events.rs`, `model::Launch`), so the Monitor, `stats()`, `on_oom`'s file
names and the profile agree."""

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


def launch() -> tuple[int | None, int | None]:
    """(group_rank, restart_count) of this process: its node in the job and its attempt (0 the first time, 1
    after one restart), each None where the environment does not say."""
    return (
        _env_int("GROUP_RANK", "SLURM_NODEID"),
        _env_int("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"),
    )
