"""What the commands print, as a terminal of ``WIDTH`` columns shows it: prose wrapped at
that width (``fit``), and progress that also reads in a log (``Progress``)."""

import math
import os
import sys
import textwrap
import time
from collections.abc import Callable
from typing import TextIO

WIDTH = 120  # the columns a printed line keeps within: prose, progress and the trial listing


def fit(text: str, indent: str = "") -> str:
    """``text`` with each of its lines wrapped at ``WIDTH`` columns, ``indent`` before
    every line and two spaces more before a continued one. A word longer than a line (a
    path) is kept whole on a line of its own."""
    wrap = textwrap.TextWrapper(
        WIDTH,
        initial_indent=indent,
        subsequent_indent=indent + "  ",
        break_long_words=False,
        break_on_hyphens=False,
    )
    return "\n".join(wrap.fill(line) if line.strip() else line for line in text.splitlines())


class Progress:
    """How many of ``total`` things are done, for a terminal or a log. On a terminal that
    reports its size, a bar (tqdm) redraws in place; elsewhere (a pipe, a file) a plain
    line such as ``compiled 12/80 kernels (34 s)`` goes to ``stream`` as the first thing
    ends, then at most every ``every_s`` seconds, and as the last one ends. Call the
    instance as each thing ends; ``close`` it at the end (or use it as a context)."""

    def __init__(
        self,
        total: int,
        *,
        verb: str,
        unit: str,
        desc: str = "",
        stream: TextIO | None = None,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.verb, self.unit, self.every_s, self.clock = total, verb, unit, every_s, clock
        self.stream = sys.stderr if stream is None else stream
        self.done, self.start, self._said = 0, clock(), -math.inf
        self.bar = None
        if _reports_size(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, unit=unit.rstrip("s"), desc=desc, file=self.stream, dynamic_ncols=True
            )

    def __call__(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update()
            return
        now = self.clock()
        if self.done in (1, self.total) or now - self._said >= self.every_s:
            self._said = now
            line = f"{self.verb} {self.done}/{self.total} {self.unit} ({now - self.start:.0f} s)"
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reports_size(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal that reports a size (where a bar can redraw)."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False
