"""A fast answer to "can the Hugging Face hub be reached?", asked before a hub download.

Without network access `huggingface_hub` and `datasets` retry for about 25 seconds, logging a warning per retry,
before they fail. A TCP connection to the hub's host (HF_ENDPOINT, default huggingface.co) answers in
milliseconds when there is no route or no DNS, so the caller can fail at once with a message that says what to
pass instead. The probe is skipped when it could be wrong or is not needed: HF_HUB_OFFLINE=1 (the libraries
then read their cache and fail fast themselves) or a proxy in the environment (a direct connection may fail
where the proxy works).
"""

import os
import socket
from urllib.parse import urlparse

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """None when the hub may be reachable (or the probe is skipped), else why it is not, e.g.
    "cannot connect to huggingface.co:443 (gaierror: [Errno -2] Name or service not known)"."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as e:
        return f"cannot connect to {host}:{port} ({type(e).__name__}: {e})"
