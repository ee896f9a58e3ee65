//! Test support shared by the engine's tests and the end-to-end tests: block
//! contents that identify themselves, and the durability oracle.
//!
//! The oracle follows the NBD contract: after a crash, each block must hold exactly
//! one version's content, and that version must be the one acknowledged before the
//! last completed flush, or one written after it.

pub const BS: usize = 4096;

/// Content of a block written with `version` at `lba`. Version 0 is all zeros.
pub fn pattern(lba: u64, version: u64) -> Vec<u8> {
    let mut b = vec![0u8; BS];
    fill_pattern(lba, version, &mut b);
    b
}

/// Writes the pattern of (`lba`, `version`) into a 4 KiB slice.
pub fn fill_pattern(lba: u64, version: u64, b: &mut [u8]) {
    if version == 0 {
        b.fill(0);
        return;
    }
    let mut x =
        lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ version.wrapping_mul(0xC2B2_AE3D_27D4_EB4F) ^ 1;
    for chunk in b.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b[8..16].copy_from_slice(&version.to_le_bytes());
}

/// Which version a block holds, or why it is not exactly some version's content.
pub fn decode_pattern(lba: u64, b: &[u8]) -> Result<u64, String> {
    if b.iter().all(|&x| x == 0) {
        return Ok(0);
    }
    let l = u64::from_le_bytes(b[..8].try_into().unwrap());
    let v = u64::from_le_bytes(b[8..16].try_into().unwrap());
    if l != lba {
        return Err(format!("block {lba} holds data of block {l}"));
    }
    if pattern(lba, v) != b {
        return Err(format!(
            "block {lba} is torn or corrupt (its header says version {v})"
        ));
    }
    Ok(v)
}

#[derive(Clone)]
struct Block {
    /// Versions written, in submission order; `history[stable]` is durable.
    history: Vec<u64>,
    stable: usize,
    acked: usize,
}

/// What each block of a volume may hold after a crash.
#[derive(Clone)]
pub struct Oracle {
    blocks: Vec<Block>,
}

/// Identifies one write in the oracle (index in each block's history).
pub type WriteMark = Vec<usize>;

/// A flush's view of what was acknowledged when it was sent.
pub struct FlushMark(Vec<usize>);

impl Oracle {
    pub fn new(blocks: u64) -> Self {
        Oracle {
            blocks: vec![
                Block {
                    history: vec![0],
                    stable: 0,
                    acked: 0,
                };
                blocks as usize
            ],
        }
    }

    pub fn blocks(&self) -> u64 {
        self.blocks.len() as u64
    }

    /// Records that `version` was sent for blocks `first..first+count`.
    pub fn issue(&mut self, first: u64, count: u64, version: impl Fn(u64) -> u64) -> WriteMark {
        (first..first + count)
            .map(|lba| {
                let b = &mut self.blocks[lba as usize];
                b.history.push(version(lba));
                b.history.len() - 1
            })
            .collect()
    }

    /// The write was acknowledged.
    pub fn ack(&mut self, first: u64, mark: &WriteMark) {
        for (k, idx) in mark.iter().enumerate() {
            let b = &mut self.blocks[first as usize + k];
            b.acked = b.acked.max(*idx);
        }
    }

    /// A FUA write was acknowledged: its own blocks are durable.
    pub fn ack_durable(&mut self, first: u64, mark: &WriteMark) {
        self.ack(first, mark);
        for (k, idx) in mark.iter().enumerate() {
            let b = &mut self.blocks[first as usize + k];
            b.stable = b.stable.max(*idx);
        }
    }

    /// A flush is being sent: remember what is acknowledged now.
    pub fn flush_sent(&self) -> FlushMark {
        FlushMark(self.blocks.iter().map(|b| b.acked).collect())
    }

    /// That flush completed: what it covered is durable.
    pub fn flush_done(&mut self, mark: &FlushMark) {
        for (b, s) in self.blocks.iter_mut().zip(&mark.0) {
            b.stable = b.stable.max(*s);
        }
    }

    /// Versions block `lba` may hold after a crash.
    pub fn allowed(&self, lba: u64) -> &[u64] {
        let b = &self.blocks[lba as usize];
        &b.history[b.stable..]
    }

    /// Checks one block read back after a crash; returns the version found.
    pub fn check(&self, lba: u64, data: &[u8]) -> Result<u64, String> {
        let v = decode_pattern(lba, data)?;
        let allowed = self.allowed(lba);
        if !allowed.contains(&v) {
            return Err(format!(
                "block {lba} holds version {v}; allowed {allowed:?}"
            ));
        }
        Ok(v)
    }

    /// After recovery, what was found is the new durable state.
    pub fn reset_to(&mut self, found: &[u64]) {
        for (b, v) in self.blocks.iter_mut().zip(found) {
            *b = Block {
                history: vec![*v],
                stable: 0,
                acked: 0,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_identify_themselves() {
        let b = pattern(7, 3);
        assert_eq!(decode_pattern(7, &b), Ok(3));
        assert!(decode_pattern(8, &b).is_err());
        let mut torn = b.clone();
        torn[2048..].copy_from_slice(&pattern(7, 4)[2048..]);
        assert!(decode_pattern(7, &torn).is_err());
        assert_eq!(decode_pattern(1, &[0u8; BS]), Ok(0));
    }

    #[test]
    fn oracle_follows_flushes() {
        let mut o = Oracle::new(2);
        let m = o.issue(0, 1, |_| 5);
        assert_eq!(o.allowed(0), &[0, 5]);
        o.ack(0, &m);
        let f = o.flush_sent();
        let m2 = o.issue(0, 1, |_| 6);
        o.flush_done(&f);
        assert_eq!(o.allowed(0), &[5, 6]);
        o.ack(0, &m2);
        assert!(o.check(0, &pattern(0, 0)).is_err());
        assert_eq!(o.check(1, &pattern(1, 0)), Ok(0));
    }
}
