"""The import graph follows the layers of docs/architecture.md §4.1: arrows
only point down. A module-level import against the rule fails here (a lazy
import inside a function, for an optional feature, is allowed), except for
the lab: the product never imports tensorwire.lab, at module level or
lazily, and names it in one place only, the command line's hook (LAB_HOOK).
The C++ rows are checked on the #include lines of cpp/src and python/bindings."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

import tensorwire

PACKAGE = pathlib.Path(tensorwire.__file__).parent

# Area of a module (its first component below tensorwire; below tensorwire.lab,
# "lab.<folder>") -> the areas it may import at module level. "core" is the
# package root and its plain modules.
CORE = "core"
# The product: what a user of the library needs.
PRODUCT = {CORE, "ranks", "torch", "cli", "errors"}
# The lab (tensorwire.lab): what measures and reproduces; it may import the product.
LAB = "lab"
MAY_IMPORT = {
    CORE: {CORE},
    "ranks": {CORE, "ranks"},
    "torch": {CORE, "ranks", "torch"},
    "cli": {CORE, "ranks", "cli"},  # the product's commands; the lab's come through LAB_HOOK
    "errors": {"errors"},  # every area may import the exceptions
    "lab": PRODUCT | {"lab", "lab.fabric"},  # tensorwire.lab itself, demo.py
    "lab.fabric": PRODUCT | {"lab.fabric"},
    "lab.paper": PRODUCT | {"lab.paper", "lab.fabric"},
    "lab.torch_dist": PRODUCT | {"lab.torch_dist", "lab.fabric"},
    "lab.conformance": PRODUCT | {"lab.conformance"},
    "lab.testbed": {"lab.testbed", "errors"},  # runs as root in namespaces: no device, no torch
    "lab.commands": PRODUCT
    | {"lab", "lab.fabric", "lab.paper", "lab.torch_dist", "lab.conformance", "lab.testbed", "lab.commands"},
}
# The one place the product names the lab: tensorwire.cli looks up the lab's
# command module by name and lets it register its commands.
LAB_HOOK = ("tensorwire.cli", "tensorwire.lab.commands")
# Third-party packages an area must not import at module level (optional
# dependencies: their absence must not break the area's import).
_OPTIONAL = {"torch", "grpc", "matplotlib"}
FORBIDDEN_EXTERNAL = {
    CORE: _OPTIONAL,
    "ranks": _OPTIONAL,
    "cli": _OPTIONAL,
    "lab.fabric": _OPTIONAL,
    "lab.commands": _OPTIONAL,  # `tensorwire --help` builds every parser
    "lab.testbed": {"torch", "numpy"},
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


AREA_OF = {
    "ranks": "ranks",
    "torch": "torch",
    "errors": "errors",
    "cli": "cli",
    "__main__": "cli",
    "lab": LAB,
}  # the rest of the top level is the core
LAB_AREAS = {"fabric", "paper", "torch_dist", "conformance", "testbed", "commands"}  # lab.<folder>


def _area(module: str) -> str:
    parts = module.split(".")
    area = AREA_OF.get(parts[1], CORE) if len(parts) > 1 else CORE
    if area == LAB and len(parts) > 2 and parts[2] in LAB_AREAS:
        return f"{LAB}.{parts[2]}"
    return area


def _in_lab(area: str) -> bool:
    return area == LAB or area.startswith(LAB + ".")


def _imports(path: pathlib.Path, lazy: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module) of each import not inside a function or class
    (lazy=True: every import, those in functions too)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    tree = ast.parse(path.read_text())
    todo = list(ast.walk(tree)) if lazy else list(tree.body)
    while todo:
        node = todo.pop()
        if not lazy and isinstance(node, (ast.If, ast.Try, ast.With)):  # still module level
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


def _module_level_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    return _imports(path)


_LAB_NAME = re.compile(r"tensorwire\.lab(\.\w+)*")


def _lab_names(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import of the lab, lazy ones too, and every string
    that is a lab module's name (importlib.import_module("tensorwire.lab...."))."""
    found = [(n, t) for n, t in _imports(path, lazy=True) if t == "tensorwire.lab" or t.startswith("tensorwire.lab.")]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _LAB_NAME.fullmatch(node.value):
            found.append((node.lineno, node.value))
    return found


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
                if to not in allowed and not (_in_lab(to) and not _in_lab(area)):  # that one: below
                    bad.append(f"{where}: {area} imports {target} ({to}) at module level")
            elif target.split(".")[0] in FORBIDDEN_EXTERNAL.get(area, set()):
                bad.append(f"{where}: {area} imports {target} at module level (an optional dependency)")
        if not _in_lab(area):  # the product names the lab nowhere but in LAB_HOOK
            for line, target in _lab_names(path):
                if (module, target) != LAB_HOOK:
                    bad.append(
                        f"{path.relative_to(PACKAGE.parent)}:{line}: {area} (the product) imports {target} (the lab)"
                    )
    return bad


def test_imports_point_down():
    assert _violations() == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The rule is not vacuous: a fabric bench importing tensorwire.torch.ps's
    optional torch fails it, a module of the device API importing tensorwire.ranks
    does, and so does the product importing the lab, lazily or by name, anywhere
    but in the command line's hook."""
    fake = tmp_path / "tensorwire"
    for d in ("lab/fabric", "lab/commands", "lab/testbed", "cli", "torch"):
        (fake / d).mkdir(parents=True)
        (fake / d / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "lab" / "__init__.py").write_text("")
    (fake / "lab" / "fabric" / "bad.py").write_text("from ...torch import ps\nimport torch\n")
    (fake / "lab" / "fabric" / "good.py").write_text("from ...ranks import world\nfrom ... import Device\n")
    (fake / "lab" / "testbed" / "bad.py").write_text("from ... import Device\n")
    (fake / "device_api.py").write_text("from .ranks import world\n")  # the device API under the ranks
    (fake / "torch" / "lazy.py").write_text("def f():\n    from ..lab.fabric import common\n")
    (fake / "torch" / "by_name.py").write_text("import importlib\nimportlib.import_module('tensorwire.lab.paper')\n")
    (fake / "cli" / "__init__.py").write_text("LAB_COMMANDS = 'tensorwire.lab.commands'\n")  # the hook: allowed
    (fake / "cli" / "info.py").write_text("from ..lab.commands import args\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    found = _violations()
    assert any("core imports tensorwire.ranks" in v for v in found), found
    assert any("lab.fabric imports torch at module level" in v for v in found), found
    assert any("lab.testbed imports tensorwire.Device (core)" in v for v in found), found
    assert [v.split(": ", 1)[1] for v in found if "(the lab)" in v] == [
        "cli (the product) imports tensorwire.lab.commands (the lab)",
        "torch (the product) imports tensorwire.lab.paper (the lab)",
        "torch (the product) imports tensorwire.lab.fabric (the lab)",
    ], found
    assert not any("good.py" in v or "cli/__init__.py" in v for v in found), found


def _modules_of(area: str) -> list[str]:
    if area == CORE:  # the package root and its plain modules (the device API)
        paths = [p for p in sorted(PACKAGE.glob("*.py")) if _area(_module_name(p)) == CORE]
    else:
        paths = [p for p in sorted(PACKAGE.joinpath(*area.split(".")).rglob("*.py")) if p.name != "__main__.py"]
    return [_module_name(p) for p in paths]


@pytest.mark.parametrize(
    "area, absent",
    [
        (CORE, "torch"),
        ("ranks", "torch"),
        ("cli", "torch"),
        ("lab.fabric", "torch"),
        ("lab.commands", "torch"),
        ("lab.testbed", "torch"),
        (CORE, "tensorwire.lab"),
        ("ranks", "tensorwire.lab"),
        ("cli", "tensorwire.lab"),
        ("torch", "tensorwire.lab"),
    ],
)
def test_importing_an_area_does_not_load(area, absent):
    """Every module of `area` imports without pulling in `absent` (checked in a fresh interpreter)."""
    if area == "torch" and importlib.util.find_spec("torch") is None:
        pytest.skip("tensorwire.torch needs torch")
    modules = _modules_of(area)
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted(k for k in sys.modules if k == {absent!r} or k.startswith({absent!r} + '.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing tensorwire.{area} loaded {out.stdout.strip()}"


# The C++ rows: a directory of cpp/src (or the bindings) -> the directories its
# `#include "dir/..."` lines may name. tensorwire/ (the public API) is open to all.
REPO = pathlib.Path(__file__).resolve().parents[3]
_BELOW_PROTOCOLS = {"common", "cuda", "ucx", "net", "core"}
CPP_MAY_INCLUDE = {
    "common": {"common"},
    "net": {"common", "net"},  # tensorwire's own tcp transport: sockets and frames, nothing of UCX
    "cuda": {"common", "cuda"},  # the CUDA driver, loaded at run time
    "ucx": {"common", "cuda", "ucx"},
    "core": _BELOW_PROTOCOLS,  # the control plane too (core/connect.cc, control_plane.cc, control_wire.*)
    "protocol": _BELOW_PROTOCOLS | {"protocol"},
    "bench": _BELOW_PROTOCOLS | {"bench"},
    # The bindings see the library through its public headers (cpp/include/tensorwire) only.
    "bindings": set(),
}
# Files held to less than their directory (a directory, or one exact header):
# the control wire format stands on common/ alone (the fuzz targets decode it
# without a device).
CPP_FILE_MAY_INCLUDE = {
    "core/control_wire.h": {"common"},
    "core/control_wire.cc": {"common", "core/control_wire.h"},
}
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
    """Including a private header of the core, the protocols, the socket layer,
    UCX or CUDA from the bindings fails too: they see the public API only."""
    for rel, text in {
        "src/ucx/ucx.cc": '#include "core/log.h"\n',
        "src/core/control_wire.h": '#include "core/bytes.h"\n',
        "src/core/control_wire.cc": '#include "core/control_wire.h"\n#include "core/device_impl.h"\n',
        "src/core/device.cc": '#include "protocol/slot_common.h"\n',
        "src/protocol/slot_common.h": '#include "core/device_port.h"\n#include "core/device_impl.h"\n',
        "src/bench/kernels.cc": '#include "core/device_impl.h"\n',
        "bindings/device.cc": '#include "tensorwire/channel.h"\n#include "core/channel_impl.h"\n'
        '#include "protocol/slot_common.h"\n#include "net/socket.h"\n'
        '#include "ucx/ucx.h"\n#include "cuda/driver.h"\n',
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = _cpp_violations({"": tmp_path / "src", "bindings": tmp_path / "bindings"})
    assert [v.split(": ", 1)[1] for v in found] == [
        "bench/kernels.cc includes core/device_impl.h",
        "core/control_wire.cc includes core/device_impl.h",
        "core/control_wire.h includes core/",
        "core/device.cc includes protocol/",
        "protocol/slot_common.h includes core/device_impl.h",
        "ucx/ucx.cc includes core/",
        "bindings/device.cc includes core/",
        "bindings/device.cc includes protocol/",
        "bindings/device.cc includes net/",
        "bindings/device.cc includes ucx/",
        "bindings/device.cc includes cuda/",
    ], found
