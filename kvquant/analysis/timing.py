"""Time of one decode step on the cache a user gets: its KV part alone (store the new token, read,
attend: ``decode_step_time``), or a whole model's step (``model_step_time``).

Each method's cache is built through its own ``new_cache`` (so on the backend its ``backend``
parameter resolves to: the C++ kernels, CuPy or the torch reference) for a one-layer model of the
attention shape, filled with synthetic tokens untimed, then timed on ``update`` of one more token
plus attention (the layer's own ``attend`` when it reads inside attention, else transformers' SDPA
on what ``update`` returned), step after step; the first timed step leaves ``context`` tokens held.
``hf_dynamic`` is transformers' ``DynamicCache`` layer with SDPA on its fp32 tensors: the outside
reference.

Synthetic K/V: keys have per-channel scales drawn log-normally plus a few outlier channels (as real
keys do — it is what AlignedKV's key rule and KIVI's per-channel groups respond to), values are
Gaussian; seeded, so every method reads the same tensors. ``batch`` sequences are timed together.

``model_step_time``: a random-weight model of a hub model's layout (``LAYOUTS``: its config.json's
sizes, no weights downloaded; fp16 on a GPU, fp32 on a CPU, as the models run), every layer's cache
filled with synthetic K/V untimed, then one token per sequence through the whole model, timed: what a
user's decode step costs, weights and all, against ``DynamicCache`` on the same model.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvquant.attention import take_reader

SHAPES = {  # name: (query heads, KV heads, head_dim)
    "smollm2_135m": (9, 3, 64),
    "llama2_7b": (32, 32, 128),
    "llama3.1_8b": (32, 8, 128),
    "stories260k": (8, 4, 8),
}
HF_DYNAMIC = "hf_dynamic"
LAYOUTS = {  # name: LlamaConfig sizes of the hub model (RoPE without scaling: time does not depend on it)
    "stories260k": {
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 5,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "vocab_size": 512,
        "tie_word_embeddings": True,
    },
    "smollm2_135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
    "llama2_7b": {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    "llama3.1_8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
}


@dataclass(frozen=True)
class StepTime:
    """Median seconds of one step, bits read per element, bytes read per step, the backend used; for a
    whole model's step also the torch operators it dispatched per layer (``OpCounter``)."""

    seconds: float
    bits_read: float
    bytes_read: float
    backend: str
    ops_per_layer: float | None = None
    launches_per_layer: float | None = None  # a kernel backend's own launches, where it counts them (CuPy)
    profile: str | None = None  # one more step under torch.profiler (``model_step_time(profile=True)``)
    syncs_per_layer: float | None = None  # of ``ops_per_layer``, those that wait for a GPU (``syncs_host``; on a
    # CPU, those that would with the step's tensors on one)


#: operators whose CUDA implementation reads the device's values back before it returns (a host sync): ``item``,
#: ``bool(t)``, and those that size their output by the data (``bincount`` reads its min and max)
SYNCING_OPS = frozenset(
    {
        "_local_scalar_dense",
        "is_nonzero",
        "equal",
        "bincount",
        "nonzero",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
    }
)


def syncs_host(func: Any, args: tuple, kwargs: dict, cpu_as_gpu: bool = False) -> bool:
    """Whether dispatching ``func`` makes the host wait for a GPU: ``SYNCING_OPS``, indexing by a boolean mask (a
    ``nonzero`` inside) and ``repeat_interleave`` by a tensor of repeats without ``output_size``, on CUDA
    tensors; a copy from a CUDA tensor to the host, and one from the host to a GPU unless ``non_blocking`` (torch
    synchronises the stream after it). ``cpu_as_gpu``: CPU operands count as a GPU's, so a run on the CPU names
    what the same code would wait on with its tensors on a GPU (an upper bound: tensors a method keeps on the CPU
    count too; the copies, which a CPU run makes none of, cannot be seen)."""
    name = func.overloadpacket.__name__
    tensors = [x for x in (*args, *(args[1] if name == "index" else ())) if isinstance(x, torch.Tensor)]
    on_gpu = cpu_as_gpu or any(t.is_cuda for t in tensors)
    if name in SYNCING_OPS:
        return on_gpu
    if name == "index":
        masks = (torch.bool, torch.uint8)
        return on_gpu and any(isinstance(i, torch.Tensor) and i.dtype in masks for i in args[1] if i is not None)
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else args[0]
        return on_gpu and isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name in ("_to_copy", "copy_"):  # across the host/device boundary: torch waits unless non_blocking
        if name == "_to_copy":
            src, dst, non_blocking = args[0], kwargs.get("device"), kwargs.get("non_blocking", False)
        else:
            src, dst = args[1], args[0].device
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if not isinstance(src, torch.Tensor) or dst is None:
            return False
        dst = torch.device(dst).type
        return (src.is_cuda and dst == "cpu") or (src.device.type == "cpu" and dst == "cuda" and not non_blocking)
    return False


class OpCounter(TorchDispatchMode):
    """Counts the torch operators dispatched while it is active, views excepted (they launch nothing), and
    among them those that would wait for a GPU (``syncs``, by ``syncs_host``).

    On a GPU nearly every counted operator is a kernel launch or a host sync (``item``; allocations such as
    ``empty`` are counted too): at batch 1 a decode step is bound by them, so this count, the same on every
    machine, says where a cache's step loses to ``DynamicCache``'s before any timing does. A sync is worse than
    a launch: the host waits for every kernel queued before it, so a layer that syncs keeps the host from running
    ahead of the device. It is one step's: a step that flushes a block (KIVI's keys) or regrows a buffer
    dispatches more. A kernel backend's own launches (CuPy, C++) are not torch operators and are not counted.
    """

    def __init__(self, cpu_as_gpu: bool = False) -> None:
        super().__init__()
        self.cpu_as_gpu = cpu_as_gpu  # ``syncs_host``'s: count a CPU run's syncs as if its tensors were on a GPU
        self.counts: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view and func is not torch.ops.aten._unsafe_view.default:
            self.counts[func.overloadpacket.__name__] += 1
            if syncs_host(func, args, kwargs, self.cpu_as_gpu):
                self.syncs[func.overloadpacket.__name__] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@functools.cache
def shape_model(shape: str, device: str = "cpu") -> Any:
    """A one-layer Llama with the attention shape ``shape`` (random weights): what ``new_cache`` needs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hq, hkv, d = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=8,
        hidden_size=hq * d,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=d,
        max_position_embeddings=1 << 17,
    )
    return LlamaForCausalLM(config).eval().to(device)


@functools.cache
def layout_model(layout: str, device: str = "cpu", layers: int = 0) -> Any:
    """A random-weight Llama of the hub model ``layout`` (``LAYOUTS``; ``layers`` > 0 keeps that many
    layers), built on ``device`` in the dtype it runs in there (fp16 on a GPU, fp32 on a CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = dict(LAYOUTS[layout])
    if layers:
        sizes["num_hidden_layers"] = int(layers)
    config = LlamaConfig(**sizes, max_position_embeddings=1 << 17)
    dtype = torch.float32 if device == "cpu" else torch.float16
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()


def kv_geometry(shape: str) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of an attention shape or a layout."""
    if shape in SHAPES:
        return SHAPES[shape]
    sizes = LAYOUTS[shape]
    return sizes["num_attention_heads"], sizes["num_key_value_heads"], sizes["head_dim"]


def synthetic_kv(
    shape: str, n: int, seed: int = 0, batch: int = 1, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[batch, Hkv, n, D]`` with log-normal channel scales and 2 outlier channels per head; values
    Gaussian; drawn on ``device`` by its own generator (a GPU's 32K-token history in milliseconds)."""
    _, hkv, d = kv_geometry(shape)
    gen = torch.Generator(device=device).manual_seed(seed)
    scale = torch.exp(0.6 * torch.randn(1, hkv, 1, d, generator=gen, device=device))
    scale[..., torch.randint(0, d, (2,), generator=gen, device=device)] *= 8.0
    keys = torch.randn(batch, hkv, n, d, generator=gen, device=device) * scale + 0.5 * scale
    return keys, torch.randn(batch, hkv, n, d, generator=gen, device=device)


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second of a large ``copy_`` (read plus write, counted once): the memory system's pace."""
    src = torch.ones(mib << 18)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return src.numel() * src.element_size() / statistics.median(times[1:])


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere): timings name their machine."""
    import platform
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _bits(counts) -> tuple[float, int]:
    n = sum(counts.read_k.values()) + sum(counts.read_v.values())
    bits = sum(w * c for w, c in (counts.read_k + counts.read_v).items()) + counts.meta_bits_k + counts.meta_bits_v
    return bits, n


def decode_step_time(
    method: Any,
    shape: str,
    context: int,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
    device: str = "cpu",
    batch: int = 1,
) -> StepTime:
    """One decode step's KV work at ``context`` tokens through ``method``'s cache (None: ``DynamicCache``)."""
    from transformers import DynamicCache

    hq, _, d = SHAPES[shape]
    model = shape_model(shape, device)
    if context < warmup + 2:
        raise ValueError(f"context must be >= {warmup + 2}, got {context}")
    keys, values = (t.to(device) for t in synthetic_kv(shape, context + repeats, seed, batch))
    query = torch.randn(batch, hq, 1, d, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    module = model.model.layers[0].self_attn
    scaling = d**-0.5
    scope = method.attach(model) if method is not None else contextlib.nullcontext()
    with scope:
        cache = method.new_cache(model) if method is not None else DynamicCache(config=model.config)
        layer = cache.layers[0]
        fill = context - 1 - warmup  # so the first timed step leaves exactly ``context`` tokens held
        layer.update(keys[:, :, :fill], values[:, :, :fill])
        times, bits, elements = [], 0.0, 0
        for i in range(warmup + repeats):
            t = fill + i
            before = _bits(layer.counts()) if method is not None else (0.0, 0)
            start = time.perf_counter()
            k, v = layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
            reader = take_reader(k)  # a layer that reads inside attention
            if reader is not None:
                reader.attend(module, query, None, scaling=scaling)
            else:
                sdpa_attention_forward(module, query, k, v, None, scaling=scaling)
            if device != "cpu":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times.append(elapsed)
                if method is not None:
                    after = _bits(layer.counts())
                    bits, elements = bits + after[0] - before[0], elements + after[1] - before[1]
                else:  # fp32 K and V, all of them
                    bits, elements = bits + 32.0 * 2 * k.numel(), elements + 2 * k.numel()
    backend = getattr(cache, "backend", None) or "torch"
    return StepTime(statistics.median(times), bits / max(elements, 1), bits / 8 / repeats, backend)


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


@torch.no_grad()
def model_step_time(
    method: Any,
    layout: str,
    context: int,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
    device: str = "cpu",
    batch: int = 1,
    layers: int = 0,
    profile: bool = False,
) -> StepTime:
    """One whole decode step (one token per sequence through every layer) at ``context`` tokens, on a
    random-weight model of ``layout`` with ``method``'s cache (None: ``DynamicCache``); ``bits_read`` and
    ``bytes_read`` over every layer's K/V; ``profile``: one more step under ``torch.profiler``, its operators
    by host time (where a batch-1 step on a GPU spends it). The synthetic history is drawn on ``device`` (so its numbers
    differ between a CPU and a GPU; timing does not depend on them)."""
    from transformers import DynamicCache

    model = layout_model(layout, device, layers)
    if context < warmup + 2:
        raise ValueError(f"context must be >= {warmup + 2}, got {context}")
    dtype = next(model.parameters()).dtype
    fill = context - 1 - warmup  # so the first timed step leaves exactly ``context`` tokens held
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (warmup + repeats, batch, 1), generator=gen).to(device)
    scope = method.attach(model) if method is not None else contextlib.nullcontext()
    with scope:
        cache = method.new_cache(model) if method is not None else DynamicCache(config=model.config)
        keys, values = (t.to(dtype) for t in synthetic_kv(layout, fill, seed, batch, device))
        for layer in cache.layers:  # untimed: every layer stores the same synthetic history
            layer.update(keys, values)
        del keys, values
        times, bits, elements = [], 0.0, 0
        for i in range(warmup + repeats):
            t = fill + i
            before = [_bits(layer.counts()) for layer in cache.layers] if method is not None else []
            position = torch.full((batch, 1), t, device=device)
            _sync(device)
            start = time.perf_counter()
            model(input_ids=ids[i], past_key_values=cache, position_ids=position, use_cache=True)
            _sync(device)
            elapsed = time.perf_counter() - start
            if i < warmup:
                continue
            times.append(elapsed)
            if method is not None:
                for layer, (b0, n0) in zip(cache.layers, before, strict=True):
                    b1, n1 = _bits(layer.counts())
                    bits, elements = bits + b1 - b0, elements + n1 - n0
            else:  # every K and V element, at the model's width
                n = 2 * sum(layer.keys.numel() for layer in cache.layers)
                bits, elements = bits + 8.0 * dtype.itemsize * n, elements + n
        backend = getattr(cache, "backend", None) or "torch"
        count = launch_counter(backend)
        position = torch.full((batch, 1), fill + warmup + repeats, device=device)
        launched = count() if count else 0
        with OpCounter(cpu_as_gpu=device == "cpu") as counter:  # one more step, untimed: what it dispatched
            model(input_ids=ids[-1], past_key_values=cache, position_ids=position, use_cache=True)
        _sync(device)
        table = None
        if profile:
            position = position + 1
            kwargs = {"input_ids": ids[-1], "past_key_values": cache, "position_ids": position, "use_cache": True}
            table = profiled(lambda: model(**kwargs), device)
    layers = model.config.num_hidden_layers
    launches = (count() - launched) / layers if count else None
    seconds, bits_read = statistics.median(times), bits / max(elements, 1)
    syncs = sum(counter.syncs.values()) / layers
    return StepTime(seconds, bits_read, bits / 8 / repeats, backend, counter.total / layers, launches, table, syncs)


def profiled(step: Callable[[], Any], device: str, rows: int = 15) -> str:
    """``step()`` under ``torch.profiler`` (CUDA activity too on a GPU): its operators by host time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    try:
        with torch_profile(activities=activities) as prof:
            step()
            _sync(device)
    except RuntimeError as err:  # a profiler that cannot start (no CUPTI) must not fail the timing around it
        return f"(not profiled: {str(err).splitlines()[0] if str(err) else type(err).__name__})"
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def launch_counter(backend: str) -> Callable[[], int] | None:
    """The kernel backend's count of its own launches (``launch_count``, where it keeps one), else None."""
    from kvquant.backends import get_backend

    found = get_backend(backend) if backend != "torch" else None
    return found.kernel("launch_count") if found is not None else None
