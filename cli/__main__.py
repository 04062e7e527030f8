"""``python -m cli``: the ``pdserve`` command."""

import sys

from cli.main import main

sys.exit(main())
