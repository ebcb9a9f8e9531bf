"""The documented limits (docs/limits.md, summed up in the README), shown: what they say does happen, and the
way around each one works."""

from __future__ import annotations

import re
from pathlib import Path

import hyperrng.platforms as platforms
import pytest
import torch
import torch.nn.functional as F

import hyperrng
from tests._dist import run_ranks

LIMITS = (Path(__file__).resolve().parents[2] / "docs" / "limits.md").read_text()
_WIDTH, _HIDDEN, _BATCH, _SEED = 8, 16, 4, 7


def _limits() -> str:
    return LIMITS


def _masks_under_colwise_parallel(rank: int, world_size: int) -> dict[str, list[list[bool]]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    out = {}
    with platforms.use(platforms.CPUPlatform()):
        mesh = init_device_mesh("cpu", (world_size,))
        for label, local in (("local", True), ("dtensor", False)):
            torch.manual_seed(0)
            model = parallelize_module(torch.nn.Linear(_WIDTH, _HIDDEN), mesh, ColwiseParallel(use_local_output=local))
            with hyperrng.portable_random(_SEED):
                y = F.dropout(model(torch.ones(_BATCH, _WIDTH)), 0.5)
            out[label] = (y if local else y.to_local()).ne(0).tolist()
    return out


@pytest.mark.multiproc
@pytest.mark.needs_portable_mode
def test_dropout_on_a_colwise_parallel_local_output_is_not_sharding_aware_and_on_its_dtensor_output_it_is() -> None:
    assert re.search(r"ColwiseParallel\(\)\)`\s+hands on a local \(non-DTensor\) output", _limits())
    assert "ColwiseParallel(use_local_output=False)" in _limits()
    with platforms.use(platforms.CPUPlatform()):
        torch.manual_seed(0)
        model = torch.nn.Linear(_WIDTH, _HIDDEN)
        with hyperrng.portable_random(_SEED):
            full = F.dropout(model(torch.ones(_BATCH, _WIDTH)), 0.5).ne(0)
        masks = run_ranks(_masks_under_colwise_parallel, 2)
    columns = [full[:, r * _HIDDEN // 2 : (r + 1) * _HIDDEN // 2].tolist() for r in range(2)]
    assert [m["dtensor"] for m in masks] == columns, "a DTensor output draws the unsharded run's masks"
    assert [m["local"] for m in masks] != columns, "a local output draws masks of its own"
