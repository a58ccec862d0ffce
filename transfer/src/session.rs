//! The handshake's exchanges that need nothing of an engine, over any byte stream: the part of
//! the handshake before the initiator proved the secret ([`initiate`], [`respond`]), MAC'd
//! messages ([`seal`], [`check_mac`]) and both sides of a data-lane join ([`join_lane`],
//! [`accept_lane`]). The engine runs them over sockets with one deadline per exchange; the
//! fuzz targets over bytes.
//!
//! Before the initiator's proof is verified the responder sends nothing but its `Challenge`
//! (a fresh nonce, a flag and a fresh X25519 key share) or a `Reject`; a joiner sends no frame
//! before the listener proved the lane key.

use std::io::{Read, Write};

use crate::auth::{self, Key, KeyShare, Keys, LaneCred, LaneRole, Transcript};
use crate::error::Error;
use crate::wire::{self, body, kind, CtrlMsg, Expect, ProtocolError, Stage};

/// Why an exchange failed, and whether the peer is to be told (with a `Reject`): everything
/// we refuse is answered; a `Reject` of the peer, or a connection that broke, is not.
#[derive(Debug)]
pub(crate) enum Fail {
    /// Answer with a `Reject` of this error, then close.
    Answer(Error),
    /// Close without an answer (the peer refused, or the connection broke).
    Quiet(Error),
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        match e {
            Error::Io(io)
                if matches!(
                    io.kind(),
                    std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
                ) =>
            {
                Fail::Answer(Error::Timeout)
            }
            e @ Error::Io(_) => Fail::Quiet(e),
            e => Fail::Answer(e),
        }
    }
}

impl From<std::io::Error> for Fail {
    fn from(e: std::io::Error) -> Fail {
        Fail::from(Error::Io(e))
    }
}

impl Fail {
    /// The error.
    pub fn error(&self) -> &Error {
        match self {
            Fail::Answer(e) | Fail::Quiet(e) => e,
        }
    }
    /// The error, owned.
    pub fn into_error(self) -> Error {
        match self {
            Fail::Answer(e) | Fail::Quiet(e) => e,
        }
    }
    /// The `Reject` to send, if any.
    pub fn reject(&self) -> Option<Vec<u8>> {
        match self {
            Fail::Answer(e) => Some(reject_bytes(e)),
            Fail::Quiet(_) => None,
        }
    }
}

/// The encoded `Reject` of `e`.
pub(crate) fn reject_bytes(e: &Error) -> Vec<u8> {
    CtrlMsg::Reject {
        error: wire::encode_error(e),
    }
    .encode()
}

/// The failure a `Reject` of the peer means (not answered).
fn rejected(error: &[u8]) -> Fail {
    Fail::Quiet(match wire::decode_error(error, true) {
        Ok(e) | Err(e) => e,
    })
}

/// Encodes `m`, whose last 32 bytes are its MAC, with the MAC computed by `mac` over the
/// transcript so far and the encoding before the MAC; adds the message to the transcript.
pub(crate) fn seal(th: &mut Transcript, m: &CtrlMsg, mac: impl Fn(&Key, &[u8]) -> Key) -> Vec<u8> {
    let mut enc = m.encode();
    let n = enc.len() - 32;
    let tag = mac(&th.hash(), &enc[..n]);
    enc[n..].copy_from_slice(&tag);
    th.add(&enc);
    enc
}

/// Whether the MAC at the end of `raw` is the one `mac` computes (over the transcript before
/// the message and the message without its MAC); adds the message to the transcript.
pub(crate) fn check_mac(th: &mut Transcript, raw: &[u8], mac: impl Fn(&Key, &[u8]) -> Key) -> bool {
    let n = raw.len().saturating_sub(32);
    let mut want = [0u8; 32];
    want.copy_from_slice(&raw[n..]);
    let ok = auth::mac_eq(&mac(&th.hash(), &raw[..n]), &want);
    th.add(raw);
    ok
}

/// The keys and the transcript of a handshake once the initiator proved the secret.
pub struct Proved {
    /// The session's keys.
    pub keys: Keys,
    /// The transcript so far (messages 1 to 3).
    pub th: Transcript,
}

/// The initiator's side up to its proof: `Hello`, the responder's `Challenge`, `Proof`.
/// `psk`: our secret, if any (without one we refuse a responder that requires one; with one
/// we refuse a responder that does not, before proving anything to it).
pub(crate) fn initiate<S: Read + Write>(
    io: &mut S,
    psk: Option<&[u8]>,
    share: &KeyShare,
    nonce_i: Key,
) -> Result<Proved, Fail> {
    let mut th = Transcript::default();
    let hello = CtrlMsg::Hello {
        nonce: nonce_i,
        auth: psk.is_some(),
        dh: share.public,
    }
    .encode();
    io.write_all(&hello)?;
    th.add(&hello);
    let expect = Expect {
        stage: Stage::Challenge,
        kinds: &[(kind::CHALLENGE, body::CHALLENGE)],
    };
    let (m, raw) = wire::read_ctrl_limited(io, expect)?;
    let (nonce_r, required, dh_r) = match m {
        CtrlMsg::Challenge {
            nonce,
            auth_required,
            dh,
        } => (nonce, auth_required, dh),
        CtrlMsg::Reject { error } => return Err(rejected(&error)),
        _ => unreachable!("read_ctrl_limited returns only expected kinds"),
    };
    th.add(&raw);
    // Both or neither: a responder without the secret never sees a proof of ours.
    if psk.is_some() != required {
        return Err(Fail::Answer(Error::AuthFailed));
    }
    let Some(dh) = share.agree(&dh_r) else {
        return Err(Fail::Answer(ProtocolError::WeakKeyShare.into()));
    };
    let keys = Keys::derive(psk.unwrap_or_default(), &nonce_i, &nonce_r, &dh);
    let proof = CtrlMsg::Proof {
        mac: keys.proof(&th.hash()),
    }
    .encode();
    io.write_all(&proof)?;
    th.add(&proof);
    Ok(Proved { keys, th })
}

/// What the responder checks before it verifies the proof.
pub struct Responder<'a> {
    /// Our secret, if any (then the initiator must prove it).
    pub psk: Option<&'a [u8]>,
    /// Our key share.
    pub share: &'a KeyShare,
    /// Our nonce.
    pub nonce_r: Key,
}

/// The responder's side up to the verified proof, once `Hello` (decoded, and `raw` as
/// received) was read: `Challenge`, then the `Proof` read and checked. On
/// `Fail::Answer(Error::AuthFailed)` the initiator's proof was wrong or missing.
/// `on_challenge` runs once the `Challenge` is out (the caller's progress mark).
pub(crate) fn respond<S: Read + Write>(
    io: &mut S,
    r: &Responder<'_>,
    hello: &CtrlMsg,
    raw: &[u8],
    on_challenge: impl FnOnce(),
) -> Result<Proved, Fail> {
    let CtrlMsg::Hello {
        nonce: nonce_i,
        auth: has_secret,
        dh: dh_i,
    } = hello
    else {
        return Err(Fail::Answer(
            ProtocolError::Unexpected {
                stage: Stage::Hello,
                got: None,
            }
            .into(),
        ));
    };
    if r.psk.is_some() && !has_secret {
        return Err(Fail::Answer(Error::AuthFailed));
    }
    let mut th = Transcript::default();
    th.add(raw);
    let challenge = CtrlMsg::Challenge {
        nonce: r.nonce_r,
        auth_required: r.psk.is_some(),
        dh: r.share.public,
    }
    .encode();
    io.write_all(&challenge)?;
    th.add(&challenge);
    on_challenge();
    let expect = Expect {
        stage: Stage::Proof,
        kinds: &[(kind::PROOF, body::PROOF)],
    };
    let (m, praw) = wire::read_ctrl_limited(io, expect)?;
    let mac = match m {
        CtrlMsg::Proof { mac } => mac,
        CtrlMsg::Reject { error } => return Err(rejected(&error)),
        _ => unreachable!("read_ctrl_limited returns only expected kinds"),
    };
    let Some(dh) = r.share.agree(dh_i) else {
        return Err(Fail::Answer(ProtocolError::WeakKeyShare.into()));
    };
    let keys = Keys::derive(r.psk.unwrap_or_default(), nonce_i, &r.nonce_r, &dh);
    if !auth::mac_eq(&keys.proof(&th.hash()), &mac) {
        return Err(Fail::Answer(Error::AuthFailed));
    }
    th.add(&praw);
    Ok(Proved { keys, th })
}

/// The joiner's side of a lane join: `LaneJoin`, the listener's `LaneChallenge` checked,
/// `LaneProof`, `LaneOk`. Nothing but these messages is sent before the listener proved the
/// lane key.
pub(crate) fn join_lane<S: Read + Write>(
    io: &mut S,
    cred: &LaneCred,
    lane: u16,
    nonce_j: Key,
) -> Result<(), Fail> {
    io.write_all(
        &CtrlMsg::LaneJoin {
            sid: cred.sid,
            lane,
            nonce: nonce_j,
        }
        .encode(),
    )?;
    let expect = Expect {
        stage: Stage::LaneJoinAnswer,
        kinds: &[(kind::LANE_CHALLENGE, body::LANE_CHALLENGE)],
    };
    let (nonce_l, mac) = match wire::read_ctrl_limited(io, expect)?.0 {
        CtrlMsg::LaneChallenge { nonce, mac } => (nonce, mac),
        CtrlMsg::Reject { error } => return Err(rejected(&error)),
        _ => unreachable!("read_ctrl_limited returns only expected kinds"),
    };
    let want = auth::lane_mac(cred, LaneRole::Listener, lane, &nonce_j, &nonce_l);
    if !auth::mac_eq(&want, &mac) {
        return Err(Fail::Answer(Error::AuthFailed));
    }
    io.write_all(
        &CtrlMsg::LaneProof {
            mac: auth::lane_mac(cred, LaneRole::Joiner, lane, &nonce_j, &nonce_l),
        }
        .encode(),
    )?;
    let expect = Expect {
        stage: Stage::LaneOk,
        kinds: &[(kind::LANE_OK, 0)],
    };
    match wire::read_ctrl_limited(io, expect)?.0 {
        CtrlMsg::LaneOk => Ok(()),
        CtrlMsg::Reject { error } => Err(rejected(&error)),
        _ => unreachable!("read_ctrl_limited returns only expected kinds"),
    }
}

/// The listener's side of a lane join once `LaneJoin` was read: the credentials of its
/// session (an `Err` of `lookup` is answered), `LaneChallenge`, the `LaneProof` read and
/// checked (`Fail::Answer(Error::AuthFailed)`). The caller sends `LaneOk` (or a `Reject`) once
/// it admitted the lane. `on_challenge` runs once the `LaneChallenge` is out.
pub(crate) fn accept_lane<S: Read + Write>(
    io: &mut S,
    join: &CtrlMsg,
    nonce_l: Key,
    lookup: impl FnOnce(&[u8; 16]) -> Result<LaneCred, Error>,
    on_challenge: impl FnOnce(),
) -> Result<u16, Fail> {
    let CtrlMsg::LaneJoin {
        sid,
        lane,
        nonce: nonce_j,
    } = join
    else {
        return Err(Fail::Answer(
            ProtocolError::Unexpected {
                stage: Stage::FirstMessage,
                got: None,
            }
            .into(),
        ));
    };
    let cred = lookup(sid).map_err(Fail::Answer)?;
    io.write_all(
        &CtrlMsg::LaneChallenge {
            nonce: nonce_l,
            mac: auth::lane_mac(&cred, LaneRole::Listener, *lane, nonce_j, &nonce_l),
        }
        .encode(),
    )?;
    on_challenge();
    let expect = Expect {
        stage: Stage::LaneProof,
        kinds: &[(kind::LANE_PROOF, body::PROOF)],
    };
    let mac = match wire::read_ctrl_limited(io, expect)?.0 {
        CtrlMsg::LaneProof { mac } => mac,
        CtrlMsg::Reject { error } => return Err(rejected(&error)),
        _ => unreachable!("read_ctrl_limited returns only expected kinds"),
    };
    let want = auth::lane_mac(&cred, LaneRole::Joiner, *lane, nonce_j, &nonce_l);
    if !auth::mac_eq(&want, &mac) {
        return Err(Fail::Answer(Error::AuthFailed));
    }
    Ok(*lane)
}

/// Fuzzing entry points: the pre-authentication exchanges over arbitrary bytes.
#[doc(hidden)]
pub mod fuzzing {
    use super::*;

    /// A stream reading `input` and collecting what is written.
    pub struct Duplex<'a> {
        /// What the peer sends.
        pub input: std::io::Cursor<&'a [u8]>,
        /// What we sent.
        pub output: Vec<u8>,
    }

    impl Read for Duplex<'_> {
        fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
            self.input.read(b)
        }
    }

    impl Write for Duplex<'_> {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.output.extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The responder's first read and its pre-authentication exchange over `input`, with a
    /// fixed secret and fixed randomness; returns whether the peer proved the secret and what
    /// we wrote.
    pub fn responder(input: &[u8], psk: Option<&[u8]>) -> (bool, Vec<u8>) {
        let mut io = Duplex {
            input: std::io::Cursor::new(input),
            output: Vec::new(),
        };
        let first = Expect {
            stage: Stage::FirstMessage,
            kinds: &[
                (kind::HELLO, body::HELLO),
                (kind::LANE_JOIN, body::LANE_JOIN),
            ],
        };
        let share = KeyShare::from_bytes([7; 32]);
        let proved = match wire::read_ctrl_limited(&mut io, first) {
            Ok((m @ CtrlMsg::Hello { .. }, raw)) => {
                let r = Responder {
                    psk,
                    share: &share,
                    nonce_r: [9; 32],
                };
                let got = respond(&mut io, &r, &m, &raw, || {});
                answered(&mut io, got)
            }
            Ok((m @ CtrlMsg::LaneJoin { .. }, _)) => {
                let cred = LaneCred {
                    sid: [1; 16],
                    key: [2; 32],
                };
                let lookup = |sid: &[u8; 16]| {
                    if *sid == cred.sid {
                        Ok(cred)
                    } else {
                        Err(Error::AuthFailed)
                    }
                };
                let got = accept_lane(&mut io, &m, [3; 32], lookup, || {});
                answered(&mut io, got)
            }
            Ok(_) => false,
            Err(e) => answered::<()>(&mut io, Err(Fail::from(e))),
        };
        (proved, io.output)
    }

    /// Sends the `Reject` a failure asks for, as the engine does; whether it succeeded.
    fn answered<T>(io: &mut Duplex<'_>, r: Result<T, Fail>) -> bool {
        match r {
            Ok(_) => true,
            Err(f) => {
                if let Some(b) = f.reject() {
                    io.output.extend_from_slice(&b);
                }
                false
            }
        }
    }

    /// The initiator's exchanges (pre-authentication and a lane join) against the bytes of
    /// a responder; returns what we wrote.
    pub fn initiator(input: &[u8], psk: Option<&[u8]>) -> Vec<u8> {
        let mut io = Duplex {
            input: std::io::Cursor::new(input),
            output: Vec::new(),
        };
        let share = KeyShare::from_bytes([5; 32]);
        let r = initiate(&mut io, psk, &share, [6; 32]).map(|_| ());
        answered(&mut io, r);
        let cred = LaneCred {
            sid: [1; 16],
            key: [2; 32],
        };
        let r = join_lane(&mut io, &cred, 0, [4; 32]);
        answered(&mut io, r);
        io.output
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both sides of the pre-authentication exchange, threads over a socket pair.
    type Outcome = Result<Key, Error>;

    fn answer(s: &mut std::net::TcpStream, r: Result<Proved, Fail>) -> Outcome {
        match r {
            Ok(p) => Ok(p.th.hash()),
            Err(f) => {
                if let Some(b) = f.reject() {
                    let _ = s.write_all(&b);
                }
                Err(f.into_error())
            }
        }
    }

    fn run(psk_i: Option<&'static [u8]>, psk_r: Option<&'static [u8]>) -> (Outcome, Outcome) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let t = std::thread::spawn(move || {
            let mut c = std::net::TcpStream::connect(addr).expect("connect");
            let share = KeyShare::random();
            let r = initiate(&mut c, psk_i, &share, auth::random());
            answer(&mut c, r)
        });
        let (mut s, _) = l.accept().expect("accept");
        let (m, raw) = wire::read_ctrl_limited(&mut s, wire::ANY).expect("hello");
        let share = KeyShare::random();
        let r = Responder {
            psk: psk_r,
            share: &share,
            nonce_r: auth::random(),
        };
        let got = respond(&mut s, &r, &m, &raw, || {});
        let got = answer(&mut s, got);
        drop(s);
        (t.join().expect("initiator"), got)
    }

    #[test]
    fn both_or_neither_and_the_right_secret() {
        let (i, r) = run(Some(b"k"), Some(b"k"));
        assert_eq!(i.expect("initiator"), r.expect("responder"));
        let (i, r) = run(None, None);
        assert_eq!(i.expect("initiator"), r.expect("responder"));
        let (_, r) = run(Some(b"k"), Some(b"x"));
        assert!(matches!(r, Err(Error::AuthFailed)));
        let (i, _) = run(None, Some(b"k"));
        assert!(matches!(i, Err(Error::AuthFailed)));
        let (i, r) = run(Some(b"k"), None);
        assert!(matches!(i, Err(Error::AuthFailed)));
        assert!(
            matches!(r, Err(Error::AuthFailed)),
            "the initiator's Reject: {r:?}"
        );
    }

    #[test]
    fn fuzz_entry_points_answer_garbage_with_a_reject_or_nothing() {
        let (ok, out) = fuzzing::responder(b"garbage that is no header", Some(b"k"));
        assert!(!ok);
        assert!(matches!(CtrlMsg::decode(&out), Ok(CtrlMsg::Reject { .. })));
        let hello = CtrlMsg::Hello {
            nonce: [1; 32],
            auth: true,
            dh: KeyShare::from_bytes([3; 32]).public,
        }
        .encode();
        let (ok, out) = fuzzing::responder(&hello, Some(b"k"));
        assert!(!ok);
        assert!(matches!(
            CtrlMsg::decode(&out),
            Ok(CtrlMsg::Challenge { .. })
        ));
        let out = fuzzing::initiator(b"", Some(b"k"));
        let mut cur = std::io::Cursor::new(&out);
        assert!(matches!(
            wire::read_ctrl(&mut cur),
            Ok(CtrlMsg::Hello { .. })
        ));
        assert!(matches!(
            wire::read_ctrl(&mut cur),
            Ok(CtrlMsg::LaneJoin { .. })
        ));
    }
}
