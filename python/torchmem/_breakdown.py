"""What the memory is, at the Monitor's step and phase boundaries: the bytes of parameters, gradients,
optimizer state, activations (what autograd saved for backward), inputs, other, cache and non-torch, per
device. The result is the `"breakdown"` list a boundary marker carries (the record the Rust side stores and
renders: `crates/torchmem-core/src/breakdown.rs`).

Everything is counted by storage (`t.untyped_storage()`: key = device and data pointer, bytes = the
storage's size), so a storage shared by views or tied weights counts once; a storage that falls in two
categories counts in the first of parameters > gradients > optimizer state > inputs > activations.

It is built to run every step: the parameter list is walked once per step (at the step's start) and each
parameter's storage is looked up again only when its data pointer moved; gradients are matched to the
storage found the last time by (object, data pointer); the optimizer's state is read after each optimizer
step (the only place it changes, besides `load_state_dict`, which is hooked); activations come from a
saved-tensors hook (`_SavedTracker`) that records a weak reference per saved storage, so a storage
autograd freed drops out by itself and one kept alive across steps (`total_loss += loss`) stays visible.
Nothing here calls `gc.get_objects()` or keeps a tensor alive.
"""

from __future__ import annotations

import weakref
from typing import Any

from . import _ledger, _native

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
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{t.type()} {list(t.shape)}] is at version {now}; expected version {version} "
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

    def __init__(self, models: list[Any], optimizers: list[Any], activations: str | None) -> None:
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
        self._param_cache: list[Any] = []  # per parameter: [data_ptr, key, bytes]
        self._grad_cache: dict[tuple[int, int], tuple[Any, int]] = {}
        self._opt: dict[Any, tuple[int, list[int]]] | None = None  # key -> bytes; per group
        self._opt_keys: dict[Any, tuple[int, int]] = {}  # key -> (bytes, group)
        self._opt_groups = 0
        self._inputs: list[tuple[Any, Any, int]] = []  # (weak ref, key, bytes)
        self._handles: list[Any] = []
        for o in optimizers:
            hook = getattr(o, "register_load_state_dict_post_hook", None)
            if hook is not None:
                self._handles.append(hook(lambda opt: self.invalidate_optimizer()))

    def add_optimizer(self, optimizer: Any) -> None:
        """Counts one more optimizer's state (its param groups follow the earlier optimizers' groups)."""
        self._optimizers.append(weakref.ref(optimizer))
        hook = getattr(optimizer, "register_load_state_dict_post_hook", None)
        if hook is not None:
            self._handles.append(hook(lambda opt: self.invalidate_optimizer()))
        self._params = None
        self.invalidate_optimizer()

    # --- parameters ------------------------------------------------------------------------------------

    def refresh_parameters(self) -> None:
        """Walks the parameter lists again (once per step: a module added or replaced shows up)."""
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
        if (
            self._params is None
            or len(params) != len(self._params)
            or any(a is not b for (a, _), (b, _) in zip(params, self._params))
        ):
            self._params = params
            self._param_cache = [[None, None, 0] for _ in params]

    def _parameters(self) -> tuple[dict[Any, int], dict[Any, dict[str, int]]]:
        if self._params is None:
            self.refresh_parameters()
        assert self._params is not None
        keys: dict[Any, int] = {}
        by_module: dict[Any, dict[str, int]] = {}
        for (p, top), cached in zip(self._params, self._param_cache):
            try:
                ptr = p.data_ptr()
            except Exception:
                continue
            if ptr != cached[0]:
                found = _key_of(p)
                cached[0] = ptr
                cached[1], cached[2] = (found[0], found[1]) if found else (None, 0)
            key = cached[1]
            if key is None or key in keys:
                continue
            keys[key] = cached[2]
            per = by_module.setdefault(key[0], {})
            per[top] = per.get(top, 0) + cached[2]
        self._param_keys.clear()
        self._param_keys.update(keys)
        return keys, by_module

    def _gradients(self, params: dict[Any, int]) -> tuple[dict[Any, int], dict[Any, dict[str, int]]]:
        keys: dict[Any, int] = {}
        by_module: dict[Any, dict[str, int]] = {}
        cache: dict[tuple[int, int], tuple[Any, int]] = {}
        old = self._grad_cache
        for p, top in self._params or ():
            g = p.grad
            if g is None:
                continue
            try:
                ident = (id(g), g.data_ptr())
            except Exception:
                continue
            hit = old.get(ident)
            if hit is None:
                found = _key_of(g)
                hit = (found[0], found[1]) if found else (None, 0)
            cache[ident] = hit
            key, n = hit
            if key is None or key in keys or key in params:
                continue
            keys[key] = n
            per = by_module.setdefault(key[0], {})
            per[top] = per.get(top, 0) + n
        self._grad_cache = cache
        return keys, by_module

    # --- optimizer state ---------------------------------------------------------------------------------

    def invalidate_optimizer(self) -> None:
        """The optimizer's state may have changed (after a step, a `load_state_dict`): read it again."""
        self._opt = None

    def _optimizer_state(self) -> dict[Any, tuple[int, int]]:
        if self._opt is not None:
            return self._opt_keys
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
        self._opt_keys, self._opt_groups, self._opt = keys, group_no, {}
        return keys

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
        params, params_by_module = self._parameters()
        grads, grads_by_module = self._gradients(params)
        opt = self._optimizer_state()
        taken: set[Any] = set(params)
        taken.update(grads)
        per_dev: dict[Any, list[int]] = {}  # dev -> [params, grads, opt, activations, inputs]

        def add(dev: Any, slot: int, n: int) -> None:
            row = per_dev.get(dev)
            if row is None:
                row = per_dev[dev] = [0, 0, 0, 0, 0]
            row[slot] += n

        for key, n in params.items():
            add(key[0], 0, n)
        for key, n in grads.items():
            add(key[0], 1, n)
        groups: dict[Any, list[int]] = {}
        for key, (n, g) in opt.items():
            if key in taken:
                continue
            taken.add(key)
            add(key[0], 2, n)
            per = groups.setdefault(key[0], [0] * self._opt_groups)
            per[g] += n
        for ref, key, n in self._inputs:
            if key not in taken and not ref.expired():
                taken.add(key)
                add(key[0], 4, n)
        by_module_acts: dict[str, int] | None = None
        if self.saved is not None:
            live = self.saved.live()
            want_modules = self.activations == "modules"
            if want_modules:
                by_module_acts = {}
            last = self.saved.forward_no
            for key, rec in live.items():
                if key in taken:
                    continue
                add(key[0], 3, rec[1])
                if want_modules and rec[3] == last and by_module_acts is not None:
                    name = rec[2] or "(root)"
                    by_module_acts[name] = by_module_acts.get(name, 0) + rec[1]
        torch = _torch()
        cuda_devs = sorted(d for d in per_dev if isinstance(d, int) and d >= 0)
        if cuda_dev is not None and cuda_dev not in per_dev and _ledger.cuda_initialized(torch):
            cuda_devs = sorted([*cuda_devs, cuda_dev])
        out = []
        for dev in [*cuda_devs, *(d for d in per_dev if not isinstance(d, int)), -1]:
            row = per_dev.get(dev, [0, 0, 0, 0, 0])
            entry: dict[str, Any] = {
                "device": device_name(dev),
                "parameters_bytes": row[0],
                "gradients_bytes": row[1],
                "optimizer_state_bytes": row[2],
                "activations_bytes": row[3],
                "inputs_bytes": row[4],
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
                "by_param_group": groups.get(dev, [0] * self._opt_groups),
            }
            if dev == -1:
                entry["rss_bytes"] = _native.self_rss_bytes()
            elif isinstance(dev, int):
                _cuda_totals(torch, dev, entry, sum(row))
            out.append(entry)
        if self.saved is None:  # not tracked (a compiled model, or activations=None): not measured, not 0
            for entry in out:
                entry["activations_bytes"] = None
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
    allocated, reserved = c[0], c[1]
    entry["allocated_bytes"], entry["reserved_bytes"] = allocated, reserved
    entry["other_bytes"] = allocated - counted_bytes
    entry["cache_bytes"] = reserved - allocated
    from . import api

    nv = api._nvml(torch, dev)
    if nv is not None:
        mine = nv[3] if nv[3] is not None else nv[1]
        entry["non_torch_bytes"] = mine - reserved


def _torch() -> Any:
    import sys

    return sys.modules.get("torch")
