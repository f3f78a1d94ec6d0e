"""Reading a profile file written by `torchmem run` from Python: `load_profile(path)`.

The file is read once, in Rust (`torchmem._native.open_profile`). `summary()` is the same dict as
`torchmem report --format json`; each table (`cpu_samples`, `markers`, `phases`, `epochs`, `processes`, …)
comes out as plain rows (a list of dicts) or, when pandas or polars is installed, as a DataFrame.
A missing file raises `FileNotFoundError`; a file that is not a readable profile `torchmem.ProfileError`
(a `ValueError`) with the message `torchmem report` gives.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from . import _native

if TYPE_CHECKING:
    from ._types import ProfileReport, ReportMeta

__all__ = ["Profile", "load_profile"]


class Profile:
    """A loaded profile. Tables are named as in `tables()`; bytes are `*_bytes` ints, times `*_ns` ints."""

    def __init__(self, data: _native.ProfileData) -> None:
        self._data = data

    def __repr__(self) -> str:
        return f"<torchmem.Profile {self.path!r}>"

    @property
    def path(self) -> str:
        """The profile file's path, as given."""
        return self._data.path

    @property
    def meta(self) -> ReportMeta:
        """The run's metadata (command, exit code, duration, host, GPUs): `summary()["meta"]`."""
        return self.summary()["meta"]

    def summary(self) -> ProfileReport:
        """The report of `torchmem report --format json` as a dict."""
        return self._data.summary()

    def tables(self) -> list[str]:
        """The table names `rows`, `columns`, `to_pandas` and `to_polars` accept."""
        return self._data.tables()

    def columns(self, table: str) -> list[str]:
        """The column names of a table (empty when the table has no rows)."""
        return self._data.table(table)[0]

    def rows(self, table: str) -> list[dict[str, Any]]:
        """A table as a list of dicts, one per row (a nested record such as `origin` is flattened to
        `origin_pid`, `origin_rank`, …). Unknown names raise `torchmem.InputError` (a `ValueError`)."""
        columns, rows = self._data.table(table)
        return [dict(zip(columns, row, strict=False)) for row in rows]

    def to_pandas(self, table: str) -> Any:
        """A table as a `pandas.DataFrame` (needs pandas)."""
        import pandas as pd

        columns, rows = self._data.table(table)
        return pd.DataFrame.from_records(rows, columns=columns)

    def to_polars(self, table: str) -> Any:
        """A table as a `polars.DataFrame` (needs polars)."""
        import polars as pl

        columns, rows = self._data.table(table)
        return pl.DataFrame(rows, schema=columns, orient="row")

    @property
    def cpu_samples(self) -> list[dict[str, Any]]:
        """Host memory over time: t_ns, rss_bytes, pss_bytes, uss_bytes, process_count."""
        return self.rows("cpu_samples")

    @property
    def torch_samples(self) -> list[dict[str, Any]]:
        """PyTorch allocator readings per device over time."""
        return self.rows("torch_samples")

    @property
    def gpu_samples(self) -> list[dict[str, Any]]:
        """NVML readings per device over time."""
        return self.rows("gpu_samples")

    @property
    def markers(self) -> list[dict[str, Any]]:
        """Epoch, step, phase and mark events as recorded (kept spans)."""
        return self.rows("markers")

    @property
    def phases(self) -> list[dict[str, Any]]:
        """The per-phase table of the report."""
        return self.rows("phases")

    @property
    def epochs(self) -> list[dict[str, Any]]:
        """The per-epoch table of the report."""
        return self.rows("epochs")

    @property
    def processes(self) -> list[dict[str, Any]]:
        """The processes the run started (pid, parent, command, …)."""
        return self.rows("processes")


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Opens a profile file written by `torchmem run -o PROFILE`."""
    return Profile(_native.open_profile(path))
