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


@pytest.mark.parametrize("name", [n for n in env.VARIABLES if n != env.DISABLE])
def test_every_variable_reads_its_default_when_unset_and_rejects_garbage(name):
    default = env.VARIABLES[name].default
    assert env.read(name, environ={}) == default
    assert env.read(name, environ={name: "  "}) == default
    with pytest.raises(env.EnvError) as info:
        env.read(name, environ={name: "maybe"})
    assert f"{name}='maybe'" in str(info.value)
    assert env.VARIABLES[name].accepted in str(info.value)


def test_setting_never_raises_and_reports_once(caplog):
    name = env.ROLLBACK_SNAPSHOTS
    environ = {name: "many"}
    with caplog.at_level("WARNING", logger="mlx_lm_patches"):
        assert [env.setting(name, environ) for _ in range(3)] == [32, 32, 32]
        assert env.setting(name, {name: "5"}) == 5
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["mlx-lm-patches: MLX_LM_PATCHES_ROLLBACK_SNAPSHOTS='many' is not understood; "
                     "accepted values: a positive integer; using the default (32)"]


def test_problems_lists_every_malformed_variable_but_the_switch():
    environ = {env.ENABLED: "maybe", env.STRICT: "maybe", env.PREFIX_CHECKPOINTS: "-1",
               env.DEBUG: "1", env.DISABLE: "a-b"}
    named = [str(e).split("=")[0] for e in env.problems(environ)]
    assert named == [env.STRICT, env.PREFIX_CHECKPOINTS]


def test_unknown_variable_name_is_a_programming_error():
    with pytest.raises(KeyError, match="MLX_LM_PATCHES_NOPE"):
        env.read("MLX_LM_PATCHES_NOPE")


def test_a_malformed_value_is_the_default_not_an_explicit_setting(monkeypatch, caplog):
    """Setting ``MLX_LM_PATCHES_PREFIX_CHECKPOINTS`` turns prefill cuts on before any prompt-cache
    store exists; a typo in it is reported and means the default - unset - so it turns nothing
    on."""
    from mlx_lm_patches.mechanisms.prefix_reuse import settings

    name = env.PREFIX_CHECKPOINTS
    assert env.given(name, {name: " 4 "}) and env.given(name, {name: "0"})
    assert not env.given(name, {}) and not env.given(name, {name: "  "})
    monkeypatch.setenv(name, "maybe!")
    with caplog.at_level("WARNING", logger="mlx_lm_patches"):
        assert not env.given(name)
        assert settings.max_checkpoints() == 8
        assert not settings.capturing({}), "a malformed value turned prefill cuts on"
    assert settings.capturing({settings.STORE_SEEN: True})
    monkeypatch.setenv(name, "8")
    assert settings.capturing({})
    said = [r.getMessage() for r in caplog.records if "PREFIX_CHECKPOINTS='maybe!'" in r.getMessage()]
    assert len(said) <= 1, said  # once per process (an earlier test may have said it already)
