"""One configuration object, from (lowest to highest precedence) defaults, a YAML file,
`TRACETRAIN_…` environment variables and command-line flags."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Config(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRACETRAIN_", env_nested_delimiter="__", extra="forbid")

    host: str = "127.0.0.1"
    """Address the gateway binds. Anything but loopback requires API keys."""
    port: int = 8000
    """Port of the gateway."""
    engine: Literal["auto", "vllm", "transformers"] = "auto"
    """`vllm` starts or connects to a vLLM server; `transformers` runs in-process; `auto` picks vLLM
    when it is installed."""
    engine_url: str | None = None
    """Base URL of a running vLLM server (http://host:port) instead of starting one."""
    model: str = "smollm2"
    """Model directory, or `smollm2` for the embedded SmolLM2-135M-Instruct (converted once, cached)."""
    served_model_name: str = "smollm2-135m-instruct"
    """Name clients put in `model`; requests naming another model get 404."""
    vllm_python: str | None = None
    """Python executable of the environment where vLLM is installed (default: .venv-vllm, then
    TRACETRAIN_VLLM_PYTHON)."""
    vllm_port: int = 8100
    """Port for the vLLM server the gateway starts."""
    vllm_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for the vLLM server the gateway starts."""
    engine_timeout_s: float = 300.0
    """Longest wait for the engine on one request before answering 504."""
    db_url: str = "sqlite:///tracetrain.db"
    """Store URL: SQLite (WAL) file or postgresql+psycopg://…"""
    sqlite_synchronous: Literal["FULL", "NORMAL"] = "FULL"
    """FULL survives power loss; NORMAL survives a killed process only, and commits faster."""
    api_keys: list[str] = Field(default_factory=list)
    """Agent keys: each may create sessions and read or reward its own."""
    admin_key: str | None = None
    """Key for listing, export and weight endpoints (and every session)."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Requests with a larger body are refused with 413."""
    chat_template: Path | None = None
    """Jinja chat template to use instead of the model's (or the bundled tool-capable ChatML one)."""
    default_max_tokens: int = 512
    """max_tokens when a request gives none."""
    reward_weights: dict[str, float] = Field(default_factory=dict)
    """Weights for dict-valued rewards; a component without a weight counts 1."""
    log_level: str = "INFO"
    """Logging level of the gateway."""

    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def check_access(self) -> None:
        """A gateway reachable from other machines must not run without keys."""
        if not self.is_loopback() and not (self.api_keys and self.admin_key):
            raise SystemExit(
                f"refusing to bind {self.host}: set api_keys and admin_key (TRACETRAIN_API_KEYS, "
                "TRACETRAIN_ADMIN_KEY) or bind 127.0.0.1"
            )


def load_config(yaml_path: Path | None = None, **overrides: Any) -> Config:
    """YAML values sit below environment variables, which sit below explicit overrides (CLI flags)."""
    file_values: dict[str, Any] = {}
    if yaml_path is not None:
        file_values = yaml.safe_load(yaml_path.read_text()) or {}
    env_values = Config().model_dump(exclude_unset=True)
    merged = {**file_values, **env_values, **{k: v for k, v in overrides.items() if v is not None}}
    return Config(**merged)
