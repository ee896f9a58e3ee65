//! Placement: which heat class (and so which open segment) a block goes to.
//!
//! Each volume has one open segment per class: `user_classes()` classes for blocks
//! written by users and `gc_classes()` more for blocks rewritten by garbage
//! collection, so fresh writes and relocated data never share a segment. A
//! [`Classifier`] picks the class of every block written. Blocks that will be
//! overwritten at about the same time end up in the same segments, which GC then
//! finds nearly empty: that is where write amplification is won or lost.
//!
//! Time is counted in user blocks written to the volume, the unit in which block
//! lifespans are measured.

use std::sync::Arc;

/// Chooses the heat class of written blocks. User classes are `0..user_classes()`,
/// GC classes `user_classes()..user_classes() + gc_classes()`.
pub trait Classifier: Send {
    fn name(&self) -> &'static str;
    fn user_classes(&self) -> u8;
    fn gc_classes(&self) -> u8;
    /// Class of a user write of `lba` at time `now`.
    fn classify_user(&mut self, lba: u64, now: u64) -> u8;
    /// Class of a block GC relocates from a segment of class `from`.
    fn classify_gc(&mut self, lba: u64, now: u64, from: u8) -> u8;
    /// A segment of class `class` was chosen as a GC victim; `created` is when it was
    /// opened (in the same time unit), `now` the current time.
    fn segment_collected(&mut self, _class: u8, _created: u64, _now: u64) {}
    /// Memory the classifier keeps per volume block, in bytes (for documentation
    /// and status).
    fn bytes_per_block(&self) -> usize {
        0
    }
}

/// One user class and one GC class: fresh writes and relocated blocks apart, no more.
pub struct NoClassifier;

impl Classifier for NoClassifier {
    fn name(&self) -> &'static str {
        "none"
    }
    fn user_classes(&self) -> u8 {
        1
    }
    fn gc_classes(&self) -> u8 {
        1
    }
    fn classify_user(&mut self, _lba: u64, _now: u64) -> u8 {
        0
    }
    fn classify_gc(&mut self, _lba: u64, _now: u64, _from: u8) -> u8 {
        1
    }
}

/// A per-block array of timestamps, grown lazily (most volumes are thin).
#[derive(Default)]
struct Stamps {
    t: Vec<u64>,
}

impl Stamps {
    fn get(&self, lba: u64) -> u64 {
        self.t.get(lba as usize).copied().unwrap_or(0)
    }
    fn set(&mut self, lba: u64, v: u64) {
        let i = lba as usize;
        if i >= self.t.len() {
            self.t.resize((i + 1).next_power_of_two(), 0);
        }
        self.t[i] = v;
    }
}

/// Update frequency with decay (SALSA 2.3): each block keeps a heat counter that is
/// incremented on every overwrite and halved for every `half_life` writes that pass;
/// classes are heat ranges on a log scale. Blocks rewritten by GC are placed by the
/// heat they have left.
pub struct Frequency {
    heat: Vec<u16>,
    last: Stamps,
    half_life: u64,
    classes: u8,
}

impl Frequency {
    pub fn new(half_life: u64, classes: u8) -> Self {
        Frequency {
            heat: Vec::new(),
            last: Stamps::default(),
            half_life: half_life.max(1),
            classes: classes.clamp(2, 8),
        }
    }
    fn decayed(&self, lba: u64, now: u64) -> u32 {
        let h = self.heat.get(lba as usize).copied().unwrap_or(0) as u32;
        let halvings = (now.saturating_sub(self.last.get(lba)) / self.half_life).min(16);
        h >> halvings
    }
    fn class_of(&self, heat: u32) -> u8 {
        // Heat 1 (written once) or less -> coldest class; each doubling of heat
        // beyond that one class hotter.
        let c = 32 - heat.saturating_sub(1).leading_zeros();
        (self.classes - 1).saturating_sub(c.min(self.classes as u32 - 1) as u8)
    }
}

impl Classifier for Frequency {
    fn name(&self) -> &'static str {
        "frequency"
    }
    fn user_classes(&self) -> u8 {
        self.classes
    }
    fn gc_classes(&self) -> u8 {
        self.classes
    }
    fn classify_user(&mut self, lba: u64, now: u64) -> u8 {
        let h = (self.decayed(lba, now) + 1).min(u16::MAX as u32);
        let i = lba as usize;
        if i >= self.heat.len() {
            self.heat.resize((i + 1).next_power_of_two(), 0);
        }
        self.heat[i] = h as u16;
        self.last.set(lba, now);
        self.class_of(h)
    }
    fn classify_gc(&mut self, lba: u64, now: u64, _from: u8) -> u8 {
        self.classes + self.class_of(self.decayed(lba, now))
    }
    fn bytes_per_block(&self) -> usize {
        10
    }
}

/// SepBIT (Wang et al., FAST'22): infers each block's invalidation time.
///
/// User writes: class 0 when the block's previous lifespan (time since it was last
/// written) is below `l`, the mean lifespan of the last 16 collected class-0
/// segments; class 1 otherwise (including first writes). GC rewrites: blocks from
/// class 0 go to class 2; others by age (time since last user write) into classes 3,
/// 4, 5 with thresholds 4l and 16l.
pub struct SepBit {
    last_write: Stamps,
    recent: std::collections::VecDeque<u64>,
    l: f64,
}

impl Default for SepBit {
    fn default() -> Self {
        SepBit {
            last_write: Stamps::default(),
            recent: std::collections::VecDeque::new(),
            l: f64::INFINITY,
        }
    }
}

impl Classifier for SepBit {
    fn name(&self) -> &'static str {
        "sepbit"
    }
    fn user_classes(&self) -> u8 {
        2
    }
    fn gc_classes(&self) -> u8 {
        4
    }
    fn classify_user(&mut self, lba: u64, now: u64) -> u8 {
        let prev = self.last_write.get(lba);
        self.last_write.set(lba, now + 1);
        // Stamps hold time + 1 so that 0 means "never written".
        if prev != 0 && ((now + 1 - prev) as f64) < self.l {
            0
        } else {
            1
        }
    }
    fn classify_gc(&mut self, lba: u64, now: u64, from: u8) -> u8 {
        if from == 0 {
            return 2;
        }
        let age = (now + 1).saturating_sub(self.last_write.get(lba)) as f64;
        if age < 4.0 * self.l {
            3
        } else if age < 16.0 * self.l {
            4
        } else {
            5
        }
    }
    fn segment_collected(&mut self, class: u8, created: u64, now: u64) {
        if class == 0 {
            self.recent.push_back(now.saturating_sub(created));
            if self.recent.len() > 16 {
                self.recent.pop_front();
            }
            self.l = self.recent.iter().sum::<u64>() as f64 / self.recent.len() as f64;
        }
    }
    fn bytes_per_block(&self) -> usize {
        8
    }
}

/// Future knowledge, for the bound: blocks are classed by their actual remaining
/// lifespan (how long until they are overwritten), computed by a pre-pass over the
/// workload. `next_write[t]` is the time of the next write of the block written at
/// time `t` (`u64::MAX`: never). Classes are powers of `base` of remaining lifespan.
pub struct Oracle {
    next_write: Arc<Vec<u64>>,
    /// Per block: when it will next be written.
    due: Stamps,
    classes: u8,
    unit: f64,
}

impl Oracle {
    /// `unit` sets the scale of the lifespan classes (a quarter of the volume's
    /// block count is a good choice: class k holds lifespans around unit x 2^k).
    pub fn new(next_write: Arc<Vec<u64>>, classes: u8, unit: u64) -> Self {
        Oracle {
            next_write,
            due: Stamps::default(),
            classes: classes.clamp(2, 16),
            unit: unit.max(1) as f64,
        }
    }
    fn class_of(&self, remaining: u64) -> u8 {
        if remaining == u64::MAX {
            return self.classes - 1;
        }
        let x = (remaining as f64 / self.unit).max(1e-9).log2() + (self.classes as f64 / 2.0);
        x.clamp(0.0, self.classes as f64 - 2.0) as u8
    }
}

impl Classifier for Oracle {
    fn name(&self) -> &'static str {
        "oracle"
    }
    fn user_classes(&self) -> u8 {
        self.classes
    }
    fn gc_classes(&self) -> u8 {
        self.classes
    }
    fn classify_user(&mut self, lba: u64, now: u64) -> u8 {
        let next = self
            .next_write
            .get(now as usize)
            .copied()
            .unwrap_or(u64::MAX);
        self.due.set(lba, next);
        let rem = if next == u64::MAX {
            u64::MAX
        } else {
            next.saturating_sub(now)
        };
        self.class_of(rem)
    }
    fn classify_gc(&mut self, lba: u64, now: u64, _from: u8) -> u8 {
        let due = self.due.get(lba);
        let rem = if due == u64::MAX {
            u64::MAX
        } else {
            due.saturating_sub(now)
        };
        self.classes + self.class_of(rem)
    }
    fn bytes_per_block(&self) -> usize {
        8
    }
}

/// Lamina's classifier: each block's expected lifespan from a moving average of its
/// past inter-write intervals.
///
/// SepBIT predicts a block's next lifespan from its last one alone; under memoryless
/// (random) overwrites a single interval is exponentially distributed around the
/// mean, so hot and cold blocks are often confused. Averaging the last few intervals
/// (an exponentially weighted mean, weight 1/2 on the newest) separates them much
/// better for the same memory order (a time stamp and an interval per block).
/// Classes are octaves of the expected interval relative to the volume's size in
/// blocks (the mean interval of uniform traffic): class 0 holds blocks rewritten
/// within 1/32 of a volume's worth of writes, the last class the coldest and the
/// never-rewritten. A block GC moves is placed by the larger of its expected
/// interval and the time it has already survived: a block that outlived its
/// estimate by far is colder than the estimate says.
pub struct Lamina {
    last: Stamps,
    interval: Vec<f32>,
    classes: u8,
    /// Interval of class 0's upper bound.
    base: f64,
}

impl Lamina {
    /// `classes` octaves, the first ending at `blocks / divisor`.
    pub fn new(blocks: u64, classes: u8, divisor: u64) -> Self {
        Lamina {
            last: Stamps::default(),
            interval: Vec::new(),
            classes: classes.clamp(2, 12),
            base: (blocks.max(64) as f64) / divisor.max(1) as f64,
        }
    }
    fn class_of(&self, interval: f64) -> u8 {
        if !interval.is_finite() {
            return self.classes - 1;
        }
        let octave = (interval / self.base).max(1e-9).log2().floor() + 1.0;
        octave.clamp(0.0, self.classes as f64 - 1.0) as u8
    }
    fn expected(&self, lba: u64) -> f64 {
        match self.interval.get(lba as usize) {
            Some(&i) if i > 0.0 => i as f64,
            _ => f64::INFINITY,
        }
    }
}

impl Classifier for Lamina {
    fn name(&self) -> &'static str {
        "lamina"
    }
    fn user_classes(&self) -> u8 {
        self.classes
    }
    fn gc_classes(&self) -> u8 {
        self.classes
    }
    fn classify_user(&mut self, lba: u64, now: u64) -> u8 {
        let prev = self.last.get(lba);
        self.last.set(lba, now + 1);
        let i = lba as usize;
        if prev != 0 {
            let gap = (now + 1 - prev) as f32;
            if i >= self.interval.len() {
                self.interval.resize((i + 1).next_power_of_two(), 0.0);
            }
            let old = self.interval[i];
            self.interval[i] = if old > 0.0 {
                (1.0 - 0.25) * old + 0.25 * gap
            } else {
                gap
            };
        }
        self.class_of(self.expected(lba))
    }
    fn classify_gc(&mut self, lba: u64, now: u64, _from: u8) -> u8 {
        let age = (now + 1).saturating_sub(self.last.get(lba)) as f64;
        let e = self.expected(lba);
        self.classes + self.class_of(if e.is_finite() { e.max(age) } else { e })
    }
    fn bytes_per_block(&self) -> usize {
        12
    }
}

/// Names accepted by [`classifier_by_name`] (the oracle needs a workload pre-pass
/// and is built by the simulator).
pub const CLASSIFIER_NAMES: &[&str] = &["none", "frequency", "sepbit", "lamina"];

/// Builds a classifier by name for a volume of `blocks` blocks.
pub fn classifier_by_name(name: &str, blocks: u64) -> Option<Box<dyn Classifier>> {
    Some(match name {
        "none" => Box::new(NoClassifier),
        "frequency" => Box::new(Frequency::new((blocks / 4).max(1024), 6)),
        "sepbit" => Box::new(SepBit::default()),
        "lamina" => Box::new(Lamina::new(blocks, 8, 16)),
        n if n.starts_with("lamina:") => {
            // lamina:CLASSES:DIVISOR, for experiments.
            let mut it = n[7..].split(':');
            let classes = it.next()?.parse().ok()?;
            let divisor = it.next().unwrap_or("16").parse().ok()?;
            Box::new(Lamina::new(blocks, classes, divisor))
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sepbit_splits_by_previous_lifespan_and_age() {
        let mut s = SepBit::default();
        // Before any class-0 segment was collected, l is infinite: overwrites are
        // short-lived, first writes are long-lived.
        assert_eq!(s.classify_user(1, 0), 1);
        assert_eq!(s.classify_user(1, 10), 0);
        s.segment_collected(0, 0, 100);
        assert_eq!(s.l, 100.0);
        assert_eq!(s.classify_user(1, 50), 0); // lifespan 40 < 100
        assert_eq!(s.classify_user(1, 500), 1); // lifespan 450 >= 100
        assert_eq!(s.classify_gc(1, 600, 0), 2);
        assert_eq!(s.classify_gc(1, 600, 1), 3); // age 100 < 400
        assert_eq!(s.classify_gc(1, 1300, 1), 4); // age 800 < 1600
        assert_eq!(s.classify_gc(1, 5000, 1), 5);
        for _ in 0..16 {
            s.segment_collected(0, 0, 20);
        }
        assert_eq!(s.l, 20.0, "l is the mean of the last 16 class-0 victims");
    }

    #[test]
    fn frequency_heats_and_cools() {
        let mut f = Frequency::new(100, 4);
        let cold = f.classify_user(7, 0);
        let mut hot = cold;
        for t in 1..10 {
            hot = f.classify_user(7, t);
        }
        assert!(
            hot < cold,
            "repeated writes make a block hotter (lower class)"
        );
        // Much later, after many half-lives, it is cold again.
        assert_eq!(f.classify_gc(7, 100_000, 0), f.gc_classes() + 3);
        assert_eq!(f.classify_user(8, 0), 3, "first writes are coldest");
    }

    #[test]
    fn oracle_groups_by_remaining_lifespan() {
        // Writes at t: block 0 at 0, 1, 2, 3 (short lives); block 1 at 4 and never again.
        let next = Arc::new(vec![1, 2, 3, u64::MAX, u64::MAX]);
        let mut o = Oracle::new(next, 8, 1000);
        let short = o.classify_user(0, 0);
        let never = o.classify_user(1, 4);
        assert!(short < never);
        assert_eq!(never, 7);
        assert_eq!(o.classify_gc(1, 10, 0), 8 + 7);
    }
}
