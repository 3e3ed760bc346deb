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
