"""Waits until a gateway lists a served model (every service of its stack is up): exit 0, or 1 after the timeout.

python3 benchmark/wait_models.py URL TIMEOUT_S
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request


def main(url: str, timeout_s: float) -> int:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                if json.load(r)["data"]:
                    return 0
        except (OSError, urllib.error.URLError, ValueError, KeyError):
            pass
        time.sleep(1.0)
    print(f"no model served at {url} after {timeout_s:.0f} s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2])))
