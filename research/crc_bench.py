"""CRC-32 throughput: zlib vs ISA-L (``isal``), which compute the same checksum.

Every fetched segment is checksummed before it is decoded, so a fetch checks GBs: this is
why ``container`` uses ISA-L when it is installed. Writes research/results/crc.json.

    python -m research.crc_bench
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
import zlib
from pathlib import Path

from isal import isal_zlib

OUT = Path(__file__).resolve().parent / "results" / "crc.json"


def rate(fn, data: bytes, repeats: int = 7) -> float:
    """Median GB/s over ``repeats`` checksums of ``data``."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(data)
        times.append(time.perf_counter() - t)
    return len(data) / statistics.median(times) / 1e9


def main() -> None:
    data = os.urandom(32 << 20)  # one q8 segment of a Llama-3-8B-shaped chunk is ~20 MB
    assert zlib.crc32(data) == isal_zlib.crc32(data)
    res = {"date": datetime.date.today().isoformat(), "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
           "bytes": len(data), "zlib_GB_s": rate(zlib.crc32, data), "isal_GB_s": rate(isal_zlib.crc32, data)}
    res["speedup"] = res["isal_GB_s"] / res["zlib_GB_s"]
    OUT.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
