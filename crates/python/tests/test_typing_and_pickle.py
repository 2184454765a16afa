"""What the package promises besides its calls (issue 34): every exception it exports pickles
with its arguments and attributes (in this process and into a fresh interpreter), its
``__version__`` is the Rust crate's, and it is typed (PEP 561): a user's script that imports it
passes ``mypy --strict``, a wrong use of it fails, the pure-Python modules, the engine adapters included, are clean under
``--strict``, and ``_native.pyi`` matches the extension module (``mypy.stubtest``). No pool
needed; mypy runs in a subprocess (scripts/python-env.sh installs it)."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import kvpool
from kvpool import _native

CRATE = Path(__file__).resolve().parents[1]
REPO = CRATE.parents[1]


def exported_exceptions() -> list[type[BaseException]]:
    """The exception classes in ``kvpool.__all__``."""
    found = [getattr(kvpool, name) for name in kvpool.__all__]
    return [c for c in found if isinstance(c, type) and issubclass(c, BaseException)]


EXCEPTIONS = exported_exceptions()
KVPOOL_ERRORS = [c for c in EXCEPTIONS if issubclass(c, kvpool.Error)]


def test_every_native_exception_is_exported():
    native = {
        name
        for name in _native.__all__
        if isinstance(getattr(_native, name), type)
        and issubclass(getattr(_native, name), BaseException)
    }
    assert native, "the extension module defines no exception classes"
    assert native <= set(kvpool.__all__), native - set(kvpool.__all__)
    # The hierarchy and the count the Rust side defines (errors.rs, one class per kind).
    assert len(KVPOOL_ERRORS) == 13
    assert issubclass(kvpool.BufferTooSmall, kvpool.InvalidArgument)
    assert issubclass(kvpool.NotRegistered, kvpool.InvalidArgument)
    assert issubclass(kvpool.Error, Exception)


@pytest.mark.parametrize("cls", EXCEPTIONS, ids=lambda c: c.__name__)
def test_exception_pickles(cls):
    # Pickle imports a class by its module and qualified name: that must name this class.
    assert getattr(sys.modules[cls.__module__], cls.__qualname__) is cls
    e = cls("key 'k': something failed", 7)
    e.detail = {"attempt": 2}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(e, protocol=protocol))
        assert type(back) is cls
        assert back.args == e.args
        assert str(back) == str(e)
        assert back.detail == {"attempt": 2}
        if issubclass(cls, kvpool.Error):
            assert isinstance(back, kvpool.Error)
            assert (back.kind, back.code) == (cls.kind, cls.code)


def test_every_kvpool_error_class_carries_kind_and_code():
    seen = {}
    for cls in KVPOOL_ERRORS:
        assert isinstance(cls.kind, str) and isinstance(cls.code, int), cls
        seen[cls.kind] = cls
    assert len(seen) == len(KVPOOL_ERRORS), "two classes share a kind"
    assert (kvpool.NotFound.kind, kvpool.NotFound.code) == ("not_found", -704)
    assert (kvpool.Error.kind, kvpool.Error.code) == ("internal", -1)


def raised_by_kvpool() -> kvpool.Error:
    """An exception as the extension raises it: class, message, and kind and code set on the
    instance."""
    with pytest.raises(kvpool.InvalidArgument) as e:
        _native.Placement(0)
    assert "kind" in vars(e.value) and "code" in vars(e.value)
    return e.value


def test_raised_exception_pickles_with_its_kind_and_code():
    e = raised_by_kvpool()
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is kvpool.InvalidArgument
    assert back.args == e.args and "replica count 0" in str(back)
    assert (back.kind, back.code) == ("invalid_argument", -600)
    assert vars(back) == vars(e)


def test_exceptions_unpickle_in_a_fresh_interpreter(tmp_path):
    # Another process (multiprocessing, a worker pool) has not imported kvpool: unpickling
    # must import it by the classes' names.
    errors = [cls(f"{cls.__name__} message") for cls in EXCEPTIONS] + [raised_by_kvpool()]
    blob = tmp_path / "errors.pickle"
    blob.write_bytes(pickle.dumps(errors))
    code = textwrap.dedent(
        """
        import json, pickle, sys
        errors = pickle.loads(open(sys.argv[1], "rb").read())
        print(json.dumps([[type(e).__module__, type(e).__qualname__, list(e.args),
                           getattr(e, "kind", None), getattr(e, "code", None)] for e in errors]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(blob)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    expected = [
        [type(e).__module__, type(e).__qualname__, list(e.args),
         getattr(e, "kind", None), getattr(e, "code", None)]
        for e in errors
    ]
    assert json.loads(out.stdout) == expected


def cargo_version() -> str:
    """The version in crates/python/Cargo.toml, or the workspace's when it inherits it."""
    package = tomllib.loads((CRATE / "Cargo.toml").read_text())["package"]
    version = package["version"]
    if isinstance(version, dict):
        assert version == {"workspace": True}, version
        workspace = tomllib.loads((REPO / "Cargo.toml").read_text())
        version = workspace["workspace"]["package"]["version"]
    return version


def test_version_is_the_crates():
    assert isinstance(kvpool.__version__, str)
    assert kvpool.__version__ == cargo_version()
    assert kvpool.__version__ == _native.__version__


def mypy(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``mypy --strict ARGS`` run from ``tmp_path`` (so the installed package is what it
    sees, not the source tree), with its cache there too."""
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / ".mypy_cache"),
         *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


USER_SCRIPT = '''
from typing import List, Optional, Tuple

import kvpool
import kvpool.mooncake
from kvpool.mooncake import MooncakeDistributedStore, ReplicateConfig


def native(store: kvpool.Store) -> Tuple[bytes, int, bool, List[Optional[bytes]]]:
    store.put("k", b"value", replicas=2)
    store.put_many([("a", b"1"), (b"b", bytearray(b"2"))])
    buf = bytearray(16)
    n: int = store.get_into("k", buf)
    ptr, size = store.register(buf)
    store.put_from("k2", ptr, size)
    n += store.get_to("k2", ptr, size)
    try:
        value = store.get("k")
    except kvpool.NotFound as e:
        kind: str = e.kind
        code: int = e.code
        value = f"{kind} {code}".encode()
    store.remove("k")
    return value, n, store.exists("k"), store.get_many(["a", "b"])


def mooncake() -> int:
    s = MooncakeDistributedStore()
    rc: int = s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", "127.0.0.1:50051")
    config = ReplicateConfig()
    config.replica_num = 2
    rc = s.put("k", b"v", config) or s.register_buffer(0, 0)
    codes: List[int] = s.batch_get_into(["k"], [0], [1])
    data: bytes = s.get("k")
    return rc + sum(codes) + len(data) + s.is_exist("k") + s.close()


def errors() -> str:
    try:
        with kvpool.Store("127.0.0.1:50051", "/etc/kvpool/pool.key", mode="direct") as store:
            store.healthy()
    except kvpool.Unavailable as e:
        return f"{e.kind}: {e}"
    except kvpool.Error as e:
        return str(e.code)
    except kvpool.ConfigError as e:
        return str(e)
    return kvpool.__version__
'''


def test_user_script_passes_mypy_strict(tmp_path):
    script = tmp_path / "uses_kvpool.py"
    script.write_text(USER_SCRIPT)
    out = mypy(tmp_path, str(script))
    assert out.returncode == 0, f"mypy --strict {script.name}:\n{out.stdout}{out.stderr}"


def test_mypy_sees_kvpool_types(tmp_path):
    # The check above cannot pass by everything being Any: a wrong use must be reported.
    script = tmp_path / "misuses_kvpool.py"
    script.write_text(
        textwrap.dedent(
            """
            import kvpool
            from kvpool.mooncake import MooncakeDistributedStore

            def wrong(store: kvpool.Store) -> None:
                size: str = store.size("k")
                code: str = MooncakeDistributedStore().put("k", b"v")
                store.remove("k", "force")
                print(size, code, kvpool.Error("x").code + "")
            """
        )
    )
    out = mypy(tmp_path, str(script))
    assert out.returncode == 1, f"{out.stdout}{out.stderr}"
    for line in (6, 7, 8, 9):
        assert f"misuses_kvpool.py:{line}: error:" in out.stdout, out.stdout


# The engines' packages the adapters import when present. None is installed where the types
# are checked (scripts/python-env.sh), so their imports carry `type: ignore[import-not-found]`
# (torch is imported through importlib, as Any); under --strict an ignore that is not needed
# fails too, so installing one of them here means revisiting those imports.
ENGINE_PACKAGES = ("vllm", "sglang", "lmcache", "torch")


def test_package_modules_pass_mypy_strict(tmp_path):
    """Every module of the installed package, the engine adapters (kvpool.adapters.*) too."""
    import importlib.util

    present = [p for p in ENGINE_PACKAGES if importlib.util.find_spec(p) is not None]
    assert not present, f"installed in the type-check environment: {present}"
    out = mypy(tmp_path, "-p", "kvpool")
    assert out.returncode == 0, f"mypy --strict -p kvpool:\n{out.stdout}{out.stderr}"
    checked = re.search(r"no issues found in (\d+) source files", out.stdout)
    assert checked, out.stdout
    modules = ["kvpool", "kvpool._config", "kvpool.mooncake", "kvpool._native",
               "kvpool.vllm_serve", "kvpool.adapters", "kvpool.adapters.vllm",
               "kvpool.adapters.vllm_blocks", "kvpool.adapters.sglang", "kvpool.adapters.lmcache"]
    assert int(checked.group(1)) >= len(modules), out.stdout
    # Named modules too, so that a module left out of the package would be reported.
    out = mypy(tmp_path, *[arg for m in modules for arg in ("-m", m)])
    assert out.returncode == 0, f"mypy --strict {' '.join(modules)}:\n{out.stdout}{out.stderr}"


def test_stub_matches_the_extension_module(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "kvpool._native"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"stubtest kvpool._native:\n{out.stdout}{out.stderr}"
