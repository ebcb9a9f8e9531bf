"""Repository-wide pytest set-up: hardware markers and RNG isolation between tests."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator

import pytest

# torch >= 2.5 imports out-of-tree device backends (torch_npu) on `import torch`; a
# torch_npu without Ascend libraries would break every test, so tests load it explicitly.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

# A shell starts background jobs with Ctrl-C (SIGINT) ignored, and Python then installs no handler of
# its own: the tests of Ctrl-C during saves, loads and seeding need the one a terminal's Python has.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _has_npu() -> bool:
    try:
        import torch_npu  # noqa: F401

        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    except Exception:
        return False


SIM_FIXTURES = frozenset({"sim"})
"""Fixtures that hand a test the simulated device: a test that asks for one needs it."""

SIM_PARAMETERS = frozenset({"sim", "plugin-without-generator"})
"""Parameter values (the platform tables of ``tests/_platforms.py``, ``parametrize`` over platform
names, alone or first in a tuple of parameters) that run a test on the simulated device, or on a
plug-in built on it."""


def _uses_sim(item: pytest.Item) -> bool:
    """Whether ``item`` runs on the simulated device: marked ``needs_sim`` (itself or its module), asks
    for a fixture of :data:`SIM_FIXTURES`, or is the instance of a parametrised test that runs on it."""
    if item.get_closest_marker("needs_sim") is not None:
        return True
    if SIM_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    values = [v for value in params.values() for v in (value if isinstance(value, tuple) else (value,))]
    return any(isinstance(value, str) and value in SIM_PARAMETERS for value in values)


FAKE_PG_FIXTURES = frozenset({"fake_world"})
"""Fixtures that start a process group on torch's built-in "fake" backend (torch >= 2.9)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch.distributed as dist
    from hyperrng.platforms import _features

    # torch's own "fake" backend (torch >= 2.9): torch 2.5's DCP registers one of its own, with another mesh API
    has_fake_pg = "fake" in getattr(dist.Backend, "backend_list", ()) and torch.torch_version.TorchVersion(
        torch.__version__
    ) >= (2, 9)

    has_cuda = torch.cuda.is_available()
    triton_refusal = _triton_refusal(items)
    need_npu = any("npu" in item.keywords for item in items)
    has_npu = _has_npu() if need_npu else False
    sim, local_tensor = _features.feature("sim"), _features.feature("local-tensor")
    portable_mode, user_generator = _features.feature("portable-mode"), _features.feature("user-generator")
    portable_compile = _features.feature("portable-compile")
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "npu" in item.keywords and not has_npu:
            item.add_marker(pytest.mark.skip(reason="needs an Ascend NPU with torch_npu"))
        if not sim.available and _uses_sim(item):
            item.add_marker(pytest.mark.skip(reason=sim.refusal()))
        if not portable_mode.available and item.get_closest_marker("needs_portable_mode") is not None:
            item.add_marker(pytest.mark.skip(reason=portable_mode.refusal()))
        if not portable_compile.available and item.get_closest_marker("needs_portable_compile") is not None:
            item.add_marker(pytest.mark.skip(reason=portable_compile.refusal()))
        if not local_tensor.available and item.get_closest_marker("needs_local_tensor") is not None:
            item.add_marker(pytest.mark.skip(reason=local_tensor.refusal()))
        if not user_generator.available and item.get_closest_marker("needs_user_generator") is not None:
            item.add_marker(pytest.mark.skip(reason=user_generator.refusal()))
        if triton_refusal is not None and item.get_closest_marker("needs_triton") is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs a Triton that runs the kernels: {triton_refusal}"))
        if not has_fake_pg and FAKE_PG_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            reason = f"needs torch's built-in 'fake' process-group backend (torch >= 2.9); this is {torch.__version__}"
            item.add_marker(pytest.mark.skip(reason=reason))


def _triton_refusal(items: list[pytest.Item]) -> str | None:
    """Why Triton's interpreter cannot run the kernels here (``None``: it can), asked only where a collected
    test needs it: a test draw costs a second."""
    if not any(item.get_closest_marker("needs_triton") is not None for item in items):
        return None
    from hyperrng.philox import backends

    return backends.interpreter_refusal()


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
