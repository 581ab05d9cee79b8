"""Start-up and SIGTERM drain shared by both services."""

from __future__ import annotations

import logging
import signal
import threading
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
