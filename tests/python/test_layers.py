"""The import graph follows the layers of docs/architecture.md §4.1: arrows
only point down. A module-level import against the rule fails here (a lazy
import inside a function, for an optional feature, is allowed). The C++ rows
are checked on the #include lines of cpp/src and python/bindings."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

import tensorwire

PACKAGE = pathlib.Path(tensorwire.__file__).parent

# Area of a module (its first component below tensorwire) -> the areas it may
# import at module level. "core" is the package root and its plain modules.
CORE = "core"
MAY_IMPORT = {
    CORE: {CORE},
    "ranks": {CORE, "ranks"},
    "bench": {CORE, "ranks", "bench"},
    "torch": {CORE, "ranks", "bench", "torch"},
    "testbed": {"testbed", "errors"},  # runs as root in namespaces: no device, no torch
    "cli": {CORE, "ranks", "bench", "torch", "testbed", "cli"},
    "errors": {"errors"},  # every area may import the exceptions
}
# Third-party packages an area must not import at module level (optional
# dependencies: their absence must not break the area's import).
FORBIDDEN_EXTERNAL = {CORE: {"torch", "grpc", "matplotlib"}, "ranks": {"torch", "grpc", "matplotlib"},
                      "bench": {"torch", "grpc", "matplotlib"},
                      "testbed": {"torch", "numpy"}}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


AREA_OF = {"ranks": "ranks", "bench": "bench", "torch": "torch", "testbed": "testbed", "errors": "errors",
           "cli": "cli", "__main__": "cli", "demo": "cli"}  # the rest of the top level is the core


def _area(module: str) -> str:
    parts = module.split(".")
    return AREA_OF.get(parts[1], CORE) if len(parts) > 1 else CORE


def _module_level_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module) of each import not inside a function or class."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    todo = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.If, ast.Try, ast.With)):  # still module level
            todo.extend(ast.iter_child_nodes(node))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [f"{target}.{a.name}" for a in node.names] if node.module is None else [target]
                out += [(node.lineno, n) for n in names]
            else:
                out.append((node.lineno, node.module or ""))
    return out


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        area = _area(module)
        allowed = MAY_IMPORT[area] | {"errors"}
        for line, target in _module_level_imports(path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            if target.split(".")[0] == "tensorwire":
                to = _area(target)
                if to not in allowed:
                    bad.append(f"{where}: {area} imports {target} ({to}) at module level")
            elif target.split(".")[0] in FORBIDDEN_EXTERNAL.get(area, set()):
                bad.append(f"{where}: {area} imports {target} at module level (an optional dependency)")
    return bad


def test_imports_point_down():
    assert _violations() == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The rule is not vacuous: a bench module importing tensorwire.torch fails it, and so does a
    module of the device API importing tensorwire.ranks."""
    fake = tmp_path / "tensorwire"
    (fake / "bench").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "bench" / "__init__.py").write_text("")
    (fake / "bench" / "bad.py").write_text("from ..torch import ps\nimport torch\n")
    (fake / "device_api.py").write_text("from .ranks import world\n")  # the device API under the ranks
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    found = _violations()
    assert any("core imports tensorwire.ranks" in v for v in found), found
    assert any("bench imports tensorwire.torch" in v for v in found), found
    assert any("bench imports torch at module level" in v for v in found), found


def _modules_of(area: str) -> list[str]:
    if area == CORE:  # the package root and its plain modules (the device API)
        paths = [p for p in sorted(PACKAGE.glob("*.py")) if _area(_module_name(p)) == CORE]
    else:
        paths = [p for p in sorted((PACKAGE / area).rglob("*.py")) if p.name != "__main__.py"]
    return [_module_name(p) for p in paths]


@pytest.mark.parametrize("area, absent", [(CORE, "torch"), ("ranks", "torch"), ("bench", "torch"), ("testbed", "torch")])
def test_importing_an_area_does_not_load(area, absent):
    """Every module of `area` imports without pulling in `absent` (checked in a fresh interpreter)."""
    modules = _modules_of(area)
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            f"print(sorted(k for k in sys.modules if k == {absent!r} or k.startswith({absent!r} + '.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing tensorwire.{area} loaded {out.stdout.strip()}"


# The C++ rows: a directory of cpp/src (or the bindings) -> the directories its
# `#include "dir/..."` lines may name. tensorwire/ (the public API) is open to all.
REPO = pathlib.Path(__file__).resolve().parents[2]
_BELOW_PROTOCOLS = {"common", "cuda", "ucx", "net", "core"}
CPP_MAY_INCLUDE = {
    "common": {"common"},
    "net": {"common", "net"},  # tensorwire's own tcp transport: sockets and frames, nothing of UCX
    "cuda": {"common", "cuda"},  # the CUDA driver, loaded at run time
    "ucx": {"common", "cuda", "ucx"},
    "core": _BELOW_PROTOCOLS,  # the control plane too (core/connect.cc, control_plane.cc, control_wire.*)
    "protocol": _BELOW_PROTOCOLS | {"protocol"},
    "bench": _BELOW_PROTOCOLS | {"bench"},
    "bindings": _BELOW_PROTOCOLS | {"protocol"},
}
# Files held to less than their directory (a directory, or one exact header):
# the control wire format stands on common/ alone (the fuzz targets decode it
# without a device), and only bench.cc binds the benchmark library.
CPP_FILE_MAY_INCLUDE = {"core/control_wire.h": {"common"}, "core/control_wire.cc": {"common", "core/control_wire.h"},
                        "bindings/bench.cc": _BELOW_PROTOCOLS | {"protocol", "bench"}}
# Headers an area must not include although their directory is open to it:
# the protocols and the bench kernels see a device through core/device_port.h
# and core/channel_impl.h, never DeviceImpl.
CPP_MAY_NOT_INCLUDE = {"protocol": {"core/device_impl.h"}, "bench": {"core/device_impl.h"}}
_INCLUDE = re.compile(r'\s*#\s*include\s+"(([^"/]+)/[^"]*)"')


def _cpp_violations(roots: dict[str, pathlib.Path]) -> list[str]:
    """`roots`: label -> directory whose subdirectories (cpp/src) or files (bindings) are areas."""
    bad = []
    for label, root in roots.items():
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".h", ".cc")):
            rel = path.relative_to(root)
            area = label or rel.parts[0]
            key = f"{area}/{rel.name}"
            allowed = CPP_FILE_MAY_INCLUDE.get(key, CPP_MAY_INCLUDE[area])
            for n, line in enumerate(path.read_text().splitlines(), 1):
                m = _INCLUDE.match(line)
                if not m or m.group(2) == "tensorwire":
                    continue
                where = f"{path.relative_to(root.parent)}:{n}: {key} includes"
                if m.group(2) not in allowed and m.group(1) not in allowed:
                    exact = any("/" in a for a in allowed)  # a file rule naming headers: say which one
                    bad.append(f"{where} {m.group(1) if exact else m.group(2) + '/'}")
                elif m.group(1) in CPP_MAY_NOT_INCLUDE.get(area, set()):
                    bad.append(f"{where} {m.group(1)}")
    return bad


def test_cpp_includes_point_down():
    assert _cpp_violations({"": REPO / "cpp" / "src", "bindings": REPO / "python" / "bindings"}) == []


def test_the_cpp_check_catches_an_upward_include(tmp_path):
    for rel, text in {"ucx/ucx.cc": '#include "core/log.h"\n', "core/control_wire.h": '#include "core/bytes.h"\n',
                      "core/control_wire.cc": '#include "core/control_wire.h"\n#include "core/device_impl.h"\n',
                      "core/device.cc": '#include "protocol/slot_common.h"\n',
                      "protocol/slot_common.h": '#include "core/device_port.h"\n#include "core/device_impl.h"\n',
                      "bench/kernels.cc": '#include "core/device_impl.h"\n'}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = _cpp_violations({"": tmp_path})
    assert [v.split(": ", 1)[1] for v in found] == [
        "bench/kernels.cc includes core/device_impl.h", "core/control_wire.cc includes core/device_impl.h",
        "core/control_wire.h includes core/",
        "core/device.cc includes protocol/", "protocol/slot_common.h includes core/device_impl.h",
        "ucx/ucx.cc includes core/"], found
