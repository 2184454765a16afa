//! Test and benchmark payloads: pseudo-random bytes from a seed, so that nothing on a data path
//! can shortcut on zero pages or repeated content, and a reader can recompute what a writer
//! stored from the seed alone. Pure.

/// `len` pseudo-random bytes (xorshift64 over a mixed seed); the same seed gives the same bytes.
pub fn pseudo_random(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_give_distinct_repeatable_bytes() {
        assert_eq!(pseudo_random(7, 4096), pseudo_random(7, 4096));
        assert_ne!(pseudo_random(7, 4096), pseudo_random(8, 4096));
        let v = pseudo_random(0, 1 << 16);
        let zeros = v.iter().filter(|b| **b == 0).count();
        assert!(zeros < v.len() / 64, "{zeros} zero bytes");
    }
}
