"""Loading the scripts of tools/ as modules."""

import importlib.util
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[3] / "tools"


@pytest.fixture(scope="module")
def load_tool():
    """``load_tool(name)``: tools/<name>.py as a fresh module, imported as the script imports its
    neighbours (benchmark_report) when run."""

    def load(name):
        sys.path.insert(0, str(TOOLS))
        try:
            spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(TOOLS))
        return module

    return load
