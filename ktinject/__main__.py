"""``python -m ktinject COMMAND [options]``: the ``ktinject`` command (``ktinject.cli.main``)."""
import sys

from ktinject.cli import main

sys.exit(main())
