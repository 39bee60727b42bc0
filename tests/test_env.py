"""Environment variables: accepted values, and clear errors naming the variable otherwise."""

import pytest

from mlx_lm_patches.engine import env


@pytest.mark.parametrize("raw,expected", [
    ("", True), ("1", True), ("true", True), (" ON ", True), ("yes", True),
    ("0", False), ("false", False), ("Off", False), ("no", False),
])
def test_flag_accepted_values(raw, expected):
    assert env.flag("X", default=True, environ={"X": raw}) is expected


def test_flag_malformed_names_variable_and_accepted_values():
    with pytest.raises(env.EnvError) as info:
        env.flag(env.STRICT, environ={env.STRICT: "maybe"})
    message = str(info.value)
    assert "MLX_LM_PATCHES_STRICT='maybe'" in message
    assert "1" in message and "off" in message


@pytest.mark.parametrize("raw,expected", [
    ("", None), ("  ", None), ("*", "*"), (" * ", "*"),
    ("a-b", ("a-b",)), ("a-b,c-d", ("a-b", "c-d")), ("a-b  c-d, a-b", ("a-b", "c-d")),
])
def test_id_list(raw, expected):
    assert env.id_list(env.DISABLE, environ={env.DISABLE: raw}) == expected


@pytest.mark.parametrize("raw", ["*,a-b", "a-b;c", "bad id!"])
def test_id_list_malformed(raw):
    with pytest.raises(env.EnvError, match="MLX_LM_PATCHES_DISABLE"):
        env.id_list(env.DISABLE, environ={env.DISABLE: raw})
