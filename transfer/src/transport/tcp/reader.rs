//! [`FrameReader`]: a buffered lane reader that lands large payloads straight in region memory.

use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::AsFd;

use crate::mem::RegionMem;
use crate::wire::FRAME_HEADER_LEN;

/// Receive buffer of a lane reader. Headers and small payloads arrive with one `read`; the
/// bytes of a large payload beyond what was buffered with its header go straight into region
/// memory, so at most this much of a payload is copied twice.
const READ_BUF: usize = 32 << 10;

/// Buffered frame reader that reads large payloads straight into region memory.
pub(crate) struct FrameReader {
    s: TcpStream,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl FrameReader {
    pub fn new(s: TcpStream) -> Self {
        FrameReader {
            s,
            buf: vec![0u8; READ_BUF].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    pub fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Next header, `None` on a clean EOF at a frame boundary.
    pub fn header(&mut self) -> io::Result<Option<[u8; FRAME_HEADER_LEN]>> {
        while self.buffered() < FRAME_HEADER_LEN {
            if self.buf.len() - self.end < FRAME_HEADER_LEN {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            let n = (&self.s).read(&mut self.buf[self.end..])?;
            if n == 0 {
                if self.buffered() == 0 {
                    return Ok(None);
                }
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed mid-header",
                ));
            }
            self.end += n;
        }
        let mut h = [0u8; FRAME_HEADER_LEN];
        h.copy_from_slice(&self.buf[self.start..self.start + FRAME_HEADER_LEN]);
        self.start += FRAME_HEADER_LEN;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        Ok(Some(h))
    }

    /// Reads a `len`-byte payload into `mem` at `off` (bounds checked by `RegionMem`).
    pub fn payload_into(&mut self, mem: &RegionMem, off: u64, len: usize) -> io::Result<()> {
        let take = len.min(self.buffered());
        if take > 0 {
            mem.copy_in(off, &self.buf[self.start..self.start + take])?;
            self.start += take;
        }
        if take < len {
            mem.recv_into(self.s.as_fd(), off + take as u64, len - take)?;
        }
        Ok(())
    }

    /// Reads a payload into a vector (small, bounded payloads only).
    pub fn payload_vec(&mut self, len: usize) -> io::Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        let take = len.min(self.buffered());
        v[..take].copy_from_slice(&self.buf[self.start..self.start + take]);
        self.start += take;
        if take < len {
            (&self.s).read_exact(&mut v[take..])?;
        }
        Ok(v)
    }

    /// Skips a payload without landing it anywhere.
    pub fn discard(&mut self, mut len: usize) -> io::Result<()> {
        let take = len.min(self.buffered());
        self.start += take;
        len -= take;
        let mut scratch = [0u8; 8192];
        while len > 0 {
            let n = len.min(scratch.len());
            (&self.s).read_exact(&mut scratch[..n])?;
            len -= n;
        }
        Ok(())
    }
}
