"""The tests' S3 server: `make s3-demo`'s `LocalS3` (a `moto_server` subprocess; it stays in
memwal_pipeline.s3_demo because the demo is a user-facing command) with the tests' credentials."""

from __future__ import annotations

from memwal_pipeline.s3_demo import LocalS3


class MotoServer(LocalS3):
    """`moto_server` on 127.0.0.1 in a subprocess (memwal's own `LocalS3`), with the tests'
    credentials; can be stopped and restarted on its port."""

    def options(self, secret: str = "testing-secret") -> dict[str, str]:
        return {"aws_endpoint": self.endpoint, "allow_http": "true", "aws_access_key_id": "testing",
                "aws_secret_access_key": secret, "aws_region": "us-east-1"}
