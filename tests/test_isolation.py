"""The test session's own set-up (tests/conftest.py): its package cache and its markers."""

import ast
from pathlib import Path


def test_the_tests_never_write_the_users_cache(test_cache):
    """Tests wrote calibration.json and downloads into the real $DFLASH2_CACHE default."""
    from dflash2_mlx.loading import assets
    from dflash2_mlx.policy import calibration

    assert assets.resolve_cache_dir() == test_cache
    assert calibration.cache_file().parent == test_cache


def test_the_slow_list_names_tests_that_exist():
    """`slow` is applied from a list of names: a renamed test or fixture must not drop out of
    it unseen."""
    import conftest

    here = Path(__file__).parent
    for key in conftest.SLOW:
        module, name = key.split("::")
        tree = ast.parse((here / f"{module}.py").read_text())
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, \
            f"tests/conftest.py SLOW: {key} names no test or fixture"
    for module in conftest.MODULE_MARKS:
        assert (here / f"{module}.py").is_file(), f"tests/conftest.py MODULE_MARKS: {module}"
