"""Pushes to the Hugging Face Hub, in the background, from the main process.

``Pusher`` uploads on one worker thread of its own (so pushes land in order) while every stage keeps training: a
folder is handed over as a snapshot (hard links, so pruning or the next export cannot change it mid-upload) and
removed once uploaded. The token comes from the environment (``HF_TOKEN``) or the cached login; it is never printed
or logged (error texts are scrubbed of anything token-shaped). A failed upload is retried with backoff, then
reported; the local folder is always kept. ``wait()`` at the end of a run returns the commits, and
``raise_failures()`` then ends the run with a :class:`HubError` if a push never landed. :func:`check_repo` is the
Trainer's check at its start (token and repository), so that a bad token fails in the first seconds, not after the
training.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..config.sections import HubConfig
from ..errors import HubError
from ..storage.names import EXPORT_DIR

log = logging.getLogger("hf_asyncpp.hub")
# Every token form huggingface_hub knows: user access tokens (hf_...), OAuth access and refresh tokens
# (hf_oauth_...), organization API tokens (api_org_...), and whatever follows "Bearer" in a header.
# (User tokens are hf_ + 34 letters and digits; 16 is the floor, so that names like hf_asyncpp stay readable.)
_TOKEN = re.compile(r"\b(?:hf|api_org)_[A-Za-z0-9_]{16,}|(?<=Bearer )[^\s'\"]+")
_TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_API_TOKEN")


def _scrub(text: str) -> str:
    """``text`` without tokens: the token-shaped strings, and the token values set in the environment (any form)."""
    for name in _TOKEN_ENV:
        value = os.environ.get(name, "").strip()
        if len(value) >= 8:
            text = text.replace(value, "***")
    return _TOKEN.sub("***", text)


def cause_of(e: BaseException) -> str:
    """The first line of an error, without tokens."""
    text = str(e).strip().splitlines()
    return _scrub(f"{type(e).__name__}: {text[0] if text else ''}")


def check_repo(cfg: HubConfig) -> None:
    """As the Trainer does at its start (``init_hf_repo``): the token is accepted (``whoami``) and the repository
    exists or can be created (``create_repo(exist_ok=True)``); a HubError naming the token or ``hub.hub_model_id``."""
    import huggingface_hub  # looked up at call time: the network edge tests replace HfApi

    api = huggingface_hub.HfApi()
    try:
        user = api.whoami().get("name", "?")
    except Exception as e:  # noqa: BLE001 - no token, a refused token and no network all end here
        raise HubError(f"hub.push_to_hub: the Hugging Face Hub does not accept the token ({cause_of(e)}); log in with "
                       "`hf auth login` or set HF_TOKEN, check that the Hub is reachable, or set hub.push_to_hub=false") from None
    try:
        api.create_repo(cfg.hub_model_id, private=cfg.private, exist_ok=True, repo_type="model")
    except Exception as e:  # noqa: BLE001 - a bad name, a namespace the token may not write to
        raise HubError(f"hub.hub_model_id: {cfg.hub_model_id!r} cannot be created or used by {user} ({cause_of(e)}); "
                       "choose a repository the token may write to") from None


REFUSED = (401, 403)
"""HTTP statuses of a refused token or a forbidden repository: no retry can succeed, so none is made."""


def _status(e: BaseException) -> int | None:
    """The HTTP status behind a huggingface_hub error (its ``response``), None for others (a network error)."""
    return getattr(getattr(e, "response", None), "status_code", None)


def push_folder(folder: str | Path, cfg: HubConfig, *, path_in_repo: str | None = None, commit_message: str = "",
                retries: int = 3, backoff_s: float = 2.0, failures: list[str] | None = None) -> str | None:
    """create_repo + upload_folder with retries; returns the commit URL, or None after the last failure (then
    appended to ``failures``)."""
    import huggingface_hub  # looked up at call time: the network edge tests replace HfApi

    folder = Path(folder)
    api = huggingface_hub.HfApi()
    last = None
    for attempt in range(1, retries + 1):
        try:
            api.create_repo(cfg.hub_model_id, private=cfg.private, exist_ok=True, repo_type="model")
            info = api.upload_folder(repo_id=cfg.hub_model_id, folder_path=str(folder), path_in_repo=path_in_repo,
                                     commit_message=commit_message or f"hf_asyncpp: upload {folder.name}", repo_type="model")
            url = getattr(info, "commit_url", None) or str(info)
            log.info("pushed %s to %s", folder, cfg.hub_model_id)
            return url
        except Exception as e:  # noqa: BLE001 - a transient failure is retried; every failure is reported
            last = _scrub(f"{type(e).__name__}: {e}")
            log.warning("push of %s to %s failed (attempt %d/%d): %s", folder, cfg.hub_model_id, attempt, retries, last)
            if _status(e) in REFUSED:
                break
            if attempt < retries:
                time.sleep(backoff_s * attempt)
    log.error("giving up pushing %s to %s after %d attempt(s) (%s); the local copy is kept", folder, cfg.hub_model_id,
              attempt, last)
    if failures is not None:
        failures.append(f"{folder.name}: {last}")
    return None


def snapshot(folder: Path, into: Path) -> Path:
    """A hard-linked copy of ``folder`` (instant, no extra space) that later writes and deletions do not touch."""
    shutil.rmtree(into, ignore_errors=True)
    into.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(folder, into, copy_function=os.link)
    return into


class Pusher:
    """Background pushes of one run, in order, on one worker thread."""

    def __init__(self, cfg: HubConfig):
        self.cfg = cfg
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_asyncpp-hub")
        self.futures: list[Future] = []
        self.failures: list[str] = []  # "folder: cause" of each push that never landed

    def push(self, folder: Path, *, path_in_repo: str | None = None, commit_message: str = "",
             remove_after: bool = False) -> Future:
        def job():
            try:
                return push_folder(folder, self.cfg, path_in_repo=path_in_repo, commit_message=commit_message,
                                   failures=self.failures)
            finally:
                if remove_after:
                    shutil.rmtree(folder, ignore_errors=True)

        fut = self.pool.submit(job)
        self.futures.append(fut)
        return fut

    def wait(self) -> list[str | None]:
        """Block until every push is done; their commit URLs (None for a push that failed)."""
        results = [f.result() for f in self.futures]
        self.pool.shutdown(wait=True)
        return results

    def raise_failures(self, out: Path) -> None:
        """After ``wait()``, once every file of the run is written: a HubError if any push never landed, so that
        the run does not end as a success with its model missing from the Hub."""
        if self.failures:
            export = out / EXPORT_DIR
            folder = export if export.is_dir() else "FOLDER"
            raise HubError(f"hub.hub_model_id: {len(self.failures)} push(es) to {self.cfg.hub_model_id!r} failed "
                           f"({'; '.join(self.failures)}); the run's files are kept in {out}: upload them with "
                           f"`hf upload {self.cfg.hub_model_id} {folder}` once the Hub is reachable")
