//! How many heat classes each volume may keep open at once, so that open segments
//! fit the spare space.
//!
//! Every class of a volume holds an open segment (user classes for new writes, GC
//! classes for relocated blocks). An open segment is space GC cannot reclaim: on an
//! array whose spare is a few segments, a classifier with many classes would hold
//! most of the spare open and leave GC nothing to work with (SepBIT's six classes
//! on a 45-segment array wrote about 600 blocks per user block, footprint-matched
//! against greedy in `bench/placement.sh`; the oracle and the Lamina classifier ran
//! out of space). So open segments may take at most a quarter of the spare: the
//! classes a volume's classifier names are folded into fewer streams when the
//! spare is short (neighbouring classes merged, so that the hottest and the
//! coldest stay apart), down to one user and one GC class, which is greedy
//! without separation.

/// Open segments may take at most 1/OPEN_SHARE of the spare segments.
pub(crate) const OPEN_SHARE: u64 = 4;

/// User and GC classes a volume keeps open, of those its classifier wants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Caps {
    pub user: u8,
    pub gc: u8,
    pub want_user: u8,
    pub want_gc: u8,
}

impl Caps {
    /// Folds a user class of the classifier into the classes kept (class `c` of
    /// `want_user` goes to `c * user / want_user`).
    pub fn user_class(self, c: u8) -> u8 {
        (c as u32 * self.user as u32 / self.want_user.max(1) as u32).min(self.user as u32 - 1) as u8
    }

    /// Folds a class index (user classes first, then GC classes) given by a
    /// classifier with `user_classes` user classes.
    pub fn class(self, user_classes: u8, c: u8) -> u8 {
        if c < user_classes {
            self.user_class(c)
        } else {
            user_classes
                + ((c - user_classes) as u32 * self.gc as u32 / self.want_gc.max(1) as u32)
                    .min(self.gc as u32 - 1) as u8
        }
    }
}

/// The classes (of `user_classes` user classes and `total` in all) whose streams
/// no class folds into under `cap`: their open segments can be closed.
pub(crate) fn dropped(cap: Caps, user_classes: u8, total: u8) -> Vec<u8> {
    let targets: Vec<u8> = (0..total).map(|c| cap.class(user_classes, c)).collect();
    (0..total).filter(|c| !targets.contains(c)).collect()
}

/// The classes each volume keeps when `spare` segments are spare, for volumes whose
/// classifiers want `wanted[i]` = (user, GC) classes. Every volume keeps at least
/// one of each; the spare's share is split evenly between the volumes, and within a
/// volume in proportion to what its classifier wants.
pub(crate) fn caps(spare: u64, wanted: &[Caps]) -> Vec<Caps> {
    let n = wanted.len().max(1) as u64;
    let per_volume = (spare / OPEN_SHARE / n).max(2);
    wanted
        .iter()
        .map(|w| {
            let want = w.user as u64 + w.gc as u64;
            if want <= per_volume {
                return *w;
            }
            let user = ((w.user as u64 * per_volume) / want).clamp(1, w.user as u64);
            let gc = per_volume.saturating_sub(user).clamp(1, w.gc as u64);
            Caps {
                user: user as u8,
                gc: gc as u8,
                ..*w
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEPBIT: Caps = Caps {
        user: 2,
        gc: 4,
        want_user: 2,
        want_gc: 4,
    };
    fn kept(user: u8, gc: u8) -> Caps {
        Caps { user, gc, ..SEPBIT }
    }

    #[test]
    fn plenty_of_spare_keeps_every_class() {
        assert_eq!(caps(1000, &[SEPBIT]), vec![SEPBIT]);
        assert_eq!(
            caps(24, &[SEPBIT]),
            vec![SEPBIT],
            "6 open of 24 spare is a quarter"
        );
    }

    #[test]
    fn short_spare_folds_classes_down_to_greedy() {
        assert_eq!(caps(16, &[SEPBIT]), vec![kept(1, 3)]);
        assert_eq!(caps(8, &[SEPBIT]), vec![kept(1, 1)]);
        assert_eq!(caps(0, &[SEPBIT]), vec![kept(1, 1)], "never below one each");
        // The spare is shared between volumes.
        assert_eq!(caps(48, &[SEPBIT, SEPBIT]), vec![SEPBIT, SEPBIT]);
        assert_eq!(caps(40, &[SEPBIT, SEPBIT])[0], kept(1, 4));
    }

    #[test]
    fn only_streams_nothing_folds_into_are_dropped() {
        // SepBIT (2 user + 4 GC classes) kept at 1 + 3: user class 1 and the GC
        // class that merges away go; the kept GC streams stay open.
        let c = kept(1, 3);
        let targets: Vec<u8> = (0..6).map(|k| c.class(2, k)).collect();
        assert_eq!(targets, vec![0, 0, 2, 2, 3, 4]);
        assert_eq!(dropped(c, 2, 6), vec![1, 5]);
        assert_eq!(dropped(SEPBIT, 2, 6), Vec::<u8>::new());
        assert_eq!(dropped(kept(1, 1), 2, 6), vec![1, 3, 4, 5]);
    }

    #[test]
    fn folding_maps_every_class_into_the_kept_ones() {
        // Neighbouring classes merge: a hot class never lands with a cold one.
        let c = kept(1, 2);
        let folded: Vec<u8> = (0..6).map(|k| c.class(2, k)).collect();
        assert_eq!(folded, vec![0, 0, 2, 2, 3, 3]);
        assert!(folded.iter().all(|&k| k < 2 || k - 2 < c.gc));
    }
}
