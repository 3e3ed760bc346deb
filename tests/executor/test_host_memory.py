"""The malloc thresholds a CPU runner sets (executor/host_memory.py): applied once through
mallopt with glibc, and left alone when switched off or set by the user."""

from __future__ import annotations

import ctypes
import platform

import pytest

from prelude.executor import host_memory


class _FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


@pytest.fixture
def libc(monkeypatch: pytest.MonkeyPatch) -> _FakeLibc:
    fake = _FakeLibc()
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: fake)
    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
    for name in (host_memory.SWITCH, *host_memory._USER_SET):
        monkeypatch.delenv(name, raising=False)
    return fake


def test_thresholds_set_once(libc: _FakeLibc) -> None:
    assert host_memory.keep_freed_activations()
    assert host_memory.keep_freed_activations()
    assert libc.calls == [(host_memory.M_MMAP_THRESHOLD, 32 << 20), (host_memory.M_TRIM_THRESHOLD, 64 << 20)]


@pytest.mark.parametrize("env", [(host_memory.SWITCH, "0"), ("MALLOC_TRIM_THRESHOLD_", "1000000"),
                                 ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1")])
def test_left_alone_when_off_or_set_by_the_user(libc: _FakeLibc, monkeypatch: pytest.MonkeyPatch,
                                                env: tuple[str, str]) -> None:
    monkeypatch.setenv(*env)
    assert not host_memory.keep_freed_activations()
    assert libc.calls == []


def test_left_alone_without_glibc(libc: _FakeLibc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert not host_memory.keep_freed_activations()
    assert libc.calls == []


def test_a_refused_value_reports_not_applied(libc: _FakeLibc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(libc, "mallopt", lambda param, value: 0)
    assert not host_memory.keep_freed_activations()


def test_the_real_libc_takes_them() -> None:
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(host_memory.M_MMAP_THRESHOLD, host_memory.MMAP_BYTES) == 1
    assert libc.mallopt(host_memory.M_TRIM_THRESHOLD, host_memory.TRIM_BYTES) == 1
