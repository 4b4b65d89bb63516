"""Local Azure Blob (Azurite) and GCS emulators on 127.0.0.1, started by the tests like
`moto_server`. The project installs them itself: Azurite (an npm package) into `.tools/azurite`
of the checkout (`make emulators`, or the first test that needs it), the GCS emulator as a dev
dependency (pyproject) extended by tests/support/gcs_server.py. A test skips only when an
emulator cannot be installed.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import hmac
import http.client
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from email.utils import formatdate
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AZURITE_DIR = REPO / ".tools" / "azurite"
AZURITE_BIN = AZURITE_DIR / "node_modules" / ".bin" / "azurite-blob"
AZURITE_VERSION = "3.35.0"
# Azurite's well-known development account (public, documented by Microsoft; no real secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(proc: subprocess.Popen, port: int, what: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} (is port {port} taken?)")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def install_azurite(timeout: float = 600) -> str | None:
    """Azurite's blob server in `.tools/azurite` (npm, project-local); None when it is there,
    else why it cannot be installed."""
    if AZURITE_BIN.exists():
        return None
    npm = shutil.which("npm")
    if npm is None:
        return "npm is not on PATH: Azurite (an npm package) cannot be installed"
    # Parallel test processes (pytest -n) install it once: the others wait on the lock, then find it.
    AZURITE_DIR.mkdir(parents=True, exist_ok=True)
    with open(AZURITE_DIR.parent / "azurite.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return None if AZURITE_BIN.exists() else _npm_install_azurite(npm, timeout)


def _npm_install_azurite(npm: str, timeout: float) -> str | None:
    try:
        r = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(AZURITE_DIR),
                            f"azurite@{AZURITE_VERSION}"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"npm install azurite@{AZURITE_VERSION} took over {timeout:.0f} s"
    if r.returncode != 0 or not AZURITE_BIN.exists():
        return f"npm install azurite@{AZURITE_VERSION} failed: {(r.stderr or r.stdout).strip()[-500:]}"
    return None


class Azurite:
    """Azurite's blob service on 127.0.0.1 in a subprocess, data in memory."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> "Azurite":
        self.proc = subprocess.Popen(
            [str(AZURITE_BIN), "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--inMemoryPersistence",
             "--skipApiVersionCheck", "--loose", "--disableTelemetry", "--silent"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_listening(self.proc, self.port, "azurite-blob", timeout)
        return self

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None

    def public_options(self) -> dict[str, str]:
        """What may be on a command line: the endpoint, plain HTTP, the account name."""
        return {"azure_endpoint": self.endpoint, "allow_http": "true",
                "azure_storage_account_name": AZURITE_ACCOUNT}

    def options(self) -> dict[str, str]:
        return {**self.public_options(), "azure_storage_account_key": AZURITE_KEY}

    def create_container(self, name: str) -> None:
        """A container, by a SharedKey-signed REST call (neither Lance nor obstore makes one)."""
        date = formatdate(usegmt=True)
        headers = {"x-ms-date": date, "x-ms-version": "2021-08-06"}
        to_sign = ("PUT" + "\n" * 12 + "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
                   + f"/{AZURITE_ACCOUNT}/{AZURITE_ACCOUNT}/{name}\nrestype:container")
        sig = base64.b64encode(hmac.new(base64.b64decode(AZURITE_KEY), to_sign.encode(),
                                        hashlib.sha256).digest()).decode()
        url = urllib.parse.urlsplit(self.endpoint)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
        conn.request("PUT", f"{url.path}/{name}?restype=container", body=b"",
                     headers={**headers, "Authorization": f"SharedKey {AZURITE_ACCOUNT}:{sig}"})
        r = conn.getresponse()
        body = r.read()
        if r.status != 201:
            raise RuntimeError(f"creating Azurite container {name} failed: {r.status} {body[:300]!r}")


class GcsEmulator:
    """A GCS emulator on 127.0.0.1 in a subprocess, in memory: `gcp-storage-emulator` (a dev
    dependency) with the XML API `object_store` speaks (tests/support/gcs_server.py)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="memwal-gcs-")
        self.service_account = os.path.join(self._dir.name, "service-account.json")

    @staticmethod
    def missing() -> str | None:
        """Why the emulator cannot run here, or None."""
        import importlib.util

        if importlib.util.find_spec("gcp_storage_emulator") is None:
            return "gcp-storage-emulator is not installed (pip install -e '.[dev]')"
        return None

    def start(self, timeout: float = 30) -> "GcsEmulator":
        import json

        with open(self.service_account, "w") as f:  # object_store's emulator convention
            json.dump({"gcs_base_url": self.endpoint, "disable_oauth": True, "client_email": "",
                       "private_key": "", "private_key_id": ""}, f)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("gcs_server.py")), str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_listening(self.proc, self.port, "the GCS emulator", timeout)
        return self

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None
        self._dir.cleanup()

    def options(self) -> dict[str, str]:
        return {"google_service_account": self.service_account, "allow_http": "true"}

    def create_bucket(self, name: str) -> None:
        """A bucket, through the emulator's JSON API."""
        import json

        url = urllib.parse.urlsplit(self.endpoint)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
        conn.request("POST", "/storage/v1/b?project=memwal", body=json.dumps({"name": name}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise RuntimeError(f"creating GCS bucket {name} failed: {r.status} {body[:300]!r}")
