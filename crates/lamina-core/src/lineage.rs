//! Snapshot families: which volumes share blocks (docs/design.md, "Snapshots and
//! clones").
//!
//! A snapshot or a clone starts as a copy of another volume's map, so the two map
//! the same physical blocks at the same LBAs. The volumes that can share a block
//! form a *family*: the volume the first snapshot was taken of (its id names the
//! family), its snapshots, clones of those, and so on. Blocks are only ever shared
//! within a family and always at the same LBA, so "who else maps this block" is a
//! map lookup per member at one LBA, never a search.
//!
//! Deleted members stay on record (as tombstones) while their family has a live
//! member, because unit records written for them may name blocks that others map.

use crate::types::VolumeId;
use lamina_format::checkpoint::{LineageRecord, LINEAGE_DELETED, LINEAGE_READ_ONLY, NO_ORIGIN};
use std::collections::{BTreeMap, HashMap};

#[derive(Default)]
pub(crate) struct Lineage {
    records: BTreeMap<u16, LineageRecord>,
    /// Live members of each family, in id order.
    members: HashMap<u16, Vec<VolumeId>>,
}

impl Lineage {
    /// From a checkpoint's section: records naming volumes the checkpoint does not
    /// have (other than tombstones) are kept as tombstones.
    pub(crate) fn from_records(recs: &[LineageRecord], exists: impl Fn(u16) -> bool) -> Self {
        let mut l = Lineage::default();
        for r in recs {
            let mut r = *r;
            if !exists(r.volume) {
                r.flags |= LINEAGE_DELETED;
            }
            l.records.insert(r.volume, r);
        }
        l.rebuild_members();
        l
    }

    fn rebuild_members(&mut self) {
        self.members.clear();
        for r in self.records.values() {
            let m = self.members.entry(r.family).or_default();
            if r.flags & LINEAGE_DELETED == 0 {
                m.push(VolumeId(r.volume));
            }
        }
        // A family without a live member shares nothing any more.
        let dead: Vec<u16> = self
            .members
            .iter()
            .filter(|(_, m)| m.is_empty())
            .map(|(&f, _)| f)
            .collect();
        for f in dead {
            self.members.remove(&f);
            self.records.retain(|_, r| r.family != f);
        }
    }

    pub(crate) fn records(&self) -> Vec<LineageRecord> {
        self.records.values().copied().collect()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The family of `vol`, if it shares blocks (tombstones included).
    #[inline]
    pub(crate) fn family(&self, vol: VolumeId) -> Option<u16> {
        if self.records.is_empty() {
            return None;
        }
        self.records.get(&vol.0).map(|r| r.family)
    }

    /// The live members of `family`, in id order.
    #[inline]
    pub(crate) fn members(&self, family: u16) -> &[VolumeId] {
        self.members.get(&family).map_or(&[], |m| &m[..])
    }

    pub(crate) fn read_only(&self, vol: VolumeId) -> bool {
        self.records
            .get(&vol.0)
            .is_some_and(|r| r.flags & LINEAGE_READ_ONLY != 0)
    }

    /// The volume `vol` was made from.
    pub(crate) fn origin(&self, vol: VolumeId) -> Option<VolumeId> {
        self.records
            .get(&vol.0)
            .filter(|r| r.origin != NO_ORIGIN)
            .map(|r| VolumeId(r.origin))
    }

    /// Live volumes made from `vol`.
    pub(crate) fn children(&self, vol: VolumeId) -> Vec<VolumeId> {
        self.records
            .values()
            .filter(|r| r.origin == vol.0 && r.flags & LINEAGE_DELETED == 0)
            .map(|r| VolumeId(r.volume))
            .collect()
    }

    /// Records `new`, made from `origin` (a snapshot when `read_only`).
    pub(crate) fn add(&mut self, origin: VolumeId, new: VolumeId, read_only: bool) {
        let family = match self.records.get(&origin.0) {
            Some(r) => r.family,
            None => {
                self.records.insert(
                    origin.0,
                    LineageRecord {
                        volume: origin.0,
                        family: origin.0,
                        origin: NO_ORIGIN,
                        flags: 0,
                    },
                );
                origin.0
            }
        };
        assert!(
            !self.records.contains_key(&new.0),
            "a volume id a family names is not given out again"
        );
        self.records.insert(
            new.0,
            LineageRecord {
                volume: new.0,
                family,
                origin: origin.0,
                flags: if read_only { LINEAGE_READ_ONLY } else { 0 },
            },
        );
        self.rebuild_members();
    }

    /// Every volume id a family still names (deleted members included: their
    /// blocks may still be shared).
    pub(crate) fn ids(&self) -> impl Iterator<Item = u16> + '_ {
        self.records.keys().copied()
    }

    /// `vol` is gone (its deletion committed).
    pub(crate) fn deleted(&mut self, vol: VolumeId) {
        if let Some(r) = self.records.get_mut(&vol.0) {
            r.flags |= LINEAGE_DELETED;
            self.rebuild_members();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_grow_from_the_origin_and_die_with_their_last_member() {
        let mut l = Lineage::default();
        assert_eq!(l.family(VolumeId(0)), None);
        l.add(VolumeId(0), VolumeId(3), true);
        l.add(VolumeId(3), VolumeId(5), false);
        assert_eq!(l.family(VolumeId(5)), Some(0));
        assert_eq!(l.members(0), &[VolumeId(0), VolumeId(3), VolumeId(5)]);
        assert!(l.read_only(VolumeId(3)) && !l.read_only(VolumeId(5)));
        assert_eq!(l.origin(VolumeId(5)), Some(VolumeId(3)));
        assert_eq!(l.children(VolumeId(0)), vec![VolumeId(3)]);
        // A deleted member stays on record: unit records may name it.
        l.deleted(VolumeId(5));
        assert_eq!(l.members(0), &[VolumeId(0), VolumeId(3)]);
        assert_eq!(l.family(VolumeId(5)), Some(0));
        let back = Lineage::from_records(&l.records(), |v| v != 5);
        assert_eq!(back.records(), l.records());
        // Gone with the last live member.
        l.deleted(VolumeId(3));
        l.deleted(VolumeId(0));
        assert!(l.is_empty() && l.members(0).is_empty());
    }
}
