"""Every ``conf/method/*.yaml`` composes (defaults inheritance included) to exactly what the registry
builds under that name: one source of truth for each method's defaults."""

import pytest
from conftest import ROOT
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvquant import get_method

METHOD_FILES = sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml"))


def plain(value):
    """YAML has no tuples: compare sequences as lists, recursively."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def composed():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return {name: compose(config_name="config", overrides=[f"method={name}"]).method for name in METHOD_FILES}


@pytest.mark.parametrize("name", METHOD_FILES)
def test_method_yaml_equals_the_registry_parameters(composed, name):
    node = OmegaConf.to_container(composed[name], resolve=True)
    assert node.pop("name") == name
    assert plain(node) == plain(get_method(name).params())


def test_presets_inherit_their_family():
    """``kivi2.yaml`` sets only what differs from ``kivi.yaml`` (Hydra defaults inheritance)."""
    raw = OmegaConf.load(ROOT / "conf" / "method" / "kivi2.yaml")
    assert list(raw.defaults) == ["kivi", "_self_"] and set(raw) == {"defaults", "name", "bits"}
