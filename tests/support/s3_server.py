"""The S3 server of the tests and of `make s3-demo`: `moto_server` on 127.0.0.1 in a subprocess
(`LocalS3`), and `MotoServer`, the same with the tests' credentials. Test tooling: it lives
beside the tests, not in the product packages (moto is a dev dependency)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalS3:
    """`moto_server` on 127.0.0.1 in a subprocess. `stop()` then `start()` reuses the port
    (moto keeps no data across restarts)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def _command(self) -> list[str]:
        exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
        if exe:
            return [exe]
        try:
            import moto.server  # noqa: F401
        except ImportError:
            raise SystemExit("the S3 demo needs moto's server: pip install 'moto[server]' "
                             "(make s3-demo installs the dev dependencies)") from None
        return [sys.executable, "-m", "moto.server"]

    def start(self, timeout: float = 30.0) -> "LocalS3":
        self.proc = subprocess.Popen(self._command() + ["-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with status {self.proc.returncode} "
                                   f"(is port {self.port} taken?)")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto_server did not listen on {self.endpoint} within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None

    def options(self, secret: str) -> dict[str, str]:
        """Storage options in Lance's names (memwal adds `allow_http` for an http endpoint)."""
        return {"aws_endpoint": self.endpoint, "aws_region": "us-east-1",
                "aws_access_key_id": "memwal-demo", "aws_secret_access_key": secret}

    def __enter__(self) -> "LocalS3":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class MotoServer(LocalS3):
    """`moto_server` on 127.0.0.1 in a subprocess (memwal's own `LocalS3`), with the tests'
    credentials; can be stopped and restarted on its port."""

    def options(self, secret: str = "testing-secret") -> dict[str, str]:
        return {"aws_endpoint": self.endpoint, "allow_http": "true", "aws_access_key_id": "testing",
                "aws_secret_access_key": secret, "aws_region": "us-east-1"}
