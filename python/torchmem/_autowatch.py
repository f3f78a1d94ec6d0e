"""`torchmem run` with no change to the program: finds its model and optimizer by itself and watches them
(`torchmem.watch`: phases and the memory breakdown at their boundaries, sent to the recorder).

How, without importing torch or changing what the program sees:
1. a finder on `sys.meta_path` waits for the program to import torch, then takes itself off the path;
2. `torch.optim.Optimizer.__init__` is wrapped (same signature, same result, same exceptions) to learn each
   optimizer as it is built (a weak reference);
3. once an optimizer exists, a global module forward pre-hook looks at the first module calls: the first
   (outermost) module whose parameters hold the optimizer's first parameter is the model; the hook then
   removes itself and `watch(model, optimizers)` takes over with ordinary per-module hooks, recording the
   measured steps only (the first 3, then one in 10: `_sampled_watch.py`); the others cost a counter.
Nothing is printed, no warning is raised, and any failure of this machinery is swallowed (the program runs
as without it). `TORCHMEM_WATCH=0` turns it off; `TORCHMEM_WATCH=noactivations` keeps it but without the
saved-tensors hook (for a forward that calls `torch.func.grad`/`vjp`, which refuse to run under any
saved-tensors hook)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import weakref
from typing import Any

_optimizers: list[Any] = []  # weak references, in creation order
_state: dict[str, Any] = {
    "installed": False,
    "hook": None,
    "watch": None,
    "checked": None,
    "user": False,
    "ours": False,
}


def user_monitor_started() -> None:
    """The program made a Monitor (or `torchmem.watch`) of its own for a model or optimizer: that one records
    the phases and the breakdown, so the automatic watch stands down (else every phase is recorded twice)."""
    if _state["ours"]:
        return
    _state["user"] = True
    _stop_looking()
    mon = _state["watch"]
    if mon is not None:
        _state["watch"] = None
        try:
            mon.close()
        except Exception:
            pass


def install() -> None:
    """Called by `_bootstrap.start()` under `torchmem run`, before the program runs."""
    mode = os.environ.get("TORCHMEM_WATCH", "1").strip().lower()
    if mode in ("0", "off", "no", "false"):
        return
    if "torch" in sys.modules:
        _after_torch_import()
        return
    sys.meta_path.insert(0, _TorchImportFinder())


class _TorchImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `torch` is being imported, wraps its loader so that torchmem's part runs
    right after torch's own module code, then leaves `sys.meta_path`."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        _leave(self)
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None) if spec is not None else None
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_watch(module: Any) -> None:
            exec_module(module)
            _after_torch_import()

        try:
            loader.exec_module = exec_then_watch  # type: ignore[union-attr]
        except Exception:
            return spec
        return spec


def _leave(finder: Any) -> None:
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def _after_torch_import() -> None:
    if _state["installed"]:
        return
    _state["installed"] = True
    try:
        import torch  # already imported by the program: this is a dictionary look-up

        optimizer_cls = torch.optim.Optimizer
        original = optimizer_cls.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            try:
                _learn_optimizer(self)
            except Exception:
                pass

        for attr in ("__doc__", "__name__", "__qualname__", "__module__", "__wrapped__"):
            try:
                setattr(__init__, attr, getattr(original, attr) if attr != "__wrapped__" else original)
            except AttributeError:
                pass
        optimizer_cls.__init__ = __init__  # type: ignore[method-assign]
    except Exception:
        pass


def _learn_optimizer(opt: Any) -> None:
    if _state["user"]:
        return
    # A subclass's __init__ calling super().__init__ twice, or nested wrappers: learn each optimizer once.
    if any(r() is opt for r in _optimizers):
        return
    _optimizers.append(weakref.ref(opt))
    w = _state["watch"]
    if w is not None:
        _maybe_add_to_watch(opt, w)
        return
    if _state["hook"] is None:
        import torch

        _state["checked"] = weakref.WeakKeyDictionary()
        _state["hook"] = torch.nn.modules.module.register_module_forward_pre_hook(_first_forward)


def _first_param(opt: Any) -> Any:
    for group in opt.param_groups:
        for p in group["params"]:
            return p
    return None


def _first_forward(module: Any, args: Any) -> None:
    try:
        _find_model(module, args)
    except Exception:
        _stop_looking()


def _find_model(module: Any, args: Any) -> None:
    checked = _state["checked"]
    if checked is None or _state["user"] or module in checked:
        return
    checked[module] = True
    live = [o for o in (r() for r in _optimizers) if o is not None]
    if not live:
        return
    want = _first_param(live[0])
    if want is None or not any(p is want for p in module.parameters()):
        return
    _stop_looking()
    from ._sampled_watch import sampled_watch

    mode = os.environ.get("TORCHMEM_WATCH", "1").strip().lower()
    acts = None if mode == "noactivations" else "total"
    _state["ours"] = True
    try:
        # Phases and breakdown on the measured steps only: a step not measured costs a counter and a flag.
        mon = sampled_watch(module, live[0], acts)
    finally:
        _state["ours"] = False
    if mon._bd is not None:
        ids = {id(p) for p in module.parameters()}
        for o in live[1:]:
            first = _first_param(o)
            if first is not None and id(first) in ids:
                mon._bd.add_optimizer(o)
    _state["watch"] = mon
    # This call's own pre-hooks were collected before watch registered its hook: start its forward here.
    mon._forward_pre_kw(module, args, {})


def _maybe_add_to_watch(opt: Any, mon: Any) -> None:
    first = _first_param(opt)
    if mon._bd is None or first is None or mon.model is None:
        return
    if any(p is first for p in mon.model.parameters()):
        mon._bd.add_optimizer(opt)


def _stop_looking() -> None:
    hook = _state["hook"]
    if hook is not None:
        hook.remove()
    _state["hook"] = None
    _state["checked"] = None
