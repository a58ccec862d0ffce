//! The loaded libibverbs ([`Lib`]) and [`ibv_fn!`], which fetches one of its entry points.

use crate::sys;

/// The loaded library. Shared (`Arc`) by every resource created from it, so it is unloaded
/// only after the last resource is destroyed.
pub(crate) struct Lib {
    pub(crate) raw: sys::IbvLib,
}

/// Fetches a resolved entry point of [`Lib`], or returns `MissingSymbol` from the caller.
macro_rules! ibv_fn {
    ($lib:expr, $name:ident) => {
        match &$lib.raw.$name {
            Ok(f) => *f,
            Err(_) => return Err($crate::error::VerbsError::MissingSymbol(stringify!($name))),
        }
    };
}
pub(crate) use ibv_fn;

impl Lib {
    pub(crate) fn has(&self, name: &str) -> bool {
        let r = &self.raw;
        match name {
            "ibv_get_device_list" => r.ibv_get_device_list.is_ok(),
            "ibv_free_device_list" => r.ibv_free_device_list.is_ok(),
            "ibv_get_device_name" => r.ibv_get_device_name.is_ok(),
            "ibv_get_device_guid" => r.ibv_get_device_guid.is_ok(),
            "ibv_open_device" => r.ibv_open_device.is_ok(),
            "ibv_close_device" => r.ibv_close_device.is_ok(),
            "ibv_query_device" => r.ibv_query_device.is_ok(),
            "ibv_query_port" => r.ibv_query_port.is_ok(),
            "ibv_query_gid" => r.ibv_query_gid.is_ok(),
            "ibv_alloc_pd" => r.ibv_alloc_pd.is_ok(),
            "ibv_dealloc_pd" => r.ibv_dealloc_pd.is_ok(),
            "ibv_reg_mr" => r.ibv_reg_mr.is_ok(),
            "ibv_dereg_mr" => r.ibv_dereg_mr.is_ok(),
            "ibv_create_comp_channel" => r.ibv_create_comp_channel.is_ok(),
            "ibv_destroy_comp_channel" => r.ibv_destroy_comp_channel.is_ok(),
            "ibv_create_cq" => r.ibv_create_cq.is_ok(),
            "ibv_destroy_cq" => r.ibv_destroy_cq.is_ok(),
            "ibv_get_cq_event" => r.ibv_get_cq_event.is_ok(),
            "ibv_ack_cq_events" => r.ibv_ack_cq_events.is_ok(),
            "ibv_create_qp" => r.ibv_create_qp.is_ok(),
            "ibv_modify_qp" => r.ibv_modify_qp.is_ok(),
            "ibv_destroy_qp" => r.ibv_destroy_qp.is_ok(),
            _ => false,
        }
    }
}
