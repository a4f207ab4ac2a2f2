"""The package's modules import one another without cycles, function-level imports included
(the graph of benchmarks/code_shape.py, loaded from its file)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def code_shape():
    spec = importlib.util.spec_from_file_location("code_shape",
                                                  ROOT / "benchmarks" / "code_shape.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_has_no_import_cycles(code_shape):
    graph = code_shape.import_graph()
    # the graph sees relative, absolute and function-level imports (or it would prove nothing)
    assert "dflash2_mlx.loading.weights" in graph["dflash2_mlx.loading.gguf"]             # from .weights import
    assert "dflash2_mlx.loading.gguf" in graph["dflash2_mlx.loading.checkpoint"]             # inside load_target
    assert "dflash2_mlx.model.kernels.ops" in graph["dflash2_mlx.model.kernels.metal"]
    assert "dflash2_mlx.train.trainer" in graph["dflash2_mlx.train.recipe"]
    assert code_shape.cycles(graph) == []


def test_the_cycle_finder_finds_cycles(code_shape):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(code_shape.cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
