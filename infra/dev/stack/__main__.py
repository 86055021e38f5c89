"""The Serve driver: ``python -m infra.dev.stack ACTION ADDRESS`` prints one JSON line (see ``app.py``)."""

from __future__ import annotations

import json
import sys

from infra.dev.stack.app import serve_action

if __name__ == "__main__":
    print(json.dumps(serve_action(sys.argv[1], sys.argv[2])), flush=True)
