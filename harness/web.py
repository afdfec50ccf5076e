"""The tests' one HTTP client.

`httpx.get()` and its siblings build a Client for each call, and every Client an SSL context loaded from
certifi's bundle: about 15 ms of CPU on an idle machine and 45 ms on a busy one, for plain-HTTP requests to
local processes. Readiness waits poll at 10 Hz, so under `pytest -n 3` this was most of the test processes'
own CPU (py-spy over their samples: 84 %, half of it in `wait_http`). One Client serves them all instead:
httpx documents a Client as safe to share between threads, and with no connections kept alive and no limit
on how many are open at once, every request opens and closes its own connection, as `httpx.get()` did.
"""

from __future__ import annotations

import httpx

web = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
