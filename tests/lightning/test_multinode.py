"""Multi-node through an existing launcher: two torchrun "nodes" on 127.0.0.1 vs one node, 2 processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--trainer.max_steps", "6", "--trainer.log_every_n_steps", "1", "--trainer.limit_val_batches", "0",
         "--trainer.enable_progress_bar", "false", "--model.init_args.n_layer", "2",
         "--model.init_args.n_embd", "64"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(save_dir: Path, extra: list[str]) -> list[str]:
    return ["--config", str(ROOT / "configs/demo_zero2.yaml"), *SMALL,
            "--trainer.logger.init_args.save_dir", str(save_dir), *extra]


def losses_and_weights(save_dir: Path) -> tuple[list[float], dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = next(save_dir.glob("demo/version_*"))
    events = EventAccumulator(str(run))
    events.Reload()
    losses = [e.value for e in events.Scalars("train_loss")]
    from lzero.cli import main

    plain = save_dir / "consolidated.ckpt"  # last.ckpt is a sharded directory; the command makes one file
    assert main(["consolidate", str(run / "checkpoints" / "last.ckpt"), str(plain)]) == 0
    state = torch.load(plain, weights_only=True)["state_dict"]
    # the GPT's tied embedding/head stays one tensor in the consolidated file
    assert state["model.lm_head.weight"].data_ptr() == state["model.wte.weight"].data_ptr()
    return losses, state


def test_two_torchrun_nodes_equal_one_node_bitwise(tmp_path: Path) -> None:
    # the same threads per process in both layouts (Lightning divides the cores by local processes)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    single = tmp_path / "single"
    subprocess.run([sys.executable, "-m", "lzero.cli", "fit", *cli(single, [])], check=True, cwd=tmp_path,
                   env=env, capture_output=True, timeout=300)
    multi = tmp_path / "multi"
    port = str(free_port())
    nodes = [
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                          "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", port,
                          "-m", "lzero.cli", "fit", *cli(multi, ["--trainer.num_nodes", "2", "--trainer.devices", "1"])],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)
    ]
    for node in nodes:
        out, _ = node.communicate(timeout=300)
        assert node.returncode == 0, out[-6000:]
    single_losses, single_weights = losses_and_weights(single)
    multi_losses, multi_weights = losses_and_weights(multi)
    assert len(single_losses) == 6
    assert multi_losses == single_losses
    for key, value in single_weights.items():
        assert torch.equal(multi_weights[key], value), key
