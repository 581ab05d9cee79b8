"""Start-up and SIGTERM drain shared by both services."""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from collections.abc import Callable

log = logging.getLogger("specsplit")


def install_drain_handler(on_drain: Callable[[], None]) -> threading.Event:
    """SIGTERM/SIGINT start a drain once (in a thread, so the handler returns at once)."""
    draining = threading.Event()

    def handler(signum: int, frame: object) -> None:
        if draining.is_set():
            return
        draining.set()
        log.info("received %s: draining", signal.Signals(signum).name)
        threading.Thread(target=on_drain, name="drain", daemon=True).start()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return draining


def release_startup_heap() -> None:
    """Undoes freeze_startup_heap at shutdown: objects left frozen are never collected, and the native
    extensions (Triton's nanobind bindings) then report each of them as "leaked" at exit."""
    gc.unfreeze()
    gc.collect()


def freeze_startup_heap() -> None:
    """Takes every object alive once start-up is done (the model, its CUDA graphs' Python side, torch's
    and Triton's caches) out of the garbage collector's reach (gc.freeze, as vLLM and SGLang do after
    their graph capture). Serving allocates containers every step, which now and then sets off a full
    collection; without this it walks that whole heap inside whatever step runs into it. Logged: the
    objects frozen and what a full collection costs before and after."""
    gc.collect()  # start-up's garbage first: the second collection below is what serving would pay
    t0 = time.perf_counter()
    gc.collect()
    before = time.perf_counter() - t0
    gc.freeze()
    t0 = time.perf_counter()
    gc.collect()
    after = time.perf_counter() - t0
    log.info("start-up heap frozen: %d objects; a full collection took %.1f ms, now %.2f ms",
             gc.get_freeze_count(), before * 1e3, after * 1e3)  # fmt: skip
