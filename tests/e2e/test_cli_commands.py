"""The CLI commands besides `run`, as a newcomer meets them (issue 28): `torchmem estimate` in a Python without
torch says one clear line, `torchmem info` reads torch's version without importing torch and gives the same
full string as `device_info()`, and `%tmemit -d cuda:0` on a machine without CUDA says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torchmem

ROOT = Path(__file__).resolve().parents[2]


def _torchmem(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchmem", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env or dict(os.environ, TORCHMEM_PYTHON=sys.executable),
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv without pip, torch or torchmem (the base interpreter's stdlib only)."""
    where = tmp_path_factory.mktemp("bare") / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(where)
    python = where / "bin" / "python"
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True)
    assert probe.returncode != 0, "the bare venv must not see torch"
    return python


def _torchmem_only(tmp_path: Path) -> Path:
    """A directory holding the installed torchmem package alone (a link to it), for PYTHONPATH."""
    only = tmp_path / "only-torchmem"
    only.mkdir()
    (only / "torchmem").symlink_to(Path(torchmem.__file__).parent)
    return only


@pytest.mark.parametrize("has_torchmem", [True, False])
def test_estimate_in_a_python_without_torch_says_one_clear_line(tmp_path, bare_python, has_torchmem):
    script = tmp_path / "hi.py"
    script.write_text("print('hi')\n")
    env = dict(os.environ, TORCHMEM_PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)
    if has_torchmem:
        env["PYTHONPATH"] = str(_torchmem_only(tmp_path))
    r = _torchmem("estimate", "--", str(bare_python), str(script), env=env, cwd=tmp_path)
    assert r.returncode == 1, r
    assert "Fatal Python error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "hi" not in r.stdout, "the program never ran"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    missing = "torch" if has_torchmem else "torchmem"
    assert lines[0].startswith(f"torchmem: error: this Python ({bare_python}) cannot import {missing} ("), lines[0]
    assert f"-m pip install {missing}`" in lines[0], lines[0]


def test_estimate_keep_trace_never_replaces_a_foreign_file(tmp_path):
    precious = tmp_path / "snapshot.pickle"
    precious.write_bytes(b"\x80\x04my recorded snapshot")
    r = _torchmem("estimate", "--keep-trace", str(precious), "--", "train.py", cwd=tmp_path)
    assert r.returncode == 1 and "--force" in r.stderr and "--keep-trace" in r.stderr, r.stderr
    assert precious.read_bytes() == b"\x80\x04my recorded snapshot"


def test_info_reads_the_full_torch_version_without_importing_torch(tmp_path):
    torch = pytest.importorskip("torch")
    r = _torchmem("info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)["torch"]
    assert info["torch_version"] == torch.__version__, info
    assert info["torch_cuda_version"] == torch.version.cuda, info
    # The same string from the Python API, whether torch is imported or not.
    code = "import sys, torchmem; v = torchmem.device_info()['torch_version']; print(v, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [torch.__version__, "False"], out
    assert torchmem.device_info()["torch_version"] == torch.__version__
    # `info` never imports torch: an `import torch` that would fail loudly is never run.
    poisoned = tmp_path / "poison"
    (poisoned / "torch").mkdir(parents=True)
    (poisoned / "torch" / "__init__.py").write_text("raise SystemExit('torch was imported')\n")
    (poisoned / "torch" / "version.py").write_text("__version__ = '9.9.9+cu999'\ncuda: str = '99.9'\n")
    env = dict(os.environ, TORCHMEM_PYTHON=sys.executable, PYTHONPATH=str(poisoned))
    r = _torchmem("info", env=env)
    assert r.returncode == 0, r.stderr
    assert "torch          9.9.9+cu999 (CUDA build 99.9)" in r.stdout, r.stdout


def test_info_without_torch_says_so(bare_python):
    env = dict(os.environ, TORCHMEM_PYTHON=str(bare_python))
    env.pop("PYTHONPATH", None)
    r = _torchmem("info", env=env)
    assert r.returncode == 0, r.stderr
    assert f"torch          not available: torch is not installed for {bare_python}" in r.stdout, r.stdout


def test_tmemit_on_cuda_without_a_cuda_device_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():  # pragma: no cover - about machines without CUDA
        pytest.skip("this machine has CUDA")
    from torchmem._jupyter import memit

    r = memit(lambda: bytearray(1 << 20), "cuda:0")
    assert r.device == "cpu" and r.peak_allocated_bytes is None
    assert "cuda:0 was asked for, but there is no CUDA device" in str(r), str(r)
    assert "no CUDA device" in r._repr_html_()
    assert memit(lambda: None, "cpu").note is None


def test_the_build_filter_drops_pips_marker_noise_and_keeps_errors():
    # The lines `maturin develop` printed 27 of in ./setup.sh (pip, for each optional dependency), and a real error.
    noise = [
        "Ignoring ipython: markers 'extra == \"jupyter\"' don't match your environment",
        "Ignoring lightning: markers 'extra == \"lightning\"' don't match your environment",
        "Ignoring accelerate: markers 'extra == \"transformers\"' don't match your environment",
    ]
    kept = ["error: could not compile `torchmem-snapshot` (lib) due to 1 previous error", "🛠 Installed torchmem-0.1.0"]
    text = "\n".join(noise[:2] + kept[:1] + noise[2:] + kept[1:]) + "\n"
    r = subprocess.run([ROOT / "scripts" / "quiet-pip-markers.sh"], input=text, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.splitlines() == kept, r
    assert "quiet-pip-markers.sh" in (ROOT / "scripts" / "dev-env.sh").read_text()
