//! The engine's side of the DRAM write buffer: which unit buffer is free, open in
//! a stream, being written to the device, or written and waiting for readers.
//!
//! A buffer goes Free -> Open (a stream fills it) -> InFlight (sealed, its write
//! queued) -> Done (written; the map now names the device) -> Free (no reader pins
//! it any more: a reader that found the block in the buffer may still be copying
//! it out). A unit that is sealed empty goes back to Free at once, and a unit whose
//! blocks all died before its write (a small unit moved out of a sequential zone)
//! goes from Open to Done. Any other transition is a bug, and panics.

/// The state of one unit buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BufState {
    Free,
    Open {
        stream: u32,
    },
    InFlight {
        seg: u32,
        offset: u32,
        data: u32,
        stream: u32,
    },
    /// Written; waiting for readers to unpin.
    Done,
}

pub(crate) struct UnitBuffers {
    state: Vec<BufState>,
    free: Vec<u32>,
}

impl UnitBuffers {
    pub fn new(count: u32) -> Self {
        UnitBuffers {
            state: vec![BufState::Free; count as usize],
            // Popped from the end: buffer 0 first.
            free: (0..count).rev().collect(),
        }
    }

    pub fn state(&self, buf: u32) -> BufState {
        self.state[buf as usize]
    }

    /// Takes a free buffer for stream `stream`.
    pub fn open(&mut self, stream: u32) -> Option<u32> {
        let b = self.free.pop()?;
        debug_assert_eq!(self.state[b as usize], BufState::Free);
        self.state[b as usize] = BufState::Open { stream };
        Some(b)
    }

    /// An open buffer was sealed with nothing in it.
    pub fn release_empty(&mut self, buf: u32) {
        self.expect_open(buf);
        self.state[buf as usize] = BufState::Free;
        self.free.push(buf);
    }

    /// An open buffer was sealed and its write queued.
    pub fn sealed(&mut self, buf: u32, seg: u32, offset: u32, data: u32) {
        let stream = self.expect_open(buf);
        self.state[buf as usize] = BufState::InFlight {
            seg,
            offset,
            data,
            stream,
        };
    }

    /// An open buffer's blocks all moved elsewhere: it is dropped unwritten.
    pub fn dropped(&mut self, buf: u32) {
        self.expect_open(buf);
        self.state[buf as usize] = BufState::Done;
    }

    /// A buffer's write completed: where it went (segment, offset, data blocks).
    pub fn written(&mut self, buf: u32) -> (u32, u32, u32) {
        let BufState::InFlight {
            seg, offset, data, ..
        } = self.state[buf as usize]
        else {
            panic!(
                "completion for buffer {buf} in state {:?}",
                self.state[buf as usize]
            );
        };
        self.state[buf as usize] = BufState::Done;
        (seg, offset, data)
    }

    /// Some buffer is being written or waits for readers: it will become free
    /// without anything else happening.
    pub fn any_coming_back(&self) -> bool {
        self.state
            .iter()
            .any(|b| matches!(b, BufState::InFlight { .. } | BufState::Done))
    }

    /// Frees the written buffers no reader pins.
    pub fn recycle(&mut self, pinned: impl Fn(u32) -> bool) {
        for b in 0..self.state.len() as u32 {
            if self.state[b as usize] == BufState::Done && !pinned(b) {
                self.state[b as usize] = BufState::Free;
                self.free.push(b);
            }
        }
    }

    fn expect_open(&self, buf: u32) -> u32 {
        match self.state[buf as usize] {
            BufState::Open { stream } => stream,
            s => panic!("buffer {buf} is {s:?}, not open"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_comes_back_only_when_written_and_unpinned() {
        let mut b = UnitBuffers::new(2);
        let x = b.open(5).unwrap();
        let y = b.open(6).unwrap();
        assert_eq!((x, y), (0, 1));
        assert_eq!(b.open(7), None);
        assert!(!b.any_coming_back());
        b.sealed(x, 3, 16, 100);
        assert!(b.any_coming_back());
        b.recycle(|_| false);
        assert_eq!(b.open(7), None, "in flight is not free");
        assert_eq!(b.written(x), (3, 16, 100));
        b.recycle(|_| true);
        assert_eq!(b.open(7), None, "pinned by a reader");
        b.recycle(|_| false);
        assert_eq!(b.open(7), Some(x));
        b.release_empty(y);
        assert_eq!(b.open(8), Some(y));
    }

    #[test]
    #[should_panic(expected = "not open")]
    fn a_free_buffer_cannot_be_sealed() {
        let mut b = UnitBuffers::new(1);
        b.sealed(0, 0, 0, 0);
    }

    #[test]
    #[should_panic(expected = "completion for buffer 0")]
    fn an_open_buffer_cannot_complete() {
        let mut b = UnitBuffers::new(1);
        b.open(0);
        b.written(0);
    }
}
