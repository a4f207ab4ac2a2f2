"""The test session's own set-up (tests/conftest.py): its package cache and its markers."""

import re
from pathlib import Path


def test_the_tests_never_write_the_users_cache(test_cache):
    """Tests wrote calibration.json and downloads into the real $DFLASH2_CACHE default."""
    from dflash2_mlx.loading import assets
    from dflash2_mlx.policy import calibration

    assert assets.resolve_cache_dir() == test_cache
    assert calibration.cache_file().parent == test_cache


def test_every_slow_test_says_what_it_costs():
    """`slow` is a marker on the test itself, with the seconds it took beside it in a comment
    (tests/conftest.py says how they were measured): `@pytest.mark.slow  # 12 s: ...`."""
    here = Path(__file__).parent
    marked = 0
    for path in sorted(here.glob("test_*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*@pytest\.mark\.slow\b", line):
                marked += 1
                assert re.search(r"# [0-9][0-9-]* s\b", line), \
                    f"tests/{path.name}:{n}: a slow test without its seconds"
    assert marked, "no test is marked slow"
