"""Repository-wide pytest set-up: hardware markers and RNG isolation between tests."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest

# torch >= 2.5 imports out-of-tree device backends (torch_npu) on `import torch`; a
# torch_npu without Ascend libraries would break every test, so tests load it explicitly.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402


def _has_npu() -> bool:
    try:
        import torch_npu  # noqa: F401

        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = torch.cuda.is_available()
    need_npu = any("npu" in item.keywords for item in items)
    has_npu = _has_npu() if need_npu else False
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "npu" in item.keywords and not has_npu:
            item.add_marker(pytest.mark.skip(reason="needs an Ascend NPU with torch_npu"))


@pytest.fixture(autouse=True)
def _isolate_rng() -> Iterator[None]:
    """Give every test the process RNG state and platform selection it found, back afterwards.

    That covers the CPU platform's cursor and, once a test has registered it, every
    generator of the simulated device (``torch.manual_seed`` seeds those too).
    """
    import hyperrng.platforms.registry as registry
    import numpy as np
    from hyperrng.platforms.cpu import CPUPlatform
    from hyperrng.platforms.simulated import _Backend

    host = CPUPlatform()
    py_state, np_state, host_state = random.getstate(), np.random.get_state(), host.get_rng_state()
    sim = _Backend.module
    sim_states = [g.get_state() for g in sim.default_generators] if sim is not None else []
    sim_device = sim.current_device() if sim is not None else 0
    selection = registry._selection
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        host.set_rng_state(host_state)
        if sim is not None:
            sim.set_device(sim_device)
            for gen, state in zip(sim.default_generators, sim_states):
                gen.set_state(state)
        registry._selection = selection
