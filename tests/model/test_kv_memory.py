import mmap

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

import pytest
import torch

from prelude.config import Populate
from prelude.model.attention import kv_memory
from prelude.model.attention.kv_memory import populate_in_background, populate_write_works, zeroed_kv_tensors


def test_cpu_kv_tensors_read_as_zero_and_do_not_alias() -> None:
    shape = (7, 16, 3, 8)
    tensors = zeroed_kv_tensors(4, shape, torch.bfloat16, torch.device("cpu"))
    assert len(tensors) == 4
    for t in tensors:
        assert t.shape == shape and t.dtype == torch.bfloat16
        assert not t.any()
    tensors[1][2, 5] = 1.5
    tensors[2].fill_(-3.0)
    assert tensors[1][2, 5].eq(1.5).all() and tensors[1].count_nonzero() == 3 * 8
    assert not tensors[0].any() and not tensors[3].any()
    assert tensors[2].eq(-3.0).all()


def test_empty_shapes_fall_back_to_plain_zeros() -> None:
    assert zeroed_kv_tensors(0, (2, 2), torch.float32, torch.device("cpu")) == []
    (t,) = zeroed_kv_tensors(1, (0, 4), torch.float32, torch.device("cpu"))
    assert t.shape == (0, 4)


@pytest.mark.skipif(not hasattr(mmap, "MAP_POPULATE") or resource is None, reason="needs Linux's MAP_POPULATE")
def test_a_populated_pool_takes_no_page_faults_when_first_written() -> None:
    """A serving engine's pool (CacheConfig.populate_kv): its pages are there before the
    first K/V write, which then faults nothing; a lazy pool faults at every new page."""
    shape = (64, 16, 8, 64)  # 2 tensors x 1 MiB of bf16 = 512 pages of 4 KiB
    pages = 2 * 64 * 16 * 8 * 64 * 2 // 4096

    def faults_of_first_write(populate: Populate) -> int:
        tensors = zeroed_kv_tensors(2, shape, torch.bfloat16, torch.device("cpu"), populate=populate)
        assert not any(t.any() for t in tensors)  # zeros either way (a lazy one maps the zero page)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for t in tensors:
            t.fill_(1.0)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    lazy, populated = faults_of_first_write("off"), faults_of_first_write("start")
    assert lazy >= pages // 2  # one per page (fewer only with huge pages)
    assert populated <= pages // 10


@pytest.mark.skipif(resource is None or not populate_write_works(), reason="needs Linux 5.14+'s MADV_POPULATE_WRITE")
def test_a_pool_populated_in_the_background_keeps_its_zeros_and_what_was_written_meanwhile() -> None:
    """The thread fills the page tables without writing: values written before or while it
    runs stay, unwritten ones read zero, and once it is done first writes fault nothing."""
    shape = (64, 16, 8, 64)
    pages = 2 * 64 * 16 * 8 * 64 * 2 // 4096
    k, v = zeroed_kv_tensors(2, shape, torch.bfloat16, torch.device("cpu"))  # lazy: nothing faulted yet
    k[3].fill_(2.5)  # a request's K/V, written before the pages are filled
    flat = torch.empty(0, dtype=torch.bfloat16).set_(k.untyped_storage(), 0, (2 * k.numel(),))  # the whole mapping
    assert flat.data_ptr() == k.data_ptr() and flat.numel() == 2 * k.numel()
    populate_in_background(flat).join()
    assert k[3].eq(2.5).all() and k[:3].count_nonzero() == 0 and k[4:].count_nonzero() == 0
    assert v.count_nonzero() == 0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    k.fill_(1.0)
    v.fill_(1.0)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before <= pages // 10


def test_background_falls_back_to_faulting_at_start_where_the_kernel_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_memory, "populate_write_works", lambda: False)
    started: list[object] = []
    monkeypatch.setattr(kv_memory, "populate_in_background", started.append)
    k, v = zeroed_kv_tensors(2, (4, 16, 2, 8), torch.float32, torch.device("cpu"), populate="background")
    assert not started and not k.any() and not v.any()
    monkeypatch.setattr(kv_memory, "populate_write_works", lambda: True)
    zeroed_kv_tensors(2, (4, 16, 2, 8), torch.float32, torch.device("cpu"), populate="background")
    assert len(started) == 1
