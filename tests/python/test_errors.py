"""kvwire's exceptions come from one table (kvwire.errors): each derives from KvwireError and
from the builtin of the same meaning, kvwire re-exports them all, the native module raises
them, and code that knows only the builtins catches them."""

import builtins
import os
import re
import time

import pytest

import kvwire
from kvwire import errors

# What each class must also be, beyond KvwireError (None: nothing else).
BUILTIN = {
    "IoError": OSError,
    "ProtocolError": None,
    "VersionMismatchError": None,
    "AuthError": PermissionError,
    "OutOfBoundsError": IndexError,
    "UnknownRegionError": LookupError,
    "StaleRegionError": LookupError,
    "AccessDeniedError": PermissionError,
    "PeerDeadError": ConnectionError,
    "TimeoutError": builtins.TimeoutError,
    "ShutdownError": None,
    "InvalidArgumentError": ValueError,
    "UnsupportedError": NotImplementedError,
    "ResourceLimitError": None,
    "FencedError": ConnectionRefusedError,
    "ConnectorError": None,
    "AbortedError": None,
    "LayerStreamError": None,
    "CudaError": None,
}


def test_every_class_is_a_kvwire_error_and_its_builtin():
    names = [name for name, _, _ in errors.TABLE]
    assert names[0] == "KvwireError" and sorted(names[1:]) == sorted(BUILTIN)
    assert issubclass(kvwire.KvwireError, Exception)
    assert kvwire.KvwireError.__module__ == "kvwire"
    for name, builtin in BUILTIN.items():
        cls = getattr(kvwire, name)
        assert cls is getattr(errors, name), name
        assert issubclass(cls, kvwire.KvwireError), name
        assert cls.__name__ == name and cls.__module__ == "kvwire"
        assert cls.__doc__, name
        if builtin is not None:
            assert issubclass(cls, builtin), (name, builtin)
        # Raised with a message, as the native module does.
        e = cls("boom")
        assert str(e) == "boom"
        with pytest.raises(kvwire.KvwireError):
            raise e


def test_kvwire_all_is_built_from_the_table():
    for name in errors.__all__:
        assert name in kvwire.__all__
        assert getattr(kvwire, name) is getattr(errors, name)
    assert len(kvwire.__all__) == len(set(kvwire.__all__))


def test_the_type_stub_is_made_from_the_table():
    stub = os.path.join(os.path.dirname(errors.__file__), "errors.pyi")
    with open(stub, encoding="utf-8") as f:
        assert f.read() == errors._stub(), "run `python errors.py > errors.pyi` in ffi/python/kvwire"


def test_the_native_module_raises_only_classes_of_the_table():
    # ffi/src/errors.rs names the classes it raises; each must be in the table.
    src = os.path.join(os.path.dirname(__file__), "..", "..", "ffi", "src", "errors.rs")
    if not os.path.exists(src):
        pytest.skip("source tree not available")
    with open(src, encoding="utf-8") as f:
        text = f.read()
    listed = re.search(r"from_errors_module!\((.*?)\);", text, re.S)
    assert listed, "the list of raised classes moved"
    raised = {n.strip() for n in listed.group(1).split(",") if n.strip()}
    assert raised == {name for name, _, _ in errors.TABLE}


def test_an_engine_timeout_is_a_builtin_timeout_error():
    e = kvwire.Engine()
    try:
        with pytest.raises(TimeoutError) as info:
            e.get_notification(timeout=0.01)
        assert isinstance(info.value, kvwire.TimeoutError)
        with pytest.raises(OSError):  # TimeoutError is an OSError
            e.get_notification(timeout=0.0)
    finally:
        e.shutdown()


def test_a_dead_peer_is_a_connection_error():
    a = kvwire.Engine()
    b = kvwire.Engine()
    try:
        b.alloc(4096, "rw")
        p = a.connect(b.listen_addr)
        src = a.alloc(4096, "local")
        dst = p.regions()[0]
        b.shutdown()
        deadline = time.monotonic() + 10
        while p.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ConnectionError) as info:
            a.write(p, [(src, 0, dst, 0, 16)]).wait(timeout=5)
        assert isinstance(info.value, kvwire.PeerDeadError)
    finally:
        a.shutdown()
        b.shutdown()


def test_bad_arguments_are_value_errors_and_refused_connects_os_errors():
    e = kvwire.Engine()
    try:
        with pytest.raises(ValueError):
            e.alloc(16, "sideways")
        # A refused connect is an operating-system error (kvwire.IoError).
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        with pytest.raises(OSError) as info:
            e.connect(f"127.0.0.1:{port}")
        assert isinstance(info.value, kvwire.IoError)
    finally:
        e.shutdown()
