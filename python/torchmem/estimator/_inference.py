"""Programs without an optimizer (inference, evaluation, generation) under `torchmem estimate`: counts the
program's top-level forward calls and Hugging Face `generate` calls (the `--forward-calls N` bound), and makes
`generate` end on the emulated device.

Why `generate` needs help: the emulated device has no tensor values, and a value read (`.item()`, `bool(t)`)
answers 0 (`_rules`). `generate` decides whether to go on from values: greedy search and sampling from
`bool(unfinished_sequences.max() == 0)`, which then always said "not finished" (the loop never ended: the KV
cache grew until the machine ran out of memory), beam search from `not bool(any(...))`, which said "finished"
after the first token. The rule here: the stopping criteria that depend on values only (end-of-sequence tokens,
stop strings) never fire, and the one that depends on shapes only (`MaxLengthCriteria`: the sequence length
against `max_length`, i.e. `max_new_tokens`) is evaluated in Python, where the shapes are known; inside
`generate`, `_has_unfinished_sequences` answers from it alone ("go on" until the sequences reach `max_length`).
So generation runs to `max_new_tokens` for every sequence: the largest KV cache and sequence buffers the call can
reach (a sequence that meets its EOS earlier only makes the real run smaller). The values `generate` returns
are not computed (token ids read as 0; beam search crops its output by a value read, so it comes back empty).

The patches go onto `transformers.generation` when the program imports it (an import hook: the program
imports transformers after the estimator starts) or at once if it is already imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Callable

_GEN_UTILS = "transformers.generation.utils"
_GEN_STOPPING = "transformers.generation.stopping_criteria"
GENERATION_NOTE = (
    "generate() ran every sequence to max_new_tokens (max_length): the emulated device has no token values, so "
    "no end-of-sequence token or stop string is ever seen; that is the memory worst case of the call"
)


class ForwardCounter:
    """Top-level forward calls (a module called while no other module's forward and no `generate` runs, outside
    backward) and `generate` calls; calls `on_limit` once their sum reaches `limit`."""

    def __init__(self, limit: int | None, on_limit: Callable[[], None]) -> None:
        self.limit = limit
        self.on_limit = on_limit
        self.forward_calls = 0
        self.generate_calls = 0
        self.module_depth = 0
        self.generate_depth = 0

    def reset(self) -> None:
        self.forward_calls = self.generate_calls = self.module_depth = self.generate_depth = 0

    @property
    def calls(self) -> int:
        return self.forward_calls + self.generate_calls

    def _check(self) -> None:
        if self.limit is not None and self.calls >= self.limit:
            self.on_limit()

    def forward_pre(self) -> None:
        self.module_depth += 1

    def forward_post(self, in_backward: bool) -> None:
        self.module_depth = max(0, self.module_depth - 1)
        if self.module_depth == 0 and self.generate_depth == 0 and not in_backward:
            self.forward_calls += 1
            self._check()

    def generate_enter(self) -> None:
        self.generate_depth += 1

    def generate_exit(self) -> None:
        self.generate_depth = max(0, self.generate_depth - 1)
        if self.generate_depth == 0:
            self.generate_calls += 1
            self._check()


class GenerationPatches:
    """The `transformers.generation` patches of one session (see the module doc)."""

    def __init__(self, counter: ForwardCounter, note: Callable[[str], None]) -> None:
        self.counter = counter
        self.note = note
        # One "max length reached" flag per `generate` call in progress (an assistant model's generate runs
        # inside the main one).
        self.stop: list[bool] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self._finder: _ImportHook | None = None
        self._patched: set[str] = set()

    def install(self) -> None:
        from . import _deepcopy

        _deepcopy.install()  # deep copies of constant-carrying fake tensors (EMA, Lightning's self.log)
        for name in (_GEN_UTILS, _GEN_STOPPING):
            if name in sys.modules:
                self.patch_module(name, sys.modules[name])
        if len(self._patched) < 2:
            self._finder = _ImportHook(self)
            sys.meta_path.insert(0, self._finder)

    def uninstall(self) -> None:
        from . import _deepcopy

        _deepcopy.uninstall()
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None
        for obj, name, old in reversed(self._saved):
            setattr(obj, name, old)
        self._saved.clear()
        self._patched.clear()

    def _set(self, obj, name: str, value) -> None:
        self._saved.append((obj, name, obj.__dict__[name]))
        setattr(obj, name, value)

    def patch_module(self, name: str, module) -> None:
        if name in self._patched:
            return
        self._patched.add(name)
        if name == _GEN_UTILS:
            mixin = getattr(module, "GenerationMixin", None)
            if mixin is None:
                return
            if "generate" in mixin.__dict__:
                self._set(mixin, "generate", self._generate(mixin.__dict__["generate"]))
            unfinished = mixin.__dict__.get("_has_unfinished_sequences")
            if unfinished is not None:
                self._set(mixin, "_has_unfinished_sequences", self._unfinished(unfinished))
        elif name == _GEN_STOPPING:
            scl = getattr(module, "StoppingCriteriaList", None)
            if scl is not None and "__call__" in scl.__dict__:
                self._set(scl, "__call__", self._criteria(scl.__dict__["__call__"]))

    def _generate(self, original):
        patches = self
        counter = self.counter

        def generate(model, *args, **kwargs):
            patches.stop.append(False)
            counter.generate_enter()
            try:
                return original(model, *args, **kwargs)
            finally:
                patches.stop.pop()
                counter.generate_exit()

        generate.__wrapped__ = original  # type: ignore[attr-defined]
        generate.__doc__ = original.__doc__
        return generate

    def _unfinished(self, original):
        patches = self

        def has_unfinished_sequences(model, *args, **kwargs):
            # Inside generate, `this_peer_finished` came from tensor values (answered 0: "not finished" for
            # greedy/sampling's `max() == 0`, but "finished" for beam search's `not any(...)`): ignored; the
            # max-length rule decides.
            if patches.stop:
                return not patches.stop[-1]
            return original(model, *args, **kwargs)

        return has_unfinished_sequences

    def _criteria(self, original):
        patches = self

        def call(criteria, input_ids, scores, **kwargs):
            out = original(criteria, input_ids, scores, **kwargs)
            max_length = getattr(criteria, "max_length", None)
            if patches.stop and max_length is not None and input_ids.shape[-1] >= max_length:
                patches.stop[-1] = True
                patches.note(GENERATION_NOTE)
            return out

        return call


class _ImportHook(importlib.abc.MetaPathFinder):
    """Patches `transformers.generation` modules right after the program imports them."""

    def __init__(self, patches: GenerationPatches) -> None:
        self.patches = patches
        self._busy: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in (_GEN_UTILS, _GEN_STOPPING) or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader = spec.loader
        patches = self.patches

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                loader.exec_module(module)
                patches.patch_module(fullname, module)

        spec.loader = _Loader()
        return spec
