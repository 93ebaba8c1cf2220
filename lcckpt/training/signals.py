"""SIGTERM: noted when it arrives, acted on between iterations (an emergency checkpoint),
then handed to the handler that was installed before."""

from __future__ import annotations

import signal
import threading
from typing import Any

from ..errors import InvalidArgumentError

SIGTERM_EXIT = 128 + signal.SIGTERM


class SigtermHook:
    """Installed in the main thread only (Python delivers signals only there)."""

    def __init__(self):
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError("sigterm=True needs the manager to be created in the "
                                       "main thread (Python delivers signals only there)")
        self.pending = False
        prev = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._prev: Any = signal.SIG_DFL if prev is None else prev   # None: set from C

    def _on_sigterm(self, signum, frame) -> None:
        self.pending = True             # acted on at the next step(), between iterations

    def uninstall(self) -> Any:
        """Put the previous handler back; returns it (None if already uninstalled)."""
        prev, self._prev = self._prev, None
        if prev is not None:
            signal.signal(signal.SIGTERM, prev)
        return prev

    def pass_on(self) -> None:
        """After the emergency checkpoint: call the previous handler, or exit with 143."""
        self.pending = False
        prev = self.uninstall()
        if callable(prev):
            prev(signal.SIGTERM, None)
        elif prev != signal.SIG_IGN:
            raise SystemExit(SIGTERM_EXIT)
