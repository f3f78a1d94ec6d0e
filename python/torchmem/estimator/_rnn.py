"""cuDNN RNNs (`nn.LSTM`, `nn.GRU`, `nn.RNN`) on the emulated device (issue 23 item 3).

On a CUDA tensor, `torch._VF.lstm` (and `gru`, `rnn_tanh`, `rnn_relu`) is a composite that asks the real CUDA
runtime for its dropout state and cuDNN's weight layout before any operator is dispatched: without a GPU it
failed with "CUDA driver version is insufficient". And torch's meta kernel of `aten._cudnn_rnn` says the
reserve space is 0 bytes, with no workspace and no backward. Here the four `_VF` functions are replaced, on
fake CUDA inputs, by what CUDA's kernels request, in their order (aten/src/ATen/native/cudnn/RNN.cpp, torch
2.11), with cuDNN's sizes from `reserve_bytes` and `WorkspaceCatalogue` (recorded on the H200 by
`scripts/gpu_rnn_truth.py`):

* `.to("cuda")` flattens the weights into one buffer (`flatten_parameters`: the buffer is zeroed, each weight
  copied in and made a view of it; the weights' own blocks are freed);
* forward: the input made contiguous (a copy when `batch_first`, as the composite transposes it first), the
  output, h_n, c_n, cuDNN's workspace (freed at the end of the call) and, in training, the reserve space that
  lives with the autograd graph; with dropout, the process's dropout state once (kept);
* backward: zeros for the gradients nobody asked for, the input and dy made contiguous, dx, dh_0, dc_0 and a
  workspace (backward data), then the input again, dw (one zeroed buffer the size of the flat weights; each
  weight's gradient is a view of it) and a workspace (backward weights);
* autocast: the weights cast into a new flat buffer of the autocast dtype on every call (its views carry the
  gradient back to the float32 weights), the input and states cast.

Where the weights are not one buffer (weights shared, or changed after `.to`), the call copies them into a new
one each time, as CUDA does (and torch warns).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

# cudnnRNNMode_t
_MODES = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}
_GATES = {0: 1, 1: 1, 2: 4, 3: 3}
_CUDNN_DTYPES = (torch.float16, torch.float32, torch.float64, torch.bfloat16)


CATALOGUE_PATH = Path(__file__).with_name("data") / "cudnn-rnn-h200.json.gz"
# cuDNN's dropout state (`cudnnDropoutGetStatesSize`) per multiprocessor: 6,488,064 bytes on the H200's 132
_DROPOUT_STATE_BYTES_PER_SM = 49152
_RESERVE_PAD_BYTES = 256  # cuDNN's reserve space is this much above its formula (all 466 recorded configs)
_WORKSPACE_BASE_BYTES = 8 << 20  # the fallback's normaliser: per layer and direction, plus the gate buffers
# An unrecorded shape's upper bound is this much above the largest workspace ratio of its kind: taking each of
# the 466 recorded shapes out in turn, the bound needed at most 1.40x (tests/unit/test_rnn_sizes.py).
_UPPER_MARGIN = 1.5


@dataclass(frozen=True)
class RnnShape:
    """One `_cudnn_rnn` call: what cuDNN's temp-space sizes depend on."""

    mode: int  # cudnnRNNMode_t
    input_size: int
    hidden_size: int
    proj_size: int
    num_layers: int
    bidirectional: bool
    seq_length: int
    mini_batch: int
    rows: int  # packed input: the number of rows (the sum of the lengths); else seq_length * mini_batch
    packed: bool
    dtype_bytes: int
    dropout: bool = False
    train: bool = True  # cuDNN's training or inference temp space (`model.train()` / `model.eval()`)

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def out_size(self) -> int:
        return self.proj_size or self.hidden_size

    def key(self) -> str:
        """The catalogue's key (dropout between layers changes cuDNN's workspace too)."""
        return (
            f"m{self.mode}|I{self.input_size}|H{self.hidden_size}|P{self.proj_size}|L{self.num_layers}|"
            f"D{self.directions}|T{self.seq_length}|B{self.mini_batch}|N{self.rows}|e{self.dtype_bytes}|"
            f"p{int(self.packed)}|r{int(self.dropout)}|t{int(self.train)}"
        )

    def family(self) -> tuple:
        return (self.mode, self.dtype_bytes, self.packed, bool(self.proj_size), self.train)

    def workspace_scale(self) -> int:
        """What the workspace grows with, for scaling a recorded neighbour (not a formula of cuDNN's)."""
        gates = _GATES[self.mode] + 1
        per = self.directions * self.num_layers
        return _WORKSPACE_BASE_BYTES * per + self.rows * self.hidden_size * per * self.dtype_bytes * gates


def reserve_bytes(s: RnnShape) -> int:
    """cuDNN's training reserve space, exact on the H200's cuDNN 9.19 for every recorded config: per layer
    and direction the gates' pre-activations and the states it keeps (LSTM 5, GRU 6, plain RNN 1 hidden-size
    rows), the output of each inner layer, one bit per inner output under dropout, and 256 bytes."""
    n, h, p, d, layers = s.rows, s.hidden_size, s.proj_size, s.directions, s.num_layers
    if p:
        units = d * (5 * h * layers + 4 * p * layers + 3 * p * (layers - 1))
    else:
        per_layer = {0: 1, 1: 1, 2: 5, 3: 6}[s.mode]
        units = d * h * (per_layer * layers + (layers - 1))
    out = units * n * s.dtype_bytes + _RESERVE_PAD_BYTES
    if s.dropout and layers > 1:
        out += n * h * d * (layers - 1) // 8
    return out


class WorkspaceCatalogue:
    """cuDNN's training workspace of the shapes recorded on the H200; other shapes from the nearest recorded
    one of the same kind (mode, dtype size, packed, projections), scaled, with an upper bound: the largest
    ratio to `workspace_scale` seen in that kind."""

    def __init__(self, data: dict) -> None:
        self.exact: dict[str, int] = dict(data.get("workspace_bytes", {}))
        self.by_family: dict[tuple, list[tuple[RnnShape, int]]] = {}
        for key, ws in self.exact.items():
            shape = _shape_from_key(key)
            self.by_family.setdefault(shape.family(), []).append((shape, ws))

    @classmethod
    def load(cls) -> WorkspaceCatalogue:
        try:
            with gzip.open(CATALOGUE_PATH, "rt") as f:
                return cls(json.load(f))
        except OSError:
            return cls({})

    def lookup(self, s: RnnShape) -> tuple[int, int, str]:
        """(point bytes, upper bytes, how): "exact", "scaled" or "unknown" (nothing of that kind recorded)."""
        ws = self.exact.get(s.key())
        if ws is not None:
            return ws, ws, "exact"
        if not s.train:
            # an inference shape not recorded as such: its training workspace (recorded inference shapes are few,
            # all at one batch shape, too few to scale from; taken as not smaller than the inference one)
            return self.lookup(dataclasses.replace(s, train=True, dropout=False))
        family = self.by_family.get(s.family())
        if not family:
            family = [e for f, v in self.by_family.items() if f[0] == s.mode and f[3] == bool(s.proj_size) for e in v]
        if not family:
            return 0, 0, "unknown"

        def distance(other: RnnShape) -> float:
            pairs = [
                (s.input_size, other.input_size),
                (s.hidden_size, other.hidden_size),
                (s.num_layers, other.num_layers),
                (s.directions, other.directions),
                (s.seq_length, other.seq_length),
                (s.mini_batch, other.mini_batch),
            ]
            return sum(abs(math.log(a / b)) for a, b in pairs if a > 0 and b > 0)

        near, near_ws = min(family, key=lambda e: distance(e[0]))
        scale = s.workspace_scale()
        point = self._regressed(s)
        if point is None and s.dropout:
            point = self._regressed_with_dropout(s)
        if point is None:
            point = int(near_ws * scale / near.workspace_scale())
        upper = int(_UPPER_MARGIN * max(ws / sh.workspace_scale() for sh, ws in family) * scale)
        return point, max(point, upper), "scaled"

    def _regressed_with_dropout(self, s: RnnShape) -> int | None:
        """Dropout between layers, where the same stack is recorded without it at three or more batch shapes: the
        regression there, plus one hidden-size row per input row, inner layer and direction for the gated modes
        (LSTM, GRU; a plain RNN's workspace does not change). Read off the catalogue's three shapes recorded both
        ways (each within 0.5 MiB of it); checked, held out, on the corpus's `lstm_lm.py` recorded on an H100
        (178.50 MiB predicted, 178.50 MiB asked by cuDNN: docs/estimator.md §3.2)."""
        base = self._regressed(dataclasses.replace(s, dropout=False))
        if base is None:
            return None
        if s.mode in (2, 3):
            base += s.rows * s.hidden_size * s.dtype_bytes * (s.num_layers - 1) * s.directions
        return base

    def _regressed(self, s: RnnShape) -> int | None:
        """Where the same layer stack (mode, sizes, layers, directions, dtype, packing, mode of use) is recorded
        at three or more other batch shapes: cuDNN's workspace there is linear in the rows and the batch (a
        constant, the per-row gate buffers, a per-sequence part), fitted by least squares over them."""
        same = [
            (sh, ws)
            for sh, ws in self.by_family.get(s.family(), [])
            if (sh.input_size, sh.hidden_size, sh.proj_size, sh.num_layers, sh.directions, sh.dropout)
            == (s.input_size, s.hidden_size, s.proj_size, s.num_layers, s.directions, s.dropout)
        ]
        if len(same) < 3 or len({(sh.rows, sh.mini_batch) for sh, _ in same}) < 3:
            return None
        # normal equations of ws = a + b * rows + c * batch (3x3, solved by Cramer's rule)
        xs = [(1.0, float(sh.rows), float(sh.mini_batch)) for sh, _ in same]
        ys = [float(ws) for _, ws in same]
        m = [[sum(x[i] * x[j] for x in xs) for j in range(3)] for i in range(3)]
        v = [sum(x[i] * y for x, y in zip(xs, ys, strict=True)) for i in range(3)]

        def det(a):
            return (
                a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
                - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0])
            )

        d = det(m)
        if abs(d) < 1e-9:
            return None
        coef = []
        for k in range(3):
            mk = [[v[i] if j == k else m[i][j] for j in range(3)] for i in range(3)]
            coef.append(det(mk) / d)
        out = coef[0] + coef[1] * s.rows + coef[2] * s.mini_batch
        return int(out) if out > 0 else None


def _shape_from_key(key: str) -> RnnShape:
    f = {part[0]: int(part[1:]) for part in key.split("|")}
    return RnnShape(
        mode=f["m"],
        input_size=f["I"],
        hidden_size=f["H"],
        proj_size=f["P"],
        num_layers=f["L"],
        bidirectional=f["D"] == 2,
        seq_length=f["T"],
        mini_batch=f["B"],
        rows=f["N"],
        dtype_bytes=f["e"],
        packed=bool(f["p"]),
        dropout=bool(f.get("r", 0)),
        train=bool(f.get("t", 1)),
    )


def grid_shape(cfg: dict) -> RnnShape:
    """The call shape of one `scripts/gpu_rnn_truth.py` config (its packed lengths as that script makes them)."""
    t, b = cfg["seq"], cfg["batch"]
    rows = t * b
    if cfg["packed"]:
        rows = sum(int(v) for v in torch.linspace(t, max(1, t // 4), b).long())
    dtype = cfg.get("autocast") or cfg["dtype"]
    return RnnShape(
        mode={"LSTM": 2, "GRU": 3, "RNN_TANH": 1}[cfg["mode"]],
        input_size=cfg["input"],
        hidden_size=cfg["hidden"],
        proj_size=cfg["proj"],
        num_layers=cfg["layers"],
        bidirectional=cfg["bidirectional"],
        seq_length=t,
        mini_batch=b,
        rows=rows,
        packed=cfg["packed"],
        dtype_bytes=2 if dtype in ("float16", "bfloat16") else 4,
        dropout=cfg.get("dropout", 0) > 0 and cfg["layers"] > 1,
        train=not cfg.get("eval", False),
    )


def training_workspace(forward_events: list) -> int | None:
    """The workspace in a recorded training forward's requests: the first block freed inside the call (past
    the 8-byte dropout seed)."""
    allocated: list[int] = []
    for action, size in forward_events:
        if action == "alloc":
            allocated.append(size)
        elif size in allocated and size > 512:
            return size
    return None


def num_weight_elements(weights: list[torch.Tensor]) -> int:
    """The flat weight buffer's element count (`cudnnGetRNNWeightSpaceSize`): the weights' sum."""
    return sum(w.numel() for w in weights)


# ---------------------------------------------------------------------------------------------- the call


class _Workspace:
    """cuDNN's workspace of one call: a request of the catalogue's size, freed at the end of the call; where the
    size is not recorded, the request can be as large as the catalogue's bound (the estimate's interval)."""

    def __init__(self, spec: dict) -> None:
        self.tracer = spec["tracer"]
        self.bytes, upper, how = spec["workspace"]
        self.addr = 0
        if self.bytes > 0 and self.tracer.enabled and not self.tracer.paused:
            self.addr = self.tracer.alloc(self.bytes, "cuDNN RNN workspace")
            if upper > self.bytes and hasattr(self.tracer, "uncertain"):
                self.tracer.uncertain(spec["reason"], upper_bytes=upper, addr=self.addr, point_bytes=self.bytes)

    def release(self) -> None:
        if self.addr:
            self.tracer.free(self.addr, self.bytes)
            self.addr = 0


class _CudnnRnn(torch.autograd.Function):
    """`aten._cudnn_rnn` and its backward, as CUDA allocates them, on fake tensors."""

    @staticmethod
    def forward(ctx, spec, x_in, hx, cx, weight_buf, *weights):  # noqa: D401
        s: RnnShape = spec["shape"]
        train = spec["train"]
        x = x_in.contiguous()
        if s.packed:
            out_shape = (s.rows, s.out_size * s.directions)
        else:
            out_shape = (s.seq_length, s.mini_batch, s.out_size * s.directions)
        output = x_in.new_empty(out_shape)
        hidden = (s.num_layers * s.directions, s.mini_batch, s.out_size)
        hy = hx.new_empty(hidden)
        cy = cx.new_empty((s.num_layers * s.directions, s.mini_batch, s.hidden_size)) if cx is not None else None
        if weight_buf is None:
            warnings.warn(
                "RNN module weights are not part of single contiguous chunk of memory. This means they need to be "
                "compacted at every call, possibly greatly increasing memory usage. To compact weights again call "
                "flatten_parameters().",
                stacklevel=2,
            )
            weight_buf = x_in.new_zeros(num_weight_elements(list(weights)))
        workspace = _Workspace(spec)
        reserve = x_in.new_empty(reserve_bytes(s) if train else 0, dtype=torch.uint8)
        workspace.release()
        del x
        ctx.spec = spec
        ctx.has_cx = cx is not None
        if not any(ctx.needs_input_grad):
            # no graph: the call's reserve space and weight copy are freed as it returns, in that order
            del reserve, weight_buf
        else:
            # the graph keeps them; after backward they go in this order (the reserve space last)
            ctx.save_for_backward(x_in, hx, cx, output, weight_buf, *weights, reserve)
        if cy is None:
            return output, hy
        return output, hy, cy

    @staticmethod
    def backward(ctx, grad_output, grad_hy, grad_cy=None):
        x_in, hx, cx, output, weight_buf, *weights, reserve = ctx.saved_tensors
        del reserve
        n_in = 5 + len(weights)
        if grad_output is None and grad_hy is None and grad_cy is None:
            return (None,) * n_in
        if grad_output is None:
            grad_output = torch.zeros_like(output)
        if grad_hy is None:
            grad_hy = torch.zeros_like(hx)
        if cx is not None and grad_cy is None:
            grad_cy = torch.zeros_like(cx)
        # backward data
        x = x_in.contiguous()
        dy = grad_output.contiguous()
        dx = torch.empty_like(x_in, memory_format=torch.contiguous_format)
        dhy = grad_hy.contiguous()
        dcy = grad_cy.contiguous() if cx is not None else None
        dhx = hx.new_empty(hx.shape)
        dcx = cx.new_empty(cx.shape) if cx is not None else None
        _Workspace(ctx.spec).release()
        del dcy, dhy, dy, x
        dws: list = [None] * len(weights)
        if any(ctx.needs_input_grad[5:]):
            # backward weights
            x = x_in.contiguous()
            dw = torch.zeros_like(weight_buf)
            _Workspace(ctx.spec).release()
            del x
            offset = 0
            for i, w in enumerate(weights):
                n = w.numel()
                dws[i] = dw[offset : offset + n].view(w.shape)
                offset += n
        # gradients nobody asked for are dropped here, before the graph releases what it saved
        if not ctx.needs_input_grad[2]:
            dhx = None
        if not ctx.needs_input_grad[3]:
            dcx = None
        return (None, dx, dhx, dcx, None, *dws)


# ---------------------------------------------------------------------------------------------- _VF


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _values_known(t) -> bool:
    """Whether `t` has values here: a real tensor, a list, or a fake tensor that carries its constant."""
    if not isinstance(t, torch.Tensor):
        return True
    if not _is_fake(t):
        return True
    return getattr(t, "constant", None) is not None


def _length_values(lengths) -> list[int] | None:
    """The lengths' values where they have some here (none is 0: that is torch's error to raise)."""
    values = None
    if isinstance(lengths, (list, tuple)):
        values = [int(v) for v in lengths]
    elif isinstance(lengths, torch.Tensor) and _values_known(lengths):
        t = lengths.constant if _is_fake(lengths) else lengths
        values = [int(v) for v in t.tolist()]
    return values if values and min(values) > 0 else None


class _PackPadded(torch.autograd.Function):
    """`aten._pack_padded_sequence` with known lengths (sorted, longest first), and its backward (a zeroed
    gradient of the input's size, the data gradient copied in), as CUDA requests them."""

    @staticmethod
    def forward(ctx, input, lengths, batch_first):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        x = input.transpose(0, 1) if batch_first else input
        steps, sizes = [], []
        prev = 0
        batch = len(lengths)
        for i in range(batch):
            length = lengths[batch - 1 - i]
            if length > prev:
                b = batch - i
                steps.append(x.narrow(0, prev, length - prev).narrow(1, 0, b).contiguous().view(-1, *x.shape[2:]))
                sizes.extend([b] * (length - prev))
                prev = length
        data = torch.cat(steps)
        while steps:  # freed first to last, as the C++ vector is
            steps.pop(0)
        with unset_fake_temporarily():
            batch_sizes = torch.tensor(sizes, dtype=torch.int64)
        ctx.input_shape = tuple(input.shape)
        ctx.batch_first = batch_first
        ctx.mark_non_differentiable(batch_sizes)
        return data, batch_sizes

    @staticmethod
    def backward(ctx, grad_data, _grad_sizes):
        grad = grad_data.new_zeros(ctx.input_shape)
        return grad, None, None


class _PadPacked(torch.autograd.Function):
    """`aten._pad_packed_sequence`: the padded output filled with the padding value, each step copied in; its
    backward gathers the steps back into a gradient of the data's size."""

    @staticmethod
    def forward(ctx, data, sizes, steps, padding_value):
        ctx.data_shape = tuple(data.shape)
        return data.new_full((steps, sizes[0], *data.shape[1:]), padding_value)

    @staticmethod
    def backward(ctx, grad):
        return grad.new_empty(ctx.data_shape), None, None, None


def _batch_sizes(batch_sizes, rows: int) -> list[int]:
    """A packed sequence's batch sizes (a CPU tensor); without values, full-length steps of the rows."""
    if _values_known(batch_sizes):
        t = batch_sizes if not _is_fake(batch_sizes) else batch_sizes.constant
        return [int(b) for b in t.tolist()]
    steps = int(batch_sizes.shape[0])
    return [max(1, rows // max(1, steps))] * steps


def _is_fake_cuda(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) and t.device.type == "cuda"


def _shared_weight_buf(weights: list[torch.Tensor]):
    """The flat buffer the weights are views of, in order and back to back (`try_get_weight_buf`), or None."""
    try:
        storage = weights[0].untyped_storage()
        key = storage._cdata
        offset = weights[0].storage_offset()
        if offset != 0:
            return None
        for w in weights:
            if w.untyped_storage()._cdata != key or w.storage_offset() != offset or not w.is_contiguous():
                return None
            offset += w.numel()
    except (NotImplementedError, RuntimeError):
        return None
    buf = weights[0].new_empty(0)
    buf.set_(storage, 0, (offset,), (1,))
    return buf


class RnnEmulation:
    """Installs the `_VF` replacements and `RNNBase.flatten_parameters` for fake CUDA modules."""

    def __init__(self, tracer, gpu) -> None:
        self.tracer = tracer
        self.gpu = gpu
        self._patches: list[tuple[object, str, object, bool]] = []
        self._dropout_state = None  # cuDNN's dropout state: made once per process, kept
        self._catalogue: WorkspaceCatalogue | None = None
        # the recorded cuDNN is the H200's (sm90): another architecture's cuDNN may choose other algorithms
        self._recorded_arch = getattr(gpu, "major", 9) == 9
        self.calls = 0

    def install(self) -> None:
        vf = torch._VF
        for name in _MODES:
            had = name in vf.__dict__
            original = getattr(vf, name)
            self._patches.append((vf, name, original, had))
            setattr(vf, name, self._wrap(name, original))
        had = "_pack_padded_sequence" in vf.__dict__
        original_pack = vf._pack_padded_sequence
        self._patches.append((vf, "_pack_padded_sequence", original_pack, had))
        vf._pack_padded_sequence = self._pack(original_pack)
        import torch.nn.utils.rnn as rnn_utils

        self._patches.append((rnn_utils, "pack_padded_sequence", rnn_utils.pack_padded_sequence, True))
        rnn_utils.pack_padded_sequence = self._pack_with_lengths(rnn_utils.pack_padded_sequence)
        had = "_pad_packed_sequence" in vf.__dict__
        self._patches.append((vf, "_pad_packed_sequence", vf._pad_packed_sequence, had))
        vf._pad_packed_sequence = self._pad(vf._pad_packed_sequence)
        rnn_base = torch.nn.modules.rnn.RNNBase
        original_flatten = rnn_base.flatten_parameters
        self._patches.append((rnn_base, "flatten_parameters", original_flatten, True))
        rnn_base.flatten_parameters = self._flatten(original_flatten)

    def uninstall(self) -> None:
        for obj, name, original, had in reversed(self._patches):
            if had:
                setattr(obj, name, original)
            else:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
        self._patches.clear()

    # -------------------------------------------------------------------------------------- flatten
    def _flatten(self, original):
        def flatten_parameters(module) -> None:
            ws = module._flat_weights
            if len(ws) != len(module._flat_weights_names) or not ws or not all(_is_fake_cuda(w) for w in ws):
                return original(module)
            # torch.backends.cudnn.is_acceptable: half, float, double (bfloat16 weights stay apart and every
            # call copies them into a new buffer, as on the H200)
            flat_dtypes = (torch.float16, torch.float32, torch.float64)
            if len({w.dtype for w in ws}) != 1 or ws[0].dtype not in flat_dtypes or not torch.backends.cudnn.enabled:
                return None
            if len({id(w) for w in ws}) != len(ws) or _shared_weight_buf(list(ws)) is not None:
                return None  # aliased weights: CUDA takes the copying path; already flat: nothing to do
            with torch.no_grad():
                buf = torch.zeros(num_weight_elements(list(ws)), dtype=ws[0].dtype, device=ws[0].device)
                offset = 0
                for w in ws:
                    n = w.numel()
                    view = buf[offset : offset + n].view(w.shape)
                    view.copy_(w)
                    w.set_(buf.untyped_storage(), offset, w.shape, view.stride())
                    offset += n
            return None

        return flatten_parameters

    # -------------------------------------------------------------------------------------- packing
    def _pack_with_lengths(self, original):
        """`pack_padded_sequence` where the lengths have values here (a list, a CPU tensor made outside the
        emulated device): CUDA's requests exactly (the sorted indices moved to the GPU, the input reordered, a
        contiguous copy of each group of steps that is not contiguous, their concatenation)."""

        def pack_padded_sequence(input, lengths, batch_first=False, enforce_sorted=True):
            values = _length_values(lengths)
            if not _is_fake_cuda(input) or values is None:
                return original(input, lengths, batch_first=batch_first, enforce_sorted=enforce_sorted)
            from torch.nn.utils.rnn import _packed_sequence_init

            sorted_indices = None
            if enforce_sorted:
                if any(a < b for a, b in zip(values, values[1:], strict=False)):
                    return original(input, lengths, batch_first=batch_first, enforce_sorted=enforce_sorted)
            else:
                order = sorted(range(len(values)), key=lambda i: -values[i])
                values = [values[i] for i in order]
                sorted_indices = torch.as_tensor(order, dtype=torch.int64).to(input.device)
                input = input.index_select(0 if batch_first else 1, sorted_indices)
            data, batch_sizes = _PackPadded.apply(input, values, batch_first)
            return _packed_sequence_init(data, batch_sizes, sorted_indices, None)

        return pack_padded_sequence

    def _pad(self, original):
        """`pad_packed_sequence` of a packed batch whose batch sizes have values here (packed above)."""

        def pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length):
            if not _is_fake_cuda(data) or not _values_known(batch_sizes):
                return original(data, batch_sizes, batch_first, padding_value, total_length)
            sizes = _batch_sizes(batch_sizes, int(data.shape[0]))
            steps = max(len(sizes), int(total_length))
            out = _PadPacked.apply(data, sizes, steps, float(padding_value))
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                lengths = torch.tensor([sum(1 for b in sizes if b > i) for i in range(sizes[0])], dtype=torch.int64)
            return (out.transpose(0, 1) if batch_first else out), lengths

        return pad_packed_sequence

    def _pack(self, original):
        tracer = self.tracer

        def pack_padded_sequence(input, lengths, batch_first):
            if not isinstance(input, torch.Tensor) or not _is_fake(input) or _values_known(lengths):
                return original(input, lengths, batch_first)
            # The lengths have no values on the emulated device (they were computed there): every sequence is
            # taken at full length, an upper bound of the packed rows (and of what the RNN keeps for backward).
            seq, batch = (input.shape[1], input.shape[0]) if batch_first else (input.shape[0], input.shape[1])
            tracer.note(
                "pack_padded_sequence: the sequence lengths have no values on the emulated device; every "
                f"sequence was taken at its full length ({seq}), an upper bound of the packed batch"
            )
            steps = input.transpose(0, 1) if batch_first else input
            data = steps.reshape(seq * batch, *input.shape[2:])
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                batch_sizes = torch.full((seq,), batch, dtype=torch.int64)
            return data, batch_sizes

        return pack_padded_sequence

    # -------------------------------------------------------------------------------------- _VF
    def _wrap(self, name: str, original):
        emulation = self

        def vf_rnn(*args):
            # packed: (data, batch_sizes, hx, params, ...); padded: (input, hx, params, has_biases, ...)
            packed = isinstance(args[1], torch.Tensor) and isinstance(args[3], (list, tuple))
            x = args[0]
            if not _is_fake_cuda(x) or not torch.backends.cudnn.enabled or x.dtype not in _CUDNN_DTYPES:
                return original(*args)
            return emulation._call(name, packed, args)

        vf_rnn.__name__ = name
        return vf_rnn

    def _call(self, name: str, packed: bool, args):
        mode = _MODES[name]
        if packed:
            data, batch_sizes, hidden, params, has_biases, num_layers, dropout, train, bidirectional = args
            batch_first = False
        else:
            data, hidden, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
            batch_sizes = None
        if name == "lstm":
            hx, cx = hidden
        else:
            hx, cx = hidden, None
        self.calls += 1
        params = list(params)
        x = data.transpose(0, 1) if (batch_first and not packed) else data
        hidden_size = cx.shape[2] if cx is not None else hx.shape[2]
        proj_size = hx.shape[2] if (cx is not None and cx.shape[2] != hx.shape[2]) else 0
        if packed:
            sizes = _batch_sizes(batch_sizes, int(data.shape[0]))
            seq_length, mini_batch, rows = len(sizes), sizes[0], int(data.shape[0])
        else:
            seq_length, mini_batch = int(x.shape[0]), int(x.shape[1])
            rows = seq_length * mini_batch
        if packed and hx.shape[1] != mini_batch:
            # nn.RNN sized h_0 by `batch_sizes[0]`, a value the emulated device does not have (0): the zeros
            # CUDA makes for them, in their order
            hx = hx.new_zeros((hx.shape[0], mini_batch, hx.shape[2]))
            if cx is not None:
                cx = cx.new_zeros((cx.shape[0], mini_batch, cx.shape[2]))
        autocast_dtype = None
        if torch.is_autocast_enabled("cuda"):
            autocast_dtype = torch.get_autocast_dtype("cuda")
        compute_dtype = autocast_dtype or data.dtype
        shape = RnnShape(
            mode=mode,
            input_size=int(data.shape[-1]),
            hidden_size=int(hidden_size),
            proj_size=int(proj_size),
            num_layers=int(num_layers),
            bidirectional=bool(bidirectional),
            seq_length=seq_length,
            mini_batch=mini_batch,
            rows=rows,
            packed=packed,
            dtype_bytes=torch.empty(0, dtype=compute_dtype, device="meta").element_size(),
            dropout=bool(train and dropout > 0 and num_layers > 1),
            train=bool(train),
        )
        # get_dropout_state: a seed drawn on the device (an 8-byte tensor), then the state, once per process
        if train and dropout > 0 and self._dropout_state is None:
            seed = data.new_empty((), dtype=torch.long)
            del seed
            sms = getattr(self.gpu, "multi_processor_count", 132) or 132
            self._dropout_state = data.new_empty(sms * _DROPOUT_STATE_BYTES_PER_SM, dtype=torch.uint8)
        if autocast_dtype is not None and data.is_floating_point():
            with torch.autocast("cuda", enabled=False):
                out = self._autocast_call(shape, x, hx, cx, params, autocast_dtype, train, dropout, name)
        else:
            weight_buf = _shared_weight_buf(params)
            out = _CudnnRnn.apply(self._spec(shape, train, name), x, hx, cx, weight_buf, *params)
        output, hy = out[0], out[1]
        cy = out[2] if cx is not None else None
        if batch_first and not packed:
            output = output.transpose(0, 1)
        if name == "lstm":
            return output, hy, cy
        return output, hy

    def _spec(self, shape: RnnShape, train, name: str) -> dict:
        if self._catalogue is None:
            self._catalogue = WorkspaceCatalogue.load()
        point, upper, how = self._catalogue.lookup(shape)
        if how == "exact" and not self._recorded_arch:
            upper = max(upper, self._catalogue_bound(shape))
            how = "another GPU"
        from ._rules import _program_site

        reason = {
            "kind": "cudnn_rnn_workspace",
            "what": f"cuDNN {name.upper()} workspace ({how}: "
            + (
                "not in the H200 catalogue, scaled from the nearest recorded shape)"
                if how == "scaled"
                else "recorded on the H200; this GPU's cuDNN may choose another algorithm)"
            ),  # fmt: skip
            "op": f"aten._cudnn_rnn ({name})",
            "shapes": shape.key(),
            "site": _program_site(),
        }
        if how == "unknown":
            self.tracer.note(f"cuDNN {name.upper()} workspace: no recorded shape of this kind; not counted")
        return {"shape": shape, "train": bool(train), "tracer": self.tracer, "workspace": (point, upper, how),
                "reason": reason}  # fmt: skip

    def _catalogue_bound(self, shape: RnnShape) -> int:
        cat = self._catalogue
        family = cat.by_family.get(shape.family(), []) if cat else []
        if not family:
            return 0
        return int(_UPPER_MARGIN * max(ws / sh.workspace_scale() for sh, ws in family) * shape.workspace_scale())

    def _autocast_call(self, shape: RnnShape, x, hx, cx, params, dtype, train, dropout, name):
        """autocast's `_cudnn_rnn` kernel: the weights cast into a new flat buffer of `dtype` (views with
        autograd history back to the float32 weights), the input and states cast, then the call."""
        flat = torch.zeros(num_weight_elements(params), dtype=dtype, device=x.device)
        views = []
        offset = 0
        for w in params:
            n = w.numel()
            v = flat[offset : offset + n].view(w.shape)
            v.copy_(w)
            views.append(v)
            offset += n

        def cast(t):
            return t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != dtype else t

        hx16, cx16 = cast(hx), cast(cx)  # the states first, then the input, as autocast's kernel casts them
        return _CudnnRnn.apply(self._spec(shape, train, name), cast(x), hx16, cx16, flat, *views)
