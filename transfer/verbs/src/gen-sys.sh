#!/bin/sh
# Regenerates transfer/verbs/src/sys.rs (run from transfer/verbs/src/: ./gen-sys.sh raw.rs,
# then prepend the header of sys.rs and rustfmt).  Needs bindgen-cli 0.73
# (`cargo install bindgen-cli`), libclang (`apt-get install libclang-dev clang`) and the
# rdma-core headers (`apt-get install libibverbs-dev`).  Nothing in the build runs this.
set -e
OUT=${1:-sys.rs}
bindgen /usr/include/infiniband/verbs.h \
  --dynamic-loading IbvLib \
  --allowlist-function 'ibv_(get_device_list|free_device_list|get_device_name|get_device_guid|open_device|close_device|query_device|query_port|query_gid|alloc_pd|dealloc_pd|reg_mr|reg_dmabuf_mr|dereg_mr|create_comp_channel|destroy_comp_channel|create_cq|destroy_cq|get_cq_event|ack_cq_events|create_qp|modify_qp|query_qp|destroy_qp|wc_status_str|fork_init)' \
  --allowlist-type 'ibv_(wc|send_wr|recv_wr|sge|qp_attr|qp_init_attr|port_attr|device_attr|gid|context|context_ops|cq|qp|pd|mr|comp_channel|device|wc_status|wc_opcode|wr_opcode|send_flags|access_flags|qp_attr_mask|qp_state|qp_type|mtu|port_state|wc_flags)' \
  --allowlist-type '_compat_ibv_port_attr' \
  --allowlist-var 'IBV_LINK_LAYER_.*' \
  --no-prepend-enum-name  \
  --with-derive-default --no-layout-tests --use-core \
  -o "$OUT" -- -I/usr/include
