"""Progress of a long benchmark: step messages to a callback and a tqdm bar on stderr.

tqdm is optional (the ``report`` and ``test`` extras install it): without it the bar is left out
and the messages still reach the callback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["Progress"]


class Progress:
    """``step(msg)``: one step of ``total`` (the bar advances and shows ``msg``); ``note(msg)``: a
    message only. Every message also goes to ``callback`` (None: the bar alone). A context manager
    that closes the bar."""

    def __init__(self, callback: Callable[[str], object] | None, total: int, desc: str):
        self.callback, self.bar = callback, None
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)

    def step(self, msg: str) -> None:
        if self.callback is not None:
            self.callback(msg)
        if self.bar is not None:
            self.bar.set_description_str(msg)
            self.bar.update(1)

    __call__ = step

    def note(self, msg: str) -> None:
        if self.callback is not None:
            self.callback(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
