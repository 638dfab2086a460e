"""The shared fp16 window (``kvquant.methods.window``): sinks, flush rules, read counting, group sizes."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvquant import get_method, method_names
from kvquant.cache import KVGeometry
from kvquant.errors import InvalidParameterError
from kvquant.formats.base import whole_bit_widths
from kvquant.formats.window import Window
from kvquant.methods.window import WindowedMethod


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


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["kivi2", "kivi4", "gear2", "gear_l4"])
def test_the_cpu_kernels_follow_the_torch_path(stories, name):
    """``backend=cpu`` attends over the codes as stored: along the torch path's greedy tokens the mean
    KL between the two is below 1e-6 (measured 3-4e-8; the methods' own KL to fp16 here is 1e-4 to
    8e-3 — fp32 differences upstream flip the odd code at a rounding boundary, so logits are not
    equal to fp32 accuracy, the kernels themselves are tested to be in test_kernels_cpu), its own
    greedy run first differs (if ever) at a near-tie, what is stored and read is the same, and beam
    search (a reorder every step) runs."""
    from conftest import assert_kernels_follow_torch, require_kernels_cpu
    from test_kivi import beam_search_runs

    require_kernels_cpu()
    model, tok = stories
    assert_kernels_follow_torch(model, tok, name, group_size=8, residual=16)
    with get_method(name, backend="cpu").attach(model) as routed:
        beam_search_runs(routed, tok, get_method(name, backend="cpu"))


@pytest.mark.parametrize("name", ["kivi2", "gear2"])
def test_prompt_chunks_on_the_kernel_backend_attend_as_the_torch_path_does(stories, name, monkeypatch):
    """A chunk of ``PROMPT_QUERIES`` or more queries dequantizes the history once for stock attention
    on both backends: chunked prefill gives bit-identical logits; shorter chunks go through the kernel."""
    from conftest import require_kernels_cpu

    import kernels_cpu.ops
    from kvquant.methods import window

    require_kernels_cpu()
    model, tok = stories
    ids = tok(" ".join(["Once upon a time, a little fox ran into the woods."] * 12), return_tensors="pt").input_ids
    calls = []
    real = kernels_cpu.ops.attend_kivi if name == "kivi2" else kernels_cpu.ops.attend_gear
    monkeypatch.setattr(kernels_cpu.ops, f"attend_{name[:4]}", lambda *a, **k: calls.append(1) or real(*a, **k))
    for chunk, kernel_calls in ((window.PROMPT_QUERIES, 0), (window.PROMPT_QUERIES - 1, 1)):
        logits = {}
        for backend in ("torch", "cpu"):
            calls.clear()
            method = get_method(name, group_size=8, residual=16, backend=backend)
            with method.attach(model), torch.no_grad():
                cache = method.new_cache(model)
                parts = [model(ids[:, i : i + chunk], past_key_values=cache).logits for i in range(0, 4 * chunk, chunk)]
            logits[backend] = torch.cat(parts, 1)
            assert bool(calls) == (backend == "cpu" and kernel_calls > 0)
        if kernel_calls:  # close, not equal: an fp32 difference flips the odd code at a rounding boundary
            assert (logits["cpu"] - logits["torch"]).abs().max() < 0.05
        else:
            assert torch.equal(logits["cpu"], logits["torch"])


@pytest.mark.parametrize("backend", ["cpu", "auto"])
def test_models_the_kernels_cannot_run_are_refused_or_fall_back(backend, capsys, monkeypatch):
    """Sliding windows and soft-capped logits: ``cpu`` is one line of error, ``auto`` the torch path
    with one warning line."""
    monkeypatch.setattr("kvquant.backends._WARNED", set())  # each fallback line is said once per process
    from conftest import require_kernels_cpu

    require_kernels_cpu()
    config = SimpleNamespace(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_size=64,
        sliding_window=32,
        model_type="mistral",
    )
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda decoder=True: config), device="cpu")
    method = get_method("kivi2", backend=backend)
    if backend == "cpu":
        with pytest.raises(InvalidParameterError, match="backend=cpu cannot run this model: .*sliding-window"):
            method.new_cache(model)
        return
    assert method.new_cache(model).backend == "torch"
    assert "uses torch" in capsys.readouterr().err


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.sampled_from([1, 16, 64]), st.sampled_from([1, 2]))
def test_a_row_buffer_holds_what_was_appended_with_bounded_slack(sizes, block, dim):
    """``RowBuffer``: the held view is every row appended, in order, and the room left is under
    ``max(block, 2·n) + block`` rows (``n`` the largest append); ``reset`` holds exactly the tensor given."""
    from kvquant.formats.base import RowBuffer

    rows, parts = RowBuffer(block, dim=dim), []
    for i, n in enumerate(sizes):
        shape = (2, 3, n, 4) if dim == 2 else (2, n, 5)
        position = torch.arange(n).reshape([n if d == dim else 1 for d in range(len(shape))])
        parts.append(torch.full(shape, 1000.0 * i) + position)
        held = rows.append(parts[-1])
        assert torch.equal(held, torch.cat(parts, dim=dim)) and rows.holds(held)
        assert 0 <= rows.buffer.shape[dim] - rows.rows < max(block, 2 * max(sizes[: i + 1])) + block
    rows.reset(held.narrow(dim, 0, 1).clone())
    assert rows.rows == 1 and not rows.holds(held)


@pytest.mark.parametrize(("size", "block", "most"), [(1, 64, 1 + 500 // 64), (128, 64, 1 + 20 // 2), (16, 64, 6)])
def test_a_row_buffer_regrows_once_a_block_or_every_other_big_append(size, block, most):
    """Single tokens regrow the buffer once per ``block``; appends bigger than a block (KIVI's key flushes of
    128 tokens) fit twice before the next regrowth, instead of regrowing (copying the history) every time."""
    from kvquant.formats.base import RowBuffer

    rows, buffers = RowBuffer(block), []
    for _ in range(500 if size == 1 else 20):
        rows.append(torch.zeros(1, 2, size, 8))
        if rows.buffer is not (buffers[-1] if buffers else None):
            buffers.append(rows.buffer)
    assert len(buffers) <= most
