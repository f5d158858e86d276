"""A tiny litgpt checkpoint folder made with litgpt's own classes (random weights) and a word-level tokenizer built
with ``tokenizers``, plus an instruction dataset in litgpt's JSON format: nothing downloaded.

    python make_litgpt_checkpoint.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
from litgpt import GPT, Config
from litgpt.utils import save_config
from tokenizers import Tokenizer, models, pre_tokenizers

WORDS = ("the a cat dog sat ran on under mat log red blue big small is was and to of in what where who why how"
         " answer question write say name color animal").split()


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *WORDS, ".", ",", ":", "#", "\n", "?"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                                                             "tokenizer_class": "PreTrainedTokenizerFast"}))
    config = Config(name="tiny-llama", block_size=64, vocab_size=len(vocab), padded_vocab_size=64, n_layer=2, n_head=4,
                    n_embd=32, n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
                    norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64)
    save_config(config, out)
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), out / "lit_model.pth")
    torch.manual_seed(1)
    rows = []
    for i in range(32):
        words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (6,))]
        rows.append({"instruction": " ".join(words[:3]), "input": "", "output": " ".join(words[3:])})
    (out / "data.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
