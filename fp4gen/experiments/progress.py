"""Progress of a sweep: a tqdm bar on a terminal, plain periodic lines otherwise (a log file, CI).

The ETA weighs the steps still to run by each recipe's own measured seconds per step: a
quantized step can cost 5-10x a BF16 step, so a plain steps-left count would be far off. A
recipe not yet timed is guessed at the mean of those that are, and the ETA then carries a "~".
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

LINE_INTERVAL = 10.0  # seconds between plain progress lines
FALLBACK_SIZE = (100, 24)  # the bar's columns and rows where the terminal does not say its own
BAR_INTERVAL = 0.5  # seconds between bar refreshes (each reads the loss: a device sync on CUDA)


def clock(seconds: float) -> str:
    """1:02:03, 4:05 or 6 s."""
    s = max(int(round(seconds)), 0)
    if s >= 3600:
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}" if s >= 60 else f"{s} s"


def _tqdm() -> Any | None:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def _width(stream: TextIO) -> dict[str, Any]:
    """Follow the terminal's size; a terminal that reports 0 x 0 (a pseudo-terminal nobody
    sized) makes tqdm draw nothing at all, so it gets a fixed size instead."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        size = os.terminal_size((0, 0))
    if size.columns > 0 and size.lines > 0:
        return {"dynamic_ncols": True}
    return {"ncols": FALLBACK_SIZE[0], "nrows": FALLBACK_SIZE[1]}


class Progress:
    """Tracks the runs of one sweep invocation (the ones to train, not those skipped)."""

    def __init__(
        self,
        runs: Sequence[tuple[str, int]],
        steps: int,
        stream: TextIO | None = None,
        bar: bool | None = None,
    ) -> None:
        self.runs = list(runs)
        self.steps = steps
        self.stream = stream if stream is not None else sys.stdout
        tqdm = _tqdm()
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self.use_bar = (isatty and tqdm is not None) if bar is None else bar and tqdm is not None
        self.started = time.perf_counter()
        self.timed: dict[str, tuple[float, int]] = {}  # recipe -> (seconds, steps) measured
        self.done_steps = 0
        self.run_index = -1
        self.run_start = self.last_show = self.started
        self.bar: Any = None
        if self.use_bar and self.runs:
            self.bar = tqdm(
                total=len(self.runs) * steps,
                unit="step",
                file=self.stream,
                **_width(self.stream),
                # tqdm's own ETA assumes every step costs the same: ours is in the postfix
                bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                "[{elapsed}{postfix}]",
            )

    # -- what the sweep reports -------------------------------------------------------------

    def write(self, line: str) -> None:
        """A log line that does not tear the bar."""
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def start_run(self, recipe: str, seed: int) -> None:
        self.run_index += 1
        self.run_recipe, self.run_seed = recipe, seed
        self.run_step = 0
        self.run_start = self.last_show = time.perf_counter()
        if self.bar is not None:
            self.bar.set_description_str(f"[{self._run_label()}]", refresh=True)

    def step(self, step: int, loss: Callable[[], float]) -> None:
        """After training step ``step`` (0-based) of the current run; ``loss`` is read only when
        the display refreshes (on a GPU reading it waits for the step to finish)."""
        self.run_step = step + 1
        self.done_steps += 1
        if self.bar is not None:
            self.bar.update(1)
        now = time.perf_counter()
        interval = BAR_INTERVAL if self.bar is not None else LINE_INTERVAL
        if now - self.last_show >= interval:
            self.last_show = now
            self._show(loss())

    def end_run(self, eval_loss: float, where: str) -> None:
        seconds = time.perf_counter() - self.run_start
        spent, steps = self.timed.get(self.run_recipe, (0.0, 0))
        self.timed[self.run_recipe] = (spent + seconds, steps + self.run_step)
        self.write(
            f"[{self._run_label()}] done: held-out loss {eval_loss:.4f}, {self.run_step} steps in "
            f"{clock(seconds)}; {self._eta_text()} -> {where}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    # -- estimates ------------------------------------------------------------------------

    def eta(self) -> tuple[float, bool]:
        """(seconds left, exact): exact is False while a recipe still to run is untimed."""
        timed = {r: s / n for r, (s, n) in self.timed.items() if n}
        # the current run's own pace counts for its recipe until the run ends
        if self.run_index >= 0 and self.run_step and self.run_recipe not in timed:
            current = (time.perf_counter() - self.run_start) / self.run_step
            timed[self.run_recipe] = current
        guess = sum(timed.values()) / len(timed) if timed else None
        left, exact = 0.0, True
        for i, (recipe, _) in enumerate(self.runs):
            if i < self.run_index:
                continue
            steps = self.steps - (self.run_step if i == self.run_index else 0)
            if recipe in timed:
                left += steps * timed[recipe]
            elif guess is not None:
                left += steps * guess
                exact = False
            else:
                return float("nan"), False
        return left, exact

    def _eta_text(self) -> str:
        left, exact = self.eta()
        if left != left:  # NaN: nothing timed yet
            return "ETA unknown"
        return f"ETA {'' if exact else '~'}{clock(left)}"

    def _run_label(self) -> str:
        return f"{self.run_index + 1}/{len(self.runs)} {self.run_recipe} seed {self.run_seed}"

    def _show(self, loss: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, {self._eta_text()}", refresh=False)
            return
        total = max(len(self.runs) * self.steps, 1)
        self.write(
            f"[{self._run_label()}] step {self.run_step}/{self.steps}  train {loss:.4f}  "
            f"sweep {self.done_steps / total:.0%}, {clock(time.perf_counter() - self.started)} "
            f"elapsed, {self._eta_text()}"
        )
