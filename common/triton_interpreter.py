"""Under TRITON_INTERPRET=1 (the CPU test suite): skip the interpreter's redundant re-patching of
`triton.language` on every call of a `@triton.jit` helper from inside a kernel.

Triton's interpreter swaps the language's builtins for NumPy-backed ones (`_patch_lang`: an
`inspect.getmembers` walk over tl, tl.core, tl.tensor and tl.math) when a kernel launches, and restores
them when the launch ends. It does the same walk again on every call of a jit helper (`_first_max`,
`tl_row_keys`, ...) from inside the kernel, although the launch has already patched everything the helper
can see: the walk finds nothing left to patch and re-sets a few equivalent attributes. On 2 CPU cores that
walk was about half of a service's time in the test suite.

The helper's walk is not always a no-op: the language helpers (`tl.max`, `tl.sum`, `tl.zeros`, ...) also
name `tl.core`, which a kernel of ours does not, so the first such call patches tl.core's builtins and
never restores them (the launch's restore only undoes what the launch itself patched). From then on
tl.core stays patched in that process.

`install()` skips the helper's walk only when every language module the helper's globals name is patched
at that moment: patched by the launch in progress on this thread, or left patched by an earlier helper's
walk. Otherwise the interpreter does what it always did (and the modules it leaves patched are noted).
The helper then runs exactly as it would have. Nothing changes when the interpreter's internals are not
the ones this was written against (Triton 3.8 / 3.9): `install()` then leaves them alone.
"""

from __future__ import annotations

import inspect
import threading
from types import ModuleType
from typing import Any

_state = threading.local()  # .launches: language modules patched by this thread's launches; .skip
_left_patched: set[int] = set()  # language modules a helper's walk patched for good (see above)
_installed = False


def _language_modules(fn: Any) -> frozenset[int]:
    """ids of the language modules `_patch_lang(fn)` patches (those fn's globals name)."""
    import triton.language as tl

    langs: tuple[ModuleType, ...] = (tl, tl.core)
    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in langs)


def install() -> None:
    global _installed
    if _installed:
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    grid_executor = getattr(interpreter, "GridExecutor", None)
    interpreted = getattr(interpreter, "InterpretedFunction", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if grid_executor is None or interpreted is None or patch_lang is None:
        return
    launch, helper_call = grid_executor.__call__, interpreted.__call__

    class _NoChanges:
        def restore(self) -> None:
            pass

    def patch_lang_once(fn: Any) -> Any:
        if getattr(_state, "skip", False):
            _state.skip = False
            return _NoChanges()
        return patch_lang(fn)

    def launch_tracked(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches = _state.__dict__.setdefault("launches", [])
        launches.append(_language_modules(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def helper_call_unpatched(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches = getattr(_state, "launches", None)
        langs = _language_modules(self.fn)
        patched = (launches[-1] if launches else frozenset()) | _left_patched
        # The helper's own `_patch_lang(self.fn)` is the first thing its __call__ does: skip just that one.
        _state.skip = bool(launches) and langs <= patched
        if not _state.skip:  # its walk patches these modules' builtins and nothing restores them
            _left_patched.update(langs - (launches[-1] if launches else frozenset()))
        try:
            return helper_call(self, *args, **kwargs)
        finally:
            _state.skip = False

    interpreter._patch_lang = patch_lang_once
    grid_executor.__call__ = launch_tracked
    interpreted.__call__ = helper_call_unpatched
    _installed = True
