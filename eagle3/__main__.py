"""``python -m eagle3`` is the ``eagle3`` command."""

import sys

from eagle3.cli import main

sys.exit(main())
