"""Training scripts that leak memory in one way each (the leaking line ends with `# LEAK`), and healthy ones
whose memory rises then plateaus. `tests/e2e/test_leaks.py` runs them on the CPU, `tests/gpu/test_gpu_leaks.py` on
CUDA (the device is the script's first argument). Each prints `LEAKS <json of mon.leaks()>` and
`PROBES <number of probes run>` at its end, and `READS <json of (RSS, malloc's free bytes) at each step end>`."""

from __future__ import annotations

import textwrap

_HEAD = """
import json, sys
import torch
import torchmem

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cpu"
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 40
torch.manual_seed(0)
torch.set_num_threads(1)  # small matrices: one thread is fastest on a shared machine
model = torch.nn.Sequential(
    torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)
).to(DEVICE)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
mon = torchmem.Monitor(model, opt, verbose=False)
# What the leak detector is fed at each step end: (RSS, what malloc keeps freed), read right after it.
READS = []
_step_end = mon._leaks.step_end
def _read_step_end(memory, index):
    _step_end(memory, index)
    READS.append((torchmem._native.self_rss_bytes(), torchmem._native.malloc_free_bytes()))
mon._leaks.step_end = _read_step_end
"""

_TAIL = """
print("LEAKS " + json.dumps(mon.leaks()))
print("PROBES " + str(len(mon._leaks.reports) + mon._leaks.probing))
print("GROWTH " + json.dumps([r.get("growth") for r in mon._leaks.reports]))
print("READS " + json.dumps(READS))
"""

# One training step of the cases that train; each case adds its own lines around it (the `# LEAK` line is the
# one the probe must name).
_TRAIN_STEP = """    with mon.step():
        x = torch.randn(2048, 256, device=DEVICE)
        out = model(x)
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
"""


def _training(before: str, in_step: str = "") -> str:
    """`before`, then the loop of STEPS training steps with `in_step` (indented into the step) at its end."""
    return (
        before + "for step in range(STEPS):\n" + _TRAIN_STEP + "".join(f"        {ln}\n" for ln in in_step.splitlines())
    )


_BODIES = {
    # Evaluation with autograd on: each step's graph (every saved activation) stays reachable from total_loss.
    "total_loss": """
total_loss = 0.0
for step in range(STEPS):
    with mon.step():
        x = torch.randn(2048, 256, device=DEVICE)
        loss = model(x).pow(2).mean()
        total_loss += loss  # LEAK
print("mean loss", float(total_loss) / STEPS)
""",
    # A list of outputs that grows: 2048 x 256 floats (2 MiB) per step.
    "tensor_list": _training("\noutputs = []\n", "outputs.append(out.detach())  # LEAK"),
    # A dict of Python objects that grows by ~1.3 MiB per step.
    "python_dict": _training("\nhistory = {}\n", "history[step] = [float(i) + step for i in range(40000)]  # LEAK"),
    # A cache of CPU copies that is never trimmed: 2 MiB per step.
    "cpu_cache": _training("\ncache = {}\n", "cache[step] = out.detach().cpu().clone()  # LEAK"),
    # Healthy: Adam's state appears at the first optimizer step, then memory is flat.
    "healthy_adam": _training("\nopt = torch.optim.Adam(model.parameters(), lr=1e-3)\n"),
    # Healthy: a warm-up cache that fills over the first 4 steps, then stops growing; a bounded history.
    "healthy_cache": _training(
        "\ncache = {}\nrecent = []\n",
        """if len(cache) < 4:
    cache[step] = torch.randn(2048, 256, device=DEVICE)
recent.append(loss.item())
recent = recent[-10:]""",
    ),
}

LEAKY = ("total_loss", "tensor_list", "python_dict", "cpu_cache")
HEALTHY = ("healthy_adam", "healthy_cache")
# The kind each leak is reported as, on the CPU and on CUDA.
KIND = {
    "total_loss": ("CPU tensor", "CUDA tensor"),
    "tensor_list": ("CPU tensor", "CUDA tensor"),
    "python_dict": ("Python object", "Python object"),
    "cpu_cache": ("CPU tensor", "CPU tensor"),
}


def source(case: str) -> str:
    """The whole script of one case."""
    return textwrap.dedent(_HEAD) + textwrap.dedent(_BODIES[case]) + textwrap.dedent(_TAIL)


def leak_line(case: str) -> int:
    """The 1-based line number of the case's `# LEAK` line."""
    for n, text in enumerate(source(case).splitlines(), 1):
        if text.rstrip().endswith("# LEAK"):
            return n
    raise KeyError(f"{case} has no # LEAK line")


def parse(stdout: str) -> tuple[list[dict], int]:
    """(the findings, the number of probes) a case printed."""
    import json

    leaks = probes = None
    for line in stdout.splitlines():
        if line.startswith("LEAKS "):
            leaks = json.loads(line[6:])
        elif line.startswith("PROBES "):
            probes = int(line[7:])
    if leaks is None or probes is None:
        raise AssertionError(f"the script printed no LEAKS/PROBES line:\n{stdout}")
    return leaks, probes


def reads_of(stdout: str) -> list[tuple[int, int]]:
    """The (RSS, malloc's free bytes) a case read at each step end."""
    import json

    for line in stdout.splitlines():
        if line.startswith("READS "):
            return [tuple(r) for r in json.loads(line[6:])]
    raise AssertionError(f"the script printed no READS line:\n{stdout}")
