"""Stage-3 state dicts (lzero/checkpoint/state_dict.py) against the plain ``state_dict`` of the same model, at world
sizes 2, 3 and 4: sharded pieces, ``full_tensor()``, tied keys and the consolidated dict on rank 0."""

from __future__ import annotations

import pytest

from _dist import run_ranks
import _engine_cases as cases


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_stage3_sharded_and_full_state_dicts(world_size: int) -> None:
    for res in run_ranks(cases.stage3_state_dicts, world_size, timeout=300):
        assert all(res.values()), res
