"""The stack level of the user's code, for warnings: the first caller outside lcckpt.

A fixed ``stacklevel`` names the user's line only on the path it was counted for; a load
reached through ``lcckpt.load``, a manager or a plugin has more of lcckpt's own frames
above it, and the warning then named a line inside lcckpt."""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel``, for a call made by this function's caller,
    that names the first frame outside the lcckpt package (or the outermost frame)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def warn_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` naming the first line outside lcckpt (:func:`user_stacklevel`)."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
