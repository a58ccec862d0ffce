//! The handshake's key schedule and proofs, and random values.
//!
//! Both sides hash every handshake message as sent (header and body) into a transcript
//! ([`Transcript`]); `th_k` is the hash of messages 1..k. Keys (HKDF-SHA256, RFC 5869):
//!
//! ```text
//! PRK     = Extract(salt = "kvwire/4" | nonce_i | nonce_r, ikm = secret | X25519(e_i, e_r))
//! k_i     = Expand(PRK, "kvwire/4 initiator")       k_r = Expand(PRK, "kvwire/4 responder")
//! proof   = HMAC(k_i, "proof" | th_2)               (message 3, the initiator proves first)
//! accept  = HMAC(k_r, "accept" | th_3 | msg4⁻)      auth = HMAC(k_i, "auth" | th_4 | msg5⁻)
//! welcome = HMAC(k_r, "welcome" | th_5 | msg6⁻)     (msgK⁻: message K without its MAC)
//! K_sess  = Expand(PRK, "kvwire/4 session" | th_5)
//! sid_ir  = Expand(K_sess, "sid i->r")[..16]        K_ir = Expand(K_sess, "lane i->r")
//! sid_ri  = Expand(K_sess, "sid r->i")[..16]        K_ri = Expand(K_sess, "lane r->i")
//! ```
//!
//! The secret is empty for engines without one: the messages are the same, and the lane keys
//! still need the X25519 shared secret. `i->r` keys join lanes the initiator opens into the
//! responder's listener, `r->i` the other way. A lane join proves `K_d` over fresh nonces of
//! both sides ([`lane_mac`]). Public (hidden) for the tests' hand-written peers.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// A 32-byte MAC or key.
pub type Key = [u8; 32];

/// HMAC-SHA256 of the concatenation of `parts` under `key`.
pub fn hmac(key: &[u8], parts: &[&[u8]]) -> Key {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// Constant-time comparison of a MAC with the expected one.
pub fn mac_eq(a: &Key, b: &Key) -> bool {
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b.iter()) {
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// HKDF-Extract.
pub fn extract(salt: &[u8], ikm: &[u8]) -> Key {
    hmac(salt, &[ikm])
}

/// HKDF-Expand to 32 bytes (its first block).
pub fn expand(prk: &Key, info: &[&[u8]]) -> Key {
    let mut parts: Vec<&[u8]> = info.to_vec();
    parts.push(&[1u8]);
    hmac(prk, &parts)
}

/// The running hash of the handshake messages.
#[derive(Clone, Default)]
pub struct Transcript {
    h: Sha256,
}

impl Transcript {
    /// Adds an encoded message (header and body, as sent or received).
    pub fn add(&mut self, encoded: &[u8]) {
        self.h.update(encoded);
    }
    /// The hash of every message added so far.
    pub fn hash(&self) -> Key {
        self.h.clone().finalize().into()
    }
}

/// An ephemeral X25519 key pair.
pub struct KeyShare {
    secret: x25519_dalek::StaticSecret,
    /// The public half (sent in `Hello` / `Challenge`).
    pub public: Key,
}

impl KeyShare {
    /// A fresh key pair.
    pub fn random() -> KeyShare {
        KeyShare::from_bytes(random())
    }
    /// The key pair of a given secret scalar (tests, fuzzing).
    pub fn from_bytes(b: Key) -> KeyShare {
        let secret = x25519_dalek::StaticSecret::from(b);
        let public = x25519_dalek::PublicKey::from(&secret).to_bytes();
        KeyShare { secret, public }
    }
    /// The shared secret with the peer's public key; `None` for a low-order point.
    pub fn agree(&self, theirs: &Key) -> Option<Key> {
        let s = self
            .secret
            .diffie_hellman(&x25519_dalek::PublicKey::from(*theirs));
        s.was_contributory().then(|| s.to_bytes())
    }
}

/// The handshake keys of one session.
pub struct Keys {
    prk: Key,
    k_i: Key,
    k_r: Key,
}

impl Keys {
    /// Derives the keys from the secret (empty without one), both nonces and the X25519 shared
    /// secret.
    pub fn derive(psk: &[u8], nonce_i: &Key, nonce_r: &Key, dh: &Key) -> Keys {
        let mut salt = Vec::with_capacity(8 + 64);
        salt.extend_from_slice(b"kvwire/4");
        salt.extend_from_slice(nonce_i);
        salt.extend_from_slice(nonce_r);
        let mut ikm = psk.to_vec();
        ikm.extend_from_slice(dh);
        let prk = extract(&salt, &ikm);
        Keys {
            k_i: expand(&prk, &[b"kvwire/4 initiator"]),
            k_r: expand(&prk, &[b"kvwire/4 responder"]),
            prk,
        }
    }

    /// The initiator's proof (message 3).
    pub fn proof(&self, th2: &Key) -> Key {
        hmac(&self.k_i, &[b"proof", th2])
    }
    /// The MAC of `Accept` (message 4; `unmaced`: its encoding without the MAC).
    pub fn accept_mac(&self, th3: &Key, unmaced: &[u8]) -> Key {
        hmac(&self.k_r, &[b"accept", th3, unmaced])
    }
    /// The MAC of `Auth` (message 5).
    pub fn auth_mac(&self, th4: &Key, unmaced: &[u8]) -> Key {
        hmac(&self.k_i, &[b"auth", th4, unmaced])
    }
    /// The MAC of `Welcome` (message 6).
    pub fn welcome_mac(&self, th5: &Key, unmaced: &[u8]) -> Key {
        hmac(&self.k_r, &[b"welcome", th5, unmaced])
    }
    /// The session's lane credentials (from `th_5`).
    pub fn session(&self, th5: &Key) -> Session {
        let k = expand(&self.prk, &[b"kvwire/4 session", th5]);
        let sid = |label: &[u8]| {
            let mut s = [0u8; 16];
            s.copy_from_slice(&expand(&k, &[label])[..16]);
            s
        };
        Session {
            i_to_r: LaneCred {
                sid: sid(b"sid i->r"),
                key: expand(&k, &[b"lane i->r"]),
            },
            r_to_i: LaneCred {
                sid: sid(b"sid r->i"),
                key: expand(&k, &[b"lane r->i"]),
            },
        }
    }
}

/// What joins a data lane in one direction: the session id the listener looks up and the key
/// both sides prove.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LaneCred {
    /// The session id (sent in `LaneJoin`).
    pub sid: [u8; 16],
    /// The lane key (never sent).
    pub key: Key,
}

impl std::fmt::Debug for LaneCred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneCred").finish_non_exhaustive()
    }
}

/// Both directions' lane credentials of a session.
#[derive(Clone, Copy, Debug)]
pub struct Session {
    /// Lanes the initiator opens into the responder.
    pub i_to_r: LaneCred,
    /// Lanes the responder opens into the initiator.
    pub r_to_i: LaneCred,
}

/// Who proves with a [`lane_mac`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaneRole {
    /// The engine that accepted the lane (`LaneChallenge`).
    Listener,
    /// The engine that opened it (`LaneProof`).
    Joiner,
}

/// A lane join proof: `HMAC(K_d, label | sid | lane | nonce_j | nonce_l)`.
pub fn lane_mac(cred: &LaneCred, role: LaneRole, lane: u16, nonce_j: &Key, nonce_l: &Key) -> Key {
    let label: &[u8] = match role {
        LaneRole::Listener => b"kvwire/4 lane listener",
        LaneRole::Joiner => b"kvwire/4 lane joiner",
    };
    hmac(
        &cred.key,
        &[label, &cred.sid, &lane.to_le_bytes(), nonce_j, nonce_l],
    )
}

/// Fresh random bytes.
pub fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    if getrandom::getrandom(&mut b).is_err() {
        // getrandom on Linux only fails if the kernel lacks the syscall and /dev/urandom: keys
        // from anything else would be guessable, so refuse to go on.
        panic!("no operating-system randomness (getrandom failed)");
    }
    b
}

/// A new random secret for [`crate::EngineConfig::secret`]: 256 bits from the operating
/// system's random source, as 64 hex digits (`kvwire-bench secret` prints one). Give every
/// engine of a deployment the same one, and keep it as secret as a private key.
pub fn new_secret() -> String {
    random::<32>().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// RFC 5869, test case 1 (first 32 bytes of the output).
    #[test]
    fn hkdf_matches_rfc5869() {
        let ikm = [0x0bu8; 22];
        let salt: Vec<u8> = (0u8..=0x0c).collect();
        let info: Vec<u8> = (0xf0u8..=0xf9).collect();
        let prk = extract(&salt, &ikm);
        assert_eq!(
            hex(&prk),
            "077709362c2e32df0ddc3f0dc47bba6390b6c73bb50f9c3122ec844ad7c2b3e5"
        );
        assert_eq!(
            hex(&expand(&prk, &[&info])),
            "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
        );
    }

    #[test]
    fn both_sides_agree_and_every_input_matters() {
        let (a, b) = (KeyShare::from_bytes([1; 32]), KeyShare::from_bytes([2; 32]));
        let dh = a.agree(&b.public).expect("contributory");
        assert_eq!(Some(dh), b.agree(&a.public));
        assert_eq!(a.agree(&[0; 32]), None, "low-order point refused");
        let th = [9u8; 32];
        let k = Keys::derive(b"s3cret", &[3; 32], &[4; 32], &dh);
        let p = k.proof(&th);
        assert_eq!(
            p,
            Keys::derive(b"s3cret", &[3; 32], &[4; 32], &dh).proof(&th)
        );
        for other in [
            Keys::derive(b"s3cres", &[3; 32], &[4; 32], &dh),
            Keys::derive(b"s3cret", &[5; 32], &[4; 32], &dh),
            Keys::derive(b"s3cret", &[3; 32], &[5; 32], &dh),
            Keys::derive(b"s3cret", &[3; 32], &[4; 32], &[0; 32]),
        ] {
            assert_ne!(other.proof(&th), p);
        }
        // Every MAC has its own label and key; the directions' credentials differ.
        let m = [
            k.accept_mac(&th, b"x"),
            k.auth_mac(&th, b"x"),
            k.welcome_mac(&th, b"x"),
        ];
        assert!(m[0] != m[1] && m[1] != m[2] && m[0] != m[2] && m[0] != p);
        let s = k.session(&th);
        assert_ne!(s.i_to_r, s.r_to_i);
        assert_ne!(s.i_to_r.sid, k.session(&[8; 32]).i_to_r.sid);
        let (nj, nl) = ([6u8; 32], [7u8; 32]);
        let l = lane_mac(&s.i_to_r, LaneRole::Listener, 0, &nj, &nl);
        assert_ne!(l, lane_mac(&s.i_to_r, LaneRole::Joiner, 0, &nj, &nl));
        assert_ne!(l, lane_mac(&s.i_to_r, LaneRole::Listener, 1, &nj, &nl));
        assert_ne!(l, lane_mac(&s.r_to_i, LaneRole::Listener, 0, &nj, &nl));
        assert!(mac_eq(&l, &l) && !mac_eq(&l, &p));
        assert_eq!(new_secret().len(), 64);
    }

    /// Pins the whole schedule: a change to any label or order shows here, even one both
    /// sides would share.
    #[test]
    fn key_schedule_known_answer() {
        let dh = KeyShare::from_bytes([1; 32])
            .agree(&KeyShare::from_bytes([2; 32]).public)
            .expect("dh");
        let k = Keys::derive(b"kvwire", &[3; 32], &[4; 32], &dh);
        let s = k.session(&[5; 32]);
        let got = [
            hex(&k.proof(&[6; 32])),
            hex(&s.i_to_r.sid),
            hex(&lane_mac(
                &s.r_to_i,
                LaneRole::Joiner,
                2,
                &[7; 32],
                &[8; 32],
            )),
        ];
        assert_eq!(got, KNOWN, "{got:?}");
    }

    const KNOWN: [&str; 3] = [
        "4c7289b5ecccad1a39e9e3334ea02b754375018b31e9d723e10641c27d52ab1c",
        "9fd63f1b82144b8b810f818533307e04",
        "2b5312a0141915dc764a5110901024843c0f7652d72d6274d1853d231117f6ac",
    ];
}
