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

use crate::types::Lba;
use lamina_format::codec::{Reader, Writer};
use lamina_format::FormatError;
use std::sync::Arc;

/// Chooses the heat class of written blocks. User classes are `0..user_classes()`,
/// GC classes `user_classes()..user_classes() + gc_classes()`.
pub trait Classifier: Send {
    fn name(&self) -> &'static str;
    fn user_classes(&self) -> u8;
    fn gc_classes(&self) -> u8;
    /// Class of a user write of `lba` at time `now`; `prev` is where the block's
    /// current copy was written (`None`: the block holds no data).
    fn classify_user(&mut self, lba: Lba, now: u64, prev: Option<Written>) -> u8;
    /// Class of a block GC relocates; `from` is where its copy was written (the
    /// victim), `from.class` the victim's class.
    fn classify_gc(&mut self, lba: Lba, now: u64, from: Written) -> u8;
    /// A segment of class `class` was chosen as a GC victim; `created` is when it was
    /// opened (in the same time unit), `now` the current time.
    fn segment_collected(&mut self, _class: u8, _created: u64, _now: u64) {}
    /// Memory the classifier keeps per volume block, in bytes (for documentation
    /// and status).
    fn bytes_per_block(&self) -> usize {
        0
    }
    /// The user and GC classes worth keeping open now (at most `user_classes()`
    /// and `gc_classes()`): a classifier that measures its classes predict nothing
    /// asks for fewer, and the engine merges the rest (see `classcap`).
    fn active_classes(&self) -> (u8, u8) {
        (self.user_classes(), self.gc_classes())
    }
    /// What the classifier has learnt that should survive a restart, bounded by
    /// `lamina_format::checkpoint::MAX_PLACEMENT_STATE` whatever the volume's size
    /// (per-block state is not kept: it follows the blocks, and a restarted
    /// classifier rebuilds it as they are rewritten). Empty: nothing to keep.
    fn save(&self) -> Vec<u8> {
        Vec::new()
    }
    /// Takes back what [`Classifier::save`] wrote. A state it cannot read (damaged,
    /// or from another version) is an error the engine reports and then ignores:
    /// the classifier starts afresh, which costs write amplification, never data.
    fn restore(&mut self, _state: &[u8]) -> Result<(), String> {
        Ok(())
    }
}

/// When and how a block's current copy was written, as the engine knows it from
/// where the copy lives: no per-block memory. A segment's blocks are written in
/// order between its opening and its closing, so a block's write time is
/// interpolated from its place in the segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Written {
    /// Volume time of the write (for a block GC moved, of the user write before).
    pub at: u64,
    /// Class of the segment that holds it (classes the caps fold share one).
    pub class: u8,
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
    fn classify_user(&mut self, _lba: Lba, _now: u64, _prev: Option<Written>) -> u8 {
        0
    }
    fn classify_gc(&mut self, _lba: Lba, _now: u64, _from: Written) -> u8 {
        1
    }
}

/// Per-block state of a classifier, in pages of 256 blocks made on first write: memory
/// follows the blocks written, not the highest LBA a client names (a write at the far
/// end of a 100 TiB thin volume costs one page).
struct PerBlock<T> {
    pages: std::collections::HashMap<u64, Box<[T; PER_PAGE]>, PageHash>,
}

const PER_PAGE: usize = 256;

impl<T: Copy + Default> Default for PerBlock<T> {
    fn default() -> Self {
        PerBlock {
            pages: Default::default(),
        }
    }
}

impl<T: Copy + Default> PerBlock<T> {
    #[inline]
    fn get(&self, lba: u64) -> T {
        self.pages
            .get(&(lba / PER_PAGE as u64))
            .map_or_else(T::default, |p| p[lba as usize % PER_PAGE])
    }
    #[inline]
    fn set(&mut self, lba: u64, v: T) {
        *self.slot(lba) = v;
    }
    /// The block's state, its page made if missing.
    #[inline]
    fn slot(&mut self, lba: u64) -> &mut T {
        &mut self
            .pages
            .entry(lba / PER_PAGE as u64)
            .or_insert_with(|| Box::new([T::default(); PER_PAGE]))[lba as usize % PER_PAGE]
    }
}

/// Page numbers are hashed by one multiplication (Fibonacci hashing): the keys are
/// block addresses, not attacker-chosen strings that need a keyed hash, and the
/// classifier looks them up several times per block written.
#[derive(Default, Clone, Copy)]
pub(crate) struct PageHash;

impl std::hash::BuildHasher for PageHash {
    type Hasher = PageHasher;
    fn build_hasher(&self) -> PageHasher {
        PageHasher(0)
    }
}

pub(crate) struct PageHasher(u64);

impl std::hash::Hasher for PageHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type Stamps = PerBlock<u64>;

/// Update frequency with decay (SALSA 2.3): each block keeps a heat counter that is
/// incremented on every overwrite and halved for every `half_life` writes that pass;
/// classes are heat ranges on a log scale. Blocks rewritten by GC are placed by the
/// heat they have left.
pub struct Frequency {
    heat: PerBlock<u16>,
    last: Stamps,
    half_life: u64,
    classes: u8,
}

impl Frequency {
    pub fn new(half_life: u64, classes: u8) -> Self {
        Frequency {
            heat: PerBlock::default(),
            last: Stamps::default(),
            half_life: half_life.max(1),
            classes: classes.clamp(2, 8),
        }
    }
    fn decayed(&self, lba: u64, now: u64) -> u32 {
        let h = self.heat.get(lba) as u32;
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
    fn classify_user(&mut self, Lba(lba): Lba, now: u64, _prev: Option<Written>) -> u8 {
        let h = (self.decayed(lba, now) + 1).min(u16::MAX as u32);
        self.heat.set(lba, h as u16);
        self.last.set(lba, now);
        self.class_of(h)
    }
    fn classify_gc(&mut self, Lba(lba): Lba, now: u64, _from: Written) -> u8 {
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
///
/// SepBIT's simulator keeps every block's last write time; here the engine derives
/// it from where the block's copy lives ([`Written`]): its place in a user segment,
/// or the mean user-write time of what GC moved into a GC segment. So the
/// classifier keeps no per-block time (that would be 8 bytes per block, as much as
/// the L2P map). The lifespan check ([`SepBit::measure`]) needs the class each
/// block was given at its last write: one bit per block.
pub struct SepBit {
    /// Per block, the user class it was given at its last write (bit `lba % 64` of
    /// word `lba / 64`).
    given: PerBlock<u64>,
    recent: std::collections::VecDeque<u64>,
    l: f64,
    /// Lifespans of overwritten blocks by the user class they were given (sum,
    /// count), decayed by half every `SEPARATION_WINDOW` deaths.
    lives: [(f64, f64); 2],
    deaths: u64,
    /// The classes do not separate lifespans (see [`SepBit::measure`]): only one
    /// user and one GC class are kept open, which is greedy.
    flat: bool,
    /// Volume time from which `given` is known: blocks last written before it (a
    /// restart, which does not keep the bits) are not tallied. `u64::MAX`: set at
    /// the next write.
    known_from: u64,
}

/// Deaths between two looks at whether SepBIT's classes separate lifespans.
const SEPARATION_WINDOW: u64 = 1 << 14;
/// Class-1 blocks must live this many times longer than class-0 blocks for the
/// classes to be kept; below `FLAT_BELOW` they are merged (hysteresis between).
const SEPARATE_ABOVE: f64 = 3.5;
const FLAT_BELOW: f64 = 3.0;

/// Encoded placement state: a version byte, then the fields.
const SEPBIT_STATE_VERSION: u8 = 1;

impl Default for SepBit {
    fn default() -> Self {
        SepBit {
            given: PerBlock::default(),
            recent: std::collections::VecDeque::new(),
            l: f64::INFINITY,
            lives: [(0.0, 0.0); 2],
            deaths: 0,
            // Nothing learnt yet: cost nothing until the classes prove themselves.
            flat: true,
            // Set at the first write: a volume that already holds data (a restart
            // without saved state, or a volume placed otherwise before) has no
            // class bits for what it holds.
            known_from: u64::MAX,
        }
    }
}

impl SepBit {
    /// Whether the user classes separate: the mean lifespan of blocks SepBIT called
    /// long-lived against that of blocks it called short-lived. Under memoryless
    /// (uniform) overwrites a block's last lifespan says nothing of its next, both
    /// classes live alike and the split only costs open segments and GC efficiency.
    fn measure(&mut self) {
        let mean = |(sum, n): (f64, f64)| (n > 0.0).then(|| sum / n);
        if let (Some(short), Some(long)) = (mean(self.lives[0]), mean(self.lives[1])) {
            let ratio = long / short.max(1.0);
            if ratio > SEPARATE_ABOVE {
                self.flat = false;
            } else if ratio < FLAT_BELOW {
                self.flat = true;
            }
        }
        for l in &mut self.lives {
            l.0 /= 2.0;
            l.1 /= 2.0;
        }
    }

    /// Time since the block's last user write, as far as its copy tells.
    fn lifespan(&self, now: u64, w: Written) -> f64 {
        now.saturating_sub(w.at) as f64
    }

    /// The lifespan check's tally: the block's previous lifespan, under the class
    /// it was given then; and the class it is given now.
    fn tally(&mut self, lba: u64, now: u64, prev: Option<Written>, class: u8) {
        let word = self.given.slot(lba / 64);
        let bit = 1u64 << (lba % 64);
        let was = (*word & bit != 0) as usize;
        if class == 1 {
            *word |= bit;
        } else {
            *word &= !bit;
        }
        if self.known_from == u64::MAX {
            self.known_from = now;
        }
        if let Some(w) = prev.filter(|w| w.at >= self.known_from) {
            self.lives[was].0 += self.lifespan(now, w);
            self.lives[was].1 += 1.0;
            self.deaths += 1;
            if self.deaths.is_multiple_of(SEPARATION_WINDOW) {
                self.measure();
            }
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
    fn classify_user(&mut self, Lba(lba): Lba, now: u64, prev: Option<Written>) -> u8 {
        let class = match prev {
            Some(w) if self.lifespan(now, w) < self.l => 0,
            _ => 1,
        };
        self.tally(lba, now, prev, class);
        class
    }
    fn classify_gc(&mut self, _lba: Lba, now: u64, from: Written) -> u8 {
        if from.class == 0 {
            return 2;
        }
        let age = self.lifespan(now, from);
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
        // One bit per block, below what this counts in bytes.
        0
    }
    fn active_classes(&self) -> (u8, u8) {
        if self.flat {
            (1, 1)
        } else {
            (self.user_classes(), self.gc_classes())
        }
    }
    fn save(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u8(SEPBIT_STATE_VERSION);
        w.u8(self.flat as u8);
        w.u64(self.deaths);
        for (sum, n) in self.lives {
            w.u64(sum.to_bits());
            w.u64(n.to_bits());
        }
        w.u8(self.recent.len() as u8);
        for &r in &self.recent {
            w.u64(r);
        }
        w.buf
    }
    fn restore(&mut self, state: &[u8]) -> Result<(), String> {
        let mut r = Reader::new(state, "SepBIT state");
        let read = |r: &mut Reader| -> Result<_, FormatError> {
            let (version, flat, deaths) = (r.u8()?, r.u8()?, r.u64()?);
            let mut lives = [(0.0, 0.0); 2];
            for l in &mut lives {
                *l = (f64::from_bits(r.u64()?), f64::from_bits(r.u64()?));
            }
            let n = r.u8()? as usize;
            let recent = (0..n.min(16)).map(|_| r.u64()).collect::<Result<_, _>>()?;
            Ok((version, flat, deaths, lives, n, recent))
        };
        let (version, flat, deaths, lives, n, recent) = read(&mut r).map_err(|e| e.to_string())?;
        if version != SEPBIT_STATE_VERSION {
            return Err(format!("SepBIT state version {version}"));
        }
        if n > 16 || r.position() != state.len() || flat > 1 {
            return Err(format!("SepBIT state damaged ({n} recent lifespans)"));
        }
        if lives
            .iter()
            .any(|&(s, n)| !(s >= 0.0 && n >= 0.0 && s.is_finite() && n.is_finite()))
        {
            return Err("SepBIT state damaged (lifespan tallies)".into());
        }
        self.flat = flat == 1;
        self.deaths = deaths;
        self.lives = lives;
        self.recent = recent;
        // The classes given before the restart are not kept.
        self.known_from = u64::MAX;
        self.l = if n == 0 {
            f64::INFINITY
        } else {
            self.recent.iter().map(|&r| r as f64).sum::<f64>() / n as f64
        };
        Ok(())
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
    fn classify_user(&mut self, Lba(lba): Lba, now: u64, _prev: Option<Written>) -> u8 {
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
    fn classify_gc(&mut self, Lba(lba): Lba, now: u64, _from: Written) -> u8 {
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

/// Lamina's classifier: calibrated lifetime classes.
///
/// Each block keeps an estimate of its rewrite interval: an exponentially weighted
/// mean of its past intervals (weight `beta` on the newest). SepBIT predicts from
/// the last interval alone; under random overwrites one interval is spread
/// exponentially around the truth, so averaging a few separates hot from cold much
/// better.
///
/// An estimate is only worth acting on if it predicts. The classifier therefore
/// *calibrates* it: estimates fall into half-octave bins (blocks written once are a
/// bin of their own), and each bin measures the rate at which its blocks are
/// actually rewritten: rewrites of blocks in the bin per block in the bin per write,
/// over windows of `blocks / 64` writes, smoothed. This is a hazard rate, events over
/// exposure, so it has no survivorship bias and converges within a few windows, long
/// before any block has been rewritten twice. A block is placed by its bin's measured
/// interval (1 / rate), not by its raw estimate. Under uniform traffic every bin
/// measures the same rate, so all blocks share one class: nothing is split for
/// nothing (splitting data of equal lifetime only stretches the time each segment
/// takes to fill, so its blocks are of mixed ages, which costs GC efficiency, the
/// more so with large segments). Under skew, bins of hot estimates measure high rates
/// and are separated; blocks written once but never again measure as cold.
///
/// Classes are octaves (`width` octaves each) of the predicted interval, with a
/// class centred on the volume's size in blocks (the interval of uniform traffic).
/// A block GC moves is placed by the larger of its prediction and the time it has
/// already survived.
pub struct Lamina {
    est: PerBlock<Estimate>,
    classes: u8,
    /// Centre of class 1's interval range.
    base: f64,
    /// Octaves per class.
    width: f64,
    /// Weight of the newest interval in the moving average.
    beta: f32,
    /// Per bin: blocks in it now, rewrites of its blocks in this window, and the
    /// smoothed rewrite rate (per block per write; 0 until measured).
    count: Vec<i64>,
    exits: Vec<u64>,
    rate: Vec<f64>,
    /// Lower bound of bin 0.
    bin_base: f64,
    window: u64,
    window_len: u64,
    /// GC places by the larger of prediction and `age_factor` x age (0: prediction
    /// alone).
    age_factor: f64,
    /// The measured rates show no skew (see `end_window`).
    flat: bool,
}

/// What [`Lamina`] keeps per block: when it was last written (time + 1; 0 never) and
/// its estimated rewrite interval (0: none yet). Packed: 12 bytes a block.
#[derive(Clone, Copy, Default)]
#[repr(C, packed(4))]
struct Estimate {
    last: u64,
    interval: f32,
}

/// Estimate bins per octave, bins of finite estimates, and the bin of blocks written
/// once.
const BINS_PER_OCTAVE: f64 = 2.0;
const BINS: usize = 64;
const ONCE: usize = BINS;
/// Weight of the newest window in a bin's rate.
const RATE_WEIGHT: f64 = 0.25;
/// Rewrites a bin must have seen in a window for the window to count.
const MIN_EXITS: u64 = 16;

impl Lamina {
    /// `classes` classes of `width` octaves each; `beta` is the weight of the newest
    /// interval in a block's estimate.
    pub fn new(blocks: u64, classes: u8, width: f64, beta: f32) -> Self {
        let blocks = blocks.max(64) as f64;
        let classes = classes.clamp(2, 12);
        Lamina {
            est: PerBlock::default(),
            classes,
            // The volume size sits at the centre of the class below the middle one:
            // uniform traffic leaves room for colder classes above.
            base: blocks / 2f64.powf(width * (classes as f64 / 2.0 - 1.0).floor()),
            width: width.max(0.1),
            beta: beta.clamp(0.01, 1.0),
            count: vec![0; BINS + 1],
            exits: vec![0; BINS + 1],
            rate: vec![0.0; BINS + 1],
            bin_base: blocks / 65536.0,
            window: 0,
            window_len: ((blocks / 64.0) as u64).max(1024),
            age_factor: 1.0,
            flat: false,
        }
    }
    fn class_of(&self, interval: f64) -> u8 {
        if !interval.is_finite() {
            return self.classes - 1;
        }
        let k = ((interval / self.base).max(1e-9).log2() / self.width + 0.5).floor() + 1.0;
        k.clamp(0.0, self.classes as f64 - 1.0) as u8
    }
    /// Bin of a block's estimate: `None` if never written.
    fn bin(&self, e: Estimate) -> Option<usize> {
        if e.last == 0 {
            return None;
        }
        let iv = e.interval;
        if iv > 0.0 {
            let b = ((iv as f64 / self.bin_base).max(1.0).log2() * BINS_PER_OCTAVE).floor();
            Some((b as usize).min(BINS - 1))
        } else {
            Some(ONCE)
        }
    }
    /// The interval to expect for a block in bin `b`: the bin's measured one, or
    /// before it was measured the block's own estimate (infinite if written once).
    fn predict(&self, e: Estimate, b: Option<usize>) -> f64 {
        let iv = e.interval;
        match b {
            Some(b) if self.rate[b] > 0.0 => 1.0 / self.rate[b],
            _ if iv > 0.0 => iv as f64,
            _ => f64::INFINITY,
        }
    }
    fn end_window(&mut self) {
        let len = self.window_len as f64;
        for b in 0..=BINS {
            if self.exits[b] >= MIN_EXITS && self.count[b] > 0 {
                let r = self.exits[b] as f64 / (len * self.count[b] as f64);
                self.rate[b] = if self.rate[b] > 0.0 {
                    self.rate[b] + (r - self.rate[b]) * RATE_WEIGHT
                } else {
                    r
                };
            }
            self.exits[b] = 0;
        }
        self.window = 0;
        // Flat: the bins that hold a noticeable share (1%) of the blocks all
        // measure about the same rate (within 10%), as under uniform traffic
        // (measured at 32 GiB: uniform stays within 1-3%, Zipf(0.2) at 16-54%). Then
        // age predicts nothing either, and GC does not split by it.
        let total: i64 = self.count.iter().map(|c| (*c).max(0)).sum();
        let rates = (0..=BINS).filter(|&b| self.count[b] * 100 >= total && self.rate[b] > 0.0);
        let (lo, hi) = rates.fold((f64::MAX, 0.0f64), |(lo, hi), b| {
            (lo.min(self.rate[b]), hi.max(self.rate[b]))
        });
        self.flat = total > 0 && hi > 0.0 && hi <= 1.1 * lo;
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
    fn classify_user(&mut self, Lba(lba): Lba, now: u64, _prev: Option<Written>) -> u8 {
        let old = self.est.get(lba);
        let old_bin = self.bin(old);
        if let Some(b) = old_bin {
            self.exits[b] += 1;
            self.count[b] -= 1;
        }
        let mut e = Estimate {
            last: now + 1,
            interval: old.interval,
        };
        if old.last != 0 {
            let gap = (now + 1 - old.last) as f32;
            let iv = old.interval;
            e.interval = if iv > 0.0 {
                (1.0 - self.beta) * iv + self.beta * gap
            } else {
                gap
            };
        }
        self.est.set(lba, e);
        let b = self.bin(e);
        if let Some(b) = b {
            self.count[b] += 1;
        }
        self.window += 1;
        if self.window >= self.window_len {
            self.end_window();
        }
        self.class_of(self.predict(e, b))
    }
    fn classify_gc(&mut self, Lba(lba): Lba, now: u64, _from: Written) -> u8 {
        let e = self.est.get(lba);
        let age = (now + 1).saturating_sub(e.last) as f64;
        let p = self.predict(e, self.bin(e));
        let age = if self.flat {
            0.0
        } else {
            age * self.age_factor
        };
        self.classes + self.class_of(p.max(age))
    }
    fn bytes_per_block(&self) -> usize {
        12
    }
}

/// Names accepted by [`classifier_by_name`] (the oracle needs a workload pre-pass
/// and is built by the simulator), and "auto", the default, which the engine
/// resolves per volume: SepBIT, or "none" where a zoned array's open-zone limit
/// cannot hold SepBIT's streams.
pub const CLASSIFIER_NAMES: &[&str] = &["auto", "none", "frequency", "sepbit", "lamina"];

/// Builds a classifier by name for a volume of `blocks` blocks (segment size
/// unknown; see [`classifier_for`]).
pub fn classifier_by_name(name: &str, blocks: u64) -> Option<Box<dyn Classifier>> {
    classifier_for(name, blocks, 0)
}

/// Octaves of predicted lifetime that Lamina's classes span together.
const LAMINA_SPAN_OCTAVES: f64 = 6.0;

/// Builds a classifier by name for a volume of `blocks` blocks on segments of
/// `segment_blocks` data blocks (0: unknown).
pub fn classifier_for(name: &str, blocks: u64, segment_blocks: u64) -> Option<Box<dyn Classifier>> {
    Some(match name {
        "none" => Box::new(NoClassifier),
        "frequency" => Box::new(Frequency::new((blocks / 4).max(1024), 6)),
        // Without a zoned array to fit (the engine resolves "auto" itself).
        "sepbit" | "auto" => Box::new(SepBit::default()),
        "lamina" => {
            // Every class keeps a user and a GC segment open, and open segments hold
            // space GC cannot collect: with large segments (few per volume) fewer,
            // wider classes pay off. One class per 16 segments of the volume, 3 to
            // 6 of them, spanning the same 6 octaves.
            let classes = match segment_blocks {
                0 => 6,
                s => (blocks / s / 16).clamp(3, 6) as u8,
            };
            Box::new(Lamina::new(
                blocks,
                classes,
                LAMINA_SPAN_OCTAVES / classes as f64,
                0.25,
            ))
        }
        n if n.starts_with("lamina:") => {
            // lamina:CLASSES:WIDTH:BETA, for experiments.
            let mut it = n[7..].split(':');
            let mut next = |d: &str| it.next().unwrap_or(d).parse::<f64>().ok();
            let classes = next("8")?;
            let width = next("1")?;
            let beta = next("0.25")?;
            let by_age = next("1")?;
            let mut l = Lamina::new(blocks, classes as u8, width, beta as f32);
            l.age_factor = by_age;
            Box::new(l)
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// SepBIT keeps its classes only where they separate lifespans: under uniform
    /// overwrites it asks for one user and one GC class (greedy), under hot/cold
    /// traffic for all six. `l` is held where SepBIT's GC feedback would put it.
    #[test]
    fn sepbit_merges_its_classes_when_they_predict_nothing() {
        let blocks = 10_000u64;
        let run = |hot: bool, l: u64| {
            let mut rng = rand::rngs::StdRng::seed_from_u64(5);
            let mut s = SepBit::default();
            let mut last = std::collections::HashMap::new();
            assert_eq!(s.active_classes(), (1, 1), "nothing learnt yet");
            for now in 0..40 * SEPARATION_WINDOW {
                if now % 1000 == 0 && now > l {
                    s.segment_collected(0, now - l, now);
                }
                let lba = if hot && rng.gen_bool(0.9) {
                    rng.gen_range(0..blocks / 10)
                } else {
                    rng.gen_range(0..blocks)
                };
                let prev = last.insert(lba, now).map(|at| user_write(at, 0));
                s.classify_user(Lba(lba), now, prev);
            }
            s.active_classes()
        };
        assert_eq!(run(false, blocks), (1, 1), "uniform");
        assert_eq!(run(true, 5 * blocks / 10), (2, 4), "hot/cold");
    }

    /// Per-block state follows the blocks written: one write at the far end of a
    /// 16 TiB thin volume makes one page, not an array up to that LBA (it used to
    /// ask for 32 GiB and abort the server).
    #[test]
    fn per_block_state_follows_the_blocks_written() {
        let blocks = 1u64 << 32;
        let far = blocks - 1;
        let mut f = Frequency::new(blocks / 4, 6);
        f.classify_user(Lba(far), 0, None);
        f.classify_user(Lba(far), 1, None);
        assert_eq!((f.heat.pages.len(), f.last.pages.len()), (1, 1));
        assert_eq!(f.heat.get(far), 2);
        let mut s = SepBit::default();
        s.classify_user(Lba(far), 0, None);
        s.classify_user(Lba(7), 1, None);
        assert_eq!(s.given.pages.len(), 2);
        let mut l = Lamina::new(blocks, 6, 1.0, 0.25);
        for t in 0..3 {
            l.classify_user(Lba(far), t * 10, None);
        }
        assert_eq!(l.est.pages.len(), 1);
        assert_eq!({ l.est.get(far).interval }, 10.0);
        assert_eq!({ l.est.get(far - 1).interval }, 0.0);
        assert_eq!({ l.est.get(far - PER_PAGE as u64).last }, 0);
        assert_eq!(std::mem::size_of::<Estimate>(), l.bytes_per_block());
    }

    /// A block a user wrote at `at` into a segment of class `class`.
    fn user_write(at: u64, class: u8) -> Written {
        Written { at, class }
    }

    /// xorshift, to keep the tests free of dependencies.
    fn rng(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    /// Writes `n` blocks at LBAs drawn by `pick` and returns the share of the last
    /// half that went to each user class.
    fn histogram(
        c: &mut dyn Classifier,
        n: u64,
        mut pick: impl FnMut(&mut u64) -> u64,
    ) -> Vec<f64> {
        let mut x = 0x2545f4914f6cdd1d;
        let mut h = vec![0u64; c.user_classes() as usize];
        for t in 0..n {
            let k = c.classify_user(Lba(pick(&mut x)), t, None);
            if t >= n / 2 {
                h[k as usize] += 1;
            }
        }
        h.iter().map(|&v| v as f64 / (n / 2) as f64).collect()
    }

    /// A sequential fill of `blocks`, then `4 x blocks` writes drawn by `pick`.
    fn fill_then(
        blocks: u64,
        mut pick: impl FnMut(&mut u64) -> u64,
    ) -> impl FnMut(&mut u64) -> u64 {
        let mut t = 0;
        move |x| {
            t += 1;
            if t <= blocks {
                t - 1
            } else {
                pick(x)
            }
        }
    }

    /// Uniform traffic carries no heat to separate: most of it shares one class
    /// (splitting it would only slow the filling of each segment).
    /// Uniform traffic measures flat: GC then ignores age (it predicts nothing
    /// there); skewed traffic does not.
    #[test]
    fn lamina_sees_when_traffic_is_flat() {
        // Large enough that every bin's measured rate is close to the truth.
        let blocks = 1 << 18;
        let mut flat = Lamina::new(blocks, 6, 1.0, 0.25);
        let mut x = 0x1234_5678u64;
        for t in 0..blocks * 12 {
            flat.classify_user(Lba(rng(&mut x) % blocks), t, None);
        }
        assert!(flat.flat, "uniform traffic is flat");
        let young = flat.classify_gc(Lba(1), blocks * 12, user_write(0, 0));
        // Old or young, a GC'd block lands in the same class.
        let mut oldest = 0;
        let mut when = u64::MAX;
        for lba in 0..blocks {
            let w = flat.est.get(lba).last;
            if w != 0 && w < when {
                when = w;
                oldest = lba;
            }
        }
        assert_eq!(
            flat.classify_gc(Lba(oldest), blocks * 12, user_write(0, 0)),
            young
        );
        let mut skew = Lamina::new(blocks, 6, 1.0, 0.25);
        for t in 0..blocks * 12 {
            let lba = if rng(&mut x) % 10 < 9 {
                rng(&mut x) % (blocks / 10)
            } else {
                rng(&mut x) % blocks
            };
            skew.classify_user(Lba(lba), t, None);
        }
        assert!(!skew.flat, "90/10 traffic is not flat");
    }

    #[test]
    fn lamina_uses_fewer_wider_classes_when_segments_are_few() {
        let n = |segs: u64| {
            classifier_for("lamina", segs * 1000, 1000)
                .unwrap()
                .user_classes()
        };
        assert_eq!(n(1024), 6);
        assert_eq!(n(64), 4);
        assert_eq!(n(10), 3);
        assert_eq!(
            classifier_by_name("lamina", 1 << 20)
                .unwrap()
                .user_classes(),
            6
        );
    }

    #[test]
    fn lamina_keeps_uniform_traffic_mostly_in_one_class() {
        let blocks = 1 << 16;
        let mut c = classifier_by_name("lamina", blocks).unwrap();
        let h = histogram(
            c.as_mut(),
            5 * blocks,
            fill_then(blocks, |x| rng(x) % blocks),
        );
        let top = h.iter().cloned().fold(0.0, f64::max);
        assert!(top > 0.9, "uniform traffic split over classes: {h:?}");
    }

    /// 90% of writes to 10% of blocks: the hot blocks' writes go to hotter classes
    /// than the cold ones', with hardly any overlap.
    #[test]
    fn lamina_separates_hot_from_cold() {
        let blocks = 1 << 16;
        let hot = blocks / 10;
        let mut c = classifier_by_name("lamina", blocks).unwrap();
        let mut x = 7u64;
        let (mut hot_classes, mut cold_classes) = (vec![0u64; 8], vec![0u64; 8]);
        for t in 0..blocks {
            c.classify_user(Lba(t), t, None);
        }
        for t in blocks..6 * blocks {
            let r = rng(&mut x);
            let lba = if r % 10 < 9 {
                (r >> 8) % hot
            } else {
                hot + (r >> 8) % (blocks - hot)
            };
            let k = c.classify_user(Lba(lba), t, None) as usize;
            if t > 3 * blocks {
                if lba < hot {
                    hot_classes[k] += 1
                } else {
                    cold_classes[k] += 1
                }
            }
        }
        let mean = |h: &[u64]| {
            h.iter()
                .enumerate()
                .map(|(k, &n)| k as f64 * n as f64)
                .sum::<f64>()
                / h.iter().sum::<u64>() as f64
        };
        let (mh, mc) = (mean(&hot_classes), mean(&cold_classes));
        assert!(mc - mh >= 1.5, "hot {hot_classes:?} cold {cold_classes:?}");
        // GC places a long-surviving block colder than its user class.
        let age_cold =
            c.classify_gc(Lba(hot + 1), 100 * blocks, user_write(0, 0)) - c.user_classes();
        assert_eq!(age_cold, c.user_classes() - 1);
    }

    #[test]
    fn sepbit_splits_by_previous_lifespan_and_age() {
        let mut s = SepBit::default();
        // Before any class-0 segment was collected, l is infinite: overwrites are
        // short-lived, first writes are long-lived.
        assert_eq!(s.classify_user(Lba(1), 0, None), 1);
        assert_eq!(s.classify_user(Lba(1), 10, Some(user_write(0, 1))), 0);
        s.segment_collected(0, 0, 100);
        assert_eq!(s.l, 100.0);
        assert_eq!(s.classify_user(Lba(1), 50, Some(user_write(10, 0))), 0); // 40 < 100
        assert_eq!(s.classify_user(Lba(1), 500, Some(user_write(50, 0))), 1); // 450 >= 100
        assert_eq!(s.classify_gc(Lba(1), 600, user_write(500, 0)), 2);
        assert_eq!(s.classify_gc(Lba(1), 600, user_write(500, 1)), 3); // age 100 < 400
        assert_eq!(s.classify_gc(Lba(1), 1300, user_write(500, 1)), 4); // age 800 < 1600
        assert_eq!(s.classify_gc(Lba(1), 5000, user_write(500, 1)), 5);
        // A block GC moved (here into classes 2 and 4) is dated by the user write
        // before the move, as any other.
        assert_eq!(s.classify_user(Lba(1), 600, Some(user_write(550, 2))), 0);
        assert_eq!(s.classify_user(Lba(1), 600, Some(user_write(450, 2))), 1);
        assert_eq!(s.classify_gc(Lba(1), 600, user_write(100, 4)), 4);
        for _ in 0..16 {
            s.segment_collected(0, 0, 20);
        }
        assert_eq!(s.l, 20.0, "l is the mean of the last 16 class-0 victims");
    }

    /// A SepBIT that starts on a volume already holding data (or after a restart,
    /// which keeps no class bits) tallies only blocks written since it started:
    /// the bits of older blocks were never set.
    #[test]
    fn sepbit_tallies_only_what_it_has_seen_written() {
        let mut s = SepBit::default();
        s.classify_user(Lba(5), 1000, Some(user_write(10, 0)));
        assert_eq!(s.deaths, 0, "written before SepBIT started");
        s.classify_user(Lba(5), 1200, Some(user_write(1000, 0)));
        assert_eq!(s.deaths, 1);
        let mut r = SepBit::default();
        r.restore(&s.save()).unwrap();
        r.classify_user(Lba(6), 1300, Some(user_write(1100, 0)));
        assert_eq!(r.deaths, 1, "written before the restart");
        r.classify_user(Lba(6), 1400, Some(user_write(1300, 0)));
        assert_eq!(r.deaths, 2);
    }

    /// What SepBIT learnt survives a save and restore; damaged state is refused.
    #[test]
    fn sepbit_state_round_trips_and_damage_is_refused() {
        let mut s = SepBit::default();
        for i in 0..20 {
            s.segment_collected(0, 0, 100 + i);
        }
        s.lives = [(5.0, 2.0), (70.0, 3.0)];
        s.deaths = 1234;
        s.flat = false;
        let saved = s.save();
        let mut r = SepBit::default();
        r.restore(&saved).unwrap();
        assert_eq!(
            (r.l, r.recent.clone(), r.lives, r.deaths, r.flat),
            (s.l, s.recent.clone(), s.lives, s.deaths, s.flat)
        );
        assert_eq!(r.save(), saved);
        for cut in 0..saved.len() {
            assert!(
                SepBit::default().restore(&saved[..cut]).is_err(),
                "cut {cut}"
            );
        }
        let mut bad = saved.clone();
        bad[0] = 9;
        assert!(SepBit::default().restore(&bad).is_err(), "version");
        let mut bad = saved.clone();
        bad[10..18].copy_from_slice(&f64::NAN.to_le_bytes());
        assert!(SepBit::default().restore(&bad).is_err(), "NaN tally");
    }

    #[test]
    fn frequency_heats_and_cools() {
        let mut f = Frequency::new(100, 4);
        let cold = f.classify_user(Lba(7), 0, None);
        let mut hot = cold;
        for t in 1..10 {
            hot = f.classify_user(Lba(7), t, None);
        }
        assert!(
            hot < cold,
            "repeated writes make a block hotter (lower class)"
        );
        // Much later, after many half-lives, it is cold again.
        assert_eq!(
            f.classify_gc(Lba(7), 100_000, user_write(0, 0)),
            f.gc_classes() + 3
        );
        assert_eq!(
            f.classify_user(Lba(8), 0, None),
            3,
            "first writes are coldest"
        );
    }

    #[test]
    fn oracle_groups_by_remaining_lifespan() {
        // Writes at t: block 0 at 0, 1, 2, 3 (short lives); block 1 at 4 and never again.
        let next = Arc::new(vec![1, 2, 3, u64::MAX, u64::MAX]);
        let mut o = Oracle::new(next, 8, 1000);
        let short = o.classify_user(Lba(0), 0, None);
        let never = o.classify_user(Lba(1), 4, None);
        assert!(short < never);
        assert_eq!(never, 7);
        assert_eq!(o.classify_gc(Lba(1), 10, user_write(0, 0)), 8 + 7);
    }
}
