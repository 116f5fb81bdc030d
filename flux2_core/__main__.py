"""``python -m flux2_core``: the main job (see cli.py)."""

import sys

from .app.cli import main

sys.exit(main())
