//! What the engine sends out: device operations, each under a tag that names what
//! its completion is for, and replies to clients. The driver drains both after
//! every engine round; completions come back by tag ([`Outbox::completed`]).
//!
//! Tags are reused as soon as their operation completes, so the table is as large
//! as the most operations ever in flight at once and a tag never allocates once
//! the engine has warmed up.

use crate::engine::{Purpose, Reply, Token};
use crate::error::EngineError;
use crate::io::{IoKind, IoOp};

#[derive(Default)]
pub(crate) struct Outbox {
    ops: Vec<IoOp>,
    /// What each tag stands for; `None` while the tag is free.
    purposes: Vec<Option<Purpose>>,
    free: Vec<u64>,
    replies: Vec<Reply>,
}

impl Outbox {
    /// Queues a device operation for `p`.
    pub fn submit(&mut self, p: Purpose, device: usize, offset: u64, kind: IoKind) {
        let tag = match self.free.pop() {
            Some(t) => {
                debug_assert!(self.purposes[t as usize].is_none());
                self.purposes[t as usize] = Some(p);
                t
            }
            None => {
                self.purposes.push(Some(p));
                self.purposes.len() as u64 - 1
            }
        };
        self.ops.push(IoOp {
            tag,
            device,
            offset,
            kind,
        });
    }

    /// The operation under `tag` completed: what it was for. The tag is free again.
    pub fn completed(&mut self, tag: u64) -> Purpose {
        let p = self
            .purposes
            .get_mut(tag as usize)
            .and_then(Option::take)
            .unwrap_or_else(|| panic!("completion for an unknown tag {tag}"));
        self.free.push(tag);
        p
    }

    /// Operations handed to the driver that have not completed.
    pub fn in_flight(&self) -> usize {
        self.purposes.len() - self.free.len()
    }

    /// Operations queued and not yet drained by the driver.
    pub fn queued(&self) -> usize {
        self.ops.len()
    }

    pub fn drain_io(&mut self, out: &mut Vec<IoOp>) {
        out.append(&mut self.ops);
    }

    pub fn reply(&mut self, token: Token, result: Result<(), EngineError>, buf: Option<Vec<u8>>) {
        self.replies.push(Reply {
            token,
            result,
            buf,
            status: None,
        });
    }

    pub fn push_reply(&mut self, r: Reply) {
        self.replies.push(r);
    }

    pub fn replies(&mut self) -> &mut Vec<Reply> {
        &mut self.replies
    }

    /// Replies made and not yet drained.
    pub fn has_replies(&self) -> bool {
        !self.replies.is_empty()
    }

    pub fn drain_replies(&mut self, out: &mut Vec<Reply>) {
        out.append(&mut self.replies);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_reused_once_completed() {
        let mut o = Outbox::default();
        o.submit(Purpose::Sync, 0, 0, IoKind::Sync);
        o.submit(Purpose::GcMeta, 1, 0, IoKind::Sync);
        let mut ops = Vec::new();
        o.drain_io(&mut ops);
        assert_eq!(ops.iter().map(|op| op.tag).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!((o.in_flight(), o.queued()), (2, 0));
        assert!(matches!(o.completed(0), Purpose::Sync));
        assert_eq!(o.in_flight(), 1);
        o.submit(Purpose::Sync, 2, 0, IoKind::Sync);
        ops.clear();
        o.drain_io(&mut ops);
        assert_eq!(ops[0].tag, 0, "the free tag is reused");
        assert_eq!(ops[0].device, 2);
        assert!(matches!(o.completed(1), Purpose::GcMeta));
        assert!(matches!(o.completed(0), Purpose::Sync));
        assert_eq!(o.in_flight(), 0);
    }

    #[test]
    #[should_panic(expected = "unknown tag 0")]
    fn a_tag_completes_once() {
        let mut o = Outbox::default();
        o.submit(Purpose::Sync, 0, 0, IoKind::Sync);
        o.completed(0);
        o.completed(0);
    }
}
