//! Stripe parity: P (XOR) and Q (Reed-Solomon over GF(2^8)), and reconstruction of
//! up to two lost members of a row.
//!
//! The code is RAID-6's: the field is GF(2^8) with the polynomial x^8 + x^4 + x^3 +
//! x^2 + 1 (0x11d) and generator 2, so `P = D0 ^ D1 ^ ... ^ Dk-1` and
//! `Q = g^0 D0 ^ g^1 D1 ^ ... ^ g^(k-1) Dk-1`. With P alone any one data member can be
//! rebuilt; with P and Q any two members (data or parity).
//!
//! Q is computed by Horner's rule, `Q = ((D(k-1) g ^ D(k-2)) g ^ ...) g ^ D0`, and
//! multiplying by g = 2 needs no table: eight field elements at once in a 64-bit
//! word, each byte shifted left and the ones that overflowed reduced by the
//! polynomial (`mul2_x8`, the Linux kernel's "int64" RAID-6 syndrome). The loops are
//! plain word loops the compiler vectorises (for AVX2 as well, chosen at run time).
//! The rebuild of lost data members uses the same steps for its syndromes, and a
//! 256-entry table (`MulTable`) for its last one or two passes, a multiplication by
//! another constant (Horner's rule over the constant's bits measured slower).
//! `bench parity` measures the word path against the table-driven reference
//! (`encode_with_tables`) the tests check it with.

/// Exponent and logarithm tables of GF(2^8) with generator 2.
struct Tables {
    exp: [u8; 512],
    log: [u8; 256],
}

const fn build() -> Tables {
    let mut exp = [0u8; 512];
    let mut log = [0u8; 256];
    let mut x: u16 = 1;
    let mut i = 0;
    while i < 255 {
        exp[i] = x as u8;
        log[x as usize] = i as u8;
        x <<= 1;
        if x & 0x100 != 0 {
            x ^= 0x11d;
        }
        i += 1;
    }
    while i < 512 {
        exp[i] = exp[i - 255];
        i += 1;
    }
    Tables { exp, log }
}

static GF: Tables = build();

/// Product in GF(2^8).
pub fn mul(a: u8, b: u8) -> u8 {
    if a == 0 || b == 0 {
        return 0;
    }
    GF.exp[GF.log[a as usize] as usize + GF.log[b as usize] as usize]
}

/// `2^i` in GF(2^8).
pub fn pow2(i: usize) -> u8 {
    GF.exp[i % 255]
}

/// Multiplicative inverse (of a non-zero element).
pub fn inv(a: u8) -> u8 {
    assert!(a != 0, "zero has no inverse");
    GF.exp[255 - GF.log[a as usize] as usize]
}

/// Multiplication by one constant, as a lookup table.
struct MulTable([u8; 256]);

impl MulTable {
    fn new(c: u8) -> Self {
        let mut t = [0u8; 256];
        for (x, v) in t.iter_mut().enumerate() {
            *v = mul(c, x as u8);
        }
        MulTable(t)
    }
    /// `dst ^= c * src`.
    fn mul_xor(&self, dst: &mut [u8], src: &[u8]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d ^= self.0[*s as usize];
        }
    }
    /// `buf = c * buf`.
    fn scale(&self, buf: &mut [u8]) {
        for b in buf.iter_mut() {
            *b = self.0[*b as usize];
        }
    }
}

/// The low bit of each byte of a word.
const LOW_BITS: u64 = 0x0101_0101_0101_0101;

/// Eight field elements multiplied by g = 2: each byte shifted left within itself,
/// and 0x1d (the polynomial without x^8) added to the ones whose top bit overflowed.
/// Every operation stays within its byte, so the byte order of the word is irrelevant.
#[inline(always)]
fn mul2_x8(v: u64) -> u64 {
    let o = (v >> 7) & LOW_BITS;
    // o * 0x1d as shifts (0x1d = 16 + 8 + 4 + 1; each byte of o is 0 or 1, so
    // nothing carries): vector units have 64-bit shifts but no 64-bit multiply.
    ((v << 1) & !LOW_BITS) ^ (o << 4) ^ (o << 3) ^ (o << 2) ^ o
}

/// One field element multiplied by g = 2.
#[inline(always)]
fn mul2(b: u8) -> u8 {
    (b << 1) ^ if b & 0x80 != 0 { 0x1d } else { 0 }
}

/// One Horner step over a buffer: `q = g * q ^ d` (`d` absent: a member counted as
/// zeros, `q = g * q`). With AVX2 the same loop is compiled for 256-bit registers,
/// chosen when the CPU has them (the baseline x86-64 build has SSE2 only).
fn horner_step(q: &mut [u8], d: Option<&[u8]>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { horner_step_avx2(q, d) };
    }
    horner_step_words(q, d)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn horner_step_avx2(q: &mut [u8], d: Option<&[u8]>) {
    horner_step_words(q, d)
}

#[inline(always)]
fn horner_step_words(q: &mut [u8], d: Option<&[u8]>) {
    let mut qc = q.chunks_exact_mut(8);
    match d {
        Some(d) => {
            let mut dc = d[..qc.len() * 8].chunks_exact(8);
            for (q8, d8) in (&mut qc).zip(&mut dc) {
                let v = mul2_x8(u64::from_ne_bytes(q8.try_into().unwrap()))
                    ^ u64::from_ne_bytes(d8.try_into().unwrap());
                q8.copy_from_slice(&v.to_ne_bytes());
            }
            let tail = d.len() - d.len() % 8;
            for (qb, db) in qc.into_remainder().iter_mut().zip(&d[tail..]) {
                *qb = mul2(*qb) ^ db;
            }
        }
        None => {
            for q8 in &mut qc {
                let v = mul2_x8(u64::from_ne_bytes(q8.try_into().unwrap()));
                q8.copy_from_slice(&v.to_ne_bytes());
            }
            for qb in qc.into_remainder() {
                *qb = mul2(*qb);
            }
        }
    }
}

/// `Q = sum of g^i D_i` over `data`, members `skip` counted as zeros.
fn q_syndrome(data: &[&[u8]], skip: &[usize], q: &mut [u8]) {
    q.fill(0);
    for (i, d) in data.iter().enumerate().rev() {
        horner_step(q, (!skip.contains(&i)).then_some(*d));
    }
}

/// `dst ^= src`, a word at a time.
pub fn xor_into(dst: &mut [u8], src: &[u8]) {
    let n = dst.len().min(src.len());
    let (d8, s8) = (&mut dst[..n], &src[..n]);
    let mut dc = d8.chunks_exact_mut(8);
    let mut sc = s8.chunks_exact(8);
    for (d, s) in (&mut dc).zip(&mut sc) {
        let v =
            u64::from_ne_bytes(d.try_into().unwrap()) ^ u64::from_ne_bytes(s.try_into().unwrap());
        d.copy_from_slice(&v.to_ne_bytes());
    }
    for (d, s) in dc.into_remainder().iter_mut().zip(sc.remainder()) {
        *d ^= s;
    }
}

/// Computes P (and Q if `q` is given) of the data members `data` (all the same length).
pub fn encode(data: &[&[u8]], p: &mut [u8], q: Option<&mut [u8]>) {
    p.fill(0);
    for d in data {
        xor_into(p, d);
    }
    if let Some(q) = q {
        q_syndrome(data, &[], q);
    }
}

/// [`encode`] with a table lookup per byte for Q: the reference the word-at-a-time
/// path is checked against, and the baseline `bench parity` measures it against.
pub fn encode_with_tables(data: &[&[u8]], p: &mut [u8], q: Option<&mut [u8]>) {
    encode(data, p, None);
    if let Some(q) = q {
        q.fill(0);
        let g = MulTable::new(2);
        for d in data.iter().rev() {
            g.scale(q);
            xor_into(q, d);
        }
    }
}

/// Why a row cannot be rebuilt.
#[derive(Debug, PartialEq, Eq)]
pub struct TooManyLost {
    pub lost: usize,
    pub tolerated: usize,
}

/// Rebuilds the lost members of one row in place.
///
/// `members` holds the `k` data members followed by P and (if `parity == 2`) Q;
/// `lost[i]` says member `i` is missing (its buffer content is ignored and
/// overwritten). At most `parity` members may be lost.
pub fn reconstruct(
    members: &mut [&mut [u8]],
    parity: usize,
    lost: &[bool],
) -> Result<(), TooManyLost> {
    let n = members.len();
    let k = n - parity;
    let lost_idx: Vec<usize> = (0..n).filter(|&i| lost[i]).collect();
    if lost_idx.len() > parity {
        return Err(TooManyLost {
            lost: lost_idx.len(),
            tolerated: parity,
        });
    }
    if lost_idx.is_empty() {
        return Ok(());
    }
    let lost_data: Vec<usize> = lost_idx.iter().copied().filter(|&i| i < k).collect();
    let len = members[0].len();
    match lost_data.len() {
        0 => {}
        1 if !lost[k] => {
            // D_x = P ^ sum of the other data.
            let x = lost_data[0];
            let mut acc = members[k].to_vec();
            for (i, d) in members[..k].iter().enumerate() {
                if i != x {
                    xor_into(&mut acc, d);
                }
            }
            members[x].copy_from_slice(&acc);
        }
        1 => {
            // P is lost too: D_x = g^-x (Q ^ sum of g^i D_i, i != x).
            let x = lost_data[0];
            let mut acc = vec![0u8; len];
            {
                let data: Vec<&[u8]> = members[..k].iter().map(|m| &**m).collect();
                q_syndrome(&data, &[x], &mut acc);
            }
            xor_into(&mut acc, &members[k + 1][..]);
            MulTable::new(inv(pow2(x))).scale(&mut acc);
            members[x].copy_from_slice(&acc);
        }
        _ => {
            // Two data members: Pxy = Dx ^ Dy, Qxy = g^x Dx ^ g^y Dy, so
            // Dx = (g^y Pxy ^ Qxy) / (g^x ^ g^y) and Dy = Pxy ^ Dx.
            let (x, y) = (lost_data[0], lost_data[1]);
            let mut pxy = members[k].to_vec();
            let mut qxy = vec![0u8; len];
            {
                let data: Vec<&[u8]> = members[..k].iter().map(|m| &**m).collect();
                for (i, d) in data.iter().enumerate() {
                    if i != x && i != y {
                        xor_into(&mut pxy, d);
                    }
                }
                q_syndrome(&data, &[x, y], &mut qxy);
            }
            xor_into(&mut qxy, &members[k + 1][..]);
            let mut dx = qxy;
            MulTable::new(pow2(y)).mul_xor(&mut dx, &pxy);
            MulTable::new(inv(pow2(x) ^ pow2(y))).scale(&mut dx);
            xor_into(&mut pxy, &dx);
            members[x].copy_from_slice(&dx);
            members[y].copy_from_slice(&pxy);
        }
    }
    // Recompute lost parity from the (now complete) data.
    if lost[k] || (parity == 2 && lost[k + 1]) {
        let mut p = vec![0u8; len];
        let mut q = vec![0u8; len];
        {
            let data: Vec<&[u8]> = members[..k].iter().map(|m| &**m).collect();
            encode(&data, &mut p, (parity == 2).then_some(&mut q[..]));
        }
        if lost[k] {
            members[k].copy_from_slice(&p);
        }
        if parity == 2 && lost[k + 1] {
            members[k + 1].copy_from_slice(&q);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn field_arithmetic() {
        for a in 1..=255u8 {
            assert_eq!(mul(a, inv(a)), 1, "a * a^-1 for {a}");
            assert_eq!(mul(a, 1), a);
        }
        // Known RAID-6 values: 2^8 = 0x1d under 0x11d.
        assert_eq!(pow2(8), 0x1d);
        assert_eq!(mul(0x80, 2), 0x1d);
        // Distributivity on a sample.
        for (a, b, c) in [(3u8, 7u8, 200u8), (0x53, 0xca, 0x11), (255, 254, 1)] {
            assert_eq!(mul(a, b ^ c), mul(a, b) ^ mul(a, c));
        }
    }

    #[test]
    fn q_matches_the_definition() {
        let data: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i * 37 + 1; 16]).collect();
        let refs: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
        let (mut p, mut q) = (vec![0; 16], vec![0; 16]);
        encode(&refs, &mut p, Some(&mut q));
        let mut want = 0u8;
        let mut want_p = 0u8;
        for (i, d) in data.iter().enumerate() {
            want ^= mul(pow2(i), d[0]);
            want_p ^= d[0];
        }
        assert_eq!(q[3], want);
        assert_eq!(p[3], want_p);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        /// Encode a row, lose any set of members the layout tolerates, rebuild,
        /// compare with the original.
        #[test]
        fn any_tolerated_loss_is_rebuilt(
            k in 1usize..10,
            parity in 1usize..=2,
            len in 1usize..64,
            seed in any::<u64>(),
            a in any::<usize>(),
            b in any::<usize>(),
            two in any::<bool>(),
        ) {
            let mut x = seed | 1;
            let mut rnd = || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x as u8 };
            let data: Vec<Vec<u8>> = (0..k).map(|_| (0..len).map(|_| rnd()).collect()).collect();
            let n = k + parity;
            let mut row: Vec<Vec<u8>> = data.clone();
            row.push(vec![0; len]);
            if parity == 2 { row.push(vec![0; len]); }
            {
                let refs: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
                let (p, q) = row.split_at_mut(k + 1);
                encode(&refs, &mut p[k], q.first_mut().map(|q| &mut q[..]));
            }
            let original = row.clone();
            let mut lost = vec![false; n];
            lost[a % n] = true;
            if parity == 2 && two { lost[b % n] = true; }
            for (i, m) in row.iter_mut().enumerate() {
                if lost[i] { m.fill(0xee); }
            }
            let mut refs: Vec<&mut [u8]> = row.iter_mut().map(|m| &mut m[..]).collect();
            reconstruct(&mut refs, parity, &lost).unwrap();
            prop_assert_eq!(row, original);
        }
    }

    proptest! {
        /// The word-at-a-time Q is the table-driven one, for every length (tails
        /// included) and member count.
        #[test]
        fn q_by_words_is_q_by_tables(k in 1usize..12, len in 0usize..100, seed in any::<u64>()) {
            let mut x = seed | 1;
            let mut rnd = || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x as u8 };
            let data: Vec<Vec<u8>> = (0..k).map(|_| (0..len).map(|_| rnd()).collect()).collect();
            let refs: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
            let (mut p1, mut q1, mut p2, mut q2) = (vec![0; len], vec![0; len], vec![0; len], vec![0; len]);
            encode(&refs, &mut p1, Some(&mut q1));
            encode_with_tables(&refs, &mut p2, Some(&mut q2));
            prop_assert_eq!(p1, p2);
            prop_assert_eq!(&q1, &q2);
            // The portable loop too, whichever one `encode` chose on this CPU.
            let mut q3 = vec![0; len];
            for d in refs.iter().rev() {
                horner_step_words(&mut q3, Some(d));
            }
            prop_assert_eq!(q3, q2);
        }
    }

    #[test]
    fn multiplying_eight_at_once_is_multiplying_each() {
        for b in 0..=255u8 {
            assert_eq!(mul2(b), mul(b, 2));
            let w = u64::from_ne_bytes([b, b ^ 0x80, 0, 0xff, b.wrapping_add(1), 0x80, 1, b]);
            let want: Vec<u8> = w.to_ne_bytes().iter().map(|&x| mul(x, 2)).collect();
            assert_eq!(mul2_x8(w).to_ne_bytes().to_vec(), want);
        }
    }

    #[test]
    fn too_many_losses_are_refused() {
        let mut row = [vec![1u8; 8], vec![2u8; 8], vec![3u8; 8]];
        let mut refs: Vec<&mut [u8]> = row.iter_mut().map(|m| &mut m[..]).collect();
        let e = reconstruct(&mut refs, 1, &[true, true, false]).unwrap_err();
        assert_eq!(
            e,
            TooManyLost {
                lost: 2,
                tolerated: 1
            }
        );
    }
}
