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


def _reads_of_our_variables(path):
    """``(line, variable)`` for every read of the environment in ``path`` whose key is one of
    ours (a literal ``MLX_LM_PATCHES...`` or one of env.py's names for them)."""
    import ast

    names = {key for key, value in vars(env).items() if isinstance(value, str) and value in env.VARIABLES}

    def ours(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value if node.value.startswith("MLX_LM_PATCHES") else None
        name = getattr(node, "id", None) or getattr(node, "attr", None)
        return getattr(env, name) if name in names else None

    def environ(node):
        return (getattr(node, "attr", None) or getattr(node, "id", None)) in ("environ", "getenv")

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        key = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr in ("get", "pop") and environ(func.value)) or environ(func):
                key = ours(node.args[0])
        elif isinstance(node, ast.Subscript) and environ(node.value):
            key = ours(node.slice)
        elif isinstance(node, ast.Compare) and any(environ(c) for c in node.comparators):
            key = ours(node.left)
        if key:
            found.append((node.lineno, key))
    return found


def test_only_env_py_parses_the_variables():
    """One parser: no module but env.py reads a variable of ours from the environment. The one
    exception is the bootstrap's ``MLX_LM_PATCHES`` at interpreter start (it imports nothing for
    the common values; a test below keeps its words env.py's)."""
    import pathlib

    import mlx_lm_patches

    root = pathlib.Path(mlx_lm_patches.__file__).parent
    allowed = {("_activation/_mlx_lm_patches_boot.py", env.ENABLED)}
    found = {}
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if where == "engine/env.py":
            continue
        reads = [(line, key) for line, key in _reads_of_our_variables(path) if (where, key) not in allowed]
        if reads:
            found[where] = reads
    assert found == {}, f"read outside engine/env.py (use env.setting / env.read / env.given): {found}"


def test_the_bootstrap_decides_with_env_py_words():
    import importlib.util
    import pathlib

    # the sources (a wheel installs these two files at the top of site-packages)
    path = pathlib.Path(__file__).resolve().parents[1] / "mlx_lm_patches" / "_activation" / "_mlx_lm_patches_boot.py"
    spec = importlib.util.spec_from_file_location("_boot_words_under_test", path)
    boot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(boot)  # defines, arms nothing
    assert set(boot._ON) == set(env._TRUE) | {""}
    assert set(boot._OFF) == set(env._FALSE)
    # the .pth line skips importing the bootstrap for the same "off" words
    import ast
    import re

    pth = (path.parent / "mlx_lm_patches.pth").read_text()
    off = ast.literal_eval(re.search(r"not in (\([^)]*\))", pth).group(1))
    assert set(off) == set(env._FALSE), pth
