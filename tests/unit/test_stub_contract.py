"""`python/torchmem/_native.pyi` is the contract of the Rust extension: every name the extension exports is
in the stub and every name in the stub exists, with the same parameter names for functions."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torchmem._native as native

STUB = Path(__file__).resolve().parents[2] / "python" / "torchmem" / "_native.pyi"
TREE = ast.parse(STUB.read_text())
STUB_FUNCS = {n.name: n for n in TREE.body if isinstance(n, ast.FunctionDef)}
STUB_CLASSES = {n.name for n in TREE.body if isinstance(n, ast.ClassDef)}
# Module constants (`NAME: type`), apart from the dunder ones.
STUB_CONSTANTS = {n.target.id for n in TREE.body if isinstance(n, ast.AnnAssign) and not n.target.id.startswith("__")}


def test_stub_and_extension_name_the_same_things() -> None:
    exported = {k for k in dir(native) if not k.startswith("__")}
    stub = set(STUB_FUNCS) | STUB_CLASSES | STUB_CONSTANTS
    assert exported - stub == set(), "exported but missing from _native.pyi"
    assert stub - exported == set(), "in _native.pyi but not exported"


@pytest.mark.parametrize("name", sorted(STUB_FUNCS))
def test_parameters_match(name: str) -> None:
    try:
        real = inspect.signature(getattr(native, name))
    except (TypeError, ValueError):
        pytest.skip(f"{name} has no introspectable signature")
    stub_args = STUB_FUNCS[name].args
    stub_names = [a.arg for a in stub_args.posonlyargs + stub_args.args + stub_args.kwonlyargs]
    assert list(real.parameters) == stub_names, f"{name}: extension {list(real.parameters)} vs stub {stub_names}"


STUB_CLASS_DEFS = {n.name: n for n in TREE.body if isinstance(n, ast.ClassDef)}


def _stub_members(cls: ast.ClassDef) -> set[str]:
    """The public names a stub class declares: annotated attributes, methods and properties."""
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    names |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    return {n for n in names if not n.startswith("_")}


def _stub_init(cls: ast.ClassDef) -> ast.FunctionDef | None:
    return next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)


@pytest.mark.parametrize("name", sorted(STUB_CLASS_DEFS))
def test_class_members_match(name: str) -> None:
    # The class's own members (an exception's are Exception's, which the stub leaves out).
    own = {k for k in vars(getattr(native, name)) if not k.startswith("_")}
    assert own == _stub_members(STUB_CLASS_DEFS[name]), f"{name}: extension {sorted(own)} vs stub"


@pytest.mark.parametrize("name", sorted(n for n, c in STUB_CLASS_DEFS.items() if _stub_init(c)))
def test_constructor_parameters_match(name: str) -> None:
    try:
        real = inspect.signature(getattr(native, name))
    except (TypeError, ValueError):
        pytest.skip(f"{name} has no introspectable signature")
    args = _stub_init(STUB_CLASS_DEFS[name]).args  # type: ignore[union-attr]
    stub_names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs][1:]  # without self
    assert list(real.parameters) == stub_names, f"{name}: extension {list(real.parameters)} vs stub {stub_names}"


# --- the dicts that cross: every function typed with a `torchmem._types` TypedDict, called on real input ---
# Each case calls the function (a profile file, snapshots and OOM messages from tests/fixtures, markers and a
# probe made here, the estimator's recorded traces with a tracer summary made here) and checks the dict it
# returns against the stub's own return annotation, evaluated: every required key there, no key the TypedDict
# does not name, every value of its type, nested records too. The line profiler runs in a fresh process
# (`fresh_process_values`): it installs its hooks process-wide.

import collections.abc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
import typing  # noqa: E402

import torchmem._types as T  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SNAPSHOTS = sorted((FIXTURES / "snapshots").glob("*.pickle"))
OOM_MESSAGES = sorted((FIXTURES / "oom").glob("*.txt"))
TYPES_NS = {**vars(T), "Any": typing.Any}


def check(value: object, tp: object, where: str = "value") -> None:
    """Asserts that `value` is of type `tp` (a TypedDict, list/tuple/dict of them, a union, a Literal, a plain
    class), naming the path to the first value that is not."""
    if tp is typing.Any:
        return
    if typing.is_typeddict(tp):
        assert isinstance(value, dict), f"{where}: {type(value).__name__}, not a dict ({tp.__name__})"
        hints = typing.get_type_hints(tp)
        missing = set(tp.__required_keys__) - set(value)
        unknown = set(value) - set(hints)
        assert not missing, f"{where} ({tp.__name__}): keys missing: {sorted(missing)}"
        assert not unknown, f"{where} ({tp.__name__}): keys the TypedDict does not name: {sorted(unknown)}"
        for k, v in value.items():
            check(v, hints[k], f"{where}[{k!r}]")
        return
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for a in args:
            try:
                check(value, a, where)
                return
            except AssertionError as e:
                errors.append(str(e))
        raise AssertionError(f"{where}: {value!r:.80} matches none of {tp}: {errors}")
    if origin is typing.Literal:
        assert value in args, f"{where}: {value!r} not one of {args}"
    elif origin is list:
        assert isinstance(value, list), f"{where}: {type(value).__name__}, not a list"
        for i, v in enumerate(value):
            check(v, args[0], f"{where}[{i}]")
    elif origin is tuple:
        assert isinstance(value, tuple) and len(value) == len(args), f"{where}: {value!r}, not a {tp}"
        for i, (v, a) in enumerate(zip(value, args, strict=True)):
            check(v, a, f"{where}[{i}]")
    elif origin is dict:
        assert isinstance(value, dict), f"{where}: {type(value).__name__}, not a dict"
        for k, v in value.items():
            check(k, args[0], f"{where} key {k!r}")
            check(v, args[1], f"{where}[{k!r}]")
    elif origin is collections.abc.Callable:
        assert callable(value), f"{where}: {value!r} is not callable"
    elif tp is None or tp is type(None):
        assert value is None, f"{where}: {value!r}, not None"
    elif tp is int:
        assert isinstance(value, int) and not isinstance(value, bool), f"{where}: {value!r}, not an int"
    elif tp is float:
        assert type(value) is float, f"{where}: {value!r}, not a float"
    else:
        assert isinstance(tp, type), f"{where}: cannot check against {tp!r}"
        assert isinstance(value, tp), f"{where}: {value!r:.80}, not a {tp.__name__}"


def _stub_def(name: str) -> ast.FunctionDef:
    """A module function (`name`) or a method (`Class.name`) of the stub."""
    if "." not in name:
        return STUB_FUNCS[name]
    cls, meth = name.split(".")
    return next(f for f in STUB_CLASS_DEFS[cls].body if isinstance(f, ast.FunctionDef) and f.name == meth)


def stub_returns(name: str) -> object:
    """The stub's return annotation of `name`, evaluated against torchmem._types."""
    return eval(ast.unparse(_stub_def(name).returns), TYPES_NS)  # noqa: S307 (our own stub)


def stub_param(name: str, param: str) -> object:
    args = _stub_def(name).args
    node = next(a for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg == param)
    return eval(ast.unparse(node.annotation), TYPES_NS)  # noqa: S307


def _typed_names() -> set[str]:
    """Every stub function and method whose return annotation names a torchmem._types record."""
    records = {n for n, v in vars(T).items() if typing.is_typeddict(v)}
    out = set()
    defs = [(f.name, f) for f in STUB_FUNCS.values()]
    defs += [
        (f"{c.name}.{f.name}", f) for c in STUB_CLASS_DEFS.values() for f in c.body if isinstance(f, ast.FunctionDef)
    ]
    for name, f in defs:
        if f.returns is not None and {n.id for n in ast.walk(f.returns) if isinstance(n, ast.Name)} & records:
            out.add(name)
    return out


def _markers() -> list[dict]:
    """Two epochs of five steps with a forward phase each, as a Monitor pushes them."""
    out: list[dict] = []
    for e in range(2):
        out.append(
            {
                "t_ns": 100 * e,
                "kind": "epoch",
                "edge": "start",
                "name": "epoch",
                "index": e,
                "memory": {"rss_bytes": 100},
            }
        )
        for i in range(5):
            for edge, t, mem in (
                ("start", 100 * e + 10 * i, {"rss_bytes": 100, "allocated_bytes": 5}),
                (
                    "end",
                    100 * e + 10 * i + 4,
                    {
                        "rss_bytes": 130 + i,
                        "allocated_bytes": 7 + i,
                        "reserved_bytes": 20,
                        "peak_allocated_bytes": 9 + i,
                    },
                ),
            ):
                out.append({"t_ns": t, "kind": "step", "edge": edge, "name": "step", "index": i, "memory": mem})
                out.append(
                    {
                        "t_ns": t + 1,
                        "kind": "phase",
                        "edge": edge,
                        "name": "forward",
                        "index": None,
                        "memory": mem,
                        "device": None,
                    }
                )
        out.append(
            {
                "t_ns": 100 * e + 99,
                "kind": "epoch",
                "edge": "end",
                "name": "epoch",
                "index": e,
                "memory": {"rss_bytes": 200 + e * 10**6, "held_rss_bytes": 150},
            }
        )
    return out


def _marker_log() -> native.MarkerLog:
    log = native.MarkerLog(2)
    for m in _markers():
        log.push(m)
    return log


def _monitor_markers() -> list[dict]:
    """The markers a real Monitor pushes on the CPU (model and optimizer hooked: breakdowns, activations by
    module, phases from its hooks), three epochs of four steps."""
    import torch
    import torchmem

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters())
    mon = torchmem.Monitor(model, opt, verbose=False)
    for _ in range(3):
        with mon.epoch():
            for _ in range(4):
                with mon.step():
                    model(torch.randn(16, 32)).sum().backward()
                    opt.step()
                    opt.zero_grad()
    return list(mon.markers)


def _monitor_log() -> native.MarkerLog:
    log = native.MarkerLog()
    for m in _monitor_markers():
        log.push(m)
    return log


def _growth() -> dict:
    d = native.StepGrowthDetector(0, 4)
    seen = [d.push(1000 * i, 10**6, 0) for i in range(10)]
    return next(g for g in reversed(seen) if g is not None)


def _probe() -> dict:
    """A probe that finds a tensor site and a Python line that grow every step (one kept in a list)."""
    kept = {"container": "list", "name": "history", "file": "/x.py", "line": 2, "source": "history = []"}
    return {
        "probe_steps": 4,
        "first_step": 3,
        "growth": _growth(),
        "tensors": [
            {
                "file": "/x.py",
                "line": 3,
                "function": "f",
                "source": "history.append(t)",
                "device": "cpu",
                "live_by_step": [1, 2, 3, 4],
                "live_bytes_by_step": [4096, 8192, 12288, 16384],
                "kept_in": kept,
            },
            {
                "file": "/x.py",
                "line": 7,
                "device": "cpu",
                "live_by_step": [1, 1, 1, 1],
                "live_bytes_by_step": [512, 1024, 1536, 2048],
                "inplace_live": 1,
                "kept_in": {"container": "variable", "name": "total"},
            },
        ],
        "python": [
            {
                "file": "/x.py",
                "line": 5,
                "source": "a.append(x)",
                "size_bytes_by_step": [0, 10**6, 2 * 10**6, 3 * 10**6],
                "count_by_step": [1, 2, 3, 4],
            },
        ],
    }


IN_PROCESS_CASES: dict[str, typing.Callable[[], list[object]]] = {
    "MarkerLog.summary": lambda: [
        _marker_log().summary(1 << 30),
        _marker_log().summary(),
        native.MarkerLog().summary(),
        _monitor_log().summary(1 << 30),
    ],
    "MarkerLog.epoch_report": lambda: [
        _marker_log().epoch_report(),
        _monitor_log().epoch_report(),
        native.MarkerLog().epoch_report(),
    ],
    "ProfileData.summary": lambda: [native.open_profile(str(FIXTURES / "profile_v1.sqlite")).summary()],
    "device_info": lambda: [native.device_info()],
    "line_monitoring_callbacks": lambda: [native.line_monitoring_callbacks()],
    "simulate": lambda: (
        [native.simulate(path=str(SNAPSHOTS[0]), min_memory=True)]
        + [native.simulate(data=s.read_bytes(), alloc_conf="expandable_segments:True") for s in SNAPSHOTS[1:3]]
        + [native.simulate(path=str(SNAPSHOTS[0]), memory_limit_bytes=64 << 20)]
    ),
    "whatif": lambda: [native.whatif(str(s)) for s in SNAPSHOTS[:3]] + [native.whatif(str(SNAPSHOTS[0]), 64 << 20)],
    "gpu_catalogue": lambda: [native.gpu_catalogue()],
    "find_gpu": lambda: [native.find_gpu(k) for k in ("H200", "4090", "A100-40GB")],
    "snapshot_summary": lambda: (
        [native.snapshot_summary(str(s), 3) for s in SNAPSHOTS] + [native.snapshot_summary(str(SNAPSHOTS[0]), 2, 2**62)]
    ),
    "snapshot_summary_bytes": lambda: [native.snapshot_summary_bytes(SNAPSHOTS[-1].read_bytes(), 2)],
    "oom_diagnosis": lambda: [
        native.oom_diagnosis(10 << 30, 5 << 30, 8 << 30, 20 << 30, 1 << 30, 7 << 30, 0),
        native.oom_diagnosis(1 << 20, 5 << 30, 5 << 30),
    ],
    "explain_oom": lambda: [native.explain_oom(p.read_text(errors="replace")) for p in OOM_MESSAGES if _is_oom(p)],
    "StepGrowthDetector.push": lambda: [_growth(), native.StepGrowthDetector().push(1, 2)],
    "estimate_report": lambda: _estimates(),
    "leak_findings": lambda: [native.leak_findings(_probe()), native.leak_findings({"probe_steps": 3})],
}


TRACES = sorted((FIXTURES / "estimator-h200").glob("*__estimator.pickle.gz"))
# A tracer summary with the optional records filled (estimator::summary::Summary; every key defaults).
TRACER_SUMMARY = {
    "kind": "training",
    "steps_traced": 3,
    "forward_calls": 3,
    "phase_peak_bytes": {"forward": 1 << 20, "backward": 2 << 20},
    "largest_at_peak": [{"size_bytes": 4096, "phase": "forward", "what": "activation", "site": "x.py:3", "step": 1}],
    "uncertainty": [
        {
            "kind": "workspace",
            "what": "conv",
            "op": "conv2d",
            "shapes": "[1, 3]",
            "site": "x.py:4",
            "calls": 2,
            "bytes": 1024,
        }
    ],
    "trace_seconds": 1.5,
    "requests": 10,
    "notes": ["a note"],
}


def _estimates() -> list[object]:
    """The estimate of recorded H200 traces: a plain summary, a full one, one that does not fit (an `oom`)."""
    out: list[object] = [
        native.estimate_report(str(TRACES[0]), {}, gpu="rtx 4090", alloc_conf="expandable_segments:True")
    ]
    out.append(native.estimate_report(str(TRACES[-1]), TRACER_SUMMARY, gpu="H200"))
    small = native.estimate_report(str(TRACES[0]), TRACER_SUMMARY, gpu="H200", device_memory_bytes=64 << 20)
    assert small["oom"] is not None
    return [*out, small]


def _is_oom(p: Path) -> bool:
    try:
        native.explain_oom(p.read_text(errors="replace"))
        return True
    except ValueError:
        return False


FRESH_PROCESS_CASES = ("line_start", "line_snapshot", "line_report")

FRESH_SCRIPT = r"""
import json, sys
import torchmem._native as n
import torchmem.line_profiler as lp
out = {"line_snapshot_before": n.line_snapshot()}
real_start = n.line_start
def spy(*a):
    out["line_start"] = real_start(*a)
    return out["line_start"]
n.line_start = spy

@lp.profile
def work():
    x = [0] * 100000
    return len(x)

work()
out["line_snapshot"] = n.line_snapshot()
out["line_snapshot"]["functions"] = [{**f, "code": f["code"].co_name} for f in out["line_snapshot"]["functions"]]
out["profile_data"] = lp.profile_data()
out["line_report"] = n.line_report(out["profile_data"])
out["line_report_list"] = n.line_report([out["profile_data"], out["profile_data"]])

print("JSON" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def fresh_process_values(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The line profiler's dicts, made in a fresh process (code objects as their names)."""
    p = subprocess.run([sys.executable, "-c", FRESH_SCRIPT], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("JSON"))
    return json.loads(line[4:])


def test_every_typed_function_has_a_case() -> None:
    """A stub function that returns a torchmem._types record is called by a test below."""
    assert _typed_names() == set(IN_PROCESS_CASES) | set(FRESH_PROCESS_CASES)


@pytest.mark.parametrize("name", sorted(IN_PROCESS_CASES))
def test_returned_dicts_match_their_typeddict(name: str) -> None:
    values = IN_PROCESS_CASES[name]()
    assert values, f"{name}: no input made a value"
    tp = stub_returns(name)
    for i, v in enumerate(values):
        check(v, tp, f"{name}#{i}")


def test_the_inputs_the_stub_types_are_what_the_extension_reads() -> None:
    """The typed inputs (a marker, a probe, a list of leak findings) in the form the stub names are accepted."""
    for m in _markers() + _monitor_markers():
        check(m, stub_param("MarkerLog.push", "marker"), "marker")
    check(_probe(), stub_param("leak_findings", "probe"), "probe")
    check(TRACER_SUMMARY, stub_param("estimate_report", "summary"), "tracer summary")
    findings = native.leak_findings(_probe())["findings"]
    assert findings
    check(findings, stub_param("leaks_text", "findings"), "findings")
    assert native.leaks_text(findings)


def test_line_profiler_dicts_match_their_typeddict(fresh_process_values: dict) -> None:
    v = fresh_process_values
    check(v["line_start"], stub_returns("line_start"), "line_start")
    # JSON carried the code objects as names and the sample tuples as lists: put both back.
    snap = v["line_snapshot"]
    for f in snap["functions"]:
        f["code"] = compile("", f["code"], "exec")
        f["lines"] = [tuple(r) for r in f["lines"]]
    for s in (v["line_snapshot_before"], snap):
        check(s, stub_returns("line_snapshot"), "line_snapshot")
    assert v["line_snapshot_before"] == {"functions": []} and snap["functions"]
    check(v["profile_data"], stub_param("line_report", "payloads"), "profile_data")
    for k in ("line_report", "line_report_list"):
        check(v[k], stub_returns("line_report"), k)


def test_the_checker_refuses_a_missing_key_an_unknown_key_and_a_wrong_type() -> None:
    """The contract check itself: each kind of drift fails."""
    good = native.find_gpu("H200")
    check(good, T.GpuCatalogueEntry)
    for bad in ({k: v for k, v in good.items() if k != "major"}, {**good, "extra": 1}, {**good, "major": "9"}):
        with pytest.raises(AssertionError):
            check(bad, T.GpuCatalogueEntry)
    with pytest.raises(AssertionError):
        check({**good, "context": {"base_bytes": 1}}, T.GpuCatalogueEntry)


def _py_returns(func: object) -> object:
    """The return annotation of a torchmem Python function (its torchmem._types names are TYPE_CHECKING-only)."""
    return typing.get_type_hints(func, localns=TYPES_NS)["return"]


def test_the_public_python_api_returns_what_it_says() -> None:
    """The Python functions that hand these dicts on say so, and the dicts they return match."""
    import torchmem
    from torchmem import estimator, recorded_profile, simulation, snapshot

    info = torchmem.device_info()
    check(info, _py_returns(torchmem.device_info), "device_info")
    assert _py_returns(torchmem.device_info) is T.TorchDeviceInfo
    check(snapshot.summary(SNAPSHOTS[0], 2), _py_returns(snapshot.summary), "snapshot.summary")
    check(estimator.gpu_catalogue(), _py_returns(estimator.gpu_catalogue), "gpu_catalogue")
    prof = torchmem.load_profile(str(FIXTURES / "profile_v1.sqlite"))
    check(prof.summary(), _py_returns(recorded_profile.Profile.summary), "Profile.summary")
    check(prof.meta, _py_returns(recorded_profile.Profile.meta.fget), "Profile.meta")
    sim = torchmem.simulate(str(SNAPSHOTS[0]), min_memory=True)
    hints = typing.get_type_hints(simulation.Simulation, localns=TYPES_NS)
    for name in ("devices", "refused", "min_memory", "raw"):
        check(getattr(sim, name), hints[name], f"Simulation.{name}")
