//! The little-endian writer and the bounded reader under every control-message codec.

use super::msg::{HostIdentity, MrChunks, WireRegion, MAX_MR_CHUNKS, MAX_REGIONS_PER_MSG};
use super::problem::{Field, Layout, ProtocolError};
use crate::types::{Access, DeviceIpc, RegionId};

#[derive(Default)]
pub(super) struct Writer {
    pub(super) buf: Vec<u8>,
}

impl Writer {
    pub(super) fn u8(&mut self, v: u8) {
        self.buf.push(v)
    }
    pub(super) fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes())
    }
    pub(super) fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes())
    }
    pub(super) fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes())
    }
    pub(super) fn bytes_fixed(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b)
    }
    pub(super) fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.buf.extend_from_slice(b)
    }
    pub(super) fn string(&mut self, s: &str) {
        self.bytes(s.as_bytes())
    }
    pub(super) fn host(&mut self, h: &HostIdentity) {
        self.string(&h.boot_id);
        self.string(&h.pid_ns);
        self.string(&h.mnt_ns);
        self.u32(h.pid);
    }
    pub(super) fn blobs(&mut self, blobs: &[(u8, Vec<u8>)]) {
        self.u32(blobs.len() as u32);
        for (k, b) in blobs {
            self.u8(*k);
            self.bytes(b);
        }
    }
    pub(super) fn regions(&mut self, rs: &[WireRegion]) {
        self.u32(rs.len() as u32);
        for r in rs {
            self.u32(r.id.index);
            self.u32(r.id.generation);
            self.u64(r.len);
            self.u8(r.access.to_wire());
            self.u64(r.addr);
            self.u32(r.fd as u32);
            self.u64(r.ino);
            self.u32(r.rkey);
            match &r.chunks {
                None => self.u64(0),
                Some(c) => {
                    self.u64(c.len);
                    self.u16(c.rkeys.len() as u16);
                    for k in c.rkeys.iter() {
                        self.u32(*k);
                    }
                }
            }
            match &r.ipc {
                None => self.u8(0),
                Some(d) => {
                    self.u8(1);
                    self.bytes_fixed(&d.handle);
                    self.u64(d.offset);
                }
            }
        }
    }
}

pub(super) struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(super) fn new(b: &'a [u8]) -> Self {
        Reader { b }
    }
    pub(super) fn rest(&self) -> &'a [u8] {
        self.b
    }
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        if self.b.len() < n {
            return Err(ProtocolError::Truncated {
                at: Layout::Field,
                need: n,
                have: self.b.len(),
            });
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    pub(super) fn u8(&mut self) -> Result<u8, ProtocolError> {
        Ok(self.take(1)?[0])
    }
    pub(super) fn bool(&mut self) -> Result<bool, ProtocolError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(ProtocolError::BadValue {
                field: Field::Bool,
                value: v,
            }),
        }
    }
    pub(super) fn u16(&mut self) -> Result<u16, ProtocolError> {
        let t = self.take(2)?;
        Ok(u16::from_le_bytes([t[0], t[1]]))
    }
    pub(super) fn u32(&mut self) -> Result<u32, ProtocolError> {
        let t = self.take(4)?;
        Ok(u32::from_le_bytes([t[0], t[1], t[2], t[3]]))
    }
    pub(super) fn u64(&mut self) -> Result<u64, ProtocolError> {
        let t = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(t);
        Ok(u64::from_le_bytes(a))
    }
    pub(super) fn fixed<const N: usize>(&mut self) -> Result<[u8; N], ProtocolError> {
        let t = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(t);
        Ok(a)
    }
    pub(super) fn bytes(&mut self, max: usize) -> Result<Vec<u8>, ProtocolError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(ProtocolError::TooLong {
                at: Layout::Field,
                len: n as u64,
                max: max as u64,
            });
        }
        Ok(self.take(n)?.to_vec())
    }
    pub(super) fn string(&mut self, max: usize) -> Result<String, ProtocolError> {
        let b = self.bytes(max)?;
        String::from_utf8(b).map_err(|_| ProtocolError::BadUtf8)
    }
    /// A count of items each at least `min_item` bytes: bounded by what remains.
    pub(super) fn count(&mut self, min_item: usize) -> Result<usize, ProtocolError> {
        let n = self.u32()? as usize;
        if n > MAX_REGIONS_PER_MSG as usize || n.saturating_mul(min_item) > self.b.len() {
            return Err(ProtocolError::BadCount {
                at: Layout::Field,
                n,
            });
        }
        Ok(n)
    }
    /// A region's RDMA chunks: `u64` chunk length (0: none), then the keys of chunks 1.., as
    /// many as cover the region's `len` bytes.
    fn chunks(&mut self, len: u64) -> Result<Option<MrChunks>, ProtocolError> {
        let chunk = self.u64()?;
        if chunk == 0 {
            return Ok(None);
        }
        let n = usize::from(self.u16()?);
        let want = MrChunks::count(chunk, len);
        if want < 2 || want > MAX_MR_CHUNKS as u64 || n as u64 != want - 1 {
            return Err(ProtocolError::BadCount {
                at: Layout::RegionChunks,
                n,
            });
        }
        let rkeys = (0..n).map(|_| self.u32()).collect::<Result<Vec<_>, _>>()?;
        let rkeys = rkeys.into();
        Ok(Some(MrChunks { len: chunk, rkeys }))
    }
    pub(super) fn host(&mut self) -> Result<HostIdentity, ProtocolError> {
        Ok(HostIdentity {
            boot_id: self.string(256)?,
            pid_ns: self.string(256)?,
            mnt_ns: self.string(256)?,
            pid: self.u32()?,
        })
    }
    pub(super) fn blobs(&mut self) -> Result<Vec<(u8, Vec<u8>)>, ProtocolError> {
        let n = self.count(5)?;
        if n > 16 {
            return Err(ProtocolError::BadCount {
                at: Layout::HelloBlobs,
                n,
            });
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let k = self.u8()?;
            v.push((k, self.bytes(64 << 10)?));
        }
        Ok(v)
    }
    pub(super) fn regions(&mut self) -> Result<Vec<WireRegion>, ProtocolError> {
        let n = self.count(50)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let id = RegionId {
                index: self.u32()?,
                generation: self.u32()?,
            };
            let len = self.u64()?;
            let a = self.u8()?;
            let access = Access::from_wire(a).ok_or(ProtocolError::BadValue {
                field: Field::Access,
                value: a,
            })?;
            v.push(WireRegion {
                id,
                len,
                access,
                addr: self.u64()?,
                fd: self.u32()? as i32,
                ino: self.u64()?,
                rkey: self.u32()?,
                chunks: self.chunks(len)?,
                ipc: match self.u8()? {
                    0 => None,
                    1 => Some(DeviceIpc {
                        handle: self.fixed::<64>()?,
                        offset: self.u64()?,
                    }),
                    v => {
                        return Err(ProtocolError::BadValue {
                            field: Field::DeviceIpc,
                            value: v,
                        })
                    }
                },
            });
        }
        Ok(v)
    }
}

/// Access codes on the wire.
impl Access {
    pub(super) fn to_wire(self) -> u8 {
        match self {
            Access::ReadWrite => 0,
            Access::WriteOnly => 1,
            Access::ReadOnly => 2,
            Access::Local => 3,
        }
    }
    pub(super) fn from_wire(b: u8) -> Option<Access> {
        Some(match b {
            0 => Access::ReadWrite,
            1 => Access::WriteOnly,
            2 => Access::ReadOnly,
            3 => Access::Local,
            _ => return None,
        })
    }
}
