#!/usr/bin/env python3
"""Checks that the include graph of src/ and include/ferry/ points down the layers of docs/design.md ("Layers"), and
that inside the cuda backend a protocol folder includes no other protocol's code (the hierarchical protocol builds on
normal mode's). Prints every include that breaks a rule, with its file and line; exit status 1 when there is one.

    tests/build_check/check_layers.py [REPO_ROOT]
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[2])

# Bottom up; a layer may include its own files and those of lower layers. trace and tuning are peers (neither includes
# the other).
LAYER_OF_DIR = {"core": 0, "bootstrap": 1, "comm": 2, "wire": 3, "trace": 4, "tuning": 4, "ep": 5}
PUBLIC = {
    "error.hpp": "core", "env.hpp": "core", "limits.hpp": "core", "mode.hpp": "core", "interrupt.hpp": "core",
    "version.hpp": "core",
    "bootstrap.hpp": "bootstrap",
    "communicator.hpp": "comm", "device_view.hpp": "comm",
    "wire_format.hpp": "wire",
    "trace.hpp": "trace",
    "tuning.hpp": "tuning",
    "ep.hpp": "ep",
}
# Inside src/ep/cuda: the protocol folders, and which other protocol each may build on.
PROTOCOLS = {"normal": set(), "ll": set(), "hier": {"normal"}}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def layer_of(path):
    """(layer name, protocol or None) of a repository path (src/... or include/ferry/...), or None outside them."""
    parts = pathlib.PurePosixPath(path).parts
    if parts[:2] == ("include", "ferry"):
        return PUBLIC.get(parts[2]), None
    if parts[0] != "src" or len(parts) < 3:
        return None, None
    layer = parts[1]
    protocol = None
    if parts[1:3] == ("ep", "cuda") and len(parts) > 4 and parts[3] in PROTOCOLS:
        protocol = parts[3]
    return layer, protocol


def target_path(include):
    """The repository path an include names: "ferry/ep.hpp" is include/ferry/ep.hpp, anything else is under src/."""
    return "include/" + include if include.startswith("ferry/") else "src/" + include


def main():
    broken = []
    files = [p for p in ROOT.glob("src/**/*") if p.suffix in {".hpp", ".cpp", ".cu", ".cuh"}]
    files += [p for p in ROOT.glob("include/ferry/*.hpp")]
    for path in sorted(files):
        rel = path.relative_to(ROOT).as_posix()
        layer, protocol = layer_of(rel)
        if layer is None:
            broken.append(f"{rel}: a file of no layer (add it to tests/build_check/check_layers.py and docs/design.md)")
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            target = target_path(m.group(1))
            if not (ROOT / target).exists():
                continue  # a system or generated header
            to_layer, to_protocol = layer_of(target)
            if to_layer is None:
                continue
            if LAYER_OF_DIR[to_layer] > LAYER_OF_DIR[layer] or (
                    LAYER_OF_DIR[to_layer] == LAYER_OF_DIR[layer] and to_layer != layer):
                broken.append(f"{rel}:{number}: {layer} includes {target} of layer {to_layer}, which is not below it")
                continue
            if to_protocol is None or to_protocol == protocol:
                continue
            if protocol is None:
                # the backend and the shared device steps may include a protocol's plain layout (the region is the
                # union of the protocols' areas); the backend (cuda_ep.cu, buffers.*, instances) anything
                if target.endswith("/layout.hpp") or rel.split("/")[-1] in {"cuda_ep.cu", "buffers.cu", "buffers.hpp"}:
                    continue
                broken.append(f"{rel}:{number}: a device step shared by the protocols includes {target} of protocol "
                              f"{to_protocol}")
            elif to_protocol not in PROTOCOLS[protocol]:
                broken.append(f"{rel}:{number}: protocol {protocol} includes {target} of protocol {to_protocol}")
    for line in broken:
        print(line)
    print(f"check_layers: {len(files)} files, {len(broken)} includes against the layers")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
