"""The serving engine in the loop: vLLM started as a server in its own venv (`server`), and a client that sends
token-id prompts and reads the engine's own acceptance counters (`client`). docs/serving.md says how."""

from dflash_lib.serve.client import EngineClient, ServedDecode, SpecCounters, parse_spec_counters
from dflash_lib.serve.adapter import EngineSpec
from dflash_lib.serve.server import EngineServer, engine_python

__all__ = ["EngineClient", "EngineServer", "EngineSpec", "ServedDecode", "SpecCounters", "engine_python",
           "parse_spec_counters"]
