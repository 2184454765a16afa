"""The wheel the package ships (issue 34): abi3 (one wheel for every CPython the package
supports), the extension stripped, and tagged manylinux_2_28 by the build that makes the
distributable wheel (scripts/python-wheel.sh, the same command as the kvpool image's python
stage). Checked from the configuration files, and on the extension installed in this venv
(scripts/python-env.sh builds it with the package's own pyproject). No build here: the script
takes minutes (docs/python.md, "Install")."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from kvpool import _native

CRATE = Path(__file__).resolve().parents[1]
REPO = CRATE.parents[1]


def maturin_config() -> dict:
    return tomllib.loads((CRATE / "pyproject.toml").read_text())["tool"]["maturin"]


def elf_sections(path: Path) -> list[str]:
    """The section names of a 64-bit little-endian ELF file."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path}: not ELF64 LE"
    shoff = int.from_bytes(data[0x28:0x30], "little")
    shentsize, shnum, shstrndx = (int.from_bytes(data[o:o + 2], "little") for o in (0x3A, 0x3C, 0x3E))
    headers = [data[shoff + i * shentsize: shoff + (i + 1) * shentsize] for i in range(shnum)]
    names_at = int.from_bytes(headers[shstrndx][0x18:0x20], "little")
    names = []
    for h in headers:
        start = names_at + int.from_bytes(h[0:4], "little")
        names.append(data[start:data.index(b"\0", start)].decode())
    return names


def test_the_extension_is_abi3_for_the_oldest_python_the_package_supports():
    workspace = tomllib.loads((REPO / "Cargo.toml").read_text())
    pyo3 = workspace["workspace"]["dependencies"]["pyo3"]
    abi3 = [f for f in pyo3["features"] if f.startswith("abi3")]
    assert abi3 == ["abi3-py39"], pyo3
    crate = tomllib.loads((CRATE / "Cargo.toml").read_text())
    assert crate["dependencies"]["pyo3"] == {"workspace": True}, "the crate must not change pyo3"
    project = tomllib.loads((CRATE / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.9"  # what abi3-py39 builds for
    # maturin names an abi3 extension module `<name>.abi3.so`.
    assert Path(_native.__file__).name == "_native.abi3.so", _native.__file__


def test_the_extension_is_stripped():
    assert maturin_config().get("strip") is True
    left = [s for s in elf_sections(Path(_native.__file__)) if s == ".symtab" or s.startswith(".debug")]
    assert not left, f"{_native.__file__} keeps {left}"


def test_the_distributable_wheel_is_manylinux_2_28_built_as_the_image_builds_it():
    script = (REPO / "scripts" / "python-wheel.sh").read_text()
    assert re.search(r"^POLICY=manylinux_2_28$", script, re.M), "python-wheel.sh policy"
    assert '--zig --compatibility "$POLICY"' in script
    assert "auditwheel" in script and "cp39-abi3" in script
    dockerfile = (REPO / "docker" / "kvpool.Dockerfile").read_text()
    assert "--strip --zig --compatibility manylinux_2_28" in dockerfile
    # One version of each tool across the scripts and the image.
    env_script = (REPO / "scripts" / "python-env.sh").read_text()
    for tool in ("MATURIN_VERSION", "ZIGLANG_VERSION"):
        ours = re.search(rf"^{tool}=(\S+)$", script, re.M)
        image = re.search(rf"^ARG {tool}=(\S+)$", dockerfile, re.M)
        assert ours and image and ours.group(1) == image.group(1), tool
    maturin = re.search(r"^MATURIN_VERSION=(\S+)$", env_script, re.M)
    assert maturin and maturin.group(1) in script
    # The source build keeps maturin's own platform tag: a manylinux_2_28 requirement in
    # pyproject.toml would fail every build on a distribution newer than glibc 2.28.
    assert "compatibility" not in maturin_config()
