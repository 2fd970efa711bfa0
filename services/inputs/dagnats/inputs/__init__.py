"""The inputs service: steering a running agent step with idempotent inputs."""
