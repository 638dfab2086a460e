"""Cache files checked on load: converted models recover by themselves, predictor files fail in one line."""

import json
import os
import shutil

import pytest
from conftest import STORIES260K_REFERENCE_IDS, run_py

from experiments.calibrate import error_line
from kvquant import get_method, models
from kvquant.fsutil import check_manifest, write_manifest
from kvquant.methods.aquakv import PredictorFileError, Predictors, model_identity

FAST = ["model=stories260k", "logger=none", "progress=false", "device=cpu", "task=tinystories"]
FAST += ["task.limit=2", "task.ppl_pieces=4", "task.max_new_tokens=4"]


def greedy_ids(model, tok):
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    return model.generate(ids, max_new_tokens=56, do_sample=False)[0].tolist()


def corrupt_lines(stderr):
    return [line for line in stderr.splitlines() if "corrupt" in line]


def flip_byte(path, offset):
    """Damage one byte in place, keeping size and mtime: only a hash can tell."""
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(offset)
        old = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([old[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def converted(tmp_path):
    """stories260k converted into a fresh cache folder: (cache root, converted folder)."""
    root = tmp_path / "cache"
    return root, models.prepare_model("stories260k", root)


def test_truncated_model_is_reconverted_with_one_line(converted, capfd):
    root, folder = converted
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size // 2)  # what a full disk or an interrupted copy leaves
    capfd.readouterr()
    model, tok = models.load_model("stories260k", device="cpu", cache_dir=root)
    [line] = corrupt_lines(capfd.readouterr().err)
    assert line == (
        f"warning: converted model at {folder} is corrupt "
        f"(model.safetensors: size {size // 2} != {size} when written); re-converting"
    )
    assert weights.stat().st_size == size and greedy_ids(model, tok) == STORIES260K_REFERENCE_IDS
    assert [p.name for p in root.iterdir()] == [folder.name]  # the damaged copy is gone, no scratch left
    models.load_model("stories260k", device="cpu", cache_dir=root)
    assert corrupt_lines(capfd.readouterr().err) == []


def test_model_damaged_in_place_is_caught_by_its_hash_when_loading_fails(converted, capfd):
    root, folder = converted
    flip_byte(folder / "model.safetensors", 8)  # first byte of the JSON header: same size, same mtime
    capfd.readouterr()
    model, tok = models.load_model("stories260k", device="cpu", cache_dir=root)
    [line] = corrupt_lines(capfd.readouterr().err)
    assert "(model.safetensors: sha256 differs from when written); re-converting" in line
    assert greedy_ids(model, tok) == STORIES260K_REFERENCE_IDS


def test_cache_without_manifest_is_checked_by_opening_it(converted, capfd):
    """Folders converted before manifests existed: a sound one gets a manifest, a truncated one is redone."""
    root, folder = converted
    manifest = folder / "kvquant-manifest.json"
    manifest.unlink(missing_ok=True)
    models.load_model("stories260k", device="cpu", cache_dir=root)
    assert manifest.is_file() and "model.safetensors" in json.loads(manifest.read_text())["files"]
    assert corrupt_lines(capfd.readouterr().err) == []

    manifest.unlink()
    os.truncate(folder / "model.safetensors", 1000)
    model, tok = models.load_model("stories260k", device="cpu", cache_dir=root)
    [line] = corrupt_lines(capfd.readouterr().err)
    assert "model.safetensors: Error while deserializing header" in line and line.endswith("re-converting")
    assert greedy_ids(model, tok) == STORIES260K_REFERENCE_IDS and manifest.is_file()


def test_run_py_recovers_from_a_truncated_model_cache(converted, tmp_path):
    root, folder = converted
    os.truncate(folder / "model.safetensors", 8)
    proc = run_py(
        tmp_path, *FAST, "method=fp16", f"results_dir={tmp_path / 'out'}", env={"KVQUANT_CACHE_DIR": str(root)}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(corrupt_lines(proc.stderr)) == 1 and "Traceback" not in proc.stderr
    assert "metrics/ppl" in proc.stdout


def test_manifest_rehashes_a_touched_file_once_and_records_it(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 1000)
    manifest = write_manifest(tmp_path / "m.json", [data])
    assert check_manifest(manifest) is None
    os.utime(data, ns=(0, 10**18))  # a copy without -p: new mtime, same bytes
    assert check_manifest(manifest) is None
    assert json.loads(manifest.read_text())["files"]["data.bin"]["mtime_ns"] == 10**18
    flip_byte(data, 500)
    assert check_manifest(manifest) is None  # same size and mtime: trusted without hashing ...
    assert check_manifest(manifest, full=True) == "data.bin: sha256 differs from when written"  # ... unless asked
    manifest.write_text("{")
    assert check_manifest(manifest) == "m.json: unreadable"


# --------------------------------------------------------------------------- AQUA-KV predictor files


@pytest.fixture(scope="module")
def predictor_file(stories, tmp_path_factory):
    """Small 2-bit aquakv predictors for stories260k, saved where ``method=aquakv`` looks for them."""
    model, tok = stories
    folder = tmp_path_factory.mktemp("predictors")
    method = get_method("aquakv")
    pred = method.calibrate(model, tok, n_seqs=2, seq_len=64, seed=0, progress=False, log=None)
    path = method.default_path(model_identity(model.config), method.quantizers(model.config))
    return folder, pred.save(folder / path.relative_to(path.parents[1]))


@pytest.fixture
def predictor_copy(predictor_file, tmp_path):
    """A private copy of the predictors folder (file + manifest, mtimes kept), free to damage."""
    folder, path = predictor_file
    copy = shutil.copytree(folder, tmp_path / "predictors")
    return copy, copy / path.relative_to(folder)


def test_truncated_predictor_file_is_one_error_line_through_run_py(predictor_copy, tmp_path):
    folder, path = predictor_copy
    os.truncate(path, path.stat().st_size - 100)
    proc = run_py(
        tmp_path, *FAST, "method=aquakv", f"results_dir={tmp_path / 'out'}", env={"KVQUANT_PREDICTOR_DIR": str(folder)}
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: predictor file {path} is corrupt or truncated (")
    assert line.endswith(
        "recalibrate: python run.py experiment=calibrate method=aquakv model=stories260k method.bits=2"
    )


def test_predictor_file_damaged_in_place_is_refused_by_its_hash(predictor_copy, stories):
    _, path = predictor_copy
    assert Predictors.load(path).header["quantizer"]["bits"] == 2
    flip_byte(path, path.stat().st_size - 3)  # inside a tensor: it would still parse
    with pytest.raises(PredictorFileError, match=f"{path.name}: sha256 differs from when written"):
        Predictors.load(path)
    method = get_method("aquakv", predictors=str(path))
    with pytest.raises(PredictorFileError) as err:
        method.new_cache(stories[0])
    assert str(path) in str(err.value) and "sha256 differs" in str(err.value) and "\n" not in str(err.value)
    assert "python run.py experiment=calibrate method=aquakv model=stories260k" in error_line(err.value)


def test_predictor_file_without_manifest_is_checked_by_parsing(predictor_copy):
    _, path = predictor_copy
    path.with_name(f"{path.name}.manifest.json").unlink(missing_ok=True)  # saved before manifests, or copied alone
    assert sorted(Predictors.load(path).k) == [1, 2, 3, 4]
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(PredictorFileError, match="is corrupt or truncated .*SafetensorError.*; recalibrate"):
        Predictors.load(path)


def test_saving_again_replaces_the_manifest(predictor_copy):
    _, path = predictor_copy
    pred = Predictors.load(path)
    pred.header["seed"] = 123
    pred.save(path)
    assert check_manifest(Predictors.manifest_path(path), full=True) is None
    assert Predictors.load(path).header["seed"] == 123
