"""Which UCX a process loads (issue 19 §6): exactly one, the one the build
linked; a system-UCX build never loads (or asks pip for) the libucx wheel; and
what an older UCX cannot do is said, not hidden."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tensorwire as tw
from tensorwire import _core, info

# A fresh process: imports tensorwire, makes a Device (UCX loads its
# transports then), reports what is mapped.
_PROBE = """
import json, sys
import tensorwire as tw
from tensorwire.info import loaded_ucx_libraries
with tw.Device() as dev:
    libs = loaded_ucx_libraries()
print(json.dumps({"libs": libs, "library": tw._core.ucx_library_path(), "libucx_imported": "libucx" in sys.modules}))
"""

_WHEEL_DIR = re.compile(r"[/\\](site|dist)-packages[/\\]libucx[/\\]")
ROOT = Path(__file__).resolve().parents[3]


def _probe() -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_process_maps_libucp_and_libucs_from_one_directory():
    p = _probe()
    core = [lib for lib in p["libs"] if re.match(r"lib(ucp|ucs)\.so", os.path.basename(lib))]
    assert {re.match(r"lib(uc.)", os.path.basename(lib)).group(1) for lib in core} == {"ucp", "ucs"}, p["libs"]
    dirs = {os.path.dirname(lib) for lib in core}
    assert len(dirs) == 1, f"UCX mapped from more than one directory: {core}"
    assert os.path.dirname(os.path.realpath(p["library"])) in dirs


def test_a_system_build_loads_no_ucx_wheel():
    if _core.ucx_source != "system":
        pytest.skip("a build against the UCX wheel")
    p = _probe()
    assert not p["libucx_imported"]
    assert not [lib for lib in p["libs"] if _WHEEL_DIR.search(lib)], p["libs"]


def test_limits_follow_the_ucx_headers():
    version = tuple(int(x) for x in _core.ucx_header_version().split(".")[:2])
    limits = _core.ucx_limits()
    if version >= (1, 14):
        assert limits == []
    else:
        assert any("cannot report an endpoint's transports" in limit for limit in limits), limits
    data = info.collect("tcp")
    assert data["ucx_limits"] == limits
    rendered = info.render(data)
    assert all(limit in rendered for limit in limits)
    assert not [w for w in data["warnings"] if "more than one UCX" in w]


def test_an_older_ucx_takes_the_message_form_to_another_process():
    # Without the endpoint's transports a channel assumes its peer must
    # progress: no direct copy even over shared memory.
    if tuple(int(x) for x in _core.ucx_header_version().split(".")[:2]) >= (1, 14):
        pytest.skip("this UCX reports an endpoint's transports")
    import numpy as np

    with tw.Device(transport="shm") as server, tw.Device(transport="shm") as client:
        dst = server.alloc(4096)
        server.publish("dst", dst)
        src = client.alloc(4096)
        np.asarray(src)[:] = 5
        ch = client.connect(server.address)
        remote = ch.lookup("dst")
        assert not ch.maps(remote, src)
        ch.write(src, remote).wait(timeout=10)
        ch.flush().wait(timeout=10)
        assert (np.asarray(dst) == 5).all()
        assert ch.stats()["direct_writes"] == 0


def _metadata(tmp_path: Path, ucx: str) -> tuple[list[str], list[str]]:
    """Build requirements and Requires-Dist of a wheel built with TENSORWIRE_UCX=ucx."""
    script = (
        "import json, sys\n"
        "from scikit_build_core import build\n"
        "requires = build.get_requires_for_build_wheel()\n"
        "d = build.prepare_metadata_for_build_wheel(sys.argv[1])\n"
        "text = open(sys.argv[1] + '/' + d + '/METADATA').read()\n"
        "print(json.dumps([requires, [l.split(':', 1)[1].strip() for l in text.splitlines() if l.startswith('Requires-Dist:')]]))\n"
    )
    env = dict(os.environ, TENSORWIRE_UCX=ucx)
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("ucx", ["wheel", "system"])
def test_only_a_wheel_build_requires_the_ucx_wheel(tmp_path, ucx):
    pytest.importorskip("scikit_build_core")
    if not (ROOT / "pyproject.toml").exists():
        pytest.skip("no source tree")
    build_requires, requires = _metadata(tmp_path, ucx)
    wants = ucx == "wheel"
    assert any(r.startswith("libucx-cu13") for r in build_requires) == wants, build_requires
    assert any(r.startswith("libucx-cu13") for r in requires) == wants, requires
    assert any(r.startswith("numpy") for r in requires)
