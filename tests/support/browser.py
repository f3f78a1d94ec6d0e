"""The one way the tests start a real headless chromium (Debian's package): flags that keep it off the
network and a fresh profile per run. Tests skip with `pytestmark = NEEDS_CHROMIUM` when it is missing."""

from __future__ import annotations

import shutil
import subprocess
import tempfile

import pytest

CHROMIUM = next((p for p in map(shutil.which, ["chromium", "chromium-browser", "google-chrome"]) if p), None)
#: Headless, offline and quiet: the flags every test's chromium runs with (`chromium()` here, `cdp.Browser`).
HEADLESS_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
NEEDS_CHROMIUM = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")


def chromium(*args: str, timeout_s: int = 120) -> subprocess.CompletedProcess[str]:
    """Runs headless chromium with `args` (e.g. `--dump-dom URL`) in a throwaway profile."""
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory(prefix="tm-chromium-") as profile_dir:
        return subprocess.run(
            [
                CHROMIUM,
                *HEADLESS_FLAGS,
                f"--user-data-dir={profile_dir}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
