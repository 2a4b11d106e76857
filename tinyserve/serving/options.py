"""The server's knobs and their defaults, in one place: ``python -m tinyserve serve`` builds
its flags from :class:`ServeOptions`, and :func:`~tinyserve.serving.server.create_app` falls
back on the same engine sizes. Kept free of heavy imports so ``--help`` stays instant."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "target"
    num_blocks: int = 1024              # KV blocks in the pool
    block_size: int = 16                # token slots per KV block
    max_num_seqs: int = 16              # running requests at most
    max_num_batched_tokens: int = 256   # tokens per engine step
    chunked_prefill: bool = True
    prefix_caching: bool = True
    policy: str = "fcfs"
    max_waiting: int = 64               # queued requests beyond which new ones get 429
    queue_timeout_s: float = 30.0       # seconds a request may wait for admission
    drain_timeout_s: float = 10.0       # seconds in-flight requests get at shutdown
    allow_remote: bool = False
    compile: bool = False               # torch.compile the engine's token-wise layers
    fast: bool = False                  # the fastest decode path (tinyserve.backends.fast)

    def check(self) -> None:
        """Raise ValueError naming the flag and its limit for a value the server cannot use."""
        if self.host not in LOOPBACK and not self.allow_remote:
            raise ValueError(f"--host {self.host} would expose the server beyond this machine; "
                             f"pass --allow-remote if that is what you want")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be between 1 and 65535, got {self.port}")
        for flag, value, low in (("--num-blocks", self.num_blocks, 1),
                                 ("--block-size", self.block_size, 1),
                                 ("--max-num-seqs", self.max_num_seqs, 1),
                                 ("--max-num-batched-tokens", self.max_num_batched_tokens, 1),
                                 ("--max-waiting", self.max_waiting, 0)):
            if value < low:
                raise ValueError(f"{flag} must be at least {low}, got {value}")
        if self.fast and self.compile:
            raise ValueError("--fast and --compile both choose the decode path: --fast already "
                             "compiles on a CPU (CUDA graphs on a GPU); pass one")
        if self.queue_timeout_s <= 0:
            raise ValueError(f"--queue-timeout must be a positive number of seconds, got "
                             f"{self.queue_timeout_s}")

    def engine_sizes(self) -> dict[str, Any]:
        """The :class:`~tinyserve.engine.EngineConfig` fields these options set."""
        return {"num_blocks": self.num_blocks, "block_size": self.block_size,
                "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "chunked_prefill": self.chunked_prefill,
                "enable_prefix_caching": self.prefix_caching, "policy": self.policy,
                "path": "fast" if self.fast else "compiled" if self.compile else "auto"}

    def app_kwargs(self) -> dict[str, Any]:
        """What :func:`~tinyserve.serving.server.create_app` takes besides the engine config."""
        return {"model_name": self.model, "max_waiting": self.max_waiting,
                "queue_timeout_s": self.queue_timeout_s, "drain_timeout_s": self.drain_timeout_s}
