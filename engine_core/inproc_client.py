"""The engine core client interface over an EngineCore in this process."""

from __future__ import annotations

from typing import Any

from config.engine import EngineConfig
from engine_core.engine_core import EngineCore
from engine_core.utilities import engine_utilities
from protocol.engine_core import EngineCoreOutputs, EngineCoreRequest


class InprocClient:
    """EngineCoreClient's methods on a local EngineCore: get_output() runs one step."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine_core = EngineCore(config)
        self._utilities = engine_utilities(self.engine_core)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Validate and queue a request; raises InvalidRequestError on bad input."""
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop requests and free their KV blocks now."""
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        """Run one step and return its outputs."""
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        """Call a utility method (engine_core.utilities) directly."""
        return self._utilities[method](*args)

    def shutdown(self) -> None:
        """Release the workers."""
        self.engine_core.shutdown()
