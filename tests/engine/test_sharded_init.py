"""Stage 3 from the meta device at world size 2: a model materialized block by block costs each rank
less than the full model, is one model on every rank, and trains exactly as a plain copy of the same
initial weights does (tests/_engine_cases.py ``stage3_sharded_init``)."""

from __future__ import annotations

from _dist import run_ranks
import _engine_cases as cases


def test_stage3_sharded_init_from_meta_device() -> None:
    for rank, r in enumerate(run_ranks(cases.stage3_sharded_init, 2, timeout=300)):
        print(f"rank {rank}: RSS grew {r['growth']} bytes while materializing a {r['full_bytes']}-byte model;"
              f" losses {r['losses']} (plain copy {r['ref_losses']}), max relative parameter difference"
              f" {r['max_rel']:.2e}")
        assert r["tied"]
        assert r["growth"] < r["full_bytes"]  # each rank holds its shards + one block, not the model
        assert r["same_as_rank0"]  # the same RNG on every rank: one model, not two
        assert r["losses"] == r["ref_losses"] and r["max_rel"] < 1e-6  # trains as the plain copy does
        # initialized by reset_parameters(): Linear's kaiming-uniform std 1/sqrt(3 * fan_in) for 1024 inputs
        assert abs(r["initial_std"]["blocks.0.fc.weight"] * (3 * 1024) ** 0.5 - 1) < 0.02
