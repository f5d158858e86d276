"""litgpt's own command line (the function its ``litgpt`` console script calls), so that tests can start its ranks as
torchrun does. Nothing of litgpt is changed: ``python litgpt_cli.py finetune_full ...`` is ``litgpt finetune_full ...``."""

import sys

from litgpt.__main__ import main

if __name__ == "__main__":
    sys.argv = ["litgpt", *sys.argv[1:]]
    main()
