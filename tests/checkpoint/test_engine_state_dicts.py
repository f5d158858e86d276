"""Stage-3 state dicts (lzero/checkpoint/state_dict.py) against the plain ``state_dict`` of the same model, at world
sizes 2, 3 and 4: sharded pieces, ``full_tensor()``, tied keys and the consolidated dict on rank 0."""

from __future__ import annotations

import pytest

from _dist import run_ranks
import _engine_cases as cases


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_stage3_sharded_and_full_state_dicts(world_size: int) -> None:
    for rank, res in enumerate(run_ranks(cases.stage3_state_dicts, world_size, timeout=300)):
        assert res["keys"] == res["reference_keys"], (rank, res["keys"], res["reference_keys"])
        assert res["shapes"] == res["reference_shapes"], (rank, res["shapes"], res["reference_shapes"])
        assert res["tied_same_object"], (rank, "embed.weight and head.weight are two objects")
        assert res["pieces_differ"] == [], (rank, "pieces differ from the reference", res["pieces_differ"])
        assert res["full_tensor_differs"] == [], (rank, "full_tensor() differs", res["full_tensor_differs"])
        assert res["still_gathered"] == [], (rank, "blocks left gathered", res["still_gathered"])
        consolidated = res["reference_keys"] if rank == 0 else []  # rank 0 holds the consolidated dict
        assert res["consolidated_keys"] == consolidated, (rank, res["consolidated_keys"])
        assert res["consolidated_differ"] == [], (rank, "consolidated values differ", res["consolidated_differ"])
