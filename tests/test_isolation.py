"""The test session runs in its own package cache (tests/conftest.py)."""


def test_the_tests_never_write_the_users_cache(test_cache):
    """Tests wrote calibration.json and downloads into the real $DFLASH2_CACHE default."""
    from dflash2_mlx import adaptive, assets

    assert assets.resolve_cache_dir() == test_cache
    assert adaptive.cache_file().parent == test_cache
