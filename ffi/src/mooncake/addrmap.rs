//! The address map each drop-in engine publishes in its metadata region (layout in the
//! module documentation of [`super`]): entries, their encoding and lookups.

use kvwire_transfer::RegionId;

pub(super) const MAGIC: &[u8; 8] = b"KVWMOON1";
pub(super) const HEADER: usize = 32;
pub(super) const ENTRY: usize = 24;
/// Most buffers one drop-in engine can publish.
pub const MAX_ENTRIES: usize = 16_384;
/// Size of the metadata region (identifies it among a peer's read-only regions).
pub const META_LEN: usize = HEADER + MAX_ENTRIES * ENTRY;

/// One entry of an address map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct MapEntry {
    pub(super) base: u64,
    pub(super) len: u64,
    pub(super) id: RegionId,
}

/// Finds the entry holding `[addr, addr+len)`; `map` is sorted by base.
pub(super) fn lookup(map: &[MapEntry], addr: u64, len: u64) -> Option<(MapEntry, u64)> {
    let i = map.partition_point(|e| e.base <= addr);
    let e = *map.get(i.checked_sub(1)?)?;
    let off = addr - e.base;
    let end = off.checked_add(len)?;
    (end <= e.len).then_some((e, off))
}

pub(super) fn encode_entries(entries: &[MapEntry]) -> Vec<u8> {
    let mut v = Vec::with_capacity(entries.len() * ENTRY);
    for e in entries {
        v.extend_from_slice(&e.base.to_le_bytes());
        v.extend_from_slice(&e.len.to_le_bytes());
        v.extend_from_slice(&e.id.index.to_le_bytes());
        v.extend_from_slice(&e.id.generation.to_le_bytes());
    }
    v
}

pub(super) fn header(seq: u64, count: u32) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..8].copy_from_slice(MAGIC);
    h[8..16].copy_from_slice(&seq.to_le_bytes());
    h[16..20].copy_from_slice(&count.to_le_bytes());
    h
}

/// Parses a header: `(seq, count)`.
pub(super) fn parse_header(b: &[u8]) -> Result<(u64, usize), String> {
    if b.len() < HEADER || &b[..8] != MAGIC {
        return Err("peer's metadata region has no kvwire address map".into());
    }
    let seq = u64::from_le_bytes(b[8..16].try_into().map_err(|_| "short header")?);
    let count = u32::from_le_bytes(b[16..20].try_into().map_err(|_| "short header")?) as usize;
    if count > MAX_ENTRIES {
        return Err(format!(
            "peer's address map claims {count} entries (max {MAX_ENTRIES})"
        ));
    }
    Ok((seq, count))
}

pub(super) fn parse_entries(b: &[u8], count: usize) -> Result<Vec<MapEntry>, String> {
    if b.len() < count * ENTRY {
        return Err("truncated address map".into());
    }
    let mut v = Vec::with_capacity(count);
    for c in b.chunks_exact(ENTRY).take(count) {
        let f8 = |r: std::ops::Range<usize>| -> u64 {
            c[r].iter()
                .rev()
                .fold(0u64, |a, &x| (a << 8) | u64::from(x))
        };
        let base = f8(0..8);
        let len = f8(8..16);
        if base.checked_add(len).is_none() {
            return Err(format!("address map entry {base:#x}+{len} overflows"));
        }
        v.push(MapEntry {
            base,
            len,
            id: RegionId {
                index: f8(16..20) as u32,
                generation: f8(20..24) as u32,
            },
        });
    }
    v.sort_by_key(|e| e.base);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_bounds() {
        let id = |i| RegionId {
            index: i,
            generation: 1,
        };
        let map = vec![
            MapEntry {
                base: 100,
                len: 50,
                id: id(1),
            },
            MapEntry {
                base: 1000,
                len: 10,
                id: id(2),
            },
        ];
        assert_eq!(
            lookup(&map, 100, 50).map(|(e, o)| (e.id, o)),
            Some((id(1), 0))
        );
        assert_eq!(
            lookup(&map, 120, 30).map(|(e, o)| (e.id, o)),
            Some((id(1), 20))
        );
        assert!(lookup(&map, 120, 31).is_none());
        assert!(lookup(&map, 99, 1).is_none());
        assert!(lookup(&map, 150, 1).is_none());
        assert_eq!(
            lookup(&map, 1009, 1).map(|(e, o)| (e.id, o)),
            Some((id(2), 9))
        );
        assert!(lookup(&map, u64::MAX, 2).is_none());
        assert!(lookup(&[], 0, 1).is_none());
    }

    #[test]
    fn map_roundtrip_and_bad_input() {
        let e = vec![MapEntry {
            base: 4096,
            len: 8192,
            id: RegionId {
                index: 3,
                generation: 7,
            },
        }];
        let mut b = header(2, 1).to_vec();
        b.extend(encode_entries(&e));
        let (seq, count) = parse_header(&b).unwrap();
        assert_eq!((seq, count), (2, 1));
        assert_eq!(parse_entries(&b[HEADER..], count).unwrap(), e);
        assert!(parse_header(&[0u8; HEADER]).is_err());
        assert!(parse_header(&b[..10]).is_err());
        assert!(parse_header(&header(0, (MAX_ENTRIES + 1) as u32)).is_err());
        assert!(parse_entries(&b[HEADER..HEADER + 5], 1).is_err());
        let bad = encode_entries(&[MapEntry {
            base: u64::MAX,
            len: 2,
            id: RegionId {
                index: 0,
                generation: 0,
            },
        }]);
        assert!(parse_entries(&bad, 1).is_err());
    }
}
