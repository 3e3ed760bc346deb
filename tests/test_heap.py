"""The start-up heap freeze (heap.py): garbage made before it is still
collected, what is alive then is frozen, and cycles made after it stay collectable."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from prelude.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()  # the rest of the test process collects as before


def test_garbage_before_the_freeze_is_collected_and_the_living_heap_frozen(unfrozen: None) -> None:
    dead, alive = _Node(), _Node()
    gone = weakref.ref(dead)
    del dead
    frozen = freeze_startup_heap()
    assert gone() is None  # collected first, not frozen for the process's life
    # other threads of the test process (earlier tests' servers winding down) may free frozen
    # objects meanwhile, never freeze more: the count can only have dropped
    assert 0 < gc.get_freeze_count() <= frozen
    assert not any(obj is alive for obj in gc.get_objects())  # moved out of the generations a pass walks
    later = _Node()
    later_ref = weakref.ref(later)
    del later
    gc.collect()
    assert later_ref() is None  # cycles made while serving are still freed


def test_native_heap_trim_runs_at_most_once_an_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    from prelude import heap

    calls: list[int] = []
    now = [100.0]
    monkeypatch.setattr(heap.time, "monotonic", lambda: now[0])
    trim = heap.NativeHeapTrim(every_s=5.0)
    trim._trim = calls.append  # the C call, recorded
    assert not trim.maybe()  # the interval counts from construction
    now[0] += 5.0
    assert trim.maybe() and calls == [0]  # malloc_trim(0): every arena, keep no pad
    now[0] += 4.9
    assert not trim.maybe()
    now[0] += 0.2
    assert trim.maybe() and trim.trims == 2


def test_native_heap_trim_calls_the_c_heap_where_there_is_one() -> None:
    from prelude import heap

    trim = heap.NativeHeapTrim(every_s=0.0)
    if trim._trim is None:
        pytest.skip("not glibc: no malloc_trim")
    assert trim.maybe() and trim.trims == 1


def test_collection_is_paused_for_startup_and_resumed_by_the_freeze_or_on_leaving(unfrozen: None) -> None:
    from prelude.heap import collection_paused_for_startup

    assert gc.isenabled()
    with collection_paused_for_startup():
        assert not gc.isenabled()
        freeze_startup_heap()  # ready to serve: collected once, frozen, resumed
        assert gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collection_paused_for_startup():
        assert not gc.isenabled()
        raise RuntimeError("a start-up that fails before it serves")
    assert gc.isenabled()  # not left paused for the rest of the process


def test_freeze_imports_freezes_without_a_pass_and_the_ready_pass_walks_only_what_came_after(unfrozen: None) -> None:
    from prelude.heap import collection_paused_for_startup, freeze_imports

    with collection_paused_for_startup():
        from_imports = _Node()
        import_garbage = weakref.ref(from_imports)
        del from_imports
        freeze_imports()
        assert import_garbage() is not None  # frozen with the modules, not collected: the price heap.py states
        assert not any(obj is import_garbage() for obj in gc.get_objects())
        from_loading = _Node()
        loading_garbage = weakref.ref(from_loading)
        del from_loading
        kept = _Node()
        freeze_startup_heap()
        assert loading_garbage() is None  # what loading left unreachable is still collected at ready
        assert not any(obj is kept for obj in gc.get_objects())
        assert gc.isenabled()


def test_serve_pauses_collection_until_ready_but_not_in_the_api_server_supervisor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prelude import cli, log_format, startup

    seen: dict[str, bool] = {}

    def recorder(name: str):  # noqa: ANN202
        def record(args: object) -> int:
            seen[name] = gc.isenabled()
            return 0
        return record

    monkeypatch.setattr(startup, "check_serve_args", lambda args: None)
    monkeypatch.setattr(log_format, "configure_logging", lambda *a, **k: None)  # the test process's handlers stay
    monkeypatch.setattr(cli, "_serve", recorder("serve"))
    monkeypatch.setattr(cli, "_serve_multiproc", recorder("supervisor"))
    assert cli.main(["serve"]) == 0
    assert seen == {"serve": False} and gc.isenabled()
    monkeypatch.setattr(cli, "_serve", lambda args: cli._serve_multiproc(args))
    assert cli.main(["serve", "--api-server-count", "2"]) == 0
    assert seen["supervisor"] is True  # it loads nothing and never freezes, so it is never paused
    assert gc.isenabled()
