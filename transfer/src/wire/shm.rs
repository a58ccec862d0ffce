//! The shared-memory transport's handshake blob: the address of 16 random bytes in the sender's
//! process (u64 LE) followed by their value, 24 bytes. The receiver reads the 16 bytes at that
//! address with `process_vm_readv` to learn whether it may access the sender's memory.

/// Length of the blob.
const BLOB_LEN: usize = 24;

/// The blob for `token` at address `addr`.
pub(crate) fn encode_probe(addr: u64, token: &[u8; 16]) -> Vec<u8> {
    let mut b = addr.to_le_bytes().to_vec();
    b.extend_from_slice(token);
    b
}

/// The address and the token of a blob (`None` unless it is exactly [`BLOB_LEN`] bytes).
pub(crate) fn decode_probe(b: &[u8]) -> Option<(u64, [u8; 16])> {
    if b.len() != BLOB_LEN {
        return None;
    }
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    let mut token = [0u8; 16];
    token.copy_from_slice(&b[8..]);
    Some((u64::from_le_bytes(a), token))
}
