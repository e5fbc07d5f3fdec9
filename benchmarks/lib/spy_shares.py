"""spy_shares: where a py-spy profile's samples are, as shares of the samples kept.

Reads py-spy's raw output (``py-spy record -f raw``: one line a stack, ``frame;frame;... count``),
keeps the stacks that contain every ``--within`` text (a thread's name with ``--threads``, a
function), and prints the share of the kept samples that each function is on the stack for
(inclusive) and that each line is the innermost frame of (self).

    py-spy record --gil -r 200 -f raw -o spy.txt -- python -m benchmarks.transform.encode_threads --threads 8
    python -m benchmarks.lib.spy_shares spy.txt --within "calls_per_s.<locals>.loop"
"""

from __future__ import annotations

import argparse
import collections
import gzip
from pathlib import Path


def _function(frame: str) -> str:
    """``name (path:line)`` -> ``name (file)``."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0].rsplit('/', 1)[-1]})"


def _line(frame: str) -> str:
    """``name (path:line)`` -> ``name:line``."""
    name, _, where = frame.partition(" (")
    return f"{name}:{where.rstrip(')').rsplit(':', 1)[-1]}"


def shares(lines, within: list[str]) -> tuple[int, collections.Counter, collections.Counter]:
    """Samples kept, and per function (inclusive) and per innermost line (self) their counts."""
    kept, inclusive, own = 0, collections.Counter(), collections.Counter()
    for text in lines:
        stack, _, count = text.rstrip().rpartition(" ")
        if not stack or not all(w in stack for w in within):
            continue
        n = int(count)
        frames = stack.split(";")
        kept += n
        for f in {_function(f) for f in frames}:
            inclusive[f] += n
        own[_line(frames[-1])] += n
    return kept, inclusive, own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile", help="py-spy raw output (.txt, or .txt.gz)")
    ap.add_argument("--within", action="append", default=[], help="keep stacks containing this text (repeatable: all of them)")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    path = Path(args.profile)
    with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
        kept, inclusive, own = shares(f, args.within)
    print(f"{kept} samples kept")
    for title, counts in (("inclusive, by function", inclusive), ("self, by line", own)):
        print(f"-- {title}")
        for name, n in counts.most_common(args.top):
            print(f"{n / max(kept, 1):7.1%}  {name}")


if __name__ == "__main__":
    main()
