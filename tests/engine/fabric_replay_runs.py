"""Fabric's ``init_module(empty_init=True)`` then initialization after it, as litgpt scripts do, for models whose
construction takes branches on the meta device: a module whose ``reset_parameters`` skips its draw there, and a
Hugging Face Llama whose transformers import happens inside the build. Rank 0 writes the set-up model's state dict.

    python fabric_replay_runs.py STRATEGY OUT
"""

import sys

import lightning as L
import torch

from replay_runs import Branchy  # a sibling: scripts run from their folder

strategy, out = sys.argv[1], sys.argv[2]
fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
fabric.seed_everything(0)
with fabric.init_module(empty_init=True):
    from transformers import AutoModelForCausalLM, LlamaConfig

    branchy = Branchy()
    llama = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
branchy.reset_parameters()  # eager code draws here; on lzero's fake device too
branchy.head.reset_parameters()
branchy.embed.reset_parameters()
llama.apply(llama._init_weights)
model = torch.nn.ModuleDict({"branchy": branchy, "llama": llama})
model = fabric.setup_module(model)
state = {k: v.clone() for k, v in model.state_dict().items()}
if fabric.global_rank == 0:
    torch.save({"state": state, "rng": torch.get_rng_state()}, out)
