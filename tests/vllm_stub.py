"""Run code that imports the vLLM connector without vLLM: in a subprocess where `vllm` and its
submodules are empty stand-ins (any attribute a class), and, when given, only the standard library,
kvfetcher and the ``allowed`` top-level modules may be imported."""

from __future__ import annotations

import subprocess
import sys

GATE = r'''
import importlib.abc, importlib.machinery, sys, types
allowed = set(sys.argv[1].split(",")) | set(sys.stdlib_module_names) | {"kvfetcher"} if sys.argv[1] != "*" else None

class Gate(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top == "vllm":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if allowed is not None and top not in allowed:
            raise ModuleNotFoundError(f"{top} (imported as {name}) is not required by kvfetcher[vllm]", name=top)
        return None
    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        def stand_in(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (), {})
        module.__getattr__ = stand_in
        return module
    def exec_module(self, module):
        pass

sys.meta_path.insert(0, Gate())
exec(sys.argv[2])
'''


def run_without_vllm(code: str, allowed: set[str] | None = None) -> subprocess.CompletedProcess:
    """``code`` run as above; its completed process (text output captured)."""
    return subprocess.run([sys.executable, "-c", GATE, ",".join(sorted(allowed)) if allowed is not None else "*", code],
                          capture_output=True, text=True, timeout=300)
