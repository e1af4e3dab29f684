"""``python -m ktinject COMMAND [options]``: the ``ktinject`` command (``ktinject.cli.main``)."""
import sys

from ktinject.cli.main import main

sys.exit(main())
