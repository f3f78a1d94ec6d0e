"""What the memory is, at the Monitor's step and phase boundaries: the bytes of parameters, gradients,
optimizer state, activations (what autograd saved for backward), inputs, other, cache and non-torch, per
device. The result is the `"breakdown"` list a boundary marker carries (the record the Rust side stores and
renders: `crates/torchmem-core/src/breakdown.rs`).

Everything is counted by storage (`t.untyped_storage()`: key = device and data pointer, bytes = the
storage's size), so a storage shared by views or tied weights counts once; a storage that falls in two
categories counts in the first of parameters > gradients > optimizer state > inputs > activations.

It is built to run on every step it measures: the parameter list is walked once per step (at the step's start) and each
parameter's storage is looked up again only when its data pointer moved; gradients are matched to the
storage found the last time by (object, data pointer); the optimizer's state is read after each optimizer
step (the only place it changes, besides `load_state_dict`, which is hooked); activations come from a
saved-tensors hook (`_SavedTracker`) that records a weak reference per saved storage, so a storage
autograd freed drops out by itself and one kept alive across steps (`total_loss += loss`) stays visible.
Nothing here calls `gc.get_objects()` or keeps a tensor alive.

Not every step is measured: the first `FIRST_STEPS` steps are (warm-up: gradients and optimizer state
appear there), then every `every`-th step (`Monitor(..., breakdown_every=10)`, the default). A measured
step gets the breakdown at all its boundaries and the saved-tensors hook on its forward; the other steps
get neither and cost nothing here. Measured on the H200 (docs/benchmarks.md): on a ResNet-50 step (batch
64, 33 ms, 532 saved tensors) a boundary's measurement takes ~0.2 ms and the pack hook ~1 us per saved
tensor; every step measured costs +1.25 % of the step (up to +5 % in an earlier, noisier run), one step in
ten −0.03 % (within noise of zero). Like torch.profiler's `schedule` and Lightning's `log_every_n_steps`,
the period trades detail for cost; `breakdown_every=1` measures every step.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from . import _ledger, _native

#: Steps between two walks of the parameter lists (a walk costs ~5 us per module; see step_started).
REWALK_STEPS = 100

#: Steps measured from the start, before one step in `every` (warm-up: gradients, optimizer state appear).
FIRST_STEPS = 3

#: The default `every`: one step in ten is measured after the first steps.
EVERY_STEPS = 10

#: Activation tracking modes of `Monitor(..., activations=...)`.
ACTIVATION_MODES = ("total", "modules", None)

_INPLACE_HINT = (
    "Hint: the backtrace further above shows the operation that failed to compute its gradient. The "
    "variable in question was changed in there or anywhere later. Good luck!"
)


def device_name(dev: Any) -> str:
    """The breakdown's device string of a storage key's device part: -1 is the CPU, N is cuda:N."""
    if dev == -1:
        return "cpu"
    if isinstance(dev, int):
        return f"cuda:{dev}"
    return str(dev)


def _key_of(t: Any) -> tuple[tuple[Any, int], int, Any] | None:
    """(storage key, storage bytes, the storage) of tensor `t`, None when it has no real storage (meta,
    sparse, a functorch wrapper, an empty or freed storage)."""
    try:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        n = s.nbytes()
    except Exception:
        return None
    if not ptr or not n:
        return None
    dev = t.get_device()
    if dev >= 0 and not t.is_cuda:
        dev = str(t.device)  # another accelerator: its own key space
    return (dev, ptr), n, s


def _storage_weakref(s: Any) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(s)


def tensors_in(obj: Any, torch: Any, depth: int = 0, out: list[Any] | None = None) -> list[Any]:
    """The tensors in a forward's arguments (tensors, tuples, lists, dicts, ModelOutputs), three levels deep."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 3:
        if isinstance(obj, dict):
            for v in obj.values():
                tensors_in(v, torch, depth + 1, out)
        elif isinstance(obj, (tuple, list)):
            for v in obj:
                tensors_in(v, torch, depth + 1, out)
    return out


def is_compiled(model: Any) -> bool:
    """True for a `torch.compile`d module (`torch.compile(model)` or `model.compile()`): autograd's saved
    tensors are then inside compiled graphs, where a saved-tensors hook does not belong."""
    if type(model).__name__ == "OptimizedModule":
        return True
    return getattr(model, "_compiled_call_impl", None) is not None


class _Packed:
    """What torchmem's pack hook hands autograd for one saved tensor: a detached alias and its version (or
    the program's own hooks' packed value). Autograd holds it exactly as long as the saved tensor is
    saved, so a weak reference to it says whether the save is still alive."""

    __slots__ = ("tensor", "version", "inner", "__weakref__")


class _SavedTracker:
    """The activations: a saved-tensors hook pair pushed around the model's forward.

    `pack` records the saved storage (its key and size, the innermost module running, and a weak reference
    to the `_Packed` object autograd keeps for this save) and returns a `_Packed` holding a detached alias of
    the tensor (same storage, same version counter, no autograd history, so no reference cycle through an
    output's grad_fn). A storage counts as an activation while any of its saves is alive: backward (or
    dropping the graph) frees the packed objects, a graph kept alive (`total_loss += loss`) keeps them.
    Autograd skips its own in-place check when hooks are installed, so `unpack` makes the same check and
    raises the same RuntimeError. When the program has its own hooks installed (`save_on_cpu`, a custom
    offloader), `pack` chains to them and leaves them the saving (PyTorch then does no in-place check
    either, as without torchmem). Python numbers in ops (`h * 0.01`) are saved by autograd without any hook:
    not seen (8 bytes each, on the CPU)."""

    def __init__(self, exclude: set[Any]) -> None:
        #: storage key -> [weak refs to the live saves' _Packed, bytes, module name, forward number]
        self.records: dict[Any, list[Any]] = {}
        self.exclude = exclude  # parameter storage keys: never activations (the weights ops save)
        self.module_stack: list[str] = []
        self.forward_no = 0
        self._pushed: list[Any] = []

    # --- the hook pair -----------------------------------------------------------------------------------

    def _record(self, t: Any, packed: _Packed) -> None:
        found = _key_of(t)
        if found is None:
            return
        key, n, _ = found
        if key in self.exclude:
            return
        ref = weakref.ref(packed)
        rec = self.records.get(key)
        if rec is not None and rec[1] == n and _any_alive(rec[0]):
            rec[0].append(ref)  # the same storage saved again (a view, or by a second op)
            return
        module = self.module_stack[-1] if self.module_stack else None
        self.records[key] = [[ref], n, module, self.forward_no]

    def _pack(self, t: Any) -> Any:
        p = _Packed()
        p.tensor, p.version = t.detach(), t._version
        try:
            self._record(t, p)
        except Exception:
            pass
        return p

    @staticmethod
    def _unpack(p: Any) -> Any:
        t, version = p.tensor, p.version
        now = t._version
        if now != version:
            # `t.type()` is a torch function: outside any torch-function mode (the leak probe's reads of a
            # graph's saves must not see torchmem's own hook as one that runs torch code).
            with sys.modules["torch"]._C.DisableTorchFunction():
                name = t.type()
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{name} {list(t.shape)}] is at version {now}; expected version {version} "
                f"instead. {_INPLACE_HINT}"
            )
        return t

    def push(self, torch: Any) -> None:
        """Installs the hooks for one forward (chained to any hooks the program has on top now)."""
        self.forward_no += 1
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            pack, unpack = self._pack, self._unpack
        else:
            inner_pack, inner_unpack = top

            def pack(t: Any) -> Any:
                p = _Packed()
                try:
                    self._record(t, p)
                except Exception:
                    pass
                p.inner = inner_pack(t)
                return p

            def unpack(p: Any) -> Any:
                return inner_unpack(p.inner)

        ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        ctx.__enter__()
        self._pushed.append(ctx)

    def pop(self) -> None:
        if self._pushed:
            self._pushed.pop().__exit__(None, None, None)

    @property
    def active(self) -> bool:
        return bool(self._pushed)

    # --- reading -------------------------------------------------------------------------------------------

    def live(self) -> dict[Any, list[Any]]:
        """The records with a save still alive (the others are dropped)."""
        dead = []
        for k, r in self.records.items():
            refs = r[0]
            alive = [w for w in refs if w() is not None]
            if not alive:
                dead.append(k)
            elif len(alive) != len(refs):
                r[0] = alive
        for k in dead:
            del self.records[k]
        return self.records


def _any_alive(refs: list[Any]) -> bool:
    for w in refs:
        if w() is not None:
            return True
    return False


class Breakdown:
    """Measures the per-device breakdown of one program's model(s) and optimizer(s)."""

    def __init__(
        self, models: list[Any], optimizers: list[Any], activations: str | None, every: int = EVERY_STEPS
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"breakdown_every={every!r}: expected a whole number of steps >= 1 (1: every step; the "
                f"default {EVERY_STEPS}: the first {FIRST_STEPS} steps, then one in {EVERY_STEPS})"
            )
        if activations not in ACTIVATION_MODES:
            raise ValueError(
                f"activations={activations!r}: expected 'total' (saved tensors, the default), 'modules' (also "
                "per module, on the end-of-forward marker) or None (no activation tracking)"
            )
        self._models = [weakref.ref(m) for m in models]
        self._optimizers = [weakref.ref(o) for o in optimizers]
        self.compiled = any(is_compiled(m) for m in models)
        self.activations = None if self.compiled else activations
        self._param_keys: set[Any] = set()
        self.saved = _SavedTracker(self._param_keys) if self.activations else None
        self._params: list[tuple[Any, str]] | None = None  # (parameter, top-level module name)
        self._param_ptrs: list[Any] | None = None  # their data pointers when `_param_result` was computed
        self._param_result: tuple[Any, Any, Any] = ({}, {}, {})
        self._grad_ident: list[Any] | None = None  # (id, data pointer) of each .grad at `_grad_result`
        self._grad_params: Any = None
        self._grad_result: tuple[Any, Any, Any] = ({}, {}, {})
        self._opt: tuple[Any, Any, Any] | None = None  # see _optimizer_state
        self._opt_groups = 0
        self._opt_count = 0
        self._steps = 0
        self._walked_at = 0  # the step of the last walk of the parameter lists
        self.every = every
        #: Whether the running step is measured (see the module's docstring); True outside steps.
        self.sampling = True
        self._inputs: list[tuple[Any, Any, int]] = []  # (weak ref, key, bytes)
        self._handles: list[Any] = []
        for o in optimizers:
            hook = getattr(o, "register_load_state_dict_post_hook", None)
            if hook is not None:
                self._handles.append(hook(lambda opt: self.invalidate_optimizer()))

    def add_model(self, model: Any) -> None:
        """Counts one more model's parameters (a framework's module: its callbacks mark the phases, so the
        Monitor does not hook it); a compiled one turns activation tracking off, as at construction."""
        if any(r() is model for r in self._models):
            return
        self._models.append(weakref.ref(model))
        if is_compiled(model):
            self.compiled = True
            self.activations = None
            self.saved = None
        self._params = None

    def add_optimizer(self, optimizer: Any) -> None:
        """Counts one more optimizer's state (its param groups follow the earlier optimizers' groups); one
        already counted is left as it is."""
        if any(r() is optimizer for r in self._optimizers):
            return
        self._optimizers.append(weakref.ref(optimizer))
        hook = getattr(optimizer, "register_load_state_dict_post_hook", None)
        if hook is not None:
            self._handles.append(hook(lambda opt: self.invalidate_optimizer()))
        self._params = None
        self.invalidate_optimizer()

    # --- parameters ------------------------------------------------------------------------------------

    def step_started(self) -> None:
        """At each step's start: decides whether this step is measured (`sampling`); on a measured step,
        walks the parameter lists again on the first steps, when `REWALK_STEPS` steps passed since the last
        walk, and whenever an optimizer's parameter count changed (`add_param_group`), so a module added or
        replaced shows up; between walks only the data pointers are checked."""
        self._steps += 1
        steps = self._steps
        self.sampling = steps <= FIRST_STEPS or steps % self.every == 0
        if not self.sampling:
            return
        count = self._optimizer_param_count()
        if self._params is None or steps <= 2 or steps - self._walked_at >= REWALK_STEPS or count != self._opt_count:
            self._walked_at = steps
            self.refresh_parameters()

    @property
    def steps_seen(self) -> int:
        """Steps counted so far: `step_started` calls plus `skip_steps`."""
        return self._steps

    def skip_steps(self, count: int) -> None:
        """`count` steps went by without `step_started` (`torchmem run`'s automatic watch does nothing on a step
        it does not measure): counted, so the choice of measured steps and the re-walk period stay in real
        steps."""
        self._steps += max(0, count)

    def _optimizer_param_count(self) -> int:
        return sum(len(g["params"]) for o in (r() for r in self._optimizers) if o is not None for g in o.param_groups)

    def refresh_parameters(self) -> None:
        """Walks the parameter lists (the models' `named_parameters()`, then the optimizers' groups)."""
        params: list[tuple[Any, str]] = []
        seen: set[int] = set()
        models = [m for m in (r() for r in self._models) if m is not None]
        for i, model in enumerate(models):
            prefix = f"{i}." if len(models) > 1 else ""
            for name, p in model.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    top = name.split(".", 1)[0] if "." in name else "(root)"
                    params.append((p, prefix + top))
        for o in (r() for r in self._optimizers):
            if o is None:
                continue
            for group in o.param_groups:
                for p in group["params"]:
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append((p, "(optimizer only)"))
        self._opt_count = self._optimizer_param_count()
        old = self._params
        changed = old is None or len(params) != len(old)
        if changed or any(a is not b for (a, _), (b, _) in zip(params, old or (), strict=False)):
            self._params = params
            self._param_ptrs = None

    def _parameters(self) -> tuple[dict[Any, int], dict[Any, dict[str, int]], dict[Any, int]]:
        """(storage key -> bytes, per device {top-level module: bytes}, per device bytes); recomputed only
        when a parameter's data pointer moved (`model.to()`, `p.data = ...`, a storage resized to 0)."""
        if self._params is None:
            self.refresh_parameters()
        params = self._params or []
        ptrs = []
        for p, _ in params:
            try:
                ptrs.append(p.data_ptr())
            except Exception:
                ptrs.append(None)
        if ptrs == self._param_ptrs:
            return self._param_result
        keys: dict[Any, int] = {}
        by_module: dict[Any, dict[str, int]] = {}
        per_dev: dict[Any, int] = {}
        for p, top in params:
            found = _key_of(p)
            if found is None or found[0] in keys:
                continue
            key, n, _ = found
            keys[key] = n
            per = by_module.setdefault(key[0], {})
            per[top] = per.get(top, 0) + n
            per_dev[key[0]] = per_dev.get(key[0], 0) + n
        self._param_keys.clear()
        self._param_keys.update(keys)
        self._param_ptrs, self._param_result = ptrs, (keys, by_module, per_dev)
        return self._param_result

    def _gradients(self, params: dict[Any, int]) -> tuple[dict[Any, int], dict[Any, dict[str, int]], dict[Any, int]]:
        """As `_parameters`, for the parameters' `.grad`s; reused while every grad is the same object at the
        same data pointer as at the last boundary."""
        grads = [p.grad for p, _ in self._params or ()]
        ident = []
        for g in grads:
            if g is None:
                ident.append(None)
            else:
                try:
                    ident.append((id(g), g.data_ptr()))
                except Exception:
                    ident.append(None)
        if ident == self._grad_ident and self._grad_params is params:
            return self._grad_result
        keys: dict[Any, int] = {}
        by_module: dict[Any, dict[str, int]] = {}
        per_dev: dict[Any, int] = {}
        for (_p, top), g, i in zip(self._params or (), grads, ident, strict=False):
            if i is None:
                continue
            found = _key_of(g)
            if found is None:
                continue
            key, n, _ = found
            if key in keys or key in params:
                continue
            keys[key] = n
            per = by_module.setdefault(key[0], {})
            per[top] = per.get(top, 0) + n
            per_dev[key[0]] = per_dev.get(key[0], 0) + n
        # Kept: the ids of live grads (the grads list holds them until this returns; ids are compared with
        # their data pointers, so a new tensor at a recycled id and address of another size is the one miss).
        self._grad_ident, self._grad_params = ident, params
        self._grad_result = (keys, by_module, per_dev)
        return self._grad_result

    # --- optimizer state ---------------------------------------------------------------------------------

    def invalidate_optimizer(self) -> None:
        """The optimizer's state may have changed (after a step, a `load_state_dict`): read it again."""
        self._opt = None

    def _optimizer_state(self) -> tuple[dict[Any, tuple[int, int]], dict[Any, int], dict[Any, list[int]]]:
        """(storage key -> (bytes, param group), per device bytes, per device bytes per group), read after
        each optimizer step and cached in between."""
        if self._opt is not None:
            return self._opt
        torch = _torch()
        keys: dict[Any, tuple[int, int]] = {}
        group_no = 0
        for o in (r() for r in self._optimizers):
            if o is None:
                continue
            state = o.state
            for group in o.param_groups:
                for p in group["params"]:
                    st = state.get(p)
                    if not st:
                        continue
                    for v in st.values():
                        if isinstance(v, torch.Tensor):
                            found = _key_of(v)
                            if found is not None and found[0] not in keys:
                                keys[found[0]] = (found[1], group_no)
                group_no += 1
        self._opt_groups = group_no
        per_dev: dict[Any, int] = {}
        groups: dict[Any, list[int]] = {}
        for key, (n, g) in keys.items():
            per_dev[key[0]] = per_dev.get(key[0], 0) + n
            groups.setdefault(key[0], [0] * group_no)[g] += n
        self._opt = (keys, per_dev, groups)
        return self._opt

    # --- inputs ---------------------------------------------------------------------------------------

    def set_inputs(self, args: Any, kwargs: Any) -> None:
        """The tensors passed to the model's forward: this step's batch (weakly held)."""
        torch = _torch()
        found = []
        seen: set[Any] = set()
        for t in tensors_in((args, kwargs), torch):
            k = _key_of(t)
            if k is not None and k[0] not in seen:
                seen.add(k[0])
                found.append((_storage_weakref(k[2]), k[0], k[1]))
        self._inputs = found

    # --- activations around a forward ------------------------------------------------------------------

    def forward_begin(self, args: Any, kwargs: Any) -> None:
        """Called at the start of the outermost forward with grad enabled: records the inputs and installs
        the saved-tensors hooks."""
        self.set_inputs(args, kwargs)
        if self.saved is not None:
            if self._params is None:
                self.refresh_parameters()
            self._parameters()  # the exclusion set for `pack`, current for this forward
            self.saved.push(_torch())

    def forward_end(self) -> None:
        if self.saved is not None:
            self.saved.pop()

    def module_enter(self, name: str) -> None:
        s = self.saved
        if s is not None and s.active:
            s.module_stack.append(name)

    def module_exit(self) -> None:
        s = self.saved
        if s is not None and s.active and s.module_stack:
            s.module_stack.pop()

    # --- the measurement ---------------------------------------------------------------------------------

    def measure(self, cuda_dev: int | None) -> tuple[list[dict[str, Any]], dict[str, int] | None]:
        """The breakdown now (one entry per device that holds tensors, the CPU always, CUDA devices first),
        and, in "modules" mode, the bytes each module's forward left saved during the last forward."""
        params, params_by_module, params_dev = self._parameters()
        grads, grads_by_module, grads_dev = self._gradients(params)
        opt, opt_dev, opt_groups = self._optimizer_state()
        per_dev: dict[Any, list[int]] = {}  # dev -> [params, grads, opt, activations, inputs]

        def row(dev: Any) -> list[int]:
            r = per_dev.get(dev)
            if r is None:
                r = per_dev[dev] = [0, 0, 0, 0, 0]
            return r

        for dev, n in params_dev.items():
            row(dev)[0] += n
        for dev, n in grads_dev.items():
            row(dev)[1] += n
        groups = opt_groups
        overlap = not (opt.keys().isdisjoint(params) and opt.keys().isdisjoint(grads))
        if not overlap:
            for dev, n in opt_dev.items():
                row(dev)[2] += n
        else:  # an optimizer state tensor that is also a parameter or gradient: counted there
            groups = {}
            for key, (n, g) in opt.items():
                if key in params or key in grads:
                    continue
                row(key[0])[2] += n
                groups.setdefault(key[0], [0] * self._opt_groups)[g] += n
        taken_before_inputs = (params, grads, opt)
        inputs: dict[Any, int] = {}
        for ref, key, n in self._inputs:
            if key not in inputs and not any(key in t for t in taken_before_inputs) and not ref.expired():
                inputs[key] = n
                row(key[0])[4] += n
        by_module_acts: dict[str, int] | None = None
        if self.saved is not None:
            live = self.saved.live()
            want_modules = self.activations == "modules"
            if want_modules:
                by_module_acts = {}
            last = self.saved.forward_no
            for key, rec in live.items():
                if key in params or key in grads or key in opt or key in inputs:
                    continue
                row(key[0])[3] += rec[1]
                if by_module_acts is not None and rec[3] == last:
                    name = rec[2] or "(root)"
                    by_module_acts[name] = by_module_acts.get(name, 0) + rec[1]
        torch = _torch()
        cuda_devs = sorted(d for d in per_dev if isinstance(d, int) and d >= 0)
        if cuda_dev is not None and cuda_dev not in per_dev and _ledger.cuda_initialized(torch):
            cuda_devs = sorted([*cuda_devs, cuda_dev])
        out = []
        tracked = self.saved is not None
        # No optimizer known (a Monitor given only the model; a framework's optimizer not found yet): its
        # state is not measured, so None ("-"), never a 0 that reads as "no state".
        has_opt = any(r() is not None for r in self._optimizers)
        for dev in [*cuda_devs, *(d for d in per_dev if not isinstance(d, int)), -1]:
            r = per_dev.get(dev, [0, 0, 0, 0, 0])
            entry: dict[str, Any] = {
                "device": device_name(dev),
                "parameters_bytes": r[0],
                "gradients_bytes": r[1],
                "optimizer_state_bytes": r[2] if has_opt else None,
                # not tracked (a compiled model, or activations=None): not measured, not 0
                "activations_bytes": r[3] if tracked else None,
                "inputs_bytes": r[4],
                "other_bytes": None,
                "allocated_bytes": None,
                "reserved_bytes": None,
                "cache_bytes": None,
                "non_torch_bytes": None,
                "rss_bytes": None,
                "by_module": {
                    "parameters": dict(params_by_module.get(dev, {})),
                    "gradients": dict(grads_by_module.get(dev, {})),
                },
                "by_param_group": list(groups.get(dev, [0] * self._opt_groups)) if has_opt else [],
            }
            if dev == -1:
                entry["rss_bytes"] = _native.self_rss_bytes()
            elif isinstance(dev, int):
                _cuda_totals(torch, dev, entry, sum(r))
            out.append(entry)
        if by_module_acts is not None:
            by_module_acts = dict(sorted(by_module_acts.items(), key=lambda kv: (-kv[1], kv[0])))
        return out, by_module_acts

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.saved is not None:
            while self.saved.active:
                self.saved.pop()


def _cuda_totals(torch: Any, dev: int, entry: dict[str, Any], counted_bytes: int) -> None:
    """The allocator's allocated/reserved of CUDA device `dev` now, other = allocated − the counted
    categories, cache = reserved − allocated, non-torch = NVML's bytes for this process − reserved."""
    c = _ledger.counters(torch, dev)
    if c is None:
        return
    allocated, reserved = c.allocated_bytes, c.reserved_bytes
    entry["allocated_bytes"], entry["reserved_bytes"] = allocated, reserved
    entry["other_bytes"] = allocated - counted_bytes
    entry["cache_bytes"] = reserved - allocated
    from . import _devices

    nv = _devices.nvml_reading(torch, dev)
    if nv is not None:
        mine = nv.process_bytes if nv.process_bytes is not None else nv.used_bytes
        entry["non_torch_bytes"] = mine - reserved


def _torch() -> Any:
    import sys

    return sys.modules.get("torch")
