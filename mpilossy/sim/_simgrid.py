"""Find SimGrid's Python bindings: `import simgrid` where pip installed them,
else Debian's python3-simgrid (built for the system CPython 3.11, whose ABI
a 3.11 virtual environment shares), loaded by path so that nothing else of
the system's site-packages leaks into the environment."""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

__all__ = ["load", "HINT"]

HINT = ("SimGrid's Python bindings are missing: `apt-get install python3-simgrid` "
        "(Debian 12, as scripts/system-packages.sh does) or `pip install simgrid` "
        "(a source build of some minutes)")


def load() -> ModuleType:
    if "simgrid" in sys.modules:
        return sys.modules["simgrid"]
    try:
        import simgrid          # noqa: F401  (pip's wheel or build)
        return sys.modules["simgrid"]
    except ImportError:
        pass
    tag = f"cpython-{sys.version_info.major}{sys.version_info.minor}"
    for path in sorted(glob.glob(f"/usr/lib/python3/dist-packages/simgrid.{tag}-*.so")):
        loader = importlib.machinery.ExtensionFileLoader("simgrid", path)
        spec = importlib.util.spec_from_file_location("simgrid", path, loader=loader)
        if spec is None:
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules["simgrid"] = module
        try:
            loader.exec_module(module)
        except ImportError:
            del sys.modules["simgrid"]
            continue
        return module
    raise ImportError(HINT)
