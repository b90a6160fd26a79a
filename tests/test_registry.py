"""Registries: names, dotted paths, and built-ins named by dotted path that load on first use."""

import sys

import pytest

from asyncflow.registry import Registry, RegistryError


def test_builtins_are_listed_before_and_loaded_on_first_use():
    reg = Registry("thing", builtins={"dumps": "json:dumps", "gone": "no_such_module_here:thing"})
    assert reg.names() == ["dumps", "gone"] and "dumps" in reg
    import json

    assert reg.resolve("dumps") is json.dumps and reg.get("dumps") is json.dumps
    with pytest.raises(RegistryError, match="cannot import 'no_such_module_here'"):
        reg.get("gone")
    with pytest.raises(RegistryError, match="valid: dumps, gone"):
        reg.get("typo")


def test_a_builtin_s_own_module_may_register_it_but_nothing_else_may_take_its_name():
    reg = Registry("thing", builtins={"reg": "asyncflow.registry:Registry"})
    reg.register("reg")(Registry)  # the module the path names registering that very object
    assert reg.get("reg") is Registry
    other = Registry("thing", builtins={"x": "json:dumps"})
    with pytest.raises(RegistryError, match="already registered"):
        other.register("x")(len)


def test_registered_names_and_dotted_paths_resolve():
    reg = Registry("thing")
    reg.register("seven")(7)
    assert reg.resolve("seven") == 7 and reg.resolve("os.path:join") is sys.modules["os"].path.join
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("seven")(8)
