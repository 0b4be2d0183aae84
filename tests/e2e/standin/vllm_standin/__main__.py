"""``python3 -m vllm_standin serve MODEL ...`` (what ``/usr/local/bin/vllm`` runs)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
