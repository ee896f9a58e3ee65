//! Array health as the engine sees it: members that fail and are replaced, and the
//! superblock updates that record it (the sequence itself is [`SbWriter`]'s).
//!
//! A member failure is recorded in the superblock before any write that left the
//! member out is acknowledged; a replacement, a member marked failed by the
//! administrator and rebuild progress are acknowledged once a superblock that
//! records them is durable.

use crate::engine::{Engine, Purpose, Token, VERSION_LEASE};
use crate::error::EngineError;
use crate::io::IoKind;
use crate::sb_writer::SbStep;
use crate::types::BLOCK_SIZE_U64;
use lamina_format::superblock::SUPERBLOCK_OFFSETS;
use std::sync::Arc;

impl Engine {
    /// Records member failures in the superblock, and releases the flushes that
    /// waited for that; answers the requests waiting for a durable superblock.
    pub(crate) fn progress_member_failures(&mut self) {
        if let Some(st) = self.shared.striped.clone() {
            let epoch = st.failure_epoch();
            if epoch != self.sbw.failures_recorded() && !self.sbw.busy() && self.failed.is_none() {
                self.start_superblock_write();
            }
            if epoch == self.sbw.failures_durable() {
                if let Some(t) = self.durability.deferred.take() {
                    self.finish_sync(t);
                }
            }
        }
        if self.sbw.dirty() && !self.sbw.busy() && self.failed.is_none() {
            self.start_superblock_write();
        }
        let mut tokens = Vec::new();
        if let Some(why) = self.failed.clone() {
            self.sbw.take_all(&mut tokens);
            for t in tokens.drain(..) {
                self.reply(t, Err(EngineError::Failed(why.clone())), None);
            }
        }
        self.sbw.take_ready(&mut tokens);
        for t in tokens {
            self.reply(t, Ok(()), None);
        }
    }

    /// Replies to `token` once a superblock written after this call is durable.
    pub(crate) fn await_superblock(&mut self, token: Token) {
        self.sbw.wait(token, self.sb.generation);
    }

    pub(crate) fn replace_member(
        &mut self,
        index: usize,
        device: Arc<dyn lamina_device::BlockDevice>,
        uuid: [u8; 16],
    ) -> Result<(), EngineError> {
        let Some((st, local)) = self.striped_of(index) else {
            return Err(EngineError::Invalid(if self.geo.mirrored() {
                format!(
                    "member {index} is in the capacity tier, a jbod without redundancy: it \
                     cannot be rebuilt online; `lamina array replace` copies it to the new \
                     device with the array stopped"
                )
            } else {
                "only striped arrays (said0/5/6) and mirrored cache tiers replace members \
                 online"
                    .into()
            }));
        };
        // A cache copy is conventional even in front of zoned capacity members.
        let zoned = self.zones.zoned && !self.geo.is_cache_member(index);
        if !zoned && device.zone_layout().is_some() {
            return Err(EngineError::Invalid(format!(
                "{} is a zoned device; this array's {} are not",
                device.describe(),
                if self.geo.is_cache_member(index) {
                    "cache members"
                } else {
                    "members"
                }
            )));
        }
        if index >= self.geo.members {
            return Err(EngineError::Invalid(format!(
                "no member {index}: the array has members 0 to {}",
                self.geo.members - 1
            )));
        }
        if !st.is_failed(local) {
            return Err(EngineError::Invalid(format!(
                "member {index} has not failed; fail it first (lamina array fail --device {index})"
            )));
        }
        if st.shape().parity == 0 {
            return Err(EngineError::Invalid(
                "said0 has no parity to rebuild a member from".into(),
            ));
        }
        // Zoned: checked, and emptied, once everything else is known to be right.
        let device = if zoned {
            self.zoned_replacement(device)?
        } else {
            device
        };
        st.replace(local, device.clone(), 0)
            .map_err(|e| EngineError::Invalid(e.to_string()))?;
        let e = &mut self.sb.devices[index];
        e.uuid = uuid;
        e.size_bytes = device.size_bytes();
        e.state = crate::recovery::MEMBER_REBUILDING;
        e.rebuild_cursor = 0;
        Ok(())
    }

    /// A replacement member of a zoned array: zoned like the others (a zone per
    /// stripe chunk after the same conventional space), every zone emptied. The
    /// rebuild then writes each stripe's zone from its start.
    fn zoned_replacement(
        &self,
        device: Arc<dyn lamina_device::BlockDevice>,
    ) -> Result<Arc<dyn lamina_device::BlockDevice>, EngineError> {
        let device = lamina_device::zonehost::host(device);
        let chunk = (self.geo.segment_blocks / self.geo.row_blocks) as u64 * BLOCK_SIZE_U64;
        let fits = device.zone_layout().is_some_and(|l| {
            l.conventional_bytes == self.geo.data_offset
                && l.zone_bytes == chunk
                && l.zones >= self.geo.segment_count as u64
                && (l.open_limit() == 0 || l.open_limit() >= self.zones.limit)
        });
        if !fits {
            return Err(EngineError::Invalid(format!(
                "{} is not zoned like the array's members ({} conventional bytes, then zones of {} bytes, at least {} of them, at least {} open at once)",
                device.describe(),
                self.geo.data_offset,
                chunk,
                self.geo.segment_count,
                self.zones.limit
            )));
        }
        crate::recovery::empty_zones(&*device)?;
        Ok(device)
    }

    /// Writes the superblock (both copies, every member in service, with syncs
    /// between) and calls `sb_done` when finished.
    pub(crate) fn start_superblock_write(&mut self) {
        self.record_member_failures();
        self.sb.generation += 1;
        let step = self.sbw.begin(self.sb.generation);
        self.sb_issue(step);
    }

    /// Issues a step of the update under way to every member in service.
    fn sb_issue(&mut self, step: SbStep) {
        let members = self.sb_members();
        if members.is_empty() && step != SbStep::Done {
            // Every member failed while the update was under way: nothing can
            // take it, and the update stays unfinished (the engine has failed).
            self.fail("no member left in service to take the superblock".into());
            return;
        }
        if step != SbStep::Done {
            self.sbw.issued(members.len());
        }
        match step {
            SbStep::Write { offset, .. } => {
                for d in members {
                    let mut sb = self.sb.clone();
                    sb.device_index = d as u32;
                    let data = sb.encode().to_vec();
                    let ticket = self.issue_ticket();
                    self.counters.meta_blocks += 1;
                    self.counters.media_blocks += 1;
                    let gen = self.slot_gen(d);
                    self.submit_io(
                        Purpose::SuperblockWrite {
                            ticket,
                            device: d,
                            gen,
                        },
                        d,
                        offset,
                        IoKind::WriteOwned { data },
                    );
                }
            }
            SbStep::Sync => {
                for d in members {
                    let gen = self.slot_gen(d);
                    self.submit_io(
                        Purpose::SuperblockSync { device: d, gen },
                        d,
                        0,
                        IoKind::Sync,
                    );
                }
            }
            SbStep::Done => self.sb_done(),
        }
    }

    /// A member's superblock write or sync completed.
    pub(crate) fn sb_step_done(&mut self) {
        if let Some(step) = self.sbw.step_done() {
            self.sb_issue(step);
        }
    }

    /// The striped device and its index for array member `d`, if `d` is one of
    /// its members (every member of a striped layout, the cache members of a
    /// mirrored cache tier).
    pub(crate) fn striped_of(
        &self,
        d: usize,
    ) -> Option<(Arc<lamina_device::striped::Striped>, usize)> {
        let st = self.shared.striped.clone()?;
        Some((st, self.geo.striped_index(d)?))
    }

    /// Whether member `d` is a member of the striped device that failed.
    pub(crate) fn member_failed(&self, d: usize) -> bool {
        self.striped_of(d).is_some_and(|(st, m)| st.is_failed(m))
    }

    /// Generation of member slot `d` (0 outside the striped device).
    fn slot_gen(&self, d: usize) -> u64 {
        self.striped_of(d)
            .map_or(0, |(st, m)| st.slot_generation(m))
    }

    /// Members the superblock goes to: all but the failed and removed ones.
    fn sb_members(&self) -> Vec<usize> {
        (0..self.geo.members)
            .filter(|&d| !self.geo.is_removed(d) && !self.member_failed(d))
            .collect()
    }

    /// Copies the striped device's failed members into the superblock's member
    /// table; true if that changed it.
    pub(crate) fn record_member_failures(&mut self) -> bool {
        let Some(st) = self.shared.striped.clone() else {
            return false;
        };
        self.sbw.recorded(st.failure_epoch());
        let mut changed = false;
        for (i, e) in self.sb.devices.iter_mut().enumerate() {
            let failed = self.geo.striped_index(i).is_some_and(|m| st.is_failed(m));
            if failed && e.state != crate::recovery::MEMBER_FAILED {
                e.state = crate::recovery::MEMBER_FAILED;
                changed = true;
            }
        }
        changed
    }

    /// A superblock write or sync to member `d` failed: striped layouts go on
    /// without the member while redundancy remains.
    pub(crate) fn sb_member_error(
        &mut self,
        d: usize,
        gen: u64,
        what: &str,
        e: lamina_device::DeviceError,
    ) {
        match self.striped_of(d) {
            // The slot was replaced since: the error was the old device's.
            Some((st, m)) if st.slot_generation(m) != gen => {
                tracing::warn!("{what} to the replaced member {d} failed: {e}");
            }
            Some((st, m)) => {
                st.write_failed(m);
                tracing::error!("{what} failed: {e}; member {d} is now failed");
                if st.redundancy_left() < 0 {
                    self.fail(format!("{what} failed: {e}; too many members failed"));
                }
            }
            None => self.fail(format!("{what} failed: {e}")),
        }
    }

    /// Renews the version lease when versions approach it.
    pub(crate) fn maybe_renew_lease(&mut self) {
        if !self.sbw.busy() && self.next_version.0 + VERSION_LEASE / 2 > self.sb.version_reserved {
            self.sb.version_reserved = self.next_version.0 + VERSION_LEASE;
            self.start_superblock_write();
        }
    }

    /// Writes the superblock to every member directly (both copies, synced), outside
    /// the engine's I/O queue. Only used before the engine starts serving.
    pub(crate) fn write_superblock_sync(&mut self) -> Result<(), EngineError> {
        self.record_member_failures();
        self.sb.generation += 1;
        let members = self.sb_members();
        let devices = self.shared.devices.clone();
        for off in SUPERBLOCK_OFFSETS {
            for &i in &members {
                let mut sb = self.sb.clone();
                sb.device_index = i as u32;
                devices[i].write_at(&sb.encode()[..], off)?;
                self.counters.meta_blocks += 1;
                self.counters.media_blocks += 1;
            }
            for &i in &members {
                devices[i].sync()?;
            }
        }
        // Synchronous and complete: what it recorded is durable.
        self.sbw.written_directly(self.sb.generation);
        Ok(())
    }
}
