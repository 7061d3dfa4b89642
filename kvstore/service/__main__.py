"""``python -m kvstore.service``: the same as ``kvstore serve``."""

import sys

from kvstore.service.cli import main

sys.exit(main())
