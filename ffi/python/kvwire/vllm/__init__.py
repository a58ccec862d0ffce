"""kvwire's vLLM v1 KV connector.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvwireConnector",
                           "kv_connector_module_path": "kvwire.vllm",
                           "kv_role": "kv_consumer",
                           "kv_connector_extra_config": {"policy": "lazy",
                                                         "control_listen": "0.0.0.0:7100",
                                                         "data_listen": "0.0.0.0:7200"}}'

See :mod:`kvwire.vllm.connector` for the protocol and the request parameters.
"""

import logging as _logging

_log = _logging.getLogger("kvwire")
if not _log.handlers and not _logging.getLogger().handlers:
    # vLLM configures only its own logger: give kvwire's lines a time and a process, once.
    _h = _logging.StreamHandler()
    _h.setFormatter(_logging.Formatter("%(levelname)s %(asctime)s kvwire[%(process)d %(threadName)s] %(message)s"))
    _log.addHandler(_h)
    _log.setLevel(_logging.DEBUG if __import__("os").environ.get("KVWIRE_DEBUG") else _logging.INFO)
    _log.propagate = False

from kvwire.vllm.connector import KvwireConnector, KvwireConnectorMetadata  # noqa: E402

__all__ = ["KvwireConnector", "KvwireConnectorMetadata"]
