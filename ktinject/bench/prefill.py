"""Prefill throughput: ktinject (eager, chunked) and HF at 128/1024/8192 prompt tokens (see bench.decode)."""
from __future__ import annotations

import sys

from ktinject.bench.decode import main_prefill as main

if __name__ == "__main__":
    sys.exit(main())
