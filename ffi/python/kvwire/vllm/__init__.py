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

from kvwire.vllm.connector import KvwireConnector, KvwireConnectorMetadata

__all__ = ["KvwireConnector", "KvwireConnectorMetadata"]
