"""The shared fp16 window (``kvquant.methods.window``): sinks, flush rules, read counting, group sizes."""

from types import SimpleNamespace

import pytest
import torch

from kvquant import get_method, method_names
from kvquant.cache import KVGeometry
from kvquant.errors import InvalidParameterError
from kvquant.methods.window import Window, WindowedMethod, whole_bit_widths


def tokens(n: int, start: int = 0) -> torch.Tensor:
    """``[1, 1, n, 2]`` whose token t holds the value t (so the tests can name tokens)."""
    return torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 1, n, 2)


def ids(x: torch.Tensor | None) -> list[int]:
    return [] if x is None else x[0, 0, :, 0].int().tolist()


def geometry(head_dim: int) -> KVGeometry:
    return KVGeometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=head_dim)


def test_tokens_leave_one_at_a_time_after_the_sinks():
    w = Window(3, sink=2)
    assert w.push(tokens(4)) is None and ids(w.sinks) == [0, 1] and ids(w.recent) == [2, 3]
    assert ids(w.push(tokens(3, 4))) == [2, 3] and ids(w.recent) == [4, 5, 6]
    assert ids(w.push(tokens(1, 7))) == [4] and ids(w.sinks) == [0, 1] and w.n_tokens == 5
    assert w.recent.dtype == torch.float16 and w.sinks.dtype == torch.float16


def test_blocks_leave_whole_and_the_newest_token_stays():
    w = Window(4, block=4)
    left = []
    for t in range(13):
        out = w.push(tokens(1, t))
        left += ids(out)
        assert 1 <= w.recent.shape[2] <= 4 and ids(w.recent)[-1] == t
    assert left == list(range(12)) and ids(w.recent) == [12]
    assert ids(Window(4, block=4).push(tokens(10))) == list(range(8))  # ⌊(10 − 1)/4⌋·4 leave at once


def test_held_tensors_own_their_storage_and_never_alias_the_input():
    x = tokens(10).clone()
    w = Window(4, sink=1)
    w.push(x)
    x.zero_()
    assert ids(w.sinks) == [0] and ids(w.recent) == [6, 7, 8, 9]
    for t in w.tensors():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_map_reaches_sinks_and_window():
    w = Window(2, sink=1)
    w.push(torch.randn(3, 2, 5, 4))
    before = [t.clone() for t in w.tensors()]
    w.map(lambda t: t.index_select(0, torch.tensor([2, 0])))
    assert all(torch.equal(a, b[[2, 0]]) for a, b in zip(w.tensors(), before, strict=True))


def test_read_widths_spread_compressed_bytes_exactly_and_count_fp16_at_16():
    w = Window(3, sink=1)
    w.push(torch.randn(2, 3, 10, 4))
    codes = torch.zeros(2, 3, 6, 3, dtype=torch.uint8)  # 6 compressed tokens, 36 bytes per row
    widths = w.read_widths(6, [codes])
    per_token = 2 * 3 * 4
    assert widths == whole_bit_widths(6 * per_token, 8 * codes.numel(), 4 * per_token)
    assert sum(b * n for b, n in widths.items()) == 8 * codes.numel() + 16 * 4 * per_token
    assert widths[16] == 4 * per_token and Window(3).read_widths(0, []) == {}


@pytest.mark.parametrize(
    "name,head_dim,used",
    [("kivi2", 8, 8), ("kivi2", 64, 32), ("kivi2", 96, 32), ("kivi2", 80, 16), ("gear2", 32, 32), ("gear_l4", 8, 8)],
)
def test_default_group_size_adapts_to_the_head_dim(name, head_dim, used):
    """The largest divisor of head_dim ≤ the paper's default that also divides residual (80: 20 would not)."""
    method = get_method(name)
    assert method.group_size is None and method.group_size_for(head_dim) == used
    default = type(method).default_group_size
    assert method.adaptations(geometry(head_dim)) == ({} if used == default else {"group_size": [default, used]})
    assert method.params()["group_size"] is None  # never written back


@pytest.mark.parametrize("name", ["kivi4", "gear2", "gear_l2"])
def test_an_explicit_group_size_that_cannot_divide_is_one_line(name):
    method = get_method(name, group_size=16)
    assert method.group_size_for(32) == 16 and method.adaptations(geometry(32)) == {}
    with pytest.raises(InvalidParameterError, match="group_size 16 does not divide the model's head_dim 8") as e:
        method.group_size_for(8)
    assert "\n" not in str(e.value)


def test_the_adaptation_is_recorded_in_the_cache_not_on_the_method():
    config = SimpleNamespace(num_hidden_layers=2, head_dim=32, hidden_size=128, num_attention_heads=4)
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda decoder=True: config))
    method = get_method("gear2")
    cache = method.new_cache(model)
    assert cache.adaptations == {"group_size": [64, 32]} and method.group_size is None
    cache.update(torch.randn(1, 4, 300, 32), torch.randn(1, 4, 300, 32), 0)
    assert cache.layers[0].group_size == 32 and cache.layers[0].k_stream.store.q.group_size == 32
    assert get_method("gear2", group_size=16).new_cache(model).adaptations == {}


def test_windowed_methods_share_one_parameter_base():
    windowed = [n for n in method_names() if n.startswith(("kivi", "gear"))]
    assert len(windowed) == 9 and all(isinstance(get_method(n), WindowedMethod) for n in windowed)
