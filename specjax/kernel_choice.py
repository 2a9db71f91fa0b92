"""Choosing a kernel implementation once, at start, outside traced code.

A kernel family (attention, KV compaction, ...) lists its implementations in order of preference,
each with a check that says why it cannot serve this configuration (None: it can). `choose` takes
the first that can ("auto") or the one the user forced (an error naming the reason if it cannot
serve), logs the decision, and returns it; the caller stores the result in its static config, so
the choice is part of the jit key of every program built from it and nothing is decided while
tracing.

    choice = choose("attention", "auto", ["mosaic_gpu", "pallas", "reference"],
                    {"mosaic_gpu": why_not_mosaic, "pallas": why_not_pallas, "reference": lambda: None})
    choice.name    -> "pallas"
    choice.note    -> "auto; mosaic_gpu: page_size 4 is not a multiple of 8"
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

log = logging.getLogger("specjax")


@dataclasses.dataclass(frozen=True)
class Choice:
    family: str
    name: str
    note: str  # why this one: "forced", or "auto" with the reasons the earlier candidates were skipped

    def __str__(self) -> str:
        return f"{self.family}: {self.name} ({self.note})"


def choose(family: str, requested: str, order: Sequence[str],
           checks: dict[str, Callable[[], str | None]]) -> Choice:
    """requested: "auto" or the name of an implementation (a key of checks). order: the names "auto"
    tries, in order of preference. checks: name -> why_not() for every implementation that may be
    forced (None: it can serve)."""
    if requested != "auto":
        if requested not in checks:
            raise ValueError(f"unknown {family} implementation {requested!r}; known: {sorted(checks)} or 'auto'")
        why = checks[requested]()
        if why is not None:
            raise ValueError(f"{family} implementation {requested!r} cannot serve this configuration: {why}")
        choice = Choice(family, requested, "forced")
    else:
        skipped = []
        for name in order:
            why = checks[name]()
            if why is None:
                choice = Choice(family, name, "; ".join(["auto"] + skipped))
                break
            skipped.append(f"{name}: {why}")
        else:
            raise ValueError(f"no {family} implementation can serve this configuration: {'; '.join(skipped)}")
    log.info("%s", choice)
    return choice
