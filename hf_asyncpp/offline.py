"""Whether the Hub can be reached, asked once, and the cache used at once when it cannot.

Without ``HF_HUB_OFFLINE``, a machine that cannot reach the Hub (no network, a firewall, a cluster's compute nodes)
meets it in every Hub load: ``huggingface_hub`` retries each request five times with backoff, so one model id took
11 retry lines and 38 s before its error, a recipe with a Hub model and tokenizer 22 lines and 62 s, and none of the
final lines said that ``HF_HUB_OFFLINE=1`` or the cache was the way out. :func:`hub_unreachable` asks once (one
``HEAD`` of the endpoint, a short timeout, no retry) before the first Hub load of a run or a tool. When the Hub
cannot be reached, a name that is in the cache is read from it, and :func:`go_offline` switches the libraries to
offline mode for the rest of the process and for the processes it starts (one line says so); a name that is not in
the cache gets one error line with the way out (:func:`offline_advice`).
"""
from __future__ import annotations

import functools
import os
import sys

from huggingface_hub import constants
from huggingface_hub.utils import get_session

PROBE_TIMEOUT_S = 3.0
"""How long the one request may take: a reachable Hub answers a HEAD of its front page in well under a second; a
firewall that drops packets would otherwise hold every load for the library's full timeout and retries."""
_said: list[str] = []  # what go_offline's line named: it is printed once per process


@functools.cache
def hub_unreachable() -> str | None:
    """Why the Hub (``HF_ENDPOINT``) cannot be reached, in a few words; None when it answers (any HTTP status:
    the network works), or when offline mode is on (nothing will be asked of it)."""
    if constants.HF_HUB_OFFLINE:
        return None
    try:
        get_session().head(constants.ENDPOINT, timeout=PROBE_TIMEOUT_S, follow_redirects=False)
    except Exception as e:  # noqa: BLE001 - httpx's connect and timeout errors, OSError from the resolver
        return f"{type(e).__name__}: {' '.join(str(e).split()) or 'no answer'}"[:200]
    return None


def switch_offline() -> None:
    """Offline mode for the rest of this process (``huggingface_hub``'s and ``datasets``' own switches, read at
    each load) and for the processes it starts (``HF_HUB_OFFLINE=1`` in the environment they inherit)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:  # imported: its copy of the switch was read at its import
        sys.modules["datasets"].config.HF_HUB_OFFLINE = True


def go_offline(why: str, what: str) -> None:
    """:func:`switch_offline`, after ``what`` was found in the cache; one line says so, the first time."""
    if not _said:
        _said.append(what)
        print(f"hf_asyncpp: {unreachable(why)}; {what} is in the cache, so "
              "this run reads the cache only (HF_HUB_OFFLINE=1 for it; set it yourself to skip this check)", flush=True)
    switch_offline()


def unreachable(why: str) -> str:
    """The words for the Hub out of reach, in every line that says so."""
    return f"the Hub ({constants.ENDPOINT}) cannot be reached ({why})"


def offline_advice(name: str, why: str) -> str:
    """The end of an error line for a Hub id that the Hub cannot serve and the cache does not hold."""
    return (f"{unreachable(why)} and {name!r} is not in the cache "
            f"({constants.HF_HUB_CACHE}); download it where the Hub is reachable (`hf download {name}`, into the "
            "same cache or HF_HOME), give a local folder, or set HF_HUB_OFFLINE=1 once the cache holds it")
