"""AQUA-KV and HIGGS caches on stories260k: calibration, predictor files, storage, RoPE, consistency."""

import hashlib
import json
import pickle
import warnings

import pytest
import torch
from conftest import ROOT
from test_kivi import beam_search_runs, check_selection_equals_rebuild

from experiments.calibrate import calibrate_command, error_line
from kvquant import get_method
from kvquant.cache import KVGeometry
from kvquant.data import tinystories_pieces
from kvquant.errors import InvalidParameterError, KvquantError
from kvquant.eval.perplexity import chunked_nll
from kvquant.methods.aquakv import SINK, WINDOW, PredictorFileError, Predictors, model_identity
from kvquant.methods.aquakv.predictors import encode_pair, from_rows, load_cached, to_rows
from kvquant.quant.rope import rope_tables, undo_rope

NAMES = ["higgs", "aquakv", "aquakv_k_only", "aquakv_v_only"]
CALIB = {"n_seqs": 4, "seq_len": 256, "seed": 0, "progress": False, "log": None}


@pytest.fixture(scope="module")
def pred_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("predictors")


@pytest.fixture(scope="module")
def calibrated(stories, pred_dir):
    """The 2-bit aquakv predictors for stories260k, saved where the method looks for them."""
    model, tok = stories
    method = get_method("aquakv", backend="torch")
    pred = method.calibrate(model, tok, **CALIB)
    path = method.default_path(model_identity(model.config), method.quantizers(model.config))
    path = pred_dir / path.relative_to(path.parents[1])
    pred.save(path)
    return pred, path


@pytest.fixture
def env_dir(monkeypatch, pred_dir):
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(pred_dir))
    return pred_dir


def story_ids(tok, n_tokens, start=0):
    text = "\n\n".join(tinystories_pieces()[start : start + 12])
    ids = tok(text, return_tensors="pt").input_ids[0][:n_tokens]
    assert ids.numel() == n_tokens
    return ids


def feed(model, ids, cache, chunk):
    """Every token of ``ids`` through ``cache``, ``chunk`` at a time."""
    with torch.no_grad():
        for start in range(0, ids.numel(), chunk):
            model(input_ids=ids[start : start + chunk].view(1, -1), past_key_values=cache, use_cache=True)


def record_inputs(cache):
    """Wrap each layer's update to keep what the model handed it (post-RoPE K, V) and what it returned."""
    seen = {i: {"k": [], "v": [], "out": None} for i in range(len(cache.layers))}
    for layer in cache.layers:

        def wrapped(k, v, *args, _layer=layer, _orig=layer.update, **kwargs):
            seen[_layer.layer_idx]["k"].append(k.detach().clone())
            seen[_layer.layer_idx]["v"].append(v.detach().clone())
            out = _orig(k, v, *args, **kwargs)
            seen[_layer.layer_idx]["out"] = out
            return out

        layer.update = wrapped
    return seen


def test_methods_default_to_two_bits_and_take_2_3_4():
    for name in NAMES:
        assert get_method(name, backend="torch").bits == 2 and get_method(name, bits=4, backend="torch").bits == 4
        with pytest.raises(InvalidParameterError, match="bits must be one of 2, 3, 4"):
            get_method(name, bits=5, backend="torch")
    assert (
        get_method("aquakv_k_only", backend="torch").predict == "k"
        and get_method("aquakv_v_only", backend="torch").predict == "v"
    )
    assert {p.stem for p in (ROOT / "conf" / "method").glob("*.yaml")} >= set(NAMES)


def test_missing_predictor_file_says_which_calibration_makes_it(stories, tmp_path, monkeypatch):
    """The library names the file and the calibration in fields; experiments format the command line."""
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(tmp_path))
    with pytest.raises(PredictorFileError) as err:
        get_method("aquakv_v_only", bits=3, backend="torch").new_cache(stories[0])
    e = err.value
    msg = str(e)
    assert "\n" not in msg and str(tmp_path) in msg and "run.py" not in msg and msg.endswith("calibrate first")
    assert e.path.parent.parent == tmp_path and e.model_id.startswith("stories260k")
    assert (e.method, e.bits, e.predict, e.first_layer_bits, e.group) == ("aquakv_v_only", 3, "v", 4, 1024)
    command = "python run.py experiment=calibrate method=aquakv_v_only model=stories260k method.bits=3"
    assert calibrate_command(e) == command and error_line(e) == f"{msg}: {command}"
    again = pickle.loads(pickle.dumps(e))  # sweeps may carry it across processes
    assert str(again) == msg and again.target() == e.target() and again.path == e.path
    with pytest.raises(PredictorFileError) as err:
        get_method("aquakv", first_layer_bits=None, group=64, backend="torch").new_cache(stories[0])
    assert calibrate_command(err.value).endswith("method.bits=2 method.first_layer_bits=null method.group=64")
    assert error_line(KvquantError("plain\nerror")) == "plain error"


def test_calibration_is_deterministic_and_predictors_beat_higgs_alone(stories, calibrated):
    pred, path = calibrated
    again = get_method("aquakv", backend="torch").calibrate(*stories, **CALIB)
    assert pred.tensors().keys() == again.tensors().keys() and len(pred.k) == len(pred.v) == 4  # layers 1..4
    for name, t in pred.tensors().items():
        assert torch.equal(t, again.tensors()[name]), name
    assert pred.header["fit"] == again.header["fit"]
    loaded = Predictors.load(path)
    assert loaded.header["model"]["id"].startswith("stories260k") and loaded.header["data"]["tokens"] == 1024
    assert loaded.header["quantizer"]["bits"] == 2 and loaded.header["lambda"] == 1e-3
    assert {"k_rel_mse", "v_rel_mse", "k_equivalent_bits"} <= set(loaded.header["fit"][1])
    for kind in ("k", "v"):
        rows = loaded.header["fit"][1:]
        with_pred = sum(r[f"{kind}_rel_mse"] for r in rows)
        alone = sum(r[f"{kind}_rel_mse_higgs"] for r in rows)
        assert with_pred < 0.8 * alone, (kind, with_pred, alone)


def test_file_for_another_quantizer_or_model_is_refused_naming_both(stories, calibrated, tmp_path):
    pred, path = calibrated
    with pytest.raises(PredictorFileError) as err:
        get_method("aquakv", bits=3, predictors=str(path), backend="torch").new_cache(stories[0])
    assert '"bits": 2' in str(err.value) and '"bits": 3' in str(err.value)
    other = Predictors({**pred.header, "model": {"id": "some-other-model", "config_hash": "0" * 12}}, pred.k, pred.v)
    other_path = other.save(tmp_path / "other.safetensors")
    with pytest.raises(PredictorFileError) as err:
        get_method("aquakv", predictors=str(other_path), backend="torch").new_cache(stories[0])
    assert "some-other-model" in str(err.value) and model_identity(stories[0].config)["id"] in str(err.value)


def test_cache_reconstruction_is_the_calibration_rule_in_chunks(stories, calibrated, env_dir):
    """Chunked prefill through the cache stores exactly what the offline rule encodes, layer by layer."""
    model, tok = stories
    pred, _ = calibrated
    cache = get_method("aquakv", backend="torch").new_cache(model)
    seen = record_inputs(cache)
    feed(model, story_ids(tok, 300), cache, 40)
    n_q = 300 - SINK - WINDOW
    cos, sin = rope_tables(model.model.rotary_emb, torch.arange(SINK, SINK + n_q).unsqueeze(0))
    prev_k = prev_v = None
    for layer in range(len(cache.layers)):
        k = torch.cat(seen[layer]["k"], dim=2)[:, :, SINK : SINK + n_q].half().float()
        v = torch.cat(seen[layer]["v"], dim=2)[:, :, SINK : SINK + n_q].half().float()
        k, v = to_rows(undo_rope(k, cos, sin)), to_rows(v)
        quant = cache.layers[layer].quant
        _, rk, _, rv = encode_pair(quant, pred.k.get(layer), pred.v.get(layer), k, v, prev_k, prev_v)
        got_k, got_v = cache.reconstruct(layer)
        assert got_k.shape == rk.shape == (1, n_q, 32)
        for got, ref in ((got_k, rk), (got_v, rv)):  # equal but for rare code flips at near-ties of the grid
            assert torch.isclose(got, ref, rtol=1e-4, atol=1e-4).float().mean() > 0.99
            assert (got - ref).pow(2).sum() < 1e-3 * ref.pow(2).sum()
        prev_k, prev_v = rk, rv


@pytest.mark.parametrize("predict", ["kv", "v", "none"])
def test_the_cache_codes_without_decoding_what_no_predictor_reads(predict):
    """``encode_pair(reconstruct=False)`` (the cache keeps codes only): the same codes, no reconstructions, and of
    the keys' decoding only what a value predictor reads — each decoding is some twenty operators a layer and step
    on a GPU, none of which a HIGGS cache (no predictors) needs."""
    from kvquant.analysis.timing import OpCounter
    from kvquant.quant.higgs import Higgs

    g = torch.Generator().manual_seed(3)
    quant, c = Higgs(32, bits=2, group=32), 32
    pred_k = (torch.randn(c, c, generator=g) * 0.1, torch.randn(c, generator=g)) if predict == "kv" else None
    pred_v = (torch.randn(2 * c, c, generator=g) * 0.1, torch.randn(c, generator=g)) if predict != "none" else None
    k, v, prev_k, prev_v = (torch.randn(1, 5, c, generator=g) for _ in range(4))
    full = encode_pair(quant, pred_k, pred_v, k, v, prev_k, prev_v)
    with OpCounter() as counted:
        lean = encode_pair(quant, pred_k, pred_v, k, v, prev_k, prev_v, reconstruct=False)
    assert lean[1] is None and lean[3] is None
    for got, want in ((lean[0], full[0]), (lean[2], full[2])):
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
    decodings = counted.counts["embedding"]  # one gather of the grid per decoding
    assert decodings == (1 if pred_v is not None else 0)


def test_returned_keys_are_rotated_back_correctly(stories):
    """Sinks and window come back as handed in; quantized keys with 4-bit error, not a RoPE mismatch."""
    model, tok = stories
    cache = get_method("higgs", bits=4, backend="torch").new_cache(model)
    seen = record_inputs(cache)
    feed(model, story_ids(tok, 260), cache, 64)
    q = slice(SINK, 260 - WINDOW)
    for layer in range(len(cache.layers)):
        ref = torch.cat(seen[layer]["k"], dim=2)
        got = seen[layer]["out"][0]
        assert got.shape == ref.shape
        assert torch.equal(got[:, :, :SINK], ref[:, :, :SINK].half().float())
        assert torch.equal(got[:, :, q.stop :], ref[:, :, q.stop :].half().float())
        err = ((got[:, :, q] - ref[:, :, q]).pow(2).sum() / ref[:, :, q].pow(2).sum()).item()
        assert err < 0.02, (layer, err)


def test_post_rope_keys_are_coded_as_handed_and_keep_no_positions(stories):
    """``higgs_post_rope`` codes the keys the model hands over (no RoPE taken off or put back): each
    coded key attention gets back is the quantizer's round trip of that very key; no positions are
    held, so it stores exactly layer 0's int32 per token less than ``higgs``."""
    model, tok = stories
    ids = story_ids(tok, 260)
    caches, seen = {}, {}
    for name in ("higgs", "higgs_post_rope"):
        caches[name] = get_method(name, bits=4, backend="torch").new_cache(model)
        seen[name] = record_inputs(caches[name])
        feed(model, ids, caches[name], 64)
    cache, coded = caches["higgs_post_rope"], slice(SINK, 260 - WINDOW)
    assert cache.positions is None and caches["higgs"].positions.shape == (1, 260)
    for layer in cache.layers:
        handed = torch.cat(seen["higgs_post_rope"][layer.layer_idx]["k"], dim=2)[:, :, coded]
        rows = to_rows(handed.half().float())
        expected = from_rows(layer.quant.roundtrip(rows), layer.n_heads)
        got = seen["higgs_post_rope"][layer.layer_idx]["out"][0][:, :, coded]
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert not torch.equal(seen["higgs"][layer.layer_idx]["out"][0][:, :, coded], got)
    # layer 0 sees the same input either way: its values are coded alike
    assert torch.equal(seen["higgs"][0]["out"][1], seen["higgs_post_rope"][0]["out"][1])
    pre, post = caches["higgs"].stats(), cache.stats()
    assert post["bytes_by_part"]["positions"] == 0 and pre["bytes"] - post["bytes"] == 4 * 260
    assert post["elements"] == pre["elements"]


def test_post_rope_keys_refuse_predictors():
    from kvquant.methods.aquakv import AquaKVCache

    with pytest.raises(InvalidParameterError, match="predictors read pre-RoPE keys"):
        AquaKVCache([], torch.nn.Identity(), Predictors(header={}), post_rope=True)


def test_stats_count_every_byte_and_report_predictors_apart(stories, calibrated, env_dir):
    model, tok = stories
    pred, _ = calibrated
    cache = get_method("aquakv", backend="torch").new_cache(model)
    chunked_nll(model, story_ids(tok, 400), cache, 32)
    s = cache.stats()
    assert s["bytes"] == sum(s["bytes_by_part"].values())
    assert s["bits_stored"] == pytest.approx(8 * s["bytes"] / s["elements"])
    assert s["elements"] == 2 * 5 * 400 * 32  # K and V, 5 layers, 400 tokens, 4 heads x 8
    fp16_bytes = s["bytes_by_part"]["sinks"] + s["bytes_by_part"]["window"]
    assert fp16_bytes == 2 * 5 * (SINK + WINDOW) * 32 * 2
    assert s["predictor_bytes"] == pred.nbytes() > 0
    assert s["bits_stored"] < 16 and s["bits_read"] > 0


def test_chunking_and_decode_store_the_same_codes(stories, calibrated, env_dir):
    """Prefill chunks then one-token decode steps store what one chunking of the same text stores."""
    model, tok = stories
    ids = story_ids(tok, 160, start=20)
    decoded = get_method("aquakv", backend="torch").new_cache(model)
    feed(model, ids[:130], decoded, 45)
    feed(model, ids[130:], decoded, 1)
    chunked = get_method("aquakv", backend="torch").new_cache(model)
    feed(model, ids, chunked, 40)
    for a, b in zip(decoded.layers, chunked.layers, strict=True):
        assert a.n_quant == b.n_quant == 160 - SINK - WINDOW
        assert (a.state.qk.codes == b.state.qk.codes).float().mean() > 0.99 and (
            a.state.qv.codes == b.state.qv.codes
        ).float().mean() > 0.99


def test_generate_and_ppl_beat_higgs(stories, calibrated, env_dir):
    model, tok = stories
    cache = get_method("aquakv", backend="torch").new_cache(model)
    prompt = tok("Once upon a time", return_tensors="pt")
    out = model.generate(**prompt, past_key_values=cache, max_new_tokens=140, do_sample=False)
    assert cache.get_seq_length() == out.shape[1] - 1 and cache.layers[0].n_quant > 0
    ids = story_ids(tok, 400, start=40)
    nll = {}
    for name, kw in (("higgs", {"first_layer_bits": 4}), ("aquakv", {})):
        nll[name] = chunked_nll(model, ids, get_method(name, **kw, backend="torch").new_cache(model), 50)[0]
    assert nll["aquakv"] < nll["higgs"]


def test_ablations_calibrate_only_their_predictors_and_may_share_one_collection_of_kv(stories):
    """Each variant fits only its predictors. ``calibration_kv`` once, then each variant's fit on it: the same
    predictors and header as a calibration that collects its own K/V (the model's forward passes run once
    for all three); K/V collected for other settings are refused in one line."""
    from kvquant.methods.aquakv.calibration import calibration_kv

    settings = {**CALIB, "n_seqs": 2}
    kv = calibration_kv(*stories, n_seqs=2, seq_len=settings["seq_len"], seed=0)
    assert len(kv.keys) == len(kv.values) == 5 and kv.keys[0].shape == (2 * (256 - SINK), 32)
    own = {name: get_method(name, backend="torch").calibrate(*stories, **settings) for name in NAMES[1:]}
    k_only, v_only = own["aquakv_k_only"], own["aquakv_v_only"]
    assert sorted(k_only.k) == [1, 2, 3, 4] and not k_only.v
    assert sorted(v_only.v) == [1, 2, 3, 4] and not v_only.k
    assert v_only.v[1][0].shape == (64, 32)  # [reconstructed keys of l, values of l-1] -> values of l
    for name, own_fit in own.items():
        shared = get_method(name, backend="torch").calibrate(*stories, **settings, kv=kv)
        own_tensors = own_fit.tensors()
        assert shared.tensors().keys() == own_tensors.keys() and own_tensors, name
        assert all(torch.equal(t, own_tensors[k]) for k, t in shared.tensors().items()), name
        assert shared.header["fit"] == own_fit.header["fit"] and shared.header["data"] == own_fit.header["data"]
    for other in ({"n_seqs": 3}, {"seed": 1}, {"seq_len": 128}):
        with pytest.raises(InvalidParameterError, match="collect them with calibration_kv") as err:
            get_method("aquakv", backend="torch").calibrate(*stories, **{**settings, **other}, kv=kv)
        assert "\n" not in str(err.value)


def test_transformers_5_17_positional_cache_kwargs(stories):
    """5.17 hands ``{cos, sin, cache_position}`` positionally: positions come from it, and cos/sin are checked."""
    model, _ = stories
    cache = get_method("higgs", backend="torch").new_cache(model)
    rotary = model.model.rotary_emb
    pos = torch.arange(10, 150).unsqueeze(0)
    cos, sin = rotary(torch.zeros(1), pos)
    k, v = torch.randn(1, 4, 140, 8), torch.randn(1, 4, 140, 8)
    cache.update(k, v, 0, {"cos": cos, "sin": sin, "cache_position": pos[0]})
    assert cache.positions[0].tolist() == list(range(10, 150))
    bad = get_method("higgs", backend="torch").new_cache(model)
    with pytest.raises(KvquantError, match="cos/sin"):
        bad.update(k, v, 0, {"cos": cos, "sin": sin, "cache_position": pos[0] + 1})


def test_group_without_hadamard_transform_is_padded_and_said():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=20,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=10,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(config).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = get_method("higgs", backend="torch").new_cache(model)
    assert any("zero-padded to 12" in str(w.message) for w in caught)
    chunked_nll(model, torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(0)), cache, 50)
    assert cache.layers[1].n_quant == 200 - SINK - WINDOW


def test_calibrate_experiment_writes_the_file_the_method_loads(stories, tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from experiments.calibrate import run

    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(tmp_path))
    overrides = ["experiment=calibrate", "model=stories260k", "method=aquakv", "method.bits=3", "progress=false"]
    overrides += ["experiment.n_seqs=2", "experiment.seq_len=128", "device=cpu"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    result = run(cfg)
    assert result["task"]["name"] == "calibrate" and result["task"]["tokens"] == 256
    assert result["metrics"]["predictor_bytes"] > 0 and len(result["calibration"]["layers"]) == 5
    json.dumps(result)
    cache = get_method("aquakv", bits=3, backend="torch").new_cache(stories[0])
    assert cache.predictors is not None and cache.predictors.header["quantizer"]["bits"] == 3


def test_analytic_bits_come_from_the_geometry_alone(stories):
    geometry = KVGeometry.of(stories[0].config)  # 5 layers, 4 KV heads of 8: one group of 32 channels
    assert (
        get_method("higgs", backend="torch").analytic_bits(geometry) == 2.5
        and get_method("higgs", backend="torch").analytic_bits() is None
    )
    assert (
        get_method("aquakv", backend="torch").analytic_bits(geometry) == (4.5 + 4 * 2.5) / 5
    )  # layer 0 at 4 bits, no file read
    assert get_method("higgs", backend="torch").adaptations(geometry) == {"group": [1024, 32]}


def test_predictor_files_are_read_once_per_version(calibrated, tmp_path):
    pred, path = calibrated
    assert load_cached(path) is load_cached(path)
    copy = pred.save(tmp_path / "copy.safetensors")
    first = load_cached(copy)
    pred.save(copy)  # a new version of the file
    assert load_cached(copy) is not first


def test_cache_names_the_predictor_file_by_digest(stories, calibrated, env_dir):
    """A result must tell two calibrations apart: they share a file name, not a sha256."""
    pred, path = calibrated
    assert pred.source is None  # fitted in memory, never read
    files = get_method("aquakv", backend="torch").new_cache(stories[0]).parameter_files
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert files["predictors"]["sha256"] == digest and files["predictors"]["path"] == str(path.resolve())
    assert files["predictors"]["calibration"]["tokens"] == 1024
    assert get_method("higgs", backend="torch").new_cache(stories[0]).parameter_files == {}


@pytest.fixture(scope="module")
def every_variant(stories, calibrated, pred_dir):
    """Small predictors for the ablations too, beside the 2-bit aquakv ones."""
    model, tok = stories
    for name in ("aquakv_k_only", "aquakv_v_only"):
        method = get_method(name, backend="torch")
        path = method.default_path(model_identity(model.config), method.quantizers(model.config))
        method.calibrate(model, tok, **{**CALIB, "n_seqs": 2}).save(pred_dir / path.relative_to(path.parents[1]))
    return pred_dir


@pytest.mark.numerics
@pytest.mark.parametrize("name", NAMES)
def test_beam_search_with_default_parameters(stories, every_variant, monkeypatch, name):
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(every_variant))
    beam_search_runs(*stories, get_method(name, backend="torch"))


@pytest.mark.parametrize("name", ["higgs", "aquakv"])
def test_batch_selection_equals_the_cache_of_the_selected_rows(stories, calibrated, env_dir, name):
    """Sinks, codes, scales and the positions and hand-off the layers share move with their rows."""
    check_selection_equals_rebuild(stories[0], get_method(name, window=32, backend="torch"))


def test_crop_takes_back_the_window_and_is_one_line_beyond(stories):
    from kvquant.cache import CropError

    cache = get_method("higgs", backend="torch").new_cache(stories[0])
    cache.update(torch.randn(1, 4, 10, 8), torch.randn(1, 4, 10, 8), 0)
    cache.crop(-5)  # 4 sinks, then 6 in the fp16 window: the newest 5 go
    assert cache.get_seq_length() == 5 and cache.layers[0].n_recent == 1
    with pytest.raises(CropError, match="only 1 are still held in the fp16 window") as e:
        cache.crop(-3)
    assert "\n" not in str(e.value)


def spec_horizons(windows: list[int | None], predicts: list[bool]) -> list[int | None]:
    """The code horizon the cache docstring states: a sliding layer's window, widened to the next
    layer's horizon when that layer predicts from it (None: unbounded)."""
    out: list[int | None] = [None] * len(windows)
    for i in reversed(range(len(windows))):
        out[i] = windows[i]
        if windows[i] is not None and i + 1 < len(windows) and predicts[i + 1]:
            out[i] = None if out[i + 1] is None else max(windows[i], out[i + 1])
    return out


# Coded tokens: a sliding layer reconstructs fewer rows than the full one (other matmul shapes), so
# another BLAS path or thread count moves its fp32 values by a few ulps of the O(1) operands of the
# ≤ 32-term dot products (Hadamard, predictors, RoPE), not of the possibly near-zero result: hence an
# absolute part (≤ 2.4e-6 seen with MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1, 0 by default). Such an
# ulp may flip a code on a cell boundary now and then: at most 2% of the coded (layer, position)
# pairs handed. Noise of 1e-4 on the rotated coordinates (far above ulps) flipped ≤ 3 of ≥ 173 and
# all 12 cases passed; a layer holding codes of the wrong tokens (``forget`` keeping the oldest codes,
# or coding its window one token off) still fails 6 of 12: 1–72% of the pairs, up to 3–10× the error.
SLIDING_TOL = {"rtol": 1e-5, "atol": 1e-5}
SLIDING_FLIP_SHARE = 0.02


def compare_handed(got, ref, true, from_codes):
    """Tokens ([B, H, T, D] on axis 2) a sliding layer hands vs the full layer's (``ref``) of the same
    positions: fp16 ones (not ``from_codes`` in ``ref``) bit for bit; coded ones within ``SLIDING_TOL``,
    except a token whose code flipped, whose difference is bounded by its quantization error
    ``‖ref − true‖``. Returns the indices of the flipped tokens."""
    assert torch.equal(got[:, :, ~from_codes], ref[:, :, ~from_codes])
    close = torch.isclose(got, ref, **SLIDING_TOL).all(3).all(1).all(0)
    flipped = (~close).nonzero().flatten()
    # A code flipped on a cell boundary moves the token by at most twice its quantization error (the
    # point is as far from either grid point; a token's channels are one HIGGS group); a flip upstream
    # moves the prediction, and the residual is coded as well (≤ 1.65× seen with the noise above). A
    # token of another position differs by about √2‖x‖, mostly beyond 2 × the 2-bit error (~0.5‖x‖).
    diff = (got - ref)[:, :, flipped].transpose(1, 2).flatten(2).norm(dim=-1)
    err = (ref - true)[:, :, flipped].transpose(1, 2).flatten(2).norm(dim=-1)
    assert (diff <= 2 * err).all(), (flipped.tolist(), diff.tolist(), err.tolist())
    return flipped.tolist()


@pytest.mark.numerics
@pytest.mark.parametrize("chunks", [(150, 1, 1, 1), (40, 40, 40, 30, 1, 1), (7,) * 22])
@pytest.mark.parametrize(
    ("windows", "predicts"),
    [
        ((12, None), (False, True)),  # Gemma-2/3: sliding layer 0 feeds a full layer's predictor
        ((12, 30, None), (False, True, True)),  # a sliding layer with a predictor feeds a full layer
        ((30, 12, 12), (False, True, True)),  # every layer slides (Mistral), windows within the fp16 span
        ((12, 30), (False, False)),  # HIGGS: no predictors
    ],
)
def test_sliding_layers_return_the_full_layers_tail_and_hold_what_the_rule_says(windows, predicts, chunks):
    """Random K/V and predictors, ``recent`` 16 fp16 tokens, 4 sinks: each sliding layer hands attention
    exactly what ``get_mask_sizes`` promised, the tail of what the same layer of an all-full cache
    hands (fp16 tokens bit for bit, coded ones as ``compare_handed`` allows), and then holds per the docstring:
    sinks within its window; codes from its code horizon on; fp16 from its window (a layer without
    predictors, which codes as tokens leave it) or its code horizon on, the newest 16 at most; positions
    of every token some layer holds."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from kvquant.methods.aquakv import AquaKVCache, AquaKVLayer
    from kvquant.quant.higgs import Higgs

    sink, recent, heads, dim = 4, 16, 2, 8
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=16, num_attention_heads=2, head_dim=dim))
    gen = torch.Generator().manual_seed(0)
    quant, c = Higgs(heads * dim, 2), heads * dim

    def linear(n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n_in, c, generator=gen) / 4, torch.randn(c, generator=gen)

    preds = [(linear(c), linear(2 * c)) if p else (None, None) for p in predicts]

    def cache(wins):
        return AquaKVCache(
            [AquaKVLayer(i, quant, *preds[i], sink, recent, w) for i, w in enumerate(wins)], rotary, None
        )

    full, sliding = cache([None] * len(windows)), cache(list(windows))
    horizons = spec_horizons(list(windows), list(predicts))
    assert [layer.horizon for layer in sliding.layers] == horizons
    kv = [
        (torch.randn(1, heads, sum(chunks), dim, generator=gen), torch.randn(1, heads, sum(chunks), dim, generator=gen))
        for _ in windows
    ]
    seen, compared, flipped = 0, set(), set()  # (layer, position) of coded tokens handed
    for n in chunks:
        for i, (k, v) in enumerate(kv):
            length, offset = sliding.layers[i].get_mask_sizes(n)
            new_k, new_v = k[:, :, seen : seen + n], v[:, :, seen : seen + n]
            (fk, fv), (sk, sv) = full.update(new_k, new_v, i), sliding.update(new_k, new_v, i)
            assert sk.shape[2] == sv.shape[2] == length
            f = full.layers[i]
            pos = torch.arange(offset, seen + n)
            from_codes = (pos >= f.state.code_lo) & (pos < f.state.code_lo + f.n_codes)
            compared.update((i, p) for p in pos[from_codes].tolist())
            for got, ref, x in ((sk, fk, k), (sv, fv, v)):
                true = x[:, :, offset : seen + n].half().float()  # what the layers hold and code: fp16
                flipped.update((i, offset + t) for t in compare_handed(got, ref[:, :, offset:], true, from_codes))
        seen += n
        for layer, w, h in zip(sliding.layers, windows, horizons, strict=True):
            if w is None:
                continue
            lo, floor = seen - w + 1, 0 if h is None else seen - h + 1
            early = not predicts[layer.layer_idx] and h != w
            fp16_from = max(sink, seen - recent, lo if early else floor)
            assert layer.n_sinks == max(0, min(seen, sink) - max(0, lo))
            assert layer.n_recent == max(0, seen - fp16_from)
            assert layer.n_codes == max(0, fp16_from - max(sink, floor))
            assert layer.get_seq_length() == seen
        assert sliding.positions.shape[1] == seen - min(layer.first_held() for layer in sliding.layers)
    assert len(flipped) <= SLIDING_FLIP_SHARE * len(compared), (len(flipped), len(compared))


def test_a_decode_step_codes_its_token_in_place(stories):
    """The coded history grows in place (``RowBuffer``): codes and scales are views of buffers with room, a
    decode step writes its token there (no buffer moves), and layer 0 holds what coding it all at once holds (up
    to the two forwards' float order)."""
    model, tok = stories
    ids = story_ids(tok, 200, start=10)
    decoded = get_method("higgs_post_rope", backend="torch").new_cache(model)
    feed(model, ids[:150], decoded, 150)
    feed(model, ids[150:190], decoded, 1)
    state = decoded.layers[2].state
    buffers = [rows.buffer.data_ptr() for rows in state.code_rows]
    held = (*state.qk.tensors(), *state.qv.tensors())
    assert [t.data_ptr() for t in held] == buffers and all(r.buffer.shape[1] > r.rows for r in state.code_rows)
    feed(model, ids[190:191], decoded, 1)
    assert [rows.buffer.data_ptr() for rows in state.code_rows] == buffers and state.n_codes == held[0].shape[1] + 1
    whole = get_method("higgs_post_rope", backend="torch").new_cache(model)
    feed(model, ids[:191], whole, 191)
    decoded.layers[2].map_tensors(lambda t: t.clone())  # a batch map: the new tensors become the buffers
    held = (*state.qk.tensors(), *state.qv.tensors())
    assert all(rows.holds(t) for rows, t in zip(state.code_rows, held, strict=True))
    assert state.code_rows[0].buffer.data_ptr() not in buffers
    a, b = decoded.layers[0].state, whole.layers[0].state  # layer 0's K/V do not depend on the history's codes
    assert a.n_codes == b.n_codes and a.qk.codes.shape == b.qk.codes.shape
    torch.testing.assert_close(a.qv.scales, b.qv.scales, rtol=2e-3, atol=1e-4)  # one forward's float order or two
    assert (a.qk.codes == b.qk.codes).float().mean() > 0.99 and (a.qv.codes == b.qv.codes).float().mean() > 0.99
