import pytest

from kvquant import get_method, get_task, method_names, task_names
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


def bad_values(task_name: str) -> list[tuple[str, object]]:
    """For each bounded parameter of a task, a value just below its bound (read from the field's type)."""
    from typing import get_type_hints

    from kvquant.eval.tasks import TASKS, AtLeast

    cls = TASKS._entries[task_name][0]
    hints = get_type_hints(cls, include_extras=True)
    return [
        (field, rule.minimum - 1)
        for field, hint in hints.items()
        for rule in getattr(hint, "__metadata__", ())
        if isinstance(rule, AtLeast)
    ]


@pytest.mark.parametrize("task_name", task_names())
def test_every_task_refuses_a_value_below_its_bound_in_a_line_naming_the_task(task_name):
    cases = bad_values(task_name)
    assert {"chunk_size", "batch_size"} <= {field for field, _ in cases}  # what the engine reads is bounded
    for field, value in cases:
        with pytest.raises(InvalidParameterError) as err:
            get_task(task_name, **{field: value})
        assert str(err.value).startswith(f"task {task_name}: {field}={value} must ")
        assert "\n" not in str(err.value)


def test_a_task_built_without_the_registry_is_validated_too():
    from kvquant.eval.passkey import PasskeyTask

    with pytest.raises(InvalidParameterError, match="^task passkey: filler='web' must be one of wikitext, tinystories"):
        PasskeyTask(filler="web")
    with pytest.raises(InvalidParameterError, match="^task passkey: trials=0 must be positive$"):
        PasskeyTask(trials=0)
    assert PasskeyTask(depths=[0, 1]).params()["depths"] == [0.0, 1.0]  # normalized, as results.json records it


def test_task_parameters_are_frozen_and_typed():
    import dataclasses

    task = get_task("wikitext", limit=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.limit = 3
    with pytest.raises(InvalidParameterError, match="task 'wikitext': parameter 'limit' expects int or None, got 2.5"):
        get_task("wikitext", limit=2.5)


@pytest.mark.parametrize("task_name", task_names())
def test_every_task_yaml_sets_exactly_its_dataclass_fields(task_name):
    """``conf/task/<name>.yaml`` is the task's parameters: one key per field, and the task builds from it."""
    import dataclasses

    from conftest import ROOT
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "task" / f"{task_name}.yaml"), resolve=True)
    assert node.pop("name") == task_name
    task = get_task(task_name, **node)
    assert list(node) and set(node) == {f.name for f in dataclasses.fields(task)}
    assert {k: v for k, v in task.params().items() if node[k] is not None} == {
        k: v for k, v in node.items() if v is not None
    }  # what the YAML sets is what results.json records (a null may resolve: longbench's tasks)
