import mmap

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

import pytest
import torch

from prelude.model.kv_memory import zeroed_kv_tensors


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

    def faults_of_first_write(populate: bool) -> int:
        tensors = zeroed_kv_tensors(2, shape, torch.bfloat16, torch.device("cpu"), populate=populate)
        assert not any(t.any() for t in tensors)  # zeros either way (a lazy one maps the zero page)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for t in tensors:
            t.fill_(1.0)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    lazy, populated = faults_of_first_write(False), faults_of_first_write(True)
    assert lazy >= pages // 2  # one per page (fewer only with huge pages)
    assert populated <= pages // 10
