"""Pin a version in an sdist's ``pyproject.toml`` in place of setuptools_scm's dynamic one (LMCache's
build then needs no setuptools_scm, whose 10.x wants a package the GPU machine lacks):
``python lmcache_version.py pyproject.toml 0.5.6``."""

from __future__ import annotations

import re
import sys
from pathlib import Path


def pinned(text: str, version: str) -> str:
    """``text`` with ``version`` out of ``dynamic``, a static ``version`` and setuptools_scm's table renamed."""
    found = re.search(r"^dynamic\s*=\s*\[([^\]]*)\]", text, flags=re.M)
    if found is None or "version" not in found.group(1):
        raise ValueError("no dynamic version in this pyproject.toml")
    rest = ", ".join(x.strip() for x in found.group(1).split(",") if x.strip() and "version" not in x)
    text = text[: found.start()] + f'dynamic = [{rest}]\nversion = "{version}"' + text[found.end() :]
    return text.replace("[tool.setuptools_scm]", "[tool.setuptools_scm_unused]")


if __name__ == "__main__":
    path = Path(sys.argv[1])
    path.write_text(pinned(path.read_text(), sys.argv[2]))
