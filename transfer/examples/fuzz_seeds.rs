//! Writes seed inputs for the cargo-fuzz targets of `transfer/fuzz` (valid encodings of every
//! message a target decodes) into `DIR/<target>/`: `cargo run --example fuzz_seeds -- DIR`.

use std::path::Path;

use kvwire_transfer::auth::KeyShare;
use kvwire_transfer::wire::{
    self, CtrlMsg, FrameHeader, FrameKind, HostIdentity, MrChunks, WireRegion,
};
use kvwire_transfer::{Access, Error, RegionId};

fn main() -> std::io::Result<()> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "fuzz-seeds".into());
    let dir = Path::new(&dir);
    let share = KeyShare::from_bytes([3; 32]);
    let id = RegionId {
        index: 1,
        generation: 2,
    };
    let region = WireRegion::keyless(id, 4096, Access::ReadWrite);
    let host = HostIdentity {
        boot_id: "b".into(),
        pid_ns: "p".into(),
        mnt_ns: "m".into(),
        pid: 1,
    };
    let msgs = vec![
        CtrlMsg::Hello {
            nonce: [1; 32],
            auth: true,
            dh: share.public,
        },
        CtrlMsg::Challenge {
            nonce: [2; 32],
            auth_required: true,
            dh: share.public,
        },
        CtrlMsg::Proof { mac: [3; 32] },
        CtrlMsg::Accept {
            host: host.clone(),
            transports: 1,
            lanes: 4,
            blobs: vec![(2, vec![0; 24])],
            mac: [4; 32],
        },
        CtrlMsg::Auth {
            host,
            listen_port: 7000,
            transports: 3,
            lanes: 4,
            blobs: vec![],
            regions: vec![region.clone()],
            mac: [5; 32],
        },
        CtrlMsg::Welcome {
            regions: vec![region.clone()],
            mac: [6; 32],
        },
        CtrlMsg::Reject {
            error: wire::encode_error(&Error::AuthFailed),
        },
        CtrlMsg::LaneJoin {
            sid: [1; 16],
            lane: 0,
            nonce: [7; 32],
        },
        CtrlMsg::LaneChallenge {
            nonce: [8; 32],
            mac: [9; 32],
        },
        CtrlMsg::LaneProof { mac: [10; 32] },
        CtrlMsg::LaneOk,
        CtrlMsg::RegionsAdded(vec![region.clone()]),
        CtrlMsg::RegionsSet(vec![region.clone()]),
        // a region registered for RDMA in three chunks
        CtrlMsg::RegionsAdded(vec![WireRegion {
            len: 3 << 20,
            rkey: 7,
            chunks: Some(MrChunks {
                len: 1 << 20,
                rkeys: vec![8, 9].into(),
            }),
            ..region.clone()
        }]),
        CtrlMsg::RegionsRemoved(vec![region.id]),
        CtrlMsg::Notify(b"tag".to_vec()),
        CtrlMsg::Transport {
            bit: 0x80,
            data: vec![1, 1, 0, 0, 0, 0, 0, 0, 0, 7],
        },
    ];
    let ctrl: Vec<Vec<u8>> = msgs.iter().map(|m| m.encode()).collect();
    for t in [
        "ctrl_decode",
        "ctrl_read_limited",
        "responder_handshake",
        "initiator_handshake",
    ] {
        write(dir, t, &ctrl)?;
    }
    let frames: Vec<Vec<u8>> = [FrameKind::Write, FrameKind::Ack, FrameKind::Notify]
        .iter()
        .map(|k| FrameHeader::simple(*k, 1, 0, 1).encode().to_vec())
        .collect();
    write(dir, "frame_header", &frames)?;
    let errors: Vec<Vec<u8>> = [
        Error::AuthFailed,
        Error::StaleRegion(region.id),
        Error::Fenced {
            addr: "127.0.0.1:7000".parse().expect("addr"),
        },
    ]
    .iter()
    .map(wire::encode_error)
    .collect();
    write(dir, "error_payload", &errors)?;
    write(
        dir,
        "second_stage",
        &[
            vec![1, 1, 0, 0, 0, 0, 0, 0, 0, 7],
            vec![3, 1, 0, 0, 0, 0, 0, 0, 0, 7, 1, 0, 0, 0, 0, 0, 0, 0],
            vec![4, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        ],
    )?;
    write(
        dir,
        "metrics_request",
        &[b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()],
    )?;
    Ok(())
}

fn write(dir: &Path, target: &str, seeds: &[Vec<u8>]) -> std::io::Result<()> {
    let d = dir.join(target);
    std::fs::create_dir_all(&d)?;
    for (i, s) in seeds.iter().enumerate() {
        std::fs::write(d.join(format!("seed-{i}")), s)?;
    }
    Ok(())
}
