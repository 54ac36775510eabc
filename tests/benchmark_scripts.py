"""A script of benchmarks/ loaded as a module from its file, for the tests: benchmarks/ never
stays on sys.path, where its megatron.py would hide megatron-core."""

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up while the class is made)
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:  # a script puts benchmarks/ first
        sys.path[:] = path
    return module
