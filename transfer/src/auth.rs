//! Shared-secret challenge/response (HMAC-SHA256 over both sides' nonces).
//!
//! The responder proves first with `HMAC(secret, "kvwire-responder" | nonce_i | nonce_r)`, the
//! initiator second with `HMAC(secret, "kvwire-initiator" | nonce_r | nonce_i)`. Distinct labels
//! keep one side's proof from being replayed as the other's; fresh nonces from both sides keep
//! old proofs from being replayed at all.

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

fn mac(secret: &[u8], label: &[u8], a: &[u8], b: &[u8]) -> Option<HmacSha256> {
    let mut m = HmacSha256::new_from_slice(secret).ok()?;
    m.update(label);
    m.update(a);
    m.update(b);
    Some(m)
}

/// The responder's proof.
pub(crate) fn responder_proof(secret: &[u8], nonce_i: &[u8; 32], nonce_r: &[u8; 32]) -> Vec<u8> {
    mac(secret, b"kvwire-responder", nonce_i, nonce_r)
        .map(|m| m.finalize().into_bytes().to_vec())
        .unwrap_or_default()
}

/// The initiator's proof.
pub(crate) fn initiator_proof(secret: &[u8], nonce_i: &[u8; 32], nonce_r: &[u8; 32]) -> Vec<u8> {
    mac(secret, b"kvwire-initiator", nonce_r, nonce_i)
        .map(|m| m.finalize().into_bytes().to_vec())
        .unwrap_or_default()
}

/// Constant-time check of the responder's proof.
pub(crate) fn verify_responder(
    secret: &[u8],
    nonce_i: &[u8; 32],
    nonce_r: &[u8; 32],
    proof: &[u8],
) -> bool {
    mac(secret, b"kvwire-responder", nonce_i, nonce_r)
        .is_some_and(|m| m.verify_slice(proof).is_ok())
}

/// Constant-time check of the initiator's proof.
pub(crate) fn verify_initiator(
    secret: &[u8],
    nonce_i: &[u8; 32],
    nonce_r: &[u8; 32],
    proof: &[u8],
) -> bool {
    mac(secret, b"kvwire-initiator", nonce_r, nonce_i)
        .is_some_and(|m| m.verify_slice(proof).is_ok())
}

/// Fresh random bytes.
pub(crate) fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    if getrandom::getrandom(&mut b).is_err() {
        // getrandom on Linux only fails if the kernel lacks the syscall and /dev/urandom; fall
        // back to a time/counter mix (still unique, not secret-grade) rather than panicking.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        for (i, x) in b.iter_mut().enumerate() {
            *x = (t >> ((i % 16) * 8)) as u8 ^ (i as u8).wrapping_mul(31);
        }
    }
    b
}
