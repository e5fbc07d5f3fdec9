"""Keyed MAC throughput on one core: the candidates for the part tags of keyed objects.

A keyed fetch verifies a tag over every part it restores, so the MAC's rate bounds what a decode
worker's core can check; why ``format.mac`` tags parts with AES-GMAC (``cryptography``) rather
than HMAC-SHA256. Keyed BLAKE3 is timed where the ``blake3`` package is installed. 4 MiB
messages, 30 after a warm-up, in one thread. Writes research/results/mac.json.

    python -m research.mac_bench
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import platform
import time
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.poly1305 import Poly1305

OUT = Path(__file__).resolve().parent / "results" / "mac.json"


def rate(fn, data: bytes, repeats: int = 30) -> float:
    """GB/s of ``repeats`` calls of ``fn`` after one."""
    fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return round(repeats * len(data) / (time.perf_counter() - t) / 1e9, 2)


def main() -> None:
    data, key, nonce = os.urandom(4 << 20), os.urandom(32), os.urandom(12)
    macs = {
        "hmac-sha256": lambda: hmac.new(key, data, hashlib.sha256).digest(),
        "blake2b-keyed": lambda: hashlib.blake2b(data, key=key).digest(),
        "poly1305": lambda: Poly1305.generate_tag(key, data),
        "aes-gmac": lambda: AESGCM(key).encrypt(nonce, b"", data),
    }
    try:
        import blake3

        macs["blake3-keyed"] = lambda: blake3.blake3(data, key=key).digest()
    except ImportError:
        pass
    res = {"date": datetime.date.today().isoformat(), "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
           "bytes": len(data), "GB_s_one_core": {name: rate(fn, data) for name, fn in macs.items()}}
    OUT.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
