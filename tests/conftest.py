import dflash2_mlx  # noqa: F401  (first: loads the fast BLAS before MLX is imported)

import pytest

from fixtures import drafter_args, write_drafter, write_target


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def llama_dir(fixture_dir):
    return write_target(fixture_dir / "llama", "llama", seed=0)


@pytest.fixture(scope="session")
def qwen3_dir(fixture_dir):
    return write_target(fixture_dir / "qwen3", "qwen3", seed=1)


@pytest.fixture(scope="session")
def dflash2_dir(fixture_dir):
    return write_drafter(fixture_dir / "dflash2", drafter_args(dflash2=True), seed=2)


@pytest.fixture(scope="session")
def dflash_dir(fixture_dir):
    return write_drafter(fixture_dir / "dflash", drafter_args(dflash2=False), seed=3)
