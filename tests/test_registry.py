import pytest

from kvquant import get_method, method_names
from kvquant.errors import InvalidParameterError, UnknownNameError
from kvquant.registry import Registry


class Thing:
    def __init__(self, bits: int = 4, group: int = 32):
        self.bits, self.group = bits, group


def test_presets_and_overrides():
    reg = Registry("widget")
    reg.register("thing", Thing)
    reg.register("thing2", Thing, bits=2)
    assert reg.create("thing2").bits == 2
    assert reg.create("thing2", bits=8).bits == 8
    made = reg.create("thing", group=64)
    assert (made.bits, made.group, made.name) == (4, 64, "thing")
    assert reg.names() == ["thing", "thing2"] and "thing" in reg


def test_unknown_name_lists_valid_names_in_one_line():
    reg = Registry("widget")
    reg.register("b", Thing)
    reg.register("a", Thing)
    with pytest.raises(UnknownNameError) as err:
        reg.create("zzz")
    assert str(err.value) == "unknown widget 'zzz'; valid widgets: a, b"


def test_unknown_parameter_names_accepted_ones():
    reg = Registry("widget")
    reg.register("thing", Thing)
    with pytest.raises(InvalidParameterError, match="its parameters are: bits, group"):
        reg.create("thing", nbits=3)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("alignedkv", {"margin": "abc"}, "method 'alignedkv': parameter 'margin' expects float, got 'abc' (str)"),
        ("kivi2", {"bits": 2.5}, "method 'kivi2': parameter 'bits' expects int, got 2.5 (float)"),
        ("higgs", {"bits": True}, "method 'higgs': parameter 'bits' expects int, got True (bool)"),
        (
            "alignedkv",
            {"k_thresholds": [4]},
            "method 'alignedkv': parameter 'k_thresholds' expects 2 values (float, float), got [4] (list)",
        ),
        ("aquakv", {"first_layer_bits": "4"}, "parameter 'first_layer_bits' expects int or None, got '4' (str)"),
    ],
)
def test_wrong_type_names_parameter_type_and_value(name, params, message):
    with pytest.raises(InvalidParameterError) as err:
        get_method(name, **params)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_values_as_yaml_and_numpy_give_them_are_accepted():
    import numpy as np

    assert get_method("alignedkv", k_thresholds=[4, 8.5], margin=1).k_thresholds == (4.0, 8.5)
    assert get_method("kivi2", group_size=np.int64(16)).group_size == 16
    assert get_method("aquakv", first_layer_bits=None).first_layer_bits is None


def test_duplicate_registration_is_refused():
    reg = Registry("widget")
    reg.register("thing", Thing)
    with pytest.raises(ValueError):
        reg.register("thing", Thing)


def test_method_registry_is_usable_without_hydra():
    assert "fp16" in method_names()
    assert get_method("fp16").name == "fp16"
    with pytest.raises(UnknownNameError, match="valid methods: .*fp16"):
        get_method("nope")
