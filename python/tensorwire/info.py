"""`tensorwire info`: which UCX is loaded and from where, what it can reach,
and the configuration in force."""

from __future__ import annotations

import os
import re
from typing import Any

from . import __version__, _core, config


def loaded_ucx_libraries() -> list[str]:
    """Every distinct libucp/libucs file mapped into this process."""
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                m = re.search(r"(/\S*lib(ucp|ucs|uct)\.so[.\d]*)$", line.strip())
                if m:
                    found.add(os.path.realpath(m.group(1)))
    except OSError:
        pass
    return sorted(found)


def rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


FAMILIES = ("tcp", "shm", "rdma", "cuda")


def transports() -> list[str]:
    """Transport/device pairs UCX offers for data here (UCX_TLS as set)."""
    from . import Device

    with Device(progress="inline") as dev:
        return sorted(dev.resources())


def usable(resources: list[str]) -> dict[str, str]:
    """family -> "" when Device(transport=family) works here, else why not (the core's check)."""
    return {f: _core.unusable_reason(resources, f) for f in FAMILIES}


def _of_family(tls: list[str], family: str) -> list[str]:
    """The transports of `family` among "transport/device" names (the core's one table)."""
    return [t for t in tls if _core.transport_family(t) == family]


def cuda(tls: list[str]) -> dict[str, Any]:
    """GPUs, driver and runtime, UCX's CUDA transports, and whether GPUDirect
    RDMA is possible here: gdr_copy, or a verbs device with peer memory
    (nvidia_peermem) so the NIC reads and writes GPU memory itself."""
    info = _core.cuda_info()
    version = info["driver_version"]
    runtime = None
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        import torch  # only for the CUDA runtime it was built with

        runtime = torch.version.cuda
    names = [t.split("/")[0] for t in tls]
    peer_memory = os.path.exists("/sys/module/nvidia_peermem") or os.path.exists("/sys/kernel/mm/memory_peers/nv_mem")
    verbs = bool(_of_family(tls, "rdma"))
    return {
        "available": info["available"],
        "reason": info["reason"],
        "driver": f"{version // 1000}.{version % 1000 // 10}" if version else None,
        "runtime": runtime,
        "devices": info["devices"],
        "ucx_transports": sorted(set(_of_family(tls, "cuda"))),
        "gdr_copy": "gdr_copy" in names,
        "peer_memory": peer_memory,
        "gpudirect_rdma": "gdr_copy" in names or (peer_memory and verbs),
    }


def collect(transport: str = "auto") -> dict[str, Any]:
    libs = loaded_ucx_libraries()
    info: dict[str, Any] = {
        "tensorwire": __version__,
        "protocol_version": _core.protocol_version(),
        "ucx_version": _core.ucx_version(),
        "ucx_headers": _core.ucx_header_version(),
        "ucx_library": os.path.realpath(_core.ucx_library_path()),
        "ucx_source": _core.ucx_source,
        "ucx_limits": _core.ucx_limits(),
        "ucx_libraries_loaded": libs,
        "transports": transports(),
        "rdma_devices": rdma_devices(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("UCX_", "TENSORWIRE_"))},
        "warnings": [],
    }
    info["configuration"] = config.effective()
    for c in info["configuration"]:
        if c["name"] == "TENSORWIRE_UCX":  # a build-time choice: what this build used
            c.update(value=f"{_core.ucx_source} (this build)", set=False)
    info["warnings"] += [
        f"{k} is set but tensorwire reads no such variable (docs/configuration.md)"
        for k in info["env"]
        if k.startswith("TENSORWIRE_") and k not in config.NAMES
    ]
    info["cuda"] = cuda(info["transports"])
    info["usable"] = usable(info["transports"])
    info["requested"] = transport
    dirs = {os.path.dirname(p) for p in libs if "libucp" in p or "libucs" in p}
    if len(dirs) > 1:
        info["warnings"].append("more than one UCX is loaded in this process: " + ", ".join(sorted(dirs)))
    tls = info["transports"]
    if info["rdma_devices"] and not _of_family(tls, "rdma"):
        info["warnings"].append(
            "RDMA devices exist (" + ", ".join(info["rdma_devices"]) + ") but UCX offers no verbs transport: "
            "this UCX is built without verbs (the PyPI wheel is); rebuild with TENSORWIRE_UCX=system "
            "against a UCX that has them"
        )
    if tls and all(t.startswith(("tcp", "self")) or "memory" in t for t in tls) and info["rdma_devices"]:
        info["warnings"].append("only TCP is available for inter-host traffic although an RDMA device exists")
    return info


def render(info: dict[str, Any]) -> str:
    lines = [
        f"tensorwire {info['tensorwire']} (control protocol v{info['protocol_version']})",
        f"UCX {info['ucx_version']} loaded from {info['ucx_library']}",
        f"  built against UCX API {info['ucx_headers']} from the {info['ucx_source']} build",
        "  UCX libraries mapped: " + ", ".join(info["ucx_libraries_loaded"]),
        *(f"  limit: {limit}" for limit in info["ucx_limits"]),
        "transports UCX offers for data: " + (", ".join(info["transports"]) or "none"),
        "RDMA devices: " + (", ".join(info["rdma_devices"]) or "none"),
        "control plane: tcp with peer error handling and keepalive; data endpoints: no UCX error handling,"
        " liveness from the control plane",
        "UCX environment: "
        + (", ".join(f"{k}={v}" for k, v in info["env"].items() if k.startswith("UCX_")) or "none (UCX defaults)"),
        "tensorwire configuration (docs/configuration.md; '=' set in the environment, ':' the default):",
        *(f"  {c['name']:<30}{'=' if c['set'] else ':'} {c['value']}" for c in info["configuration"]),
    ]
    lines.append("usable here (Device(transport=...) / --transport):")
    for family, why in info["usable"].items():
        lines.append(f"  {family:<5} {'yes' if not why else 'no: ' + why}")
    c = info["cuda"]
    if c["available"]:
        lines += [
            f"CUDA: driver {c['driver']}, runtime {c['runtime'] or 'unknown (no torch)'}; GPUs: "
            + ", ".join(f"{i}: {name}" for i, name in enumerate(c["devices"])),
            "  UCX CUDA transports: " + (", ".join(c["ucx_transports"]) or "none (this UCX has no CUDA support)"),
            f"  GPUDirect RDMA: {'possible' if c['gpudirect_rdma'] else 'not possible'} (gdr_copy "
            f"{'yes' if c['gdr_copy'] else 'no'}, NIC peer memory {'yes' if c['peer_memory'] else 'no'}, verbs "
            f"{'yes' if _of_family(info['transports'], 'rdma') else 'no'}); without it GPU memory crosses hosts staged through host memory",
        ]
    else:
        lines.append(f"CUDA: not available ({c['reason']}); GPU memory cannot be used")
    for w in info["warnings"]:
        lines.append(f"WARNING: {w}")
    return "\n".join(lines)
