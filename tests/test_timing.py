"""``kvquant.analysis.timing``: what a step dispatches (``OpCounter``) and which of it would wait for a GPU."""

import torch

from kvquant.analysis.timing import OpCounter


def test_op_counter_names_the_operators_that_would_wait_for_a_gpu():
    """``syncs``: reading a value (``item``, ``bool``), counting by value (``bincount``), sizing by the data
    (``nonzero``, one-argument ``where``, ``unique``, boolean-mask indexing, ``repeat_interleave`` by a tensor of
    repeats without ``output_size``); not reductions, copies within a device, integer indexing or repeats whose
    output size is given, which a GPU queues without waiting. Counted among all operators, views excepted; on
    CPU tensors only with ``cpu_as_gpu`` (what the same code would wait on with its tensors on a GPU)."""
    x = torch.arange(10)
    with OpCounter(cpu_as_gpu=True) as waits:
        x.sum().item()
        bool(x.any())
        torch.bincount(x)
        torch.where(x > 3)
        x.unique()
        x[x > 3]
        torch.repeat_interleave(x, torch.ones(10, dtype=torch.long))
    assert waits.syncs == {
        "_local_scalar_dense": 2, "bincount": 1, "nonzero": 1, "_unique2": 1, "index": 1, "repeat_interleave": 1
    }  # fmt: skip
    with OpCounter(cpu_as_gpu=True) as queued:
        torch.aminmax(x)
        x[torch.tensor([1, 2])]
        torch.repeat_interleave(x, torch.ones(10, dtype=torch.long), output_size=10)
        torch.empty(10, dtype=torch.long).copy_(x)
        x.view(2, 5).t()
    assert not queued.syncs and queued.counts["index"] == 1 and queued.counts["repeat_interleave"] == 1
    assert "t" not in queued.counts and "view" not in queued.counts  # views launch nothing
    assert waits.total == sum(waits.counts.values()) > sum(waits.syncs.values())
    with OpCounter() as on_cpu:  # by default only operators on CUDA tensors (and copies across) count
        x.sum().item()
        torch.bincount(x)
    assert on_cpu.total == 3 and not on_cpu.syncs
