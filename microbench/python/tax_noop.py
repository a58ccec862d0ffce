"""An inert kv_both connector: the baseline for the kv_both tax.

Loaded by vLLM's factory through ``kv_connector_module_path="tax_noop"`` like kvwire's own
connector, so everything vLLM does because *some* connector is configured (the generic
plumbing) is in the measurement, and nothing else: every hook returns at once.
"""

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

try:  # 0.33.0 and later
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # 0.18.1
    SupportsHMA = object


class NoOpConnector(KVConnectorBase_V1, SupportsHMA):
    """Does nothing, in both roles."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return None

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    # worker side
    def start_load_kv(self, forward_context, **kwargs):
        return None

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None

    def wait_for_save(self):
        return None

    def get_finished(self, finished_req_ids):
        return None, None
