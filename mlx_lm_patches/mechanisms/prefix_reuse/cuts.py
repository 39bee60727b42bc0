"""Where recurrent states are kept: extra cuts at powers of two, and thinning to a bound that
keeps a state within a factor of two of any position."""

from typing import List, Sequence


FIRST_CUT = 32
CHAIN_FLOOR = 256


def thin(marks: Sequence, limit: int) -> tuple:
    """At most ``limit`` of ``marks`` (ascending by position). In order of priority: the newest;
    a chain down from it, each the oldest within a factor of two of the previous, so that every
    position ``d`` has a kept state in ``[d/2, d]``, down to ``CHAIN_FLOOR`` tokens; the newest
    of the others (small gaps near the end, where requests usually diverge); the chain below the
    floor (a state there saves few tokens); the rest, newest first."""
    marks = tuple(marks)
    if len(marks) <= limit:
        return marks
    if limit <= 0:
        return ()
    positions = [m[0] for m in marks]
    newest = len(marks) - 1
    chain, i = [], newest
    while i > 0:
        i = next(j for j in range(i) if 2 * positions[j] >= positions[i] or j == i - 1)
        chain.append(i)
    high = [j for j in chain if positions[j] >= CHAIN_FLOOR]
    low = [j for j in chain if positions[j] < CHAIN_FLOOR]
    others = [j for j in reversed(range(newest)) if j not in chain]
    order = [newest] + high + [j for j in others if positions[j] >= CHAIN_FLOOR] + low + others
    keep = set()
    for j in order:
        if len(keep) == limit:
            break
        keep.add(j)
    return tuple(marks[j] for j in sorted(keep))


def cut_points(start: int, end: int) -> List[int]:
    """Powers of two (from ``FIRST_CUT``) strictly between ``start`` and ``end``."""
    out, p = [], FIRST_CUT
    while p < end:
        if p > start:
            out.append(p)
        p *= 2
    return out
