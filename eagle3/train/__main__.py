"""``python -m eagle3.train PARAMS.yaml --run-dir DIR`` (works under ``torchrun`` too)."""

import sys

from eagle3.train.stage import main

if __name__ == "__main__":
    sys.exit(main())
